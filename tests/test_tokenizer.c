/* The tokenizer module (spm_c.h): loading, encoding, and the streaming decoder checked
 * against SentencePiece's own DecodeIds. argv[1] is the model made by tests/tokenizer.mk
 * (BPE, vocab 320, byte fallback, unk 0, bos 1, eos 2: ids 3..258 are <0x00>..<0xFF>). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "tokenizer/spm_c.h"
#include "testutil.h"
#include "kernels/utf8.h"

/* Not in spm_c.h: spm_c.cc's hook that runs the library's own DecodeIds. */
long spm_test_library_decode(const SpmTokenizer *t, const int *ids, int n, char *buf, size_t bufsize);

static const char *s_model_path = "build/tests/tiny.model";
static SpmTokenizer *s_tok;

#define BYTE_ID(b) (3 + (int)(unsigned char)(b))
#define REPL "\xEF\xBF\xBD" /* U+FFFD */
enum { MAX_IDS = 512, TEXT_CAP = 8192 };

/* Text of several scripts; the emoji and the non-Latin letters are not in the fixture, so
 * with this tiny vocabulary they can only be spelled with byte-fallback pieces. */
static const char *const k_texts[] = {
    "Once upon a time, a little fox named Pip lived near a big green hill.",
    "The café was naïve about 2024 things, and 7 cats said \"hello!\"",
    "A dragon \xF0\x9F\x90\x89 and a tiger \xF0\x9F\x90\xAF met at 10 and left at 45!",
    "Stra\xC3\x9F"
    "e, \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E, \xCE\x95\xCE\xBB\xCE\xBB\xCE\xB7\xCE\xBD\xCE\xB9\xCE\xBA\xCE\xAC",
    "tab\there and line one\nline two",
    "\xF0\x9F\x8C\xBC",
    "x",
};

static int setup(void **state) {
    (void)state;
    char err[256];
    s_tok = spm_load_file(s_model_path, err, sizeof err);
    if (!s_tok) fprintf(stderr, "%s\n", err);
    return s_tok ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    spm_free(s_tok);
    s_tok = NULL;
    return 0;
}

static int encode_str(const char *s, int add_bos, int *ids) {
    int n = spm_encode(s_tok, s, strlen(s), add_bos, ids, MAX_IDS);
    assert_true(n >= 0);
    assert_true(n <= MAX_IDS);
    return n;
}

/* Everything the stream prints for ids[0 .. n), then its flush. */
static void stream_all(const int *ids, int n, char *out, size_t cap) {
    SpmStream *s = spm_stream_new(s_tok);
    assert_non_null(s);
    size_t len = 0;
    for (int i = 0; i <= n; i++) {
        const char *piece = i < n ? spm_stream_put(s, ids[i]) : spm_stream_flush(s);
        assert_non_null(piece);
        size_t k = strlen(piece);
        assert_true(len + k < cap);
        memcpy(out + len, piece, k);
        len += k;
    }
    out[len] = '\0';
    spm_stream_free(s);
}

static void test_vocab_and_special_ids(void **state) {
    (void)state;
    assert_int_equal(spm_vocab_size(s_tok), 320);
    assert_int_equal(spm_bos_id(s_tok), 1);
    assert_int_equal(spm_eos_id(s_tok), 2);
    /* byte pieces follow the three specials: <0x41> is 'A' */
    char buf[16];
    int a = BYTE_ID('A');
    assert_int_equal(spm_decode(s_tok, &a, 1, buf, sizeof buf), 1);
    assert_string_equal(buf, "A");
    /* id 0 is <unk>, which decodes to SentencePiece's default " \u2047 " */
    int unk = 0;
    assert_int_equal(spm_decode(s_tok, &unk, 1, buf, sizeof buf), 5);
    assert_string_equal(buf, " \xE2\x81\x87 ");
    /* pieces as the model stores them: the specials, a byte piece, nothing out of range */
    assert_string_equal(spm_piece(s_tok, 0), "<unk>");
    assert_string_equal(spm_piece(s_tok, 1), "<s>");
    assert_string_equal(spm_piece(s_tok, BYTE_ID('A')), "<0x41>");
    assert_null(spm_piece(s_tok, -1));
    assert_null(spm_piece(s_tok, 320));
    assert_null(spm_piece(NULL, 0));
    /* NULL is handled everywhere */
    assert_int_equal(spm_vocab_size(NULL), 0);
    assert_int_equal(spm_bos_id(NULL), -1);
    assert_int_equal(spm_eos_id(NULL), -1);
    assert_int_equal(spm_encode(NULL, "a", 1, 1, NULL, 0), SPM_ERR_OTHER);
    assert_null(spm_stream_new(NULL));
    assert_string_equal(spm_stream_put(NULL, 5), "");
    assert_string_equal(spm_stream_flush(NULL), "");
    spm_stream_free(NULL);
    spm_free(NULL);
}

static void test_round_trip(void **state) {
    (void)state;
    int ids[MAX_IDS];
    char out[TEXT_CAP];
    for (size_t i = 0; i < sizeof k_texts / sizeof k_texts[0]; i++) {
        const char *text = k_texts[i];
        int n = encode_str(text, 0, ids);
        assert_true(n > 0);
        size_t need = spm_decode(s_tok, ids, n, out, sizeof out);
        assert_int_equal(need, strlen(text));
        assert_string_equal(out, text);
        /* with BOS in front too */
        n = encode_str(text, 1, ids);
        assert_int_equal(spm_decode(s_tok, ids, n, out, sizeof out), strlen(text));
        assert_string_equal(out, text);
    }
}

static int count_byte_ids(const int *ids, int n) {
    int c = 0;
    for (int i = 0; i < n; i++) c += ids[i] >= 3 && ids[i] <= 258;
    return c;
}

