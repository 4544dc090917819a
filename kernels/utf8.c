/* utf8.c: see utf8.h */
#include "kernels/utf8.h"

#include <string.h>

#define REPLACEMENT "\xEF\xBF\xBD" /* U+FFFD, 3 bytes */

size_t utf8_char_len(const char *str, size_t n) {
    const unsigned char *s = (const unsigned char *)str;
    if (n == 0) return 0;
    const unsigned c0 = s[0];
    if (c0 < 0x80) return 1;
    size_t len;
    unsigned cp, min;
    if ((c0 & 0xE0) == 0xC0) {
        len = 2;
        cp = c0 & 0x1F;
        min = 0x80;
    } else if ((c0 & 0xF0) == 0xE0) {
        len = 3;
        cp = c0 & 0x0F;
        min = 0x800;
    } else if ((c0 & 0xF8) == 0xF0) {
        len = 4;
        cp = c0 & 0x07;
        min = 0x10000;
    } else
        return 0;
    if (n < len) return 0;
    for (size_t k = 1; k < len; k++) {
        if (!utf8_is_trail(s[k])) return 0;
        cp = (cp << 6) | (s[k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return len;
}

int utf8_valid(const char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (s[i] == '\0') return 0;
        const size_t len = utf8_char_len(s + i, n - i);
        if (len == 0) return 0;
        i += len;
    }
    return 1;
}

/* One step of the sanitizer: `used` bytes of the input give the `outlen` bytes at `out`. */
typedef struct {
    size_t used;
    const char *out;
    size_t outlen;
} SanitizeStep;

/* The step at s[0..n), n > 0: a character copied as it is, or one U+FFFD for a control
 * character or for a byte that starts no valid character. */
static SanitizeStep sanitize_step(const char *s, size_t n) {
    const size_t len = utf8_char_len(s, n);
    const SanitizeStep replaced = {len ? len : 1, REPLACEMENT, sizeof REPLACEMENT - 1};
    if (len == 0) return replaced;
    const unsigned char c0 = (unsigned char)s[0];
    if (len == 1 && ((c0 < 0x20 && c0 != '\n' && c0 != '\t') || c0 == 0x7F)) return replaced;
    if (len == 2 && c0 == 0xC2 && (unsigned char)s[1] <= 0x9F) return replaced; /* U+0080..U+009F */
    const SanitizeStep kept = {len, s, len};
    return kept;
}

size_t utf8_sanitize(char *dst, size_t dstlen, const char *src, size_t n) {
    size_t need = 0, written = 0;
    int room = dst != NULL && dstlen > 0; /* once a character does not fit, nothing more is written */
    for (size_t i = 0; i < n;) {
        const SanitizeStep st = sanitize_step(src + i, n - i);
        if (room && written + st.outlen < dstlen) {
            memcpy(dst + written, st.out, st.outlen);
            written += st.outlen;
        } else {
            room = 0;
        }
        need += st.outlen;
        i += st.used;
    }
    if (dst && dstlen > 0) dst[written] = '\0';
    return need;
}

void utf8_mask_controls(char *s) {
    const size_t n = strlen(s);
    char *out = s;
    for (size_t i = 0; i < n;) {
        const SanitizeStep st = sanitize_step(s + i, n - i);
        if (st.out != s + i || s[i] == '\n' || s[i] == '\t')
            *out++ = '?';
        else
            for (size_t k = 0; k < st.used; k++) *out++ = s[i + k];
        i += st.used;
    }
    *out = '\0';
}

int utf8_fputs_sanitized(const char *s, FILE *f) {
    const size_t n = strlen(s);
    for (size_t i = 0; i < n;) {
        const SanitizeStep st = sanitize_step(s + i, n - i);
        if (fwrite(st.out, 1, st.outlen, f) != st.outlen) return EOF;
        i += st.used;
    }
    return 0;
}
