/* attention.c: the attention variants.
 *
 * Each function reads s->xb (T, dim), the normalized input of T tokens at
 * positions pos0 .. pos0+T-1, appends what the cache keeps for them, and writes
 * the heads' outputs to s->heads (T, n_heads*head_dim); model.c applies W_O.
 * Query t attends to positions 0 .. pos0+t, all read from the cache. Without a KV
 * cache the caller passes a fresh cache and the whole sequence (pos0 = 0), so the
 * two modes run the very same arithmetic per (head, query, key). */
#include <math.h>
#include <string.h>

#include "model.h"
#include "parallel.h"

/* Work worth a second thread: (heads x queries x keys); a hand-off and join costs ~0.5 us
 * here (parallel.h), about 16 heads x 16 keys of work */
static int attention_is_big(const Model *m, int T, int pos0) { return m->cfg.n_heads * T * (pos0 + T) >= 256; }

/* One layer's attention over T tokens at positions pos0.., for the parallel loops below. */
typedef struct {
    const Model *m;
    RunState *s;
    KVCache *cache;
    int l, T, pos0;
    float scale;  /* of the scores: 1/sqrt(width of a query) */
} AttnPass;

/* The (head, query) items of a pass: scores writes the scores of query t of head h against
 * positions 0 .. pos0+t into att, softmax turns them into probabilities (the same for
 * every variant), and mix turns those into the head's output. */
typedef void (*QueryStage)(const AttnPass *a, int h, int t, float *att);
typedef struct {
    const AttnPass *a;
    QueryStage scores, mix;
} Queries;

/* A part of the items is a thread's static share of the n_heads*T items, in order. */
static void queries_part_range(const Queries *qs, int part, int parts, long *lo, long *hi) {
    parallel_share((long)qs->a->m->cfg.n_heads * qs->a->T, part, parts, lo, hi);
}

static long queries_part_count(const void *ctx, int part, int parts) {
    long lo, hi;
    queries_part_range(ctx, part, parts, &lo, &hi);
    return hi - lo;
}

/* Items [lo, hi) of a part, software-pipelined: item i+1's scores are computed before
 * item i's softmax and mix. In order, softmax's first load waited on the scores just
 * stored (40% of softmax's perf samples, the pipeline stalled behind the last keys' dot
 * products). */
static void queries_part_items(const void *ctx, int part, int parts, long lo, long hi) {
    const Queries *qs = ctx;
    const int T = qs->a->T;
    long first, last;
    queries_part_range(qs, part, parts, &first, &last);
    lo += first;
    hi += first;
    _Alignas(64) float att[2][MAX_SEQ_LEN];  /* two items' scores, then probabilities: in L1 on this thread's stack */
    if (lo < hi) qs->scores(qs->a, (int)(lo / T), (int)(lo % T), att[0]);
    for (long i = lo; i < hi; i++) {
        if (i + 1 < hi) qs->scores(qs->a, (int)((i + 1) / T), (int)((i + 1) % T), att[(i + 1 - lo) % 2]);
        const int h = (int)(i / T), t = (int)(i % T);
        softmax(att[(i - lo) % 2], qs->a->pos0 + t + 1);
        qs->mix(qs->a, h, t, att[(i - lo) % 2]);
    }
}

/* From MIN_TOKENS_THREADED queries a thread takes over the end of the other's share when
 * it finishes its own first (parallel_run_parts): with static shares, the thread on the
 * faster vCPU spent 28% of the attention phase waiting, in one MHA no-KV run. Decode
 * keeps static shares (16 heads of one query). */
static void run_queries(const AttnPass *a, QueryStage scores, QueryStage mix) {
    const Queries qs = {a, scores, mix};
    const ParallelParts parts = {queries_part_count, queries_part_items, &qs};
    parallel_run_parts(&parts, a->T >= MIN_TOKENS_THREADED, attention_is_big(a->m, a->T, a->pos0));
}

/* ---- MHA, GQA, MQA: n_kv_heads KV heads; query head h reads KV head h / (n_heads/n_kv_heads). ---- */

/* Item tg = (t, g): token t's key for KV head g, rotated, and its value, into the cache. */
static void kv_heads_store(const void *ctx, long tg) {
    const AttnPass *a = ctx;
    const Config *c = &a->m->cfg;
    const int Hkv = c->n_kv_heads, hd = c->head_dim, t = (int)(tg / Hkv), g = (int)(tg % Hkv);
    float *k = a->s->k + ((size_t)t * Hkv + g) * hd;
    rope(a->m, k, hd, a->pos0 + t);
    memcpy(kv_key(a->cache, a->l, g, a->pos0 + t), k, (size_t)hd * sizeof(float));
    memcpy(kv_value(a->cache, a->l, g, a->pos0 + t), a->s->v + ((size_t)t * Hkv + g) * hd, (size_t)hd * sizeof(float));
}