static void test_byte_fallback_is_used(void **state) {
    (void)state;
    int ids[MAX_IDS];
    /* plain fixture-like English needs no byte pieces */
    int n = encode_str(k_texts[0], 0, ids);
    assert_int_equal(count_byte_ids(ids, n), 0);
    /* each of the two emoji, 4 UTF-8 bytes, is spelled with 4 byte pieces */
    n = encode_str(k_texts[2], 0, ids);
    assert_int_equal(count_byte_ids(ids, n), 8);
    /* a lone dragon: the four bytes F0 9F 90 89 in order */
    n = encode_str("\xF0\x9F\x90\x89", 0, ids);
    assert_true(n >= 4);
    assert_int_equal(ids[n - 4], BYTE_ID(0xF0));
    assert_int_equal(ids[n - 3], BYTE_ID(0x9F));
    assert_int_equal(ids[n - 2], BYTE_ID(0x90));
    assert_int_equal(ids[n - 1], BYTE_ID(0x89));
}

static void test_encode_bos(void **state) {
    (void)state;
    int plain[MAX_IDS], bos[MAX_IDS];
    for (size_t i = 0; i < sizeof k_texts / sizeof k_texts[0]; i++) {
        int n = encode_str(k_texts[i], 0, plain);
        int m = encode_str(k_texts[i], 1, bos);
        assert_int_equal(m, n + 1);
        assert_int_equal(bos[0], 1);
        assert_memory_equal(bos + 1, plain, (size_t)n * sizeof(int));
        for (int k = 0; k < n; k++) assert_int_not_equal(plain[k], 1);
    }
    /* the empty text is nothing, or BOS alone */
    int ids[4] = {-7, -7, -7, -7};
    assert_int_equal(spm_encode(s_tok, "", 0, 0, ids, 4), 0);
    assert_int_equal(ids[0], -7);
    assert_int_equal(spm_encode(s_tok, "", 0, 1, ids, 4), 1);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], -7);
}

static void test_encode_rejects_invalid_utf8_and_nul(void **state) {
    (void)state;
    static const struct {
        const char *s;
        size_t len;
    } bad[] = {
        {"abc\0def", 7},         /* embedded NUL */
        {"\0", 1},               /* NUL alone */
        {"caf\xC3", 4},          /* cut short */
        {"\xC3\x28", 2},         /* bad trail byte */
        {"\xC0\xAF", 2},         /* overlong '/' */
        {"\xE0\x80\x80", 3},     /* overlong NUL */
        {"\xED\xA0\x80", 3},     /* surrogate U+D800 */
        {"\xF4\x90\x80\x80", 4}, /* above U+10FFFF */
        {"\xFF", 1},             /* never in UTF-8 */
        {"ok \x80 then", 9},     /* lone trail byte */
        {"\xF0\x9F\x90", 3},     /* emoji cut short */
    };
    int ids[MAX_IDS];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ids[0] = -7;
        assert_int_equal(spm_encode(s_tok, bad[i].s, bad[i].len, 1, ids, MAX_IDS), SPM_ERR_TEXT);
        assert_int_equal(spm_encode(s_tok, bad[i].s, bad[i].len, 0, ids, MAX_IDS), SPM_ERR_TEXT);
        assert_int_equal(ids[0], -7);
    }
    /* len is honoured: the text need not be NUL-terminated */
    int a[MAX_IDS], b[MAX_IDS];
    int n = spm_encode(s_tok, "caf\xC3\xA9 and more", 5, 0, a, MAX_IDS);
    int m = encode_str("caf\xC3\xA9", 0, b);
    assert_int_equal(n, m);
    assert_memory_equal(a, b, (size_t)n * sizeof(int));
    /* and a cut through a character is invalid */
    assert_int_equal(spm_encode(s_tok, "caf\xC3\xA9", 4, 0, a, MAX_IDS), SPM_ERR_TEXT);
    /* bad arguments are not bad text */
    assert_int_equal(spm_encode(s_tok, NULL, 3, 0, a, MAX_IDS), SPM_ERR_OTHER);
    assert_int_equal(spm_encode(s_tok, "abc", 3, 0, NULL, 5), SPM_ERR_OTHER);
    assert_int_equal(spm_encode(s_tok, "abc", 3, 0, a, -1), SPM_ERR_OTHER);
    assert_int_equal(SPM_ERR_TEXT, -1); /* the value run.c reports as "not valid UTF-8" */
}

static void test_max_ids_reports_full_count(void **state) {
    (void)state;
    const char *text = k_texts[1];
    int full[MAX_IDS];
    int n = encode_str(text, 1, full);
    assert_true(n > 6);
    int ids[MAX_IDS];
    for (int i = 0; i < MAX_IDS; i++) ids[i] = -99;
    assert_int_equal(spm_encode(s_tok, text, strlen(text), 1, ids, 5), n);
    assert_memory_equal(ids, full, 5 * sizeof(int));
    for (int i = 5; i < MAX_IDS; i++) assert_int_equal(ids[i], -99);
    /* max_ids 0 only counts: ids may be NULL */
    assert_int_equal(spm_encode(s_tok, text, strlen(text), 1, NULL, 0), n);
    assert_int_equal(spm_encode(s_tok, text, strlen(text), 0, NULL, 0), n - 1);
    /* room for exactly BOS */
    ids[0] = ids[1] = -99;
    assert_int_equal(spm_encode(s_tok, text, strlen(text), 1, ids, 1), n);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], -99);
}

static void test_stream_equals_decode_equals_text(void **state) {
    (void)state;
    int ids[MAX_IDS];
    char streamed[TEXT_CAP], decoded[TEXT_CAP];
    for (size_t i = 0; i < sizeof k_texts / sizeof k_texts[0]; i++) {
        for (int add_bos = 0; add_bos <= 1; add_bos++) {
            int n = encode_str(k_texts[i], add_bos, ids);
            ids[n++] = 2; /* EOS at the end prints nothing */
            stream_all(ids, n, streamed, sizeof streamed);
            spm_decode(s_tok, ids, n, decoded, sizeof decoded);
            assert_string_equal(streamed, k_texts[i]);
            assert_string_equal(decoded, k_texts[i]);
        }
    }
}

