/* Each variant's attention against a naive double-precision reference; the fast path
 * against its specification (attention_query_reference) bit for bit; and the cached
 * (one token at a time) pass against the whole-sequence pass, bit for bit. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "tokenizer/spm_c.h"
#include "testutil.h"

typedef struct {
    Model m;
    RunState s;
    KVPool pool;
    KVCache cache;
} Fixture;

/* A fresh pool of dtype (and window, sinks) for the fixture's cache. Its blocks come out of
 * order (testutil.h), so that attention reading a block by its place in the table instead
 * of its id gives wrong rows, not the same ones by coincidence. */
static void use_cache(Fixture *f, DType dtype, int window, int sinks) {
    if (f->cache.pool) kv_free(&f->cache);
    if (f->pool.data) kv_pool_free(&f->pool);
    assert_int_equal(kv_pool_init(&f->pool, &f->m.cfg, dtype, 2 * kv_blocks_for(f->m.cfg.max_seq_len)), 0);
    int *order = malloc((size_t)f->pool.n_blocks * sizeof *order);
    assert_non_null(order);
    assert_int_equal(scramble_free_blocks(&f->pool, order), 0);
    free(order);
    if (window) kv_pool_set_window(&f->pool, window, sinks, KV_EVICT_OLDEST);
    assert_int_equal(kv_init(&f->cache, &f->pool, window ? 1 << 16 : f->m.cfg.max_seq_len), 0);
}

/* n_heads, n_kv_heads, context: 0 keeps test_config's */
static Fixture *load_shape_context(Variant v, int latent, int n_heads, int n_kv_heads, int context) {
    Fixture *f = calloc(1, sizeof *f);
    Config c = test_config(v, latent, 320, DTYPE_BF16);
    if (n_heads) c.n_heads = n_heads, c.n_kv_heads = n_kv_heads;
    if (context) c.max_seq_len = context;
    const char *path = temp_path("attn.bin");
    /* the vocabulary must match the tokenizer: read it from the tokenizer itself */
    char err[256];
    SpmTokenizer *tok = spm_load_file(g_tokenizer_path, err, sizeof err);
    assert_non_null(tok);
    c.vocab_size = spm_vocab_size(tok);
    spm_free(tok);
    assert_int_equal(write_test_checkpoint(path, &c, g_tokenizer_path, 1234 + v + latent), 0);
    assert_int_equal(model_load(&f->m, path, err, sizeof err), 0);
    assert_int_equal(runstate_init(&f->s, &f->m.cfg, f->m.cfg.max_seq_len), 0);
    use_cache(f, DTYPE_F32, 0, 0);
    return f;
}

static Fixture *load_shape(Variant v, int latent, int n_heads, int n_kv_heads) {
    return load_shape_context(v, latent, n_heads, n_kv_heads, 0);
}
static Fixture *load_variant(Variant v, int latent) { return load_shape(v, latent, 0, 0); }

static void free_fixture(Fixture *f) {
    kv_free(&f->cache);
    kv_pool_free(&f->pool);
    runstate_free(&f->s);
    model_free(&f->m);
    free(f);
}

static double W(Mat w, int r, int c) { return mat_get(w, r, c); }

/* y = W x in double */
static void ref_matvec(double *y, Mat w, const double *x) {
    for (int r = 0; r < w.rows; r++) {
        double s = 0;
        for (int c = 0; c < w.cols; c++) s += W(w, r, c) * x[c];
        y[r] = s;
    }
}

static void ref_rope(double *v, int width, int pos, double theta) {
    for (int i = 0; i < width / 2; i++) {
        double freq = pow(theta, -2.0 * i / width), a = pos * freq;
        double v0 = v[2 * i], v1 = v[2 * i + 1];
        v[2 * i] = v0 * cos(a) - v1 * sin(a);
        v[2 * i + 1] = v0 * sin(a) + v1 * cos(a);
    }
}

