/* fuzz_tokenizer.c: spm_c.h on arbitrary text and arbitrary ids.
 *
 * Input: byte 0 picks the tokenizer (bit 0: the tiny test model or the real one), add_bos
 * (bit 1) and the room for ids (bits 2-3: exact, none, half, one); byte 1 splits the rest
 * into text (encoded as is: invalid UTF-8 and NUL bytes included) and ids (int16 little
 * endian, so negative and out-of-range ids are common); byte 2 sizes a short decode buffer.
 * Both tokenizers are loaded once (FUZZ_TINY_MODEL / FUZZ_REAL_MODEL override the paths).
 *
 * Checked, besides memory errors (abort() on a broken promise):
 * - spm_encode accepts text exactly when utf8.c's utf8_valid does (same definition),
 *   reports the full count whatever the room, and writes only ids inside the vocabulary;
 * - spm_decode of those ids, and of the arbitrary ids, is valid UTF-8 with the length it
 *   reports; cut to a short buffer it is a prefix that is still valid UTF-8;
 * - the stream (put per id, then flush) returns valid UTF-8 pieces whose concatenation is
 *   spm_decode's text;
 * - when every id is inside the vocabulary and none is the <0x00> byte piece, the text is
 *   the library's own DecodeIds. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spm_c.h"
#include "utf8.h"

#ifndef FUZZ_TINY_MODEL
#define FUZZ_TINY_MODEL "build/tests/tiny.model"
#endif
#ifndef FUZZ_REAL_MODEL
#define FUZZ_REAL_MODEL "tokenizer/tokenizer.model"
#endif
#define MAX_IDS 4096
#define TEXT_CAP (1 << 20)

long spm_test_library_decode(const SpmTokenizer *t, const int *ids, int n, char *buf, size_t bufsize);
int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static SpmTokenizer *g_tok[2];
static int g_nul_piece[2] = {-1, -1};  /* the id of <0x00>, whose byte C strings cannot hold */
static char *g_a, *g_b, *g_c;           /* TEXT_CAP each */

static SpmTokenizer *load(const char *env, const char *path) {
    const char *p = getenv(env) ? getenv(env) : path;
    char err[512];
    SpmTokenizer *t = spm_load_file(p, err, sizeof err);
    if (!t) {
        fprintf(stderr, "fuzz_tokenizer: %s\n", err);
        exit(1);
    }
    return t;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    if (g_tok[0]) return 0;
    g_tok[0] = load("FUZZ_TINY_MODEL", FUZZ_TINY_MODEL);
    g_tok[1] = load("FUZZ_REAL_MODEL", FUZZ_REAL_MODEL);
    g_a = malloc(TEXT_CAP);
    g_b = malloc(TEXT_CAP);
    g_c = malloc(TEXT_CAP);
    if (!g_a || !g_b || !g_c) abort();
    for (int k = 0; k < 2; k++)
        for (int id = 0; id < spm_vocab_size(g_tok[k]); id++) {
            char buf[8];
            if (spm_test_library_decode(g_tok[k], &id, 1, buf, sizeof buf) == 1 && buf[0] == '\0') g_nul_piece[k] = id;
        }
    return 0;
}

/* Decodes ids three ways and checks that they agree; returns the length. */
static size_t check_decode(int k, const int *ids, int n, size_t short_size) {
    const SpmTokenizer *t = g_tok[k];
    size_t len = spm_decode(t, ids, n, g_a, TEXT_CAP);
    if (len >= TEXT_CAP) return len;  /* did not fit: nothing more to compare */
    if (strlen(g_a) != len || !utf8_valid(g_a, len)) abort();
    /* a short buffer: a prefix, valid UTF-8, the same reported length */
    if (spm_decode(t, ids, n, short_size ? g_b : NULL, short_size) != len) abort();
    if (short_size > 0) {
        size_t cut = strlen(g_b);
        if (cut >= short_size || memcmp(g_a, g_b, cut) != 0 || !utf8_valid(g_b, cut)) abort();
        if (short_size > len && cut != len) abort();
        if (cut + 4 < short_size && cut < len) abort();  /* cut no further back than one character */
    }
    /* the stream */
    SpmStream *s = spm_stream_new(t);
    if (!s) abort();
    size_t at = 0;
    for (int i = 0; i <= n; i++) {
        const char *piece = i < n ? spm_stream_put(s, ids[i]) : spm_stream_flush(s);
        size_t pl = strlen(piece);
        if (!utf8_valid(piece, pl) || at + pl > len || memcmp(g_a + at, piece, pl) != 0) abort();
        at += pl;
    }
    if (at != len || spm_stream_flush(s)[0] != '\0') abort();
    spm_stream_free(s);
    /* the library, when it can say */
    int plain = 1;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= spm_vocab_size(t) || ids[i] == g_nul_piece[k]) plain = 0;
    if (plain) {
        long lib = spm_test_library_decode(t, ids, n, g_c, TEXT_CAP);
        if (lib < 0 || (size_t)lib != len || memcmp(g_a, g_c, len) != 0) {
            fprintf(stderr, "library [%.*s]\nours    [%.*s]\n", (int)(lib < 0 ? 0 : lib), g_c, (int)len, g_a);
            abort();
        }
    }
    return len;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_tok[0]) LLVMFuzzerInitialize(NULL, NULL);
    if (size < 3) return 0;
    const int k = data[0] & 1, add_bos = (data[0] >> 1) & 1, room = (data[0] >> 2) & 3;
    const size_t short_size = data[2];
    const uint8_t *rest = data + 3;
    const size_t n_rest = size - 3;
    const size_t text_len = n_rest * data[1] / 255;
    const char *text = (const char *)rest;
    const SpmTokenizer *t = g_tok[k];
    const int V = spm_vocab_size(t);
    static int ids[MAX_IDS + 1];

    /* encode */
    int full = spm_encode(t, text, text_len, add_bos, NULL, 0);
    int valid = text_len == 0 || utf8_valid(text, text_len);
    if ((full >= 0) != valid) {
        fprintf(stderr, "spm_encode says %d, utf8_valid says %d\n", full, valid);
        abort();
    }
    if (full > MAX_IDS) full = -1;  /* too long to check the rest: fine */
    if (full >= 0) {
        int max_ids = room == 0 ? full : room == 1 ? 0 : room == 2 ? full / 2 : (full > 0 ? 1 : 0);
        ids[max_ids] = -7;  /* a canary just past the room */
        int got = spm_encode(t, text, text_len, add_bos, max_ids ? ids : NULL, max_ids);
        if (got != full || ids[max_ids] != -7) abort();
        for (int i = 0; i < max_ids; i++)
            if (ids[i] < 0 || ids[i] >= V) abort();
        if (add_bos && max_ids > 0 && ids[0] != spm_bos_id(t)) abort();
        check_decode(k, ids, max_ids, short_size);
    }

    /* arbitrary ids */
    const uint8_t *p = rest + text_len;
    int n = (int)((n_rest - text_len) / 2);
    if (n > MAX_IDS) n = MAX_IDS;
    for (int i = 0; i < n; i++) ids[i] = (int16_t)(uint16_t)(p[2 * i] | p[2 * i + 1] << 8);
    check_decode(k, ids, n, short_size);
    return 0;
}