/* As run.c does: one stream for the prompt's ids (after BOS) and then what is generated. */
static void test_stream_space_between_pieces(void **state) {
    (void)state;
    int a[MAX_IDS], b[MAX_IDS];
    int na = encode_str("Hi", 0, a);
    int nb = encode_str("there, Pip.", 0, b);
    SpmStream *s = spm_stream_new(s_tok);
    assert_non_null(s);
    char out[TEXT_CAP] = "";
    for (int i = 0; i < na; i++) strcat(out, spm_stream_put(s, a[i]));
    assert_string_equal(out, "Hi"); /* the dummy prefix space is gone */
    for (int i = 0; i < nb; i++) strcat(out, spm_stream_put(s, b[i]));
    strcat(out, spm_stream_flush(s));
    assert_string_equal(out, "Hi there, Pip."); /* a later piece keeps its space */
    spm_stream_free(s);
}

static void test_stream_bytes_wait_for_whole_characters(void **state) {
    (void)state;
    SpmStream *s = spm_stream_new(s_tok);
    assert_non_null(s);
    /* the dragon: nothing until its fourth byte */
    assert_string_equal(spm_stream_put(s, BYTE_ID(0xF0)), "");
    assert_string_equal(spm_stream_put(s, BYTE_ID(0x9F)), "");
    assert_string_equal(spm_stream_put(s, BYTE_ID(0x90)), "");
    assert_string_equal(spm_stream_put(s, BYTE_ID(0x89)), "\xF0\x9F\x90\x89");
    /* an ASCII byte is ready at once; so is a 2-byte letter when complete */
    assert_string_equal(spm_stream_put(s, BYTE_ID('!')), "!");
    assert_string_equal(spm_stream_put(s, BYTE_ID(0xC3)), "");
    assert_string_equal(spm_stream_put(s, BYTE_ID(0xA9)), "\xC3\xA9");
    assert_string_equal(spm_stream_flush(s), "");
    /* a byte that can start nothing is U+FFFD at once */
    assert_string_equal(spm_stream_put(s, BYTE_ID(0xFF)), REPL);
    assert_string_equal(spm_stream_put(s, BYTE_ID(0x80)), REPL);
    assert_string_equal(spm_stream_put(s, BYTE_ID(0xC0)), REPL); /* only overlong forms */
    /* a broken sequence: U+FFFD per bad byte, then what follows */
    assert_string_equal(spm_stream_put(s, BYTE_ID(0xE2)), "");
    assert_string_equal(spm_stream_put(s, BYTE_ID(0x82)), "");
    assert_string_equal(spm_stream_put(s, BYTE_ID('A')), REPL REPL "A");
    /* a new lead byte interrupts the last one, and waits itself */
    assert_string_equal(spm_stream_put(s, BYTE_ID(0xE2)), "");
    assert_string_equal(spm_stream_put(s, BYTE_ID(0xF0)), REPL);
    assert_string_equal(spm_stream_put(s, BYTE_ID(0x9F)), "");
    /* a surrogate's second byte is bad at once */
    assert_string_equal(spm_stream_flush(s), REPL REPL);
    assert_string_equal(spm_stream_put(s, BYTE_ID(0xED)), "");
    assert_string_equal(spm_stream_put(s, BYTE_ID(0xA0)), REPL REPL);
    /* a control id ends a byte run too, as in DecodeIds */
    assert_string_equal(spm_stream_put(s, BYTE_ID(0xC3)), "");
    assert_string_equal(spm_stream_put(s, 2), REPL);
    /* and a normal piece: the pending bytes come first */
    int ids[MAX_IDS];
    int n = encode_str("x", 0, ids);
    assert_string_equal(spm_stream_put(s, BYTE_ID(0xF0)), "");
    char out[64] = "";
    for (int i = 0; i < n; i++) strcat(out, spm_stream_put(s, ids[i]));
    assert_string_equal(out, REPL " x"); /* not the first text any more: the space stays */
    /* flush at the end of generation */
    assert_string_equal(spm_stream_put(s, BYTE_ID(0xF0)), "");
    assert_string_equal(spm_stream_put(s, BYTE_ID(0x9F)), "");
    assert_string_equal(spm_stream_flush(s), REPL REPL);
    assert_string_equal(spm_stream_flush(s), "");
    spm_stream_free(s);
}

static void test_stream_controls_unknown_and_out_of_range(void **state) {
    (void)state;
    const int V = spm_vocab_size(s_tok);
    SpmStream *s = spm_stream_new(s_tok);
    assert_non_null(s);
    const int odd[] = {-5, V, 1 << 30, INT_MIN, INT_MAX, -1, 1, 2};
    for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++) {
        const char *r = spm_stream_put(s, odd[i]);
        assert_non_null(r);
        assert_string_equal(r, "");
    }
    /* out-of-range ids leave a pending byte sequence alone */
    assert_string_equal(spm_stream_put(s, BYTE_ID(0xC3)), "");
    assert_string_equal(spm_stream_put(s, -5), "");
    assert_string_equal(spm_stream_put(s, V), "");
    assert_string_equal(spm_stream_put(s, BYTE_ID(0xA9)), "\xC3\xA9");
    assert_string_equal(spm_stream_put(s, 0), " \xE2\x81\x87 ");
    spm_stream_free(s);
    /* spm_decode skips them the same way */
    int ids[MAX_IDS];
    int n = encode_str("Pip", 0, ids);
    int with_odd[MAX_IDS];
    int m = 0;
    with_odd[m++] = -5;
    with_odd[m++] = 1;
    for (int i = 0; i < n; i++) {
        with_odd[m++] = ids[i];
        with_odd[m++] = (i & 1) ? V : 1 << 30;
    }
    char out[64];
    assert_int_equal(spm_decode(s_tok, with_odd, m, out, sizeof out), 3);
    assert_string_equal(out, "Pip");
}