/* Reference attention output (T, H*hd) for layer 0 from inputs xb (T, dim). With a window
 * (window > 0) query t sees the first `sinks` positions and the most recent ones, window
 * in all, and queries and keys are rotated by their place among them; written apart from
 * the engine's window code, from the definition. */
static double *reference_attention(const Model *m, const float *xb, int T, int window, int sinks) {
    const Config *c = &m->cfg;
    const LayerWeights *w = &m->w.layers[0];
    const int H = c->n_heads, hd = c->head_dim, D = c->dim;
    const int is_mla = c->variant == VARIANT_MLA;
    const int rd = c->rope_dim, dc = c->kv_latent, qw = is_mla ? hd + rd : hd;
    const int kw = is_mla ? hd + rd : hd; /* key width per head */
    double *x = malloc(sizeof(double) * D), *out = calloc((size_t)T * H * hd, sizeof(double));
    double *q = malloc(sizeof(double) * T * H * qw), *k = malloc(sizeof(double) * T * H * kw),
           *v = malloc(sizeof(double) * T * H * hd);
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < D; i++) x[i] = xb[(size_t)t * D + i];
        double *qt = q + (size_t)t * H * qw;
        ref_matvec(qt, w->wq, x);
        if (!is_mla) {
            int Hkv = c->n_kv_heads;
            double kk[1024], vv[1024];
            ref_matvec(kk, w->wk, x);
            ref_matvec(vv, w->wv, x);
            for (int h = 0; h < H; h++) {
                int g = h / (H / Hkv);
                memcpy(k + ((size_t)t * H + h) * kw, kk + g * hd, sizeof(double) * hd);
                memcpy(v + ((size_t)t * H + h) * hd, vv + g * hd, sizeof(double) * hd);
            }
        } else {
            double lat[256], kr[64], kc[1024], vv[1024];
            ref_matvec(lat, w->wdkv, x);
            double ss = 0;
            for (int i = 0; i < dc; i++) ss += lat[i] * lat[i];
            double s = 1.0 / sqrt(ss / dc + c->norm_eps);
            for (int i = 0; i < dc; i++) lat[i] = lat[i] * s * mat_get(w->kv_norm, 0, i);
            ref_matvec(kr, w->wkr, x);
            ref_matvec(kc, w->wuk, lat);
            ref_matvec(vv, w->wuv, lat);
            for (int h = 0; h < H; h++) {
                memcpy(k + ((size_t)t * H + h) * kw, kc + h * hd, sizeof(double) * hd);
                memcpy(k + ((size_t)t * H + h) * kw + hd, kr, sizeof(double) * rd);
                memcpy(v + ((size_t)t * H + h) * hd, vv + h * hd, sizeof(double) * hd);
            }
        }
    }
    /* the rotated part of a query and of a key: a whole head, or MLA's last rope_dim */
    const int rot_at = is_mla ? hd : 0, rot = is_mla ? rd : hd;
    double *p = malloc(sizeof(double) * T), qr[1024], kr_[1024];
    int *seen = malloc(sizeof(int) * T);
    for (int h = 0; h < H; h++)
        for (int t = 0; t < T; t++) {
            int n = 0;
            for (int j = 0; j <= t; j++)
                if (!window || t < window || j < sinks || j > t - (window - sinks)) seen[n++] = j;
            memcpy(qr, q + ((size_t)t * H + h) * qw, sizeof(double) * qw);
            ref_rope(qr + rot_at, rot, n - 1, c->rope_theta); /* the query's place: the last */
            double mx = -1e300, z = 0;
            for (int i = 0; i < n; i++) {
                memcpy(kr_, k + ((size_t)seen[i] * H + h) * kw, sizeof(double) * kw);
                ref_rope(kr_ + rot_at, rot, i, c->rope_theta);
                double sc = 0;
                for (int e = 0; e < kw; e++) sc += qr[e] * kr_[e];
                p[i] = sc / sqrt((double)kw);
                mx = p[i] > mx ? p[i] : mx;
            }
            for (int i = 0; i < n; i++) z += (p[i] = exp(p[i] - mx));
            for (int i = 0; i < n; i++)
                for (int e = 0; e < hd; e++)
                    out[((size_t)t * H + h) * hd + e] += p[i] / z * v[((size_t)seen[i] * H + h) * hd + e];
        }
    free(x);
    free(q);
    free(k);
    free(v);
    free(p);
    free(seen);
    return out;
}

