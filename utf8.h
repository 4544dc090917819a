/* utf8.h: the one UTF-8 validator of the program. C11; usable from C++ (spm_c.cc). */
#ifndef UTF8_H
#define UTF8_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Length (1..4) of the valid UTF-8 character that starts s[0..n), or 0 when none does: n is
 * 0, the sequence is cut short, a trail byte is wrong, or it is an overlong form, a surrogate
 * (U+D800..U+DFFF) or above U+10FFFF. A NUL byte is a valid 1-byte character here. These are
 * also SentencePiece's rules (string_util::IsValidDecodeUTF8). */
size_t utf8_char_len(const char *s, size_t n);

/* 1 when s[0..n) is valid UTF-8 (as utf8_char_len) and holds no NUL byte, else 0. */
int utf8_valid(const char *s, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* UTF8_H */
