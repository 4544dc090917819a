/* json.h: writing JSON values for the machine-readable outputs (--json). */
#ifndef JSON_H
#define JSON_H

#include <stddef.h>
#include <stdio.h>

/* s[0..n) (valid UTF-8) as a JSON string, quotes included: ", \ and control characters
 * escaped, everything else as it is. */
void json_string(FILE *f, const char *s, size_t n);

/* A NUL-terminated string of any bytes (a path, say) as a JSON string: bytes that are not
 * UTF-8 become U+FFFD (utf8.h's sanitizer), so the output stays valid JSON. */
void json_text(FILE *f, const char *s);

/* A number, or null when it is not finite (JSON has no NaN or infinity). */
void json_number(FILE *f, double v);

#endif /* JSON_H */