static void random_input(float *xb, int n, uint64_t seed) {
    uint64_t s = seed;
    for (int i = 0; i < n; i++) xb[i] = test_uniform(&s);
}

/* What every thread of a team needs to run layer 0's attention. */
typedef struct {
    Fixture *f;
    const TokenSlots *slots;
    const float *xb;
    MlaForm form;
} AttentionRun;

static void attention_on_thread(void *arg, Worker *wk) {
    const AttentionRun *r = arg;
    const Layer layer0 = {&r->f->m.cfg, &r->f->m.w.layers[0], &r->f->m.rope, 0};
    attention(&layer0, &r->f->s.attn, r->slots, r->xb, r->f->s.heads, r->form, wk);
}

/* Layer 0's attention for T tokens of input xb at the cache's next positions, as the
 * forward pass runs it (model.c advances the cache once every layer has run), on a team
 * of three threads: every output must be its one-thread specification's bits. */
static void attention_pass_on(int threads, Fixture *f, const float *xb, int T, MlaForm form) {
    KVCache *caches[64];
    int pos[64];
    for (int t = 0; t < T; t++) caches[t] = &f->cache, pos[t] = f->cache.len + t;
    assert_int_equal(kv_reserve(&f->cache, f->cache.len + T), 0);
    const TokenSlots slots = {T, caches, pos};
    AttentionRun run = {f, &slots, xb, form};
    run_on_team(threads, attention_on_thread, &run);
    f->cache.len += T;
}
static void attention_pass(Fixture *f, const float *xb, int T, MlaForm form) { attention_pass_on(3, f, xb, T, form); }