/* query t of head h reads KV head g = h / (n_heads / n_kv_heads) */
static void kv_heads_scores(const AttnPass *a, int h, int t, float *att) {
    const Config *c = &a->m->cfg;
    const int H = c->n_heads, hd = c->head_dim, g = h / (H / c->n_kv_heads), n = a->pos0 + t + 1;
    float *q = a->s->q + ((size_t)t * H + h) * hd;
    rope(a->m, q, hd, a->pos0 + t);
    dot_rows(att, q, kv_key(a->cache, a->l, g, 0), hd, n, hd, a->scale);  /* (n) */
}

static void kv_heads_mix(const AttnPass *a, int h, int t, float *att) {
    const Config *c = &a->m->cfg;
    const int H = c->n_heads, hd = c->head_dim, g = h / (H / c->n_kv_heads), n = a->pos0 + t + 1;
    weighted_sum_rows(a->s->heads + ((size_t)t * H + h) * hd, att, kv_value(a->cache, a->l, g, 0), hd, n, hd);
}

void attn_kv_heads(const Model *m, RunState *s, KVCache *cache, int l, int T, int pos0) {
    const Config *c = &m->cfg;
    const LayerWeights *w = &m->w.layers[l];
    const int H = c->n_heads, Hkv = c->n_kv_heads, hd = c->head_dim, dim = c->dim;

    const MatmulJob qkv[] = {
        {s->q, H * hd, s->xb, dim, w->wq, T},    /* q: (T, H*hd) */
        {s->k, Hkv * hd, s->xb, dim, w->wk, T},  /* k: (T, Hkv*hd) */
        {s->v, Hkv * hd, s->xb, dim, w->wv, T},  /* v: (T, Hkv*hd) */
    };
    matmul_jobs(qkv, 3);

    const AttnPass pass = {m, s, cache, l, T, pos0, 1.0f / sqrtf((float)hd)};
    parallel_for((long)T * c->n_kv_heads, kv_heads_store, &pass, T >= MIN_TOKENS_THREADED);
    run_queries(&pass, kv_heads_scores, kv_heads_mix);
}

/* ---- MLA (DeepSeek-V2, no query compression) ----
 * q = W_Q x, per head [q_C (head_dim) ; q_R (rope_dim)], q_R rotated;
 * c = RMSNorm(W_DKV x) (kv_latent); k_R = RoPE(W_KR x) (rope_dim), shared by all heads.
 * The cache keeps [c ; k_R] per position. Scores are scaled by 1/sqrt(head_dim+rope_dim). */
static float mla_scale(const Config *c) { return 1.0f / sqrtf((float)(c->head_dim + c->rope_dim)); }

/* Item t: token t's queries get q_R rotated; its [c ; k_R] goes into the cache. */
static void mla_store(const void *ctx, long t) {
    const AttnPass *a = ctx;
    const Config *c = &a->m->cfg;
    const int H = c->n_heads, qw = c->head_dim + c->rope_dim, dc = c->kv_latent, rd = c->rope_dim;
    const int pos = a->pos0 + (int)t;
    for (int h = 0; h < H; h++) rope(a->m, a->s->q + ((size_t)t * H + h) * qw + c->head_dim, rd, pos);
    float *row = kv_latent(a->cache, a->l, pos);
    rmsnorm(row, a->s->latent + (size_t)t * dc, a->m->w.layers[a->l].kv_norm, dc, c->norm_eps);
    memcpy(row + dc, a->s->k_rope + (size_t)t * rd, (size_t)rd * sizeof(float));
    rope(a->m, row + dc, rd, pos);
}

static void mla_project(const AttnPass *a) {
    const Config *c = &a->m->cfg;
    const LayerWeights *w = &a->m->w.layers[a->l];
    RunState *s = a->s;
    const int H = c->n_heads, qw = c->head_dim + c->rope_dim, dc = c->kv_latent, rd = c->rope_dim, T = a->T;

    const MatmulJob projections[] = {
        {s->q, H * qw, s->xb, c->dim, w->wq, T},        /* q: (T, H*(hd+rd)) */
        {s->latent, dc, s->xb, c->dim, w->wdkv, T},     /* c: (T, dc) */
        {s->k_rope, rd, s->xb, c->dim, w->wkr, T},      /* k_R: (T, rd) */
    };
    matmul_jobs(projections, 3);
    parallel_for(T, mla_store, a, T >= MIN_TOKENS_THREADED);
}

