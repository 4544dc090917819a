/* utf8.h: the validator, checked against an encoder of every code point. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "utf8.h"

/* The reference: UTF-8 as the standard defines it, one code point at a time. */
static size_t encode(uint32_t cp, unsigned char out[4]) {
    if (cp < 0x80) { out[0] = (unsigned char)cp; return 1; }
    if (cp < 0x800) { out[0] = (unsigned char)(0xC0 | cp >> 6); out[1] = (unsigned char)(0x80 | (cp & 0x3F)); return 2; }
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
    static uint8_t four_lead[1 << 16];            /* first two bytes of some 4-byte encoding */
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
        if (utf8_char_len(s, 3) != expect) fail_msg("bytes %06X: got %zu, expected %zu", v, utf8_char_len(s, 3), expect);
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
    assert_true(utf8_valid("\xEF\xBF\xBD", 3));         /* U+FFFD itself */
    assert_true(utf8_valid("\xF4\x8F\xBF\xBF", 4));     /* U+10FFFF */
    assert_false(utf8_valid("a\0b", 3));                /* NUL */
    assert_false(utf8_valid("\xC0\xAF", 2));            /* overlong '/' */
    assert_false(utf8_valid("\xE0\x80\xAF", 3));        /* overlong '/' in three bytes */
    assert_false(utf8_valid("\xED\xA0\x80", 3));        /* surrogate */
    assert_false(utf8_valid("\xF4\x90\x80\x80", 4));    /* past U+10FFFF */
    assert_false(utf8_valid("ok\xE2\x82", 4));          /* cut short */
    assert_false(utf8_valid("\x80", 1));                /* lone continuation */
    assert_false(utf8_valid("\xFF", 1));
    assert_false(utf8_valid("caf\xC3\xA9", 4));          /* n is honoured: a cut character */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_char_len_matches_every_encoding),
        cmocka_unit_test(test_valid),
    };
    return cmocka_run_group_tests_name("utf8", tests, NULL, NULL);
}