static void check_shape(Variant v, int latent, MlaForm form, int n_heads, int n_kv_heads) {
    Fixture *f = load_shape(v, latent, n_heads, n_kv_heads);
    const Layer layer0 = {&f->m.cfg, &f->m.w.layers[0], &f->m.rope, 0};
    const int absorb = form == MLA_ABSORBED;
    const Config *c = &f->m.cfg;
    const int T = 19, D = c->dim, HD = c->n_heads * c->head_dim;
    float *xb = malloc(sizeof(float) * T * D);
    random_input(xb, T * D, 77 + v);

    /* one pass of T tokens */
    kv_reset(&f->cache);
    attention_pass(f, xb, T, form);
    float *whole = malloc(sizeof(float) * T * HD);
    memcpy(whole, f->s.heads, sizeof(float) * T * HD);

    /* every (query, head) equals its specification, bit for bit */
    const int qw = config_query_width(c);
    float *one = malloc(sizeof(float) * c->head_dim);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < c->n_heads; h++) {
            assert_int_equal(0,
                             attention_query_reference(&layer0, &f->cache, h,
                                                       f->s.attn.q + ((size_t)t * c->n_heads + h) * qw, t, form, one));
            if (memcmp(one, whole + ((size_t)t * c->n_heads + h) * c->head_dim, sizeof(float) * c->head_dim) != 0)
                fail_msg("%s (absorb %d): query %d head %d differs from attention_query_reference", variant_name(c),
                         absorb, t, h);
        }
    free(one);

    double *ref = reference_attention(&f->m, xb, T, 0, 0);
    double max_err = 0;
    for (int i = 0; i < T * HD; i++) max_err = fmax(max_err, fabs(whole[i] - ref[i]));
    if (max_err > 1e-4) fail_msg("%s (absorb %d): max |C - reference| = %g", variant_name(c), absorb, max_err);

    /* token by token with the cache: bitwise the same */
    kv_reset(&f->cache);
    for (int t = 0; t < T; t++) {
        attention_pass(f, xb + (size_t)t * D, 1, form);
        assert_int_equal(f->cache.len, t + 1);
        assert_memory_equal(f->s.heads, whole + (size_t)t * HD, sizeof(float) * HD);
    }
    /* a prefill of 5, then 3 tokens at once: also the same */
    kv_reset(&f->cache);
    attention_pass(f, xb, 5, form);
    assert_memory_equal(f->s.heads, whole, sizeof(float) * 5 * HD);
    attention_pass(f, xb + 5 * D, 3, form);
    assert_memory_equal(f->s.heads, whole + 5 * HD, sizeof(float) * 3 * HD);

    free(ref);
    free(whole);

    /* every cache dtype, and windows (a ring, and sinks) that fill and slide: token by
     * token, every (query, head) equals its specification, bit for bit */
    const struct {
        DType dt;
        int window, sinks;
    } caches[] = {
        {DTYPE_BF16, 0, 0}, {DTYPE_I8, 0, 0}, {DTYPE_F32, 8, 0}, {DTYPE_F32, 8, 3}, {DTYPE_I8, 6, 2},
    };
    one = malloc(sizeof(float) * c->head_dim);
    for (size_t k = 0; k < sizeof caches / sizeof caches[0]; k++) {
        use_cache(f, caches[k].dt, caches[k].window, caches[k].sinks);
        double *wref =
            caches[k].dt == DTYPE_F32 ? reference_attention(&f->m, xb, T, caches[k].window, caches[k].sinks) : NULL;
        for (int t = 0; t < T; t++) {
            /* a prefill of 3, then one token a pass, as the scheduler runs a window */
            const int n = t == 0 ? 3 : 1;
            if (t > 0 && t < 3) continue;
            attention_pass(f, xb + (size_t)t * D, n, form);
            for (int u = 0; u < n; u++)
                for (int h = 0; h < c->n_heads; h++) {
                    assert_int_equal(0, attention_query_reference(&layer0, &f->cache, h,
                                                                  f->s.attn.q + ((size_t)u * c->n_heads + h) * qw,
                                                                  t + u, form, one));
                    if (memcmp(one, f->s.heads + ((size_t)u * c->n_heads + h) * c->head_dim,
                               sizeof(float) * c->head_dim))
                        fail_msg("%s (absorb %d, dtype %d, window %d, sinks %d): query %d head %d differs from "
                                 "attention_query_reference",
                                 variant_name(c), absorb, (int)caches[k].dt, caches[k].window, caches[k].sinks, t + u,
                                 h);
                }
            for (int i = 0; wref && i < n * HD; i++)
                if (fabs(f->s.heads[i] - wref[(size_t)t * HD + i]) > 1e-4)
                    fail_msg("%s (absorb %d, window %d, sinks %d): query %d: |C - reference| = %g", variant_name(c),
                             absorb, caches[k].window, caches[k].sinks, t,
                             fabs(f->s.heads[i] - wref[(size_t)t * HD + i]));
        }
        free(wref);
    }
    free(one);
    free(xb);
    free_fixture(f);
}

static void check_variant(Variant v, int latent, MlaForm form) { check_shape(v, latent, form, 0, 0); }

static void test_mha(void **state) { check_variant(VARIANT_MHA, 0, MLA_EXPANDED); }
static void test_gqa(void **state) { check_variant(VARIANT_GQA, 0, MLA_EXPANDED); }
static void test_mqa(void **state) { check_variant(VARIANT_MQA, 0, MLA_EXPANDED); }
static void test_mla_expanded(void **state) {
    check_variant(VARIANT_MLA, 16, MLA_EXPANDED);
    check_variant(VARIANT_MLA, 32, MLA_EXPANDED);
}
static void test_mla_absorbed(void **state) {
    check_variant(VARIANT_MLA, 16, MLA_ABSORBED);
    check_variant(VARIANT_MLA, 32, MLA_ABSORBED);
}

