/* The tokenizer module (spm_c.h): loading, encoding, and the streaming decoder checked
 * against SentencePiece's own DecodeIds. argv[1] is the model made by tests/tokenizer.mk
 * (BPE, vocab 320, byte fallback, unk 0, bos 1, eos 2: ids 3..258 are <0x00>..<0xFF>). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spm_c.h"

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
    "Stra\xC3\x9F" "e, \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E, \xCE\x95\xCE\xBB\xCE\xBB\xCE\xB7\xCE\xBD\xCE\xB9\xCE\xBA\xCE\xAC",
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
    /* NULL is handled everywhere */
    assert_int_equal(spm_vocab_size(NULL), 0);
    assert_int_equal(spm_bos_id(NULL), -1);
    assert_int_equal(spm_eos_id(NULL), -1);
    assert_int_equal(spm_encode(NULL, "a", 1, 1, NULL, 0), -1);
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
        {"abc\0def", 7},                 /* embedded NUL */
        {"\0", 1},                       /* NUL alone */
        {"caf\xC3", 4},                  /* cut short */
        {"\xC3\x28", 2},                 /* bad trail byte */
        {"\xC0\xAF", 2},                 /* overlong '/' */
        {"\xE0\x80\x80", 3},             /* overlong NUL */
        {"\xED\xA0\x80", 3},             /* surrogate U+D800 */
        {"\xF4\x90\x80\x80", 4},         /* above U+10FFFF */
        {"\xFF", 1},                     /* never in UTF-8 */
        {"ok \x80 then", 9},             /* lone trail byte */
        {"\xF0\x9F\x90", 3},             /* emoji cut short */
    };
    int ids[MAX_IDS];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ids[0] = -7;
        assert_int_equal(spm_encode(s_tok, bad[i].s, bad[i].len, 1, ids, MAX_IDS), -1);
        assert_int_equal(spm_encode(s_tok, bad[i].s, bad[i].len, 0, ids, MAX_IDS), -1);
    }
    /* len is honoured: the text need not be NUL-terminated */
    int a[MAX_IDS], b[MAX_IDS];
    int n = spm_encode(s_tok, "caf\xC3\xA9 and more", 5, 0, a, MAX_IDS);
    int m = encode_str("caf\xC3\xA9", 0, b);
    assert_int_equal(n, m);
    assert_memory_equal(a, b, (size_t)n * sizeof(int));
    /* and a cut through a character is invalid */
    assert_int_equal(spm_encode(s_tok, "caf\xC3\xA9", 4, 0, a, MAX_IDS), -1);
    /* bad arguments */
    assert_int_equal(spm_encode(s_tok, NULL, 3, 0, a, MAX_IDS), -1);
    assert_int_equal(spm_encode(s_tok, "abc", 3, 0, NULL, 5), -1);
    assert_int_equal(spm_encode(s_tok, "abc", 3, 0, a, -1), -1);
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
    static const unsigned char bytes[] = {0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x90, 0x89, 0xC3, 0xA9, 0xED, 0xA0,
                                          0xF4, 0x8F, 0x90, 0xC0, 0xC2, 'A', ' ', 0xFF, 0x80, 0xBF, 0xE0, 0xF5};
    const int V = spm_vocab_size(s_tok);
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    char lib[TEXT_CAP], streamed[TEXT_CAP], decoded[TEXT_CAP];
    int ids[32];
    int with_bytes = 0;
    for (int iter = 0; iter < 20000; iter++) {
        int n = (int)(rng_next(&rng) % 24);
        for (int i = 0; i < n; i++) {
            unsigned r = (unsigned)(rng_next(&rng) % 16);
            if (r < 6) ids[i] = BYTE_ID(bytes[rng_next(&rng) % sizeof bytes]);
            else if (r < 7) ids[i] = (int)(rng_next(&rng) % 3); /* unk, bos, eos */
            else ids[i] = 3 + (int)(rng_next(&rng) % (uint64_t)(V - 3)); /* any piece but a NUL byte... */
            if (ids[i] == BYTE_ID(0)) ids[i] = BYTE_ID('0');           /* ...which C strings cannot hold */
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
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
