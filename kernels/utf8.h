/* utf8.h: the one UTF-8 validator of the program, and a sanitizer that makes generated
 * text safe to print on a terminal. C11; usable from C++ (spm_c.cc). */
#ifndef UTF8_H
#define UTF8_H

#include <stddef.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when c is a continuation (trail) byte, 10xxxxxx: never the start of a character. */
static inline int utf8_is_trail(unsigned char c) { return (c & 0xC0) == 0x80; }

/* Length (1..4) of the valid UTF-8 character that starts s[0..n), or 0 when none does: n is
 * 0, the sequence is cut short, a trail byte is wrong, or it is an overlong form, a surrogate
 * (U+D800..U+DFFF) or above U+10FFFF. A NUL byte is a valid 1-byte character here. These are
 * also SentencePiece's rules (string_util::IsValidDecodeUTF8). */
size_t utf8_char_len(const char *s, size_t n);

/* 1 when s[0..n) is valid UTF-8 (as utf8_char_len) and holds no NUL byte, else 0. */
int utf8_valid(const char *s, size_t n);

/* Copies src[0..n) to dst for a terminal: every byte that starts no valid UTF-8 character
 * becomes U+FFFD (one per byte, as SentencePiece's decoder does), and so does every control
 * character but newline and tab: C0 (U+0000..U+001F, ESC included), DEL (U+007F) and C1
 * (U+0080..U+009F, CSI U+009B included). Everything else is copied unchanged, so valid text
 * without controls comes out byte for byte. The result is valid UTF-8 without escape
 * sequences. Like snprintf: writes at most dstlen bytes including a terminating NUL (when
 * dstlen > 0), never cuts a character in two, and returns the length the whole result needs
 * without the NUL. dst may be NULL when dstlen is 0. */
size_t utf8_sanitize(char *dst, size_t dstlen, const char *src, size_t n);

/* Rewrites the NUL-terminated s in place for a one-line message: every control character
 * (C0 with newline and tab, DEL, C1) and every byte that starts no valid UTF-8 character
 * becomes one '?', so that nothing quoted in the message can break its line or drive a
 * terminal. The string only shortens. */
void utf8_mask_controls(char *s);

/* The same for a stream: writes the sanitized form of the NUL-terminated s to f.
 * Returns 0, or EOF on a write error. */
int utf8_fputs_sanitized(const char *s, FILE *f);

#ifdef __cplusplus
}
#endif

#endif /* UTF8_H */