/* Heads that read the same rows go to the kernels together, as many as divide their group
 * up to ATTN_MAX_HEADS_PER_ITEM, fewer when a pass has few tokens: groups that are odd (3),
 * larger than that (40 heads: 20 at a time) or neither a power of two nor odd (MLA, 20) give
 * every query what its specification gives, bit for bit. */
static void test_head_groups(void **state) {
    _Static_assert(ATTN_MAX_HEADS_PER_ITEM < 40 && 40 % ATTN_MAX_HEADS_PER_ITEM != 0, "40 heads: more than an item");
    check_shape(VARIANT_GQA, 0, MLA_EXPANDED, 6, 2);
    check_shape(VARIANT_MQA, 0, MLA_EXPANDED, 40, 1);
    check_shape(VARIANT_MLA, 16, MLA_ABSORBED, 20, 0);
}

/* A context longer than a chunk (ATTN_CHUNK_KEYS): 64-token passes whose queries cross a
 * chunk's end (an item runs all of a token's chunks), then one token a pass across the next
 * (each chunk an item, merged after), on teams of 1, 2, 3 and 5 threads. Every (query, head)
 * equals its specification bit for bit, whichever way its chunks ran, and the
 * double-precision reference within tolerance; with a window longer than a chunk too. */
static void check_long_context(Variant v, int latent, MlaForm form, DType dtype, int window, int sinks) {
    const int N = 2 * ATTN_CHUNK_KEYS + 40, prefilled = 7 * 64, teams[] = {1, 2, 3, 5};
    Fixture *f = load_shape_context(v, latent, 0, 0, N);
    use_cache(f, dtype, window, sinks);
    const Layer layer0 = {&f->m.cfg, &f->m.w.layers[0], &f->m.rope, 0};
    const Config *c = &f->m.cfg;
    const int D = c->dim, H = c->n_heads, hd = c->head_dim, qw = config_query_width(c);
    float *xb = malloc(sizeof(float) * N * D), one[64];
    random_input(xb, N * D, 91 + v);
    double *ref = dtype == DTYPE_F32 ? reference_attention(&f->m, xb, N, window, sinks) : NULL;
    int passes = 0;
    for (int t = 0; t < N; passes++) {
        /* a window fills in passes, then slides one token a pass */
        const int n = t < prefilled && (!window || t + 64 <= window) ? 64 : 1;
        attention_pass_on(teams[passes % 4], f, xb + (size_t)t * D, n, form);
        for (int u = 0; u < n; u++)
            for (int h = 0; h < H; h++) {
                assert_int_equal(0,
                                 attention_query_reference(&layer0, &f->cache, h,
                                                           f->s.attn.q + ((size_t)u * H + h) * qw, t + u, form, one));
                const float *got = f->s.heads + ((size_t)u * H + h) * hd;
                if (memcmp(one, got, sizeof(float) * hd) != 0)
                    fail_msg("%s (absorb %d, dtype %d, window %d): position %d head %d (a pass of %d on %d threads) "
                             "differs from attention_query_reference",
                             variant_name(c), form == MLA_ABSORBED, (int)dtype, window, t + u, h, n, teams[passes % 4]);
                for (int e = 0; ref && e < hd; e++)
                    if (fabs(got[e] - ref[((size_t)(t + u) * H + h) * hd + e]) > 1e-4)
                        fail_msg("%s (window %d): position %d head %d: |C - reference| = %g", variant_name(c), window,
                                 t + u, h, fabs(got[e] - ref[((size_t)(t + u) * H + h) * hd + e]));
            }
        t += n;
    }
    free(ref);
    free(xb);
    free_fixture(f);
}