/* Expanded form: every head's keys [W_UK,h c_j ; k_R,j] and values W_UV,h c_j are
 * materialized for all positions j, then attention runs as in MHA (48-dim keys).
 * Query t of head h against the expanded keys and values: */
static void mla_expanded_scores(const AttnPass *a, int h, int t, float *att) {
    const Config *c = &a->m->cfg;
    const int hd = c->head_dim, rd = c->rope_dim, dc = c->kv_latent, qw = hd + rd, n = a->pos0 + t + 1;
    const float *q = a->s->q + ((size_t)t * c->n_heads + h) * qw;  /* [q_C ; q_R] */
    dot_rows_cat(att, n, a->scale, q, a->s->k_exp + (size_t)h * hd, (size_t)mla_exp_stride(c), hd,  /* (n) */
                 q + hd, kv_latent(a->cache, a->l, 0) + dc, (size_t)(dc + rd), rd);
}

static void mla_expanded_mix(const AttnPass *a, int h, int t, float *att) {
    const Config *c = &a->m->cfg;
    const int hd = c->head_dim, n = a->pos0 + t + 1;
    weighted_sum_rows(a->s->heads + ((size_t)t * c->n_heads + h) * hd, att, a->s->v_exp + (size_t)h * hd,
                      (size_t)mla_exp_stride(c), n, hd);
}

void attn_mla_expanded(const Model *m, RunState *s, KVCache *cache, int l, int T, int pos0) {
    const Config *c = &m->cfg;
    const LayerWeights *w = &m->w.layers[l];
    const int lw = c->kv_latent + c->rope_dim, n_keys = pos0 + T, es = mla_exp_stride(c);
    const AttnPass pass = {m, s, cache, l, T, pos0, mla_scale(c)};

    mla_project(&pass);
    /* rows of the cache are [c ; k_R]: the products read the first dc floats of each */
    const MatmulJob expand[] = {
        {s->k_exp, es, kv_latent(cache, l, 0), lw, w->wuk, n_keys},  /* k_C: (n_keys, H*hd), stride es */
        {s->v_exp, es, kv_latent(cache, l, 0), lw, w->wuv, n_keys},  /* v:   (n_keys, H*hd), stride es */
    };
    matmul_jobs(expand, 2);
    run_queries(&pass, mla_expanded_scores, mla_expanded_mix);
}

/* Absorbed form: q_lat,h = W_UK,h^T q_C,h; score_j = [q_lat,h ; q_R,h] . [c_j ; k_R,j];
 * o_h = W_UV,h (sum_j p_j c_j). Cached latents are never expanded.
 * Query t of head h against the cached latents: */
static void mla_absorbed_scores(const AttnPass *a, int h, int t, float *att) {
    const Config *c = &a->m->cfg;
    const int H = c->n_heads, hd = c->head_dim, rd = c->rope_dim, dc = c->kv_latent, qw = hd + rd, lw = dc + rd;
    const float *q = a->s->q + ((size_t)t * H + h) * qw;          /* [q_C ; q_R] */
    float *q_abs = a->s->q_abs + ((size_t)t * H + h) * lw;        /* [q_lat ; q_R] */
    matmul_serial(q_abs, dc, q, hd, mat_block(a->m->w.layers[a->l].wuk_t, h, dc), 1);
    memcpy(q_abs + dc, q + hd, (size_t)rd * sizeof(float));
    dot_rows(att, q_abs, kv_latent(a->cache, a->l, 0), lw, a->pos0 + t + 1, lw, a->scale);  /* (n) */
}

static void mla_absorbed_mix(const AttnPass *a, int h, int t, float *att) {
    const Config *c = &a->m->cfg;
    const int H = c->n_heads, hd = c->head_dim, dc = c->kv_latent, n = a->pos0 + t + 1;
    float *ctx_lat = a->s->ctx_lat + ((size_t)t * H + h) * dc;    /* sum_j p_j c_j: (dc) */
    weighted_sum_rows(ctx_lat, att, kv_latent(a->cache, a->l, 0), dc + c->rope_dim, n, dc);
    matmul_serial(a->s->heads + ((size_t)t * H + h) * hd, hd, ctx_lat, dc, mat_block(a->m->w.layers[a->l].wuv_heads, h, hd), 1);
}

void attn_mla_absorbed(const Model *m, RunState *s, KVCache *cache, int l, int T, int pos0) {
    const AttnPass pass = {m, s, cache, l, T, pos0, mla_scale(&m->cfg)};
    mla_project(&pass);
    run_queries(&pass, mla_absorbed_scores, mla_absorbed_mix);
}
