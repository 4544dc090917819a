/* fuzz_tokenizer.c: spm_c.h on arbitrary text and arbitrary ids, with two fixed models.
 *
 * Input: byte 0 picks the tokenizer (bit 0: the tiny test model or the real one), add_bos
 * (bit 1) and the room for ids (bits 2-3: exact, none, half, one); byte 1 splits the rest
 * into text (encoded as is: invalid UTF-8 and NUL bytes included) and ids (int16 little
 * endian, so negative and out-of-range ids are common); byte 2 sizes a short decode buffer.
 * Both tokenizers are loaded once (FUZZ_TINY_MODEL / FUZZ_REAL_MODEL override the paths).
 *
 * Checked, besides memory errors: tokenizer_checks.h's promises, for the encoded text's ids
 * and for the arbitrary ids; with these sound models the library never refuses valid text. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "tokenizer/spm_c.h"
#include "tokenizer_checks.h"

#ifndef FUZZ_TINY_MODEL
#define FUZZ_TINY_MODEL "build/tests/tiny.model"
#endif
#ifndef FUZZ_REAL_MODEL
#define FUZZ_REAL_MODEL "tokenizer/tokenizer.model"
#endif

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static SpmTokenizer *g_tok[2];

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
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_tok[0]) LLVMFuzzerInitialize(NULL, NULL);
    if (size < 3) return 0;
    const SpmTokenizer *t = g_tok[data[0] & 1];
    const int add_bos = (data[0] >> 1) & 1, room = (data[0] >> 2) & 3;
    const size_t short_size = data[2];
    const uint8_t *rest = data + 3;
    const size_t n_rest = size - 3;
    const size_t text_len = n_rest * data[1] / 255;
    static int ids[CHECK_MAX_IDS + 1];

    int n = check_encode(t, (const char *)rest, text_len, add_bos, room, 0, ids);
    if (n >= 0) check_decode(t, ids, n, short_size);

    /* arbitrary ids */
    const uint8_t *p = rest + text_len;
    n = (int)((n_rest - text_len) / 2);
    if (n > CHECK_MAX_IDS) n = CHECK_MAX_IDS;
    for (int i = 0; i < n; i++) ids[i] = (int16_t)(uint16_t)(p[2 * i] | p[2 * i + 1] << 8);
    check_decode(t, ids, n, short_size);
    return 0;
}