static void test_decode_truncates_on_character_boundary(void **state) {
    (void)state;
    int ids[MAX_IDS];
    const char *text = "The caf\xC3\xA9"; /* 9 bytes */
    int n = encode_str(text, 0, ids);
    char buf[16];
    memset(buf, 'Z', sizeof buf);
    assert_int_equal(spm_decode(s_tok, ids, n, buf, 9), 9); /* room for 8: "The caf" + half of é */
    assert_string_equal(buf, "The caf");
    assert_int_equal(spm_decode(s_tok, ids, n, buf, 10), 9);
    assert_string_equal(buf, text);
    assert_int_equal(spm_decode(s_tok, ids, n, buf, 4), 9);
    assert_string_equal(buf, "The");
    assert_int_equal(spm_decode(s_tok, ids, n, buf, 1), 9);
    assert_string_equal(buf, "");
    assert_int_equal(spm_decode(s_tok, ids, n, NULL, 0), 9);
    assert_int_equal(spm_decode(s_tok, NULL, 0, buf, sizeof buf), 0);
    assert_string_equal(buf, "");
}

static void test_nul_byte_piece_prints_nothing(void **state) {
    (void)state;
    int ids[MAX_IDS];
    int n = encode_str("x", 0, ids + 1);
    ids[0] = BYTE_ID(0x00);
    char lib[64], ours[64];
    /* the library gives "\0 x": the NUL counts as text, so the space of "x" stays */
    assert_int_equal(spm_test_library_decode(s_tok, ids, n + 1, lib, sizeof lib), 3);
    assert_int_equal(lib[0], '\0');
    assert_string_equal(lib + 1, " x");
    assert_int_equal(spm_decode(s_tok, ids, n + 1, ours, sizeof ours), 2);
    assert_string_equal(ours, " x");
}

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Random id sequences, heavy in byte pieces (valid and broken UTF-8), controls and <unk>:
 * the stream, spm_decode and the library's DecodeIds agree on every one. */
static void test_stream_matches_library_decode(void **state) {
    (void)state;
    static const unsigned char bytes[] = {0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x90, 0x89, 0xC3, 0xA9, 0xED, 0xA0, 0xF4,
                                          0x8F, 0x90, 0xC0, 0xC2, 'A',  ' ',  0xFF, 0x80, 0xBF, 0xE0, 0xF5};
    const int V = spm_vocab_size(s_tok);
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    char lib[TEXT_CAP], streamed[TEXT_CAP], decoded[TEXT_CAP];
    int ids[32];
    int with_bytes = 0;
    for (int iter = 0; iter < 20000; iter++) {
        int n = (int)(rng_next(&rng) % 24);
        for (int i = 0; i < n; i++) {
            unsigned r = (unsigned)(rng_next(&rng) % 16);
            if (r < 6)
                ids[i] = BYTE_ID(bytes[rng_next(&rng) % sizeof bytes]);
            else if (r < 7)
                ids[i] = (int)(rng_next(&rng) % 3); /* unk, bos, eos */
            else
                ids[i] = 3 + (int)(rng_next(&rng) % (uint64_t)(V - 3)); /* any piece but a NUL byte... */
            if (ids[i] == BYTE_ID(0)) ids[i] = BYTE_ID('0');            /* ...which C strings cannot hold */
        }
        with_bytes += count_byte_ids(ids, n) > 0;
        long len = spm_test_library_decode(s_tok, ids, n, lib, sizeof lib);
        assert_true(len >= 0);
        assert_int_equal((size_t)len, strlen(lib));
        stream_all(ids, n, streamed, sizeof streamed);
        size_t need = spm_decode(s_tok, ids, n, decoded, sizeof decoded);
        if (strcmp(lib, streamed) != 0) {
            fprintf(stderr, "ids:");
            for (int i = 0; i < n; i++) fprintf(stderr, " %d", ids[i]);
            fprintf(stderr, "\nlibrary: [%s]\nstream:  [%s]\n", lib, streamed);
        }
        assert_string_equal(streamed, lib);
        assert_string_equal(decoded, lib);
        assert_int_equal(need, (size_t)len);
    }
    assert_true(with_bytes > 10000);
    /* and encoded text of every kind, fed with and without BOS */
    for (size_t i = 0; i < sizeof k_texts / sizeof k_texts[0]; i++) {
        int e[MAX_IDS];
        int n = encode_str(k_texts[i], 1, e);
        for (int start = 0; start <= 1; start++) {
            assert_true(spm_test_library_decode(s_tok, e + start, n - start, lib, sizeof lib) >= 0);
            stream_all(e + start, n - start, streamed, sizeof streamed);
            assert_string_equal(streamed, lib);
            assert_string_equal(lib, k_texts[i]);
        }
    }
}

