/* json.c: JSON strings and numbers (json.h). */
#include "serve/json.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/utf8.h"

void json_string(FILE *f, const char *s, size_t n) {
    fputc('"', f);
    for (size_t i = 0; i < n; i++) {
        const unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\')
            fprintf(f, "\\%c", ch);
        else if (ch == '\n')
            fputs("\\n", f);
        else if (ch == '\t')
            fputs("\\t", f);
        else if (ch < 0x20 || ch == 0x7F)
            fprintf(f, "\\u%04x", ch);
        else
            fputc(ch, f);
    }
    fputc('"', f);
}

void json_text(FILE *f, const char *s) {
    const size_t n = strlen(s), len = utf8_sanitize(NULL, 0, s, n);
    char *clean = malloc(len + 1);
    if (!clean) { /* out of memory: a valid string all the same */
        fputs("\"\"", f);
        return;
    }
    utf8_sanitize(clean, len + 1, s, n);
    json_string(f, clean, len);
    free(clean);
}

void json_number(FILE *f, double v) {
    if (isfinite(v))
        fprintf(f, "%.10g", v);
    else
        fputs("null", f);
}
