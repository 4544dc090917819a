/* utf8.h: the validator, checked against an encoder of every code point, and the terminal
 * sanitizer on escape sequences, control characters and broken UTF-8. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/errmsg.h"
#include "kernels/utf8.h"

#define R "\xEF\xBF\xBD" /* U+FFFD */

/* The reference: UTF-8 as the standard defines it, one code point at a time. */
static size_t encode(uint32_t cp, unsigned char out[4]) {
    if (cp < 0x80) {
        out[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (unsigned char)(0xC0 | cp >> 6);
        out[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (unsigned char)(0xE0 | cp >> 12);
        out[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
        out[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (unsigned char)(0xF0 | cp >> 18);
    out[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3F));
    out[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
    out[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

static int is_surrogate(uint32_t cp) { return cp >= 0xD800 && cp <= 0xDFFF; }

/* Every sequence of up to three bytes: utf8_char_len finds a character exactly where the
 * encoder of some code point (surrogates excluded) writes those bytes. */
static void test_char_len_matches_every_encoding(void **state) {
    (void)state;
    static uint8_t two[1 << 16], three[1 << 24]; /* indexed by the bytes, big-endian */
    static uint8_t four_lead[1 << 16];           /* first two bytes of some 4-byte encoding */
    memset(two, 0, sizeof two);
    memset(three, 0, sizeof three);
    memset(four_lead, 0, sizeof four_lead);
    unsigned char e[4];
    for (uint32_t cp = 0; cp <= 0x10FFFF; cp++) {
        if (is_surrogate(cp)) continue;
        size_t n = encode(cp, e);
        if (n == 2) two[e[0] << 8 | e[1]] = 1;
        if (n == 3) three[e[0] << 16 | e[1] << 8 | e[2]] = 1;
        if (n == 4) {
            four_lead[e[0] << 8 | e[1]] = 1;
            assert_int_equal(utf8_char_len((const char *)e, 4), 4);
            assert_int_equal(utf8_char_len((const char *)e, 3), 0); /* cut short */
        }
    }
    for (uint32_t v = 0; v < (1u << 24); v++) {
        const char s[3] = {(char)(v >> 16), (char)(v >> 8), (char)v};
        size_t expect = (unsigned char)s[0] < 0x80 ? 1 : two[v >> 8] ? 2 : three[v] ? 3 : 0;
        if (utf8_char_len(s, 3) != expect)
            fail_msg("bytes %06X: got %zu, expected %zu", v, utf8_char_len(s, 3), expect);
        if ((v & 0xFF) == 0) { /* and the first two bytes alone */
            size_t expect2 = (unsigned char)s[0] < 0x80 ? 1 : two[v >> 8] ? 2 : 0;
            assert_int_equal(utf8_char_len(s, 2), expect2);
        }
    }
    /* 4-byte forms: whether they are valid depends on the first two bytes, the other two
     * must be trail bytes */
    static const unsigned char tails[] = {0x00, 0x41, 0x7F, 0x80, 0x9B, 0xBF, 0xC0, 0xFF};
    for (uint32_t lead = 0xF0; lead <= 0xFF; lead++)
        for (uint32_t b1 = 0; b1 <= 0xFF; b1++)
            for (size_t i = 0; i < sizeof tails; i++)
                for (size_t j = 0; j < sizeof tails; j++) {
                    const char s[4] = {(char)lead, (char)b1, (char)tails[i], (char)tails[j]};
                    int trails = (tails[i] & 0xC0) == 0x80 && (tails[j] & 0xC0) == 0x80;
                    assert_int_equal(utf8_char_len(s, 4), four_lead[lead << 8 | b1] && trails ? 4 : 0);
                }
    assert_int_equal(utf8_char_len("", 0), 0);
    assert_int_equal(utf8_char_len("\0", 1), 1); /* NUL is a character; utf8_valid refuses it */
}

static void test_valid(void **state) {
    (void)state;
    assert_true(utf8_valid("caf\xC3\xA9 \xF0\x9F\x98\x80", 10));
    assert_true(utf8_valid("", 0));
    assert_true(utf8_valid("\xEF\xBF\xBD", 3));      /* U+FFFD itself */
    assert_true(utf8_valid("\xF4\x8F\xBF\xBF", 4));  /* U+10FFFF */
    assert_false(utf8_valid("a\0b", 3));             /* NUL */
    assert_false(utf8_valid("\xC0\xAF", 2));         /* overlong '/' */
    assert_false(utf8_valid("\xE0\x80\xAF", 3));     /* overlong '/' in three bytes */
    assert_false(utf8_valid("\xED\xA0\x80", 3));     /* surrogate */
    assert_false(utf8_valid("\xF4\x90\x80\x80", 4)); /* past U+10FFFF */
    assert_false(utf8_valid("ok\xE2\x82", 4));       /* cut short */
    assert_false(utf8_valid("\x80", 1));             /* lone continuation */
    assert_false(utf8_valid("\xFF", 1));
    assert_false(utf8_valid("caf\xC3\xA9", 4)); /* n is honoured: a cut character */
}

static char s_out[256];

/* Sanitizes src[0..n) into a big buffer and checks the returned length. */
static const char *san(const char *src, size_t n) {
    size_t need = utf8_sanitize(s_out, sizeof s_out, src, n);
    assert_int_equal(need, strlen(s_out));
    return s_out;
}
#define SAN(lit) san(lit, sizeof lit - 1)

static void test_sanitize_keeps_normal_text(void **state) {
    (void)state;
    const char *texts[] = {
        "Once upon a time, a little fox named Pip lived near a big green hill.",
        "two\nlines\tand a tab",
        "caf\xC3\xA9 na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x90\x89 \xE2\x82\xAC",
        "\xC2\xA0 no-break space, just after the C1 range; \xC2\xBF",
        "~ and U+FFFD itself: " R,
        "",
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        assert_string_equal(san(texts[i], strlen(texts[i])), texts[i]);
}

static void test_sanitize_escape_sequences(void **state) {
    (void)state;
    /* CSI colour codes, cursor moves and a screen clear */
    assert_string_equal(SAN("\x1b[31mred\x1b[0m"), R "[31mred" R "[0m");
    assert_string_equal(SAN("\x1b[2J\x1b[H"), R "[2J" R "[H");
    /* OSC (set the window title) ended by BEL, and by ST (ESC \) */
    assert_string_equal(SAN("\x1b]0;pwned\x07rest"), R "]0;pwned" R "rest");
    assert_string_equal(SAN("\x1b]0;t\x1b\\x"), R "]0;t" R "\\x");
    /* C1 CSI written as UTF-8 (U+009B), and the other ends of the C1 range */
    assert_string_equal(SAN("\xC2\x9B"
                            "31m"),
                        R "31m");
    assert_string_equal(SAN("a\xC2\x80"
                            "b\xC2\x9F"
                            "c"),
                        "a" R "b" R "c");
    /* a raw 8-bit CSI byte is not UTF-8 at all */
    assert_string_equal(SAN("\x9B"
                            "31m"),
                        R "31m");
    /* an overlong ESC must not come out as ESC */
    assert_string_equal(SAN("\xC0\x9B[31m"), R R "[31m");
}

static void test_sanitize_controls(void **state) {
    (void)state;
    assert_string_equal(SAN("a\x7F"
                            "b"),
                        "a" R "b");                                    /* DEL */
    assert_string_equal(SAN("over\rwrite"), "over" R "write");         /* CR */
    assert_string_equal(SAN("\x01\x07\x08\x0B\x0C\x1F"), R R R R R R); /* SOH BEL BS VT FF US */
    assert_string_equal(san("a\0b", 3), "a" R "b");                    /* NUL inside n */
    assert_string_equal(SAN("\n\t"), "\n\t");                          /* the two kept */
}

static void test_sanitize_invalid_utf8(void **state) {
    (void)state;
    assert_string_equal(SAN("\xFF\xFE"), R R);
    assert_string_equal(SAN("x\x80y"), "x" R "y");    /* lone trail byte */
    assert_string_equal(SAN("ab\xE2\x82"), "ab" R R); /* cut at the end */
    assert_string_equal(SAN("\xF0\x9F\x90"), R R R);
    assert_string_equal(SAN("\xE2\x82"
                            "A"),
                        R R "A");              /* cut in the middle */
    assert_string_equal(SAN("\xC0\xAF"), R R); /* overlongs */
    assert_string_equal(SAN("\xE0\x80\xAF"), R R R);
    assert_string_equal(SAN("\xED\xA0\x80"), R R R);       /* surrogate */
    assert_string_equal(SAN("\xF4\x90\x80\x80"), R R R R); /* past U+10FFFF */
    assert_string_equal(SAN("\xC2\x7F"), R R);             /* bad trail, then DEL */
}

static void test_sanitize_buffer_like_snprintf(void **state) {
    (void)state;
    char buf[16];
    /* "ab" then ESC (3 bytes as U+FFFD): 5 bytes needed */
    memset(buf, 'Z', sizeof buf);
    assert_int_equal(utf8_sanitize(buf, 5, "ab\x1b", 3), 5);
    assert_string_equal(buf, "ab"); /* U+FFFD does not fit whole: none of it */
    assert_int_equal(buf[5], 'Z');
    assert_int_equal(utf8_sanitize(buf, 6, "ab\x1b", 3), 5);
    assert_string_equal(buf, "ab" R);
    /* a kept character is not cut either */
    assert_int_equal(utf8_sanitize(buf, 4, "a\xE2\x82\xAC", 4), 4);
    assert_string_equal(buf, "a");
    assert_int_equal(utf8_sanitize(buf, 1, "abc", 3), 3);
    assert_string_equal(buf, "");
    assert_int_equal(utf8_sanitize(NULL, 0, "\x1b[0m", 4), 6);
    memset(buf, 'Z', sizeof buf);
    assert_int_equal(utf8_sanitize(buf, 0, "abc", 3), 3);
    assert_int_equal(buf[0], 'Z'); /* dstlen 0: nothing written */
    /* after a character that did not fit, smaller ones after it are not written either */
    assert_int_equal(utf8_sanitize(buf, 4,
                                   "a\x1b"
                                   "b",
                                   3),
                     5);
    assert_string_equal(buf, "a");
}

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Random bytes: the output is valid UTF-8 and holds no C0 control but newline and tab, no
 * DEL and no C1 control; the stream form writes the same bytes. */
/* A message's masking: one '?' for each control (newline and tab too) and each byte that
 * starts no character; valid text is kept byte for byte. */
static void test_mask_controls(void **state) {
    (void)state;
    const struct {
        const char *in, *out;
    } cases[] = {
        {"plain caf\xC3\xA9 \xF0\x9F\x90\x89", "plain caf\xC3\xA9 \xF0\x9F\x90\x89"},
        {"a\nb\tc\x1b[2J\x07\x7F", "a?b?c?[2J??"},
        {"\xC2\x9B"
         "31m \xC2\x80\xC2\x9F \xC2\xA0",
         "?31m ?? \xC2\xA0"},
        {"\xFFx\xC3(\xE2\x82", "?x?(??"},
        {"", ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char buf[64];
        strcpy(buf, cases[i].in);
        utf8_mask_controls(buf);
        assert_string_equal(buf, cases[i].out);
    }
}

static void test_sanitize_random_bytes(void **state) {
    (void)state;
    static const unsigned char pool[] = {0x1B, '[',  '3',  'm',  0x9B, 0xC2, 0x80, 0x9F, 0xA0,
                                         0x7F, '\n', '\t', '\r', 0x07, 0xE2, 0x82, 0xAC, 0xF0,
                                         0x9F, 0x90, 0x89, 0xED, 0xA0, 0xC0, 0xFF, 'a',  ' '};
    uint64_t rng = 0x243F6A8885A308D3ull;
    char src[32], out[32 * 3 + 1], streamed[32 * 3 + 1];
    for (int iter = 0; iter < 50000; iter++) {
        size_t n = (size_t)(rng_next(&rng) % sizeof src);
        for (size_t i = 0; i < n; i++) {
            unsigned r = (unsigned)rng_next(&rng);
            src[i] = (char)(r & 0x100 ? pool[(r >> 9) % sizeof pool] : (r & 0xFF) | 1); /* no NUL: fputs form */
        }
        size_t len = utf8_sanitize(out, sizeof out, src, n);
        assert_true(len < sizeof out);
        assert_true(utf8_valid(out, len));
        for (size_t i = 0; i < len; i++) {
            unsigned char c = (unsigned char)out[i];
            assert_false((c < 0x20 && c != '\n' && c != '\t') || c == 0x7F);
            if (c == 0xC2 && i + 1 < len) assert_false((unsigned char)out[i + 1] <= 0x9F);
        }
        if (utf8_valid(src, n)) { /* valid text changes only where it holds a control */
            int controls = 0;
            for (size_t i = 0; i < n; i++) {
                unsigned char c = (unsigned char)src[i];
                controls |= (c < 0x20 && c != '\n' && c != '\t') || c == 0x7F ||
                            (c == 0xC2 && i + 1 < n && (unsigned char)src[i + 1] <= 0x9F);
            }
            if (!controls) assert_memory_equal(out, src, n);
        }
        src[n] = '\0';
        FILE *f = fmemopen(streamed, sizeof streamed, "w");
        assert_non_null(f);
        assert_int_equal(utf8_fputs_sanitized(src, f), 0);
        assert_int_equal(ftell(f), (long)len);
        fclose(f);
        assert_memory_equal(streamed, out, len);
    }
}

/* msg_path: a path whole up to MSG_PATH_BYTES, else "..." and its tail from a character's
 * start, so an errno text after it is never cut; controls masked either way. */
static void test_msg_path(void **state) {
    (void)state;
    assert_string_equal(msg_path("dir/a\x1b[2Jb\x07.bin").s, "dir/a?[2Jb?.bin");
    char path[2 * MSG_PATH_BYTES + 1];
    memset(path, 'x', MSG_PATH_BYTES);
    path[MSG_PATH_BYTES] = '\0';
    assert_string_equal(msg_path(path).s, path); /* at the limit: whole */
    path[MSG_PATH_BYTES] = 'y', path[MSG_PATH_BYTES + 1] = '\0';
    assert_int_equal(strlen(msg_path(path).s), MSG_PATH_BYTES); /* a byte over: "..." and the last 157 */
    assert_memory_equal(msg_path(path).s, "...xxx", 6);
    memset(path, 'x', sizeof path - 1);
    path[sizeof path - 1] = '\0';
    memcpy(path + sizeof path - 10, "/tier\x1b.kv", 9);
    MsgPath m = msg_path(path);
    assert_int_equal(strlen(m.s), MSG_PATH_BYTES);
    assert_memory_equal(m.s, "...xxx", 6);
    assert_string_equal(m.s + MSG_PATH_BYTES - 9, "/tier?.kv");
    for (int i = 0; i < MSG_PATH_BYTES; i++) memcpy(path + 2 * i, "\xC3\xA9", 2); /* e-acute, two bytes */
    path[2 * MSG_PATH_BYTES] = '\0';
    m = msg_path(path); /* the cut falls inside a character: the tail starts at the next one */
    assert_int_equal(strlen(m.s), MSG_PATH_BYTES - 1);
    assert_memory_equal(m.s, "...\xC3\xA9", 5);
    assert_true(utf8_valid(m.s, strlen(m.s)));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_char_len_matches_every_encoding),
        cmocka_unit_test(test_valid),
        cmocka_unit_test(test_sanitize_keeps_normal_text),
        cmocka_unit_test(test_sanitize_escape_sequences),
        cmocka_unit_test(test_sanitize_controls),
        cmocka_unit_test(test_sanitize_invalid_utf8),
        cmocka_unit_test(test_sanitize_buffer_like_snprintf),
        cmocka_unit_test(test_sanitize_random_bytes),
        cmocka_unit_test(test_mask_controls),
        cmocka_unit_test(test_msg_path),
    };
    return cmocka_run_group_tests_name("utf8", tests, NULL, NULL);
}