static unsigned char *read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    assert_true(n > 0);
    rewind(f);
    unsigned char *data = malloc((size_t)n);
    assert_non_null(data);
    assert_int_equal(fread(data, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *size = (size_t)n;
    return data;
}

static void test_load_file_errors(void **state) {
    (void)state;
    char err[256];
    memset(err, 'Z', sizeof err);
    assert_null(spm_load_file("build/tests/no-such-dir/no-such.model", err, sizeof err));
    assert_true(strlen(err) > 0 && strlen(err) < sizeof err);
    assert_non_null(strstr(err, "no-such.model"));
    /* garbage bytes */
    char path[1024];
    snprintf(path, sizeof path, "%s.garbage.tmp", s_model_path);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint64_t rng = 12345;
    for (int i = 0; i < 4096; i++) fputc((int)(rng_next(&rng) & 0xFF), f);
    fclose(f);
    memset(err, 'Z', sizeof err);
    assert_null(spm_load_file(path, err, sizeof err));
    assert_true(strlen(err) > 0 && strlen(err) < sizeof err);
    /* an empty file */
    f = fopen(path, "wb");
    assert_non_null(f);
    fclose(f);
    err[0] = '\0';
    assert_null(spm_load_file(path, err, sizeof err));
    assert_true(strlen(err) > 0);
    remove(path);
    /* a directory */
    err[0] = '\0';
    assert_null(spm_load_file(".", err, sizeof err));
    assert_true(strlen(err) > 0);
    /* a small err buffer is cut and still terminated; none at all is fine */
    memset(err, 'Z', sizeof err);
    assert_null(spm_load_file("build/tests/no-such.model", err, 8));
    assert_int_equal(strlen(err), 7);
    assert_null(spm_load_file("build/tests/no-such.model", NULL, 0));
    assert_null(spm_load_file(NULL, err, sizeof err));
    assert_true(strlen(err) > 0);
}

static void test_load_bytes(void **state) {
    (void)state;
    size_t size;
    unsigned char *data = read_file(s_model_path, &size);
    char err[256];
    SpmTokenizer *t = spm_load_bytes(data, size, err, sizeof err);
    assert_non_null(t);
    assert_int_equal(spm_vocab_size(t), 320);
    assert_int_equal(spm_bos_id(t), 1);
    assert_int_equal(spm_eos_id(t), 2);
    /* it encodes the same as the one loaded from the file */
    int a[MAX_IDS], b[MAX_IDS];
    const char *text = k_texts[2];
    int n = spm_encode(t, text, strlen(text), 1, a, MAX_IDS);
    assert_int_equal(n, encode_str(text, 1, b));
    assert_memory_equal(a, b, (size_t)n * sizeof(int));
    spm_free(t);
    /* truncated: cut through a piece, through the last field, almost nothing, nothing */
    const size_t cuts[] = {size / 2, size / 3, size - 1, 1, 0};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        memset(err, 'Z', sizeof err);
        assert_null(spm_load_bytes(data, cuts[i], err, sizeof err));
        assert_true(strlen(err) > 0 && strlen(err) < sizeof err);
    }
    assert_null(spm_load_bytes(NULL, 10, err, sizeof err));
    assert_true(strlen(err) > 0);
    /* the bytes are copied: the tokenizer outlives them */
    t = spm_load_bytes(data, size, err, sizeof err);
    assert_non_null(t);
    memset(data, 0, size);
    free(data);
    assert_int_equal(spm_encode(t, text, strlen(text), 1, a, MAX_IDS), n);
    assert_memory_equal(a, b, (size_t)n * sizeof(int));
    spm_free(t);
}

/* ---- crafted models: the embedded tokenizer is untrusted input ---- */

/* Loads the tiny model with `extra` appended: protobuf merges the appended fields over the
 * model's own. */
static SpmTokenizer *load_with(const unsigned char *extra, size_t n, char *err, size_t errlen) {
    size_t size, total;
    unsigned char *model = read_file(s_model_path, &size);
    unsigned char *bytes = concat_bytes(model, size, extra, n, &total);
    assert_non_null(bytes);
    memset(err, 'Z', errlen);
    SpmTokenizer *t = spm_load_bytes(bytes, total, err, errlen);
    free(bytes);
    free(model);
    return t;
}

/* spec_field 3 (normalizer_spec) or 5 (denormalizer_spec) with precompiled_charsmap (2) = c,
 * then `more` (other fields, e.g. self-test data) */
static SpmTokenizer *load_with_charsmap(unsigned spec_field, const unsigned char *charsmap, size_t cs_len,
                                        const unsigned char *more, size_t more_len, char *err, size_t errlen) {
    unsigned char *spec = malloc(cs_len + 16), *extra = malloc(cs_len + 32 + more_len);
    assert_non_null(spec);
    assert_non_null(extra);
    size_t n = pb_put_bytes(spec, 2, charsmap, cs_len);
    size_t m = pb_put_bytes(extra, spec_field, spec, n);
    if (more_len) memcpy(extra + m, more, more_len);
    SpmTokenizer *t = load_with(extra, m + more_len, err, errlen);
    free(extra);
    free(spec);
    return t;
}

static int encode_with(const SpmTokenizer *t, const char *text, int *ids) {
    int n = spm_encode(t, text, strlen(text), 0, ids, MAX_IDS);
    assert_true(n >= 0 && n <= MAX_IDS);
    return n;
}

/* A sound charsmap is accepted and used: with the rule q -> "Once", "q" encodes as "Once". */
static void test_crafted_charsmap_normalizes(void **state) {
    (void)state;
    TestCharsmap c;
    test_charsmap_init(&c, 'q', "Once");
    unsigned char blob[sizeof c + 4];
    size_t len = test_charsmap_encode(&c, blob);
    char err[256];
    SpmTokenizer *t = load_with_charsmap(3, blob, len, NULL, 0, err, sizeof err);
    if (!t) fail_msg("refused: %s", err);
    int a[MAX_IDS], b[MAX_IDS];
    const char *pairs[][2] = {{"q", "Once"}, {"a q upon", "a Once upon"}, {"qq", "OnceOnce"}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        int n = encode_with(t, pairs[i][0], a);
        assert_int_equal(n, encode_str(pairs[i][1], 0, b));
        assert_memory_equal(a, b, (size_t)n * sizeof(int));
    }
    assert_int_not_equal(encode_with(t, "q", a), encode_str("q", 0, b)); /* the rule did something */
    spm_free(t);
}

