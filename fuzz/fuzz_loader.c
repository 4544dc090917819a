/* fuzz_loader.c: arbitrary bytes as a checkpoint file.
 *
 * The bytes go into a memfd (a temp file where memfd_create is missing) that model_load
 * opens by its /proc path, so the real open + fstat + mmap path runs. When the file loads,
 * one tiny forward pass (2 tokens, then 1 more through the KV cache; both MLA forms) shows
 * that every weight the loader handed out lies inside its copy of the weights: ASan
 * reports any read past it (the loader packs the weights into a heap block of exactly
 * their size, and the derived MLA matrices into another). Models whose scratch would exceed
 * FUZZ_LOADER_SCRATCH_MB (default 256) are loaded and freed without a forward pass: they
 * are legal, just too big to run thousands of times a second. Every loaded checkpoint's
 * embedded tokenizer is untrusted input too: it encodes a fixed prompt, the input's last 64
 * bytes as they are (invalid UTF-8 included) and 16 of its bytes made printable, and decodes
 * each result, under tokenizer_checks.h's promises. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "loader.h"
#include "model.h"
#include "serve/sampler.h"
#include "tokenizer/spm_c.h"
#include "tokenizer_checks.h"

static int g_fd = -1;
static char g_path[64];
static size_t g_scratch_floats = (size_t)256 << 18; /* 256 MB of floats */

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    const char *mb = getenv("FUZZ_LOADER_SCRATCH_MB");
    if (mb && atol(mb) > 0) g_scratch_floats = (size_t)atol(mb) << 18;
#ifdef MFD_CLOEXEC
    g_fd = memfd_create("fuzz_loader", MFD_CLOEXEC);
#endif
    if (g_fd >= 0) {
        snprintf(g_path, sizeof g_path, "/proc/self/fd/%d", g_fd);
    } else {
        snprintf(g_path, sizeof g_path, "/tmp/fuzz_loader.XXXXXX");
        g_fd = mkstemp(g_path);
        if (g_fd < 0) {
            perror("fuzz_loader: temp file");
            abort();
        }
    }
    return 0;
}

/* Floats runstate_init, kv_init and the rope tables allocate for c (an upper bound). */
static size_t scratch_floats(const Config *c) {
    size_t T = (size_t)c->max_seq_len, H = (size_t)c->n_heads, hd = (size_t)c->head_dim;
    size_t dc = (size_t)c->kv_latent, rd = (size_t)c->rope_dim, kv = (size_t)c->n_kv_heads * hd;
    size_t per_token = 2 * (size_t)c->dim + H * hd + H * (hd + rd) + 2 * kv + dc + rd + (dc ? 2 * H * hd : 0) +
                       H * (dc + rd) + H * dc + (dc ? dc + rd : 0) + 2 * (size_t)c->hidden_dim +
                       2 * (size_t)c->vocab_size;
    size_t cache = (size_t)c->n_layers * T * (dc ? dc + rd : 2 * kv);
    return T * per_token + cache + T * (hd + rd);
}

static void forward_once(const Model *m, MlaForm form, int t1) {
    const Config *c = &m->cfg;
    RunState s;
    KVPool pool;
    KVCache cache;
    if (runstate_init(&s, c, c->max_seq_len) != 0) return;
    if (kv_pool_init(&pool, c, DTYPE_F32, kv_blocks_for(c->max_seq_len)) != 0) {
        runstate_free(&s);
        return;
    }
    if (kv_init(&cache, &pool, c->max_seq_len) != 0) {
        kv_pool_free(&pool);
        runstate_free(&s);
        return;
    }
    int tokens[3] = {c->bos_id, t1, c->eos_id};
    int T = c->max_seq_len < 2 ? c->max_seq_len : 2;
    float *logits = malloc((size_t)3 * c->vocab_size * sizeof(float));
    /* a pass either runs or finds its logits not finite (weights that overflow): never refuses the batch */
    if (logits) {
        const int rc = model_forward(m, &s, &cache, tokens, T, form, logits, 1);
        if (rc == MODEL_ERR_BATCH) abort();
        if (rc == 0) {
            volatile int best = sampler_argmax(logits + (size_t)(T - 1) * c->vocab_size, c->vocab_size);
            (void)best;
        }
        if (c->max_seq_len > T && model_forward(m, &s, &cache, tokens + T, 1, form, logits, 0) == MODEL_ERR_BATCH)
            abort(); /* a decode step */
        free(logits);
    }
    kv_free(&cache);
    kv_pool_free(&pool);
    runstate_free(&s);
}

/* The loaded tokenizer on a fixed prompt and on pieces of the input (a loaded file has more
 * than a header's 128 bytes); the library may refuse valid text only with SPM_ERR_OTHER. */
static void encode_and_decode(const SpmTokenizer *t, const uint8_t *data, size_t size) {
    static int ids[CHECK_MAX_IDS + 1];
    static const char prompt[] = "Once upon a time, Lily saw a caf\xC3\xA9 by the sea. \xE2\x80\x9CHi!\xE2\x80\x9D 123";
    char printable[16];
    for (size_t i = 0; i < sizeof printable; i++) printable[i] = (char)(0x20 + data[i * 7 % size] % 95);
    const size_t tail = size < 64 ? size : 64;
    const struct {
        const char *text;
        size_t len;
    } texts[] = {
        {prompt, sizeof prompt - 1},
        {(const char *)data + size - tail, tail},
        {printable, sizeof printable},
    };
    for (size_t k = 0; k < sizeof texts / sizeof texts[0]; k++) {
        const int n = check_encode(t, texts[k].text, texts[k].len, 1, (int)(data[size - 1 - k] % 4), 1, ids);
        if (n >= 0) check_decode(t, ids, n, data[size - 4 - k] % 32);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (g_fd < 0) LLVMFuzzerInitialize(NULL, NULL);
    if (ftruncate(g_fd, 0) != 0) abort();
    if (size > 0 && pwrite(g_fd, data, size, 0) != (ssize_t)size) abort();
    Model m;
    char err[512];
    err[0] = 'x';
    if (model_load(&m, g_path, err, sizeof err) != 0) {
        /* refused: one non-empty line */
        if (err[0] == '\0' || memchr(err, '\n', strlen(err)) || strlen(err) >= sizeof err) abort();
        return 0;
    }
    encode_and_decode(m.tokenizer, data, size);
    const Config *c = &m.cfg;
    if (scratch_floats(c) <= g_scratch_floats) {
        int t1 = size ? data[size - 1] % c->vocab_size : 0;
        forward_once(&m, MLA_ABSORBED, t1);
        if (c->variant == VARIANT_MLA) forward_once(&m, MLA_EXPANDED, t1);
    }
    model_free(&m);
    return 0;
}
