/* utf8.c: see utf8.h */
#include "utf8.h"

#include <string.h>

static int is_trail(unsigned char c) { return (c & 0xC0) == 0x80; }

size_t utf8_char_len(const char *str, size_t n) {
    const unsigned char *s = (const unsigned char *)str;
    if (n == 0) return 0;
    const unsigned c0 = s[0];
    if (c0 < 0x80) return 1;
    size_t len;
    unsigned cp, min;
    if ((c0 & 0xE0) == 0xC0) { len = 2; cp = c0 & 0x1F; min = 0x80; }
    else if ((c0 & 0xF0) == 0xE0) { len = 3; cp = c0 & 0x0F; min = 0x800; }
    else if ((c0 & 0xF8) == 0xF0) { len = 4; cp = c0 & 0x07; min = 0x10000; }
    else return 0;
    if (n < len) return 0;
    for (size_t k = 1; k < len; k++) {
        if (!is_trail(s[k])) return 0;
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