static void test_long_context_chunks(void **state) {
    check_long_context(VARIANT_MHA, 0, MLA_EXPANDED, DTYPE_F32, 0, 0);
    check_long_context(VARIANT_GQA, 0, MLA_EXPANDED, DTYPE_F32, 0, 0);
    check_long_context(VARIANT_MQA, 0, MLA_EXPANDED, DTYPE_BF16, 0, 0);
    check_long_context(VARIANT_MLA, 16, MLA_ABSORBED, DTYPE_F32, 0, 0);
    check_long_context(VARIANT_MLA, 16, MLA_EXPANDED, DTYPE_I8, 0, 0);
    check_long_context(VARIANT_GQA, 0, MLA_EXPANDED, DTYPE_F32, ATTN_CHUNK_KEYS + 60, 4);
    check_long_context(VARIANT_MLA, 32, MLA_ABSORBED, DTYPE_F32, ATTN_CHUNK_KEYS + 60, 0);
}

/* The whole model: logits of a T-token pass equal, bit for bit, those of a prefill
 * followed by cached single-token steps. */
static void check_forward_cached_equals_uncached(Variant v, int latent) {
    Fixture *f = load_variant(v, latent);
    const Config *c = &f->m.cfg;
    const int T = 12, V = c->vocab_size;
    int tokens[12];
    for (int t = 0; t < T; t++) tokens[t] = (t * 37 + 5) % V;
    float *full = malloc(sizeof(float) * V), *step = malloc(sizeof(float) * V);
    for (int n = 4; n <= T; n++) {
        kv_reset(&f->cache);
        assert_int_equal(model_forward(&f->m, &f->s, &f->cache, tokens, n, MLA_ABSORBED, full, 0),
                         0); /* whole sequence */
        /* a prefill of 4, then one token at a time */
        kv_reset(&f->cache);
        assert_int_equal(model_forward(&f->m, &f->s, &f->cache, tokens, 4, MLA_ABSORBED, step, 0), 0);
        for (int t = 4; t < n; t++)
            assert_int_equal(model_forward(&f->m, &f->s, &f->cache, tokens + t, 1, MLA_ABSORBED, step, 0), 0);
        assert_int_equal(f->cache.len, n);
        assert_memory_equal(full, step, sizeof(float) * V);
    }
    /* the cache has room for max_seq_len positions: a pass past it is refused, untouched; so
     * is a pass past the context in a cache given more room but no window */
    kv_reset(&f->cache);
    assert_int_equal(kv_reserve(&f->cache, c->max_seq_len - 1), 0);
    f->cache.len = c->max_seq_len - 1;
    assert_int_equal(model_forward(&f->m, &f->s, &f->cache, tokens, 2, MLA_ABSORBED, step, 0), -1);
    assert_int_equal(f->cache.len, c->max_seq_len - 1);
    KVCache roomy;
    assert_int_equal(kv_init(&roomy, &f->pool, 2 * c->max_seq_len), 0);
    assert_int_equal(kv_reserve(&roomy, c->max_seq_len - 1), 0);
    roomy.len = c->max_seq_len - 1;
    assert_int_equal(model_forward(&f->m, &f->s, &roomy, tokens, 2, MLA_ABSORBED, step, 0), -1);
    kv_free(&roomy);
    free(full);
    free(step);
    free_fixture(f);
}

static void test_forward_cache_invariance(void **state) {
    check_forward_cached_equals_uncached(VARIANT_MHA, 0);
    check_forward_cached_equals_uncached(VARIANT_GQA, 0);
    check_forward_cached_equals_uncached(VARIANT_MQA, 0);
    check_forward_cached_equals_uncached(VARIANT_MLA, 16);
}

int main(int argc, char **argv) {
    if (argc > 1) g_tokenizer_path = argv[1];
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mha),
        cmocka_unit_test(test_gqa),
        cmocka_unit_test(test_mqa),
        cmocka_unit_test(test_mla_expanded),
        cmocka_unit_test(test_mla_absorbed),
        cmocka_unit_test(test_head_groups),
        cmocka_unit_test(test_forward_cache_invariance),
        cmocka_unit_test(test_long_context_chunks),
    };
    return cmocka_run_group_tests_name("attention", tests, NULL, NULL);
}