enum Corruption {
    VALUE_PAST_STRINGS,
    VALUE_FAR_PAST_STRINGS,
    VALUE_INSIDE_A_STRING,
    LAST_STRING_UNTERMINATED,
    STRING_NOT_UTF8,
    ROOT_OFFSET_OUTSIDE,
    ROOT_IS_A_VALUE,
    CHILD_OFFSET_OUTSIDE,
    TRIE_SIZE_PAST_BLOB,
    TRIE_SIZE_NOT_BLOCKS,
    TRIE_SIZE_ZERO,
    BLOB_OF_3_BYTES,
    N_CORRUPTIONS
};

static size_t corrupt_charsmap(enum Corruption k, unsigned char *blob) {
    TestCharsmap c;
    test_charsmap_init(&c, 'q', k == STRING_NOT_UTF8 ? "\xFF" : "Once");
    const uint32_t child = TEST_TRIE_BASE ^ 'q';
    switch (k) {
    case VALUE_PAST_STRINGS: c.units[TEST_TRIE_LEAF] = 1u << 31 | (uint32_t)(c.strings_len + 16); break;
    case VALUE_FAR_PAST_STRINGS: c.units[TEST_TRIE_LEAF] = 1u << 31 | 0x40000000; break;
    case VALUE_INSIDE_A_STRING: c.units[TEST_TRIE_LEAF] = 1u << 31 | 2; break;
    case LAST_STRING_UNTERMINATED: c.strings_len--; break;
    case ROOT_OFFSET_OUTSIDE: c.units[0] = 0xFFFFFC00u >> 1 | 1u << 9; break; /* offset about 2^29 */
    case ROOT_IS_A_VALUE: c.units[0] |= 1u << 31; break;
    case CHILD_OFFSET_OUTSIDE: c.units[child] = 0x1FFFFFu << 10 | 1u << 8 | 'q'; break; /* bit 31 clear */
    case TRIE_SIZE_PAST_BLOB: c.trie_bytes = 0x7FFFFFF0u; break;
    case TRIE_SIZE_NOT_BLOCKS: c.trie_bytes -= 4; break;
    case TRIE_SIZE_ZERO: c.trie_bytes = 0; break;
    default: break;
    }
    size_t len = test_charsmap_encode(&c, blob);
    return k == BLOB_OF_3_BYTES ? 3 : len;
}

/* Each broken charsmap is refused with one sentence. Before the wrapper checked them, the
 * library took them: encoding "q" then crashed or read out of bounds (the encode below). */
static void test_crafted_charsmap_refused(void **state) {
    (void)state;
    for (int k = 0; k < N_CORRUPTIONS; k++) {
        unsigned char blob[sizeof(TestCharsmap) + 4];
        size_t len = corrupt_charsmap((enum Corruption)k, blob);
        char err[256];
        SpmTokenizer *t = load_with_charsmap(3, blob, len, NULL, 0, err, sizeof err);
        if (t) {
            int ids[MAX_IDS];
            int n = spm_encode(t, "q q", 3, 1, ids, MAX_IDS);
            spm_free(t);
            fail_msg("corruption %d loaded (encoding gave %d)", k, n);
        }
        assert_true(strlen(err) < sizeof err);
        assert_null(strchr(err, '\n'));
        if (!strstr(err, "normalizer")) fail_msg("corruption %d: %s", k, err);
    }
}

/* The library runs a model's self-test samples while loading, so a broken charsmap with a
 * sample crashed the load itself. */
static void test_crafted_charsmap_with_self_test(void **state) {
    (void)state;
    unsigned char blob[sizeof(TestCharsmap) + 4], sample[32], samples[48], self_test[64];
    size_t len = corrupt_charsmap(ROOT_OFFSET_OUTSIDE, blob);
    size_t n = pb_put_bytes(sample, 1, "q", 1);           /* Sample.input */
    n += pb_put_bytes(sample + n, 2, "\xE2\x96\x81q", 4); /* Sample.expected */
    size_t m = pb_put_bytes(samples, 1, sample, n);       /* SelfTestData.samples */
    size_t k = pb_put_bytes(self_test, 4, samples, m);    /* ModelProto.self_test_data */
    char err[256];
    assert_null(load_with_charsmap(3, blob, len, self_test, k, err, sizeof err));
    assert_non_null(strstr(err, "normalizer"));
}

/* The denormalizer runs in the library's DecodeIds (called at load to learn the model's
 * decoding rules); this program's decoder does not apply one, so any is refused. */
static void test_crafted_denormalizer_refused(void **state) {
    (void)state;
    unsigned char blob[sizeof(TestCharsmap) + 4];
    TestCharsmap c;
    test_charsmap_init(&c, 'q', "Once");
    size_t sound = test_charsmap_encode(&c, blob);
    char err[256];
    assert_null(load_with_charsmap(5, blob, sound, NULL, 0, err, sizeof err));
    assert_non_null(strstr(err, "denormalizer"));
    size_t broken = corrupt_charsmap(ROOT_OFFSET_OUTSIDE, blob);
    assert_null(load_with_charsmap(5, blob, broken, NULL, 0, err, sizeof err));
    assert_non_null(strstr(err, "denormalizer"));
}

/* Appends one piece (ModelProto.pieces: piece 1, score 2, type 3) to the tiny model. */
static SpmTokenizer *load_with_typed_piece(const char *piece, size_t len, float score, int type, char *err,
                                           size_t errlen) {
    unsigned char sp[64], extra[80];
    size_t n = pb_put_bytes(sp, 1, piece, len);
    n += pb_put_float(sp + n, 2, score);
    n += pb_put_varint(sp + n, 3, (uint64_t)type);
    return load_with(extra, pb_put_bytes(extra, 1, sp, n), err, errlen);
}

