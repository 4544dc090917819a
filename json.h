/* json.h: writing JSON values for the machine-readable outputs (--json). */
#ifndef JSON_H
#define JSON_H

#include <stddef.h>
#include <stdio.h>

/* s[0..n) (valid UTF-8) as a JSON string, quotes included: ", \ and control characters
 * escaped, everything else as it is. */
void json_string(FILE *f, const char *s, size_t n);

#endif /* JSON_H */