static SpmTokenizer *load_with_piece(const char *piece, size_t len, float score, char *err, size_t errlen) {
    return load_with_typed_piece(piece, len, score, 1 /* NORMAL */, err, errlen);
}

/* The decoder prints pieces as they are: a piece must be valid UTF-8 without NUL, its score
 * a number, and its text its own. */
static void test_crafted_pieces(void **state) {
    (void)state;
    char err[256], out[64];
    SpmTokenizer *t = load_with_piece("zqzq", 4, -1000.0f, err, sizeof err);
    if (!t) fail_msg("a sound extra piece was refused: %s", err);
    int id = 320;
    assert_int_equal(spm_vocab_size(t), 321);
    assert_int_equal(spm_decode(t, &id, 1, out, sizeof out), 4);
    assert_string_equal(out, "zqzq");
    spm_free(t);
    assert_null(load_with_piece("ab\0cd", 5, -1000.0f, err, sizeof err));
    assert_non_null(strstr(err, "piece 320"));
    assert_null(load_with_piece("\xFF\xFE", 2, -1000.0f, err, sizeof err));
    assert_non_null(strstr(err, "piece 320"));
    assert_null(load_with_piece("zqzq", 4, NAN, err, sizeof err));
    assert_non_null(strstr(err, "piece 320"));
    assert_null(load_with_piece("zqzq", 4, -INFINITY, err, sizeof err));
    assert_non_null(strstr(err, "piece 320"));
    /* two pieces with one text: the library's DecodeIds would decode the other one (the
     * control <s> as nothing, <0x41> as "A") */
    assert_null(load_with_piece("<s>", 3, 0.0f, err, sizeof err));
    assert_non_null(strstr(err, "pieces 1 and 320 have the same text"));
    assert_null(load_with_piece("<0x41>", 6, 0.0f, err, sizeof err));
    assert_non_null(strstr(err, "and 320 have the same text"));
    /* the library's refusal quotes a BYTE piece (type 6): its escape sequences and invalid
     * UTF-8 must not reach the message, which ./run prints on a terminal */
    static const char evil[] = "<0x\x1b]0;pwned\x07\x1b[31m\xFF>";
    memset(err, 'Z', sizeof err);
    assert_null(load_with_typed_piece(evil, sizeof evil - 1, 0.0f, 6, err, sizeof err));
    assert_non_null(strstr(err, "\xEF\xBF\xBD]0;pwned\xEF\xBF\xBD\xEF\xBF\xBD[31m\xEF\xBF\xBD>"));
    assert_true(utf8_valid(err, strlen(err)));
    for (const char *c = err; *c; c++) assert_false((unsigned char)*c < 0x20 || *c == 0x7F);
    /* a message cut to a small buffer stays valid UTF-8 */
    for (size_t room = 1; room < 64; room++) {
        char small[64];
        assert_null(load_with_typed_piece(evil, sizeof evil - 1, 0.0f, 6, small, room));
        assert_true(strlen(small) < room && utf8_valid(small, strlen(small)));
    }
    /* the unknown piece's surface (TrainerSpec.unk_surface, 44) is printed too */
    unsigned char spec[16], extra[32];
    size_t n = pb_put_bytes(spec, 44, "\xC3", 1);
    assert_null(load_with(extra, pb_put_bytes(extra, 2, spec, n), err, sizeof err));
    assert_non_null(strstr(err, "unknown"));
}

/* What protobuf skips, the checks skip: a group field (wire type 3) numbered like the
 * normalizer holds a broken charsmap the library never sees, so the model loads. A field
 * cut short does not parse. */
static void test_crafted_wire_format(void **state) {
    (void)state;
    unsigned char blob[sizeof(TestCharsmap) + 4], extra[sizeof blob + 32];
    size_t len = corrupt_charsmap(ROOT_OFFSET_OUTSIDE, blob);
    size_t n = 0;
    extra[n++] = 3 << 3 | 3; /* start group 3 */
    n += pb_put_bytes(extra + n, 2, blob, len);
    extra[n++] = 3 << 3 | 4; /* end group 3 */
    char err[256];
    SpmTokenizer *t = load_with(extra, n, err, sizeof err);
    if (!t) fail_msg("refused: %s", err);
    int ids[MAX_IDS], ref[MAX_IDS];
    int k = encode_with(t, "q q", ids);
    assert_int_equal(k, encode_str("q q", 0, ref));
    assert_memory_equal(ids, ref, (size_t)k * sizeof(int));
    spm_free(t);
    /* a normalizer field whose length runs past the end */
    const unsigned char cut[] = {3 << 3 | 2, 100, 2 << 3 | 2, 5, 'a'};
    assert_null(load_with(cut, sizeof cut, err, sizeof err));
    assert_non_null(strstr(err, "do not parse"));
}

/* Real charsmaps, as spm_train compiles them, pass the checks and normalize. */
static void test_trained_normalizers_load(void **state) {
    (void)state;
    static const struct {
        const char *rule, *type, *text, *same_as;
    } cases[] = {
        {"nmt_nfkc", "bpe", "\xEF\xBD\x86\xEF\xBD\x95\xEF\xBD\x8C\xEF\xBD\x8C moon",
         "full moon"}, /* fullwidth letters */
        {"nfkc_cf", "unigram", "ONCE Upon", "once upon"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *prefix = temp_path(cases[i].rule);
        char cmd[2048], path[1024], err[256];
        snprintf(cmd, sizeof cmd,
                 "spm_train --input=tests/fixtures/tiny.txt --model_prefix=%s --model_type=%s --vocab_size=320 "
                 "--byte_fallback=true --character_coverage=1.0 --normalization_rule_name=%s --minloglevel=2 "
                 ">/dev/null 2>&1",
                 prefix, cases[i].type, cases[i].rule);
        if (system(cmd) != 0) fail_msg("spm_train failed: %s", cmd);
        snprintf(path, sizeof path, "%s.model", prefix);
        SpmTokenizer *t = spm_load_file(path, err, sizeof err);
        if (!t) fail_msg("%s: %s", cases[i].rule, err);
        int a[MAX_IDS], b[MAX_IDS];
        int n = encode_with(t, cases[i].text, a);
        assert_int_equal(n, encode_with(t, cases[i].same_as, b));
        assert_memory_equal(a, b, (size_t)n * sizeof(int));
        spm_free(t);
        remove(path);
        snprintf(path, sizeof path, "%s.vocab", prefix);
        remove(path);
    }
}

#if !defined(__SANITIZE_ADDRESS__)
/* Bytes of address space this process uses (VmSize), or 0 when /proc does not say. */
static size_t address_space_bytes(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    size_t kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmSize: %zu kB", &kb) == 1) break;
    fclose(f);
    return kb * 1024;
}
#endif

/* Running out of memory is reported as such, not as bad text: under an address-space limit
 * 1 MB above what the process uses, the library's buffers for the longest text it takes
 * (24 bytes a byte) cannot be had. */
static void test_encode_out_of_memory(void **state) {
    (void)state;
#if defined(__SANITIZE_ADDRESS__)
    skip(); /* ASan's allocator aborts on a failed allocation instead of throwing std::bad_alloc */
#else
    const char *preload = getenv("LD_PRELOAD");
    if (preload && strstr(preload, "vgpreload")) skip(); /* valgrind's operator new aborts too */
    const size_t n = SPM_MAX_TEXT_BYTES;
    char *text = malloc(n);
    assert_non_null(text);
    for (size_t i = 0; i < n; i++) text[i] = "ab "[i % 3];
    struct rlimit old, lim;
    assert_int_equal(getrlimit(RLIMIT_AS, &old), 0);
    size_t used = address_space_bytes();
    assert_true(used > 0);
    lim.rlim_cur = used + ((size_t)1 << 20);
    lim.rlim_max = old.rlim_max;
    assert_int_equal(setrlimit(RLIMIT_AS, &lim), 0);
    int rc = spm_encode(s_tok, text, n, 1, NULL, 0);
    assert_int_equal(setrlimit(RLIMIT_AS, &old), 0);
    free(text);
    assert_int_equal(rc, SPM_ERR_NOMEM);
#endif
}

/* A valid text over SPM_MAX_TEXT_BYTES never reaches the library, whose memory would grow
 * with it; one of exactly that length is encoded. */
static void test_encode_too_long(void **state) {
    (void)state;
    const size_t n = SPM_MAX_TEXT_BYTES + 1;
    char *text = malloc(n);
    assert_non_null(text);
    for (size_t i = 0; i < n; i++) text[i] = "ab "[i % 3];
    assert_int_equal(spm_encode(s_tok, text, n, 1, NULL, 0), SPM_ERR_TOO_LONG);
    assert_true(spm_encode(s_tok, text, n - 1, 1, NULL, 0) > 0);
    text[0] = '\xFF';
    assert_int_equal(spm_encode(s_tok, text, n, 1, NULL, 0), SPM_ERR_TEXT); /* the text is judged first */
    free(text);
}

/* add_bos on a model without BOS: the model's bos_piece (TrainerSpec 46) names no piece */
static void test_encode_bos_without_bos(void **state) {
    (void)state;
    unsigned char spec[32], extra[48];
    size_t n = pb_put_bytes(spec, 46, "<no-such-piece>", 15);
    char err[256];
    SpmTokenizer *t = load_with(extra, pb_put_bytes(extra, 2, spec, n), err, sizeof err);
    if (!t) fail_msg("refused: %s", err);
    assert_int_equal(spm_bos_id(t), -1);
    int ids[MAX_IDS];
    assert_int_equal(spm_encode(t, "Pip", 3, 1, ids, MAX_IDS), SPM_ERR_OTHER);
    assert_true(spm_encode(t, "Pip", 3, 0, ids, MAX_IDS) > 0);
    assert_int_equal(spm_encode(t, "\xFF", 1, 1, ids, MAX_IDS), SPM_ERR_TEXT); /* the text is judged first */
    spm_free(t);
}

int main(int argc, char **argv) {
    if (argc > 1) s_model_path = argv[1];
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vocab_and_special_ids),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_byte_fallback_is_used),
        cmocka_unit_test(test_encode_bos),
        cmocka_unit_test(test_encode_rejects_invalid_utf8_and_nul),
        cmocka_unit_test(test_max_ids_reports_full_count),
        cmocka_unit_test(test_stream_equals_decode_equals_text),
        cmocka_unit_test(test_stream_space_between_pieces),
        cmocka_unit_test(test_stream_bytes_wait_for_whole_characters),
        cmocka_unit_test(test_stream_controls_unknown_and_out_of_range),
        cmocka_unit_test(test_decode_truncates_on_character_boundary),
        cmocka_unit_test(test_nul_byte_piece_prints_nothing),
        cmocka_unit_test(test_stream_matches_library_decode),
        cmocka_unit_test(test_load_file_errors),
        cmocka_unit_test(test_load_bytes),
        cmocka_unit_test(test_crafted_charsmap_normalizes),
        cmocka_unit_test(test_crafted_charsmap_refused),
        cmocka_unit_test(test_crafted_charsmap_with_self_test),
        cmocka_unit_test(test_crafted_denormalizer_refused),
        cmocka_unit_test(test_crafted_pieces),
        cmocka_unit_test(test_crafted_wire_format),
        cmocka_unit_test(test_trained_normalizers_load),
        cmocka_unit_test(test_encode_out_of_memory),
        cmocka_unit_test(test_encode_too_long),
        cmocka_unit_test(test_encode_bos_without_bos),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
