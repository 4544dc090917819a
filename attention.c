/* attention.c: the attention variants (attention.h).
 *
 * Layout: RoPE; the specification of one query per variant (plain loops); then the
 * fast path, whose per-query arithmetic (scores, softmax, mix) is kept apart from the
 * scheduling that shares the queries among the threads. */
#include "attention.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"

/* ---- RoPE ---- */

int rope_tables_init(RopeTables *r, const Config *c) {
    const int width = config_rope_width(c), half = width / 2;
    const size_t n = (size_t)c->max_seq_len * (size_t)half;
    r->cos = malloc(n * sizeof(float));
    r->sin = malloc(n * sizeof(float));
    if (!r->cos || !r->sin) {
        rope_tables_free(r);
        return -1;
    }
    for (int pos = 0; pos < c->max_seq_len; pos++)
        for (int i = 0; i < half; i++) {
            double freq = pow((double)c->rope_theta, -2.0 * i / width);
            r->cos[(size_t)pos * half + i] = (float)cos(pos * freq);
            r->sin[(size_t)pos * half + i] = (float)sin(pos * freq);
        }
    return 0;
}

void rope_tables_free(RopeTables *r) {
    free(r->cos);
    free(r->sin);
    r->cos = r->sin = NULL;
}

void rope(const RopeTables *r, const Config *c, float *v, int pos) {
    const int half = config_rope_width(c) / 2;
    const float *cs = r->cos + (size_t)pos * half, *sn = r->sin + (size_t)pos * half;
    for (int i = 0; i < half; i++) {
        float v0 = v[2 * i], v1 = v[2 * i + 1];
        v[2 * i] = v0 * cs[i] - v1 * sn[i];
        v[2 * i + 1] = v0 * sn[i] + v1 * cs[i];
    }
}

/* Scores are scaled by 1/sqrt(width of a query head): head_dim, or MLA's head_dim + rope_dim. */
static float score_scale(const Config *c) { return 1.0f / sqrtf((float)config_query_width(c)); }

/* Query head h reads KV head h / (n_heads / n_kv_heads). */
static int kv_head_of(const Config *c, int h) { return h / (c->n_heads / c->n_kv_heads); }

/* ---- the specification: one query, plainly ---- */

/* out[d] = sum_j p[j] rows[j*stride + d], j < n, in weighted_sum_rows' order (kernels.h):
 * the even j and the odd j in two ascending chains, then their sum. */
static void mix_reference(float *out, const float *p, int n, const float *rows, size_t stride, int width) {
    for (int d = 0; d < width; d++) {
        float even = 0.0f, odd = 0.0f;
        for (int j = 0; j < n; j++) {
            if (j % 2 == 0) even = fmaf(p[j], rows[(size_t)j * stride + d], even);
            else odd = fmaf(p[j], rows[(size_t)j * stride + d], odd);
        }
        out[d] = even + odd;
    }
}

/* y[i] = (row r0 + i of W) . x for i < n: each output one canonical dot, as matmul computes it */
static void matvec_reference(float *y, Mat w, int r0, int n, const float *x) {
    float row[w.cols];
    for (int i = 0; i < n; i++) {
        mat_row_f32(row, w, r0 + i);
        y[i] = dot(row, x, w.cols);
    }
}

/* MHA, GQA, MQA: score_j = q . k_j / sqrt(d); p = softmax(scores); out = sum_j p_j v_j. */
static void kv_heads_query_reference(const Model *m, const KVCache *cache, int l, int h, const float *q, int pos,
                                     float *out) {
    const Config *c = &m->cfg;
    const int g = kv_head_of(c, h), hd = c->head_dim, n = pos + 1;
    float *p = malloc((size_t)n * sizeof(float));
    for (int j = 0; j < n; j++) p[j] = dot(q, kv_key(cache, l, g, j), hd) * score_scale(c);
    softmax(p, n);
    mix_reference(out, p, n, kv_value(cache, l, g, 0), (size_t)hd, hd);
    free(p);
}

/* MLA, expanded: head h's key of position j is [W_UK,h c_j ; k_R,j], its value W_UV,h c_j. */
static void mla_expanded_query_reference(const Model *m, const KVCache *cache, int l, int h, const float *q, int pos,
                                         float *out) {
    const Config *c = &m->cfg;
    const LayerWeights *w = &m->w.layers[l];
    const int hd = c->head_dim, dc = c->kv_latent, rd = c->rope_dim, n = pos + 1;
    float *p = malloc((size_t)n * sizeof(float)), *values = malloc((size_t)n * hd * sizeof(float));
    float key[hd];
    for (int j = 0; j < n; j++) {
        const float *latent = kv_latent(cache, l, j), *k_rope = latent + dc;
        matvec_reference(key, w->wuk, h * hd, hd, latent);                 /* k_C,j = W_UK,h c_j */
        matvec_reference(values + (size_t)j * hd, w->wuv, h * hd, hd, latent);  /* v_j = W_UV,h c_j */
        p[j] = dot_cat(q, key, hd, q + hd, k_rope, rd) * score_scale(c);  /* [q_C ; q_R] . [k_C ; k_R] */
    }
    softmax(p, n);
    mix_reference(out, p, n, values, (size_t)hd, hd);
    free(p);
    free(values);
}

/* MLA, absorbed: q_lat = W_UK,h^T q_C; score_j = [q_lat ; q_R] . [c_j ; k_R,j];
 * out = W_UV,h (sum_j p_j c_j). Cached latents are never expanded. */
static void mla_absorbed_query_reference(const Model *m, const KVCache *cache, int l, int h, const float *q, int pos,
                                         float *out) {
    const Config *c = &m->cfg;
    const LayerWeights *w = &m->w.layers[l];
    const int hd = c->head_dim, dc = c->kv_latent, rd = c->rope_dim, lw = dc + rd, n = pos + 1;
    float q_abs[lw], ctx_lat[dc];
    float *p = malloc((size_t)n * sizeof(float));
    matvec_reference(q_abs, mat_block(w->wuk_t, h, dc), 0, dc, q);  /* q_lat = W_UK,h^T q_C */
    memcpy(q_abs + dc, q + hd, (size_t)rd * sizeof(float));  /* q_R */
    for (int j = 0; j < n; j++) p[j] = dot(q_abs, kv_latent(cache, l, j), lw) * score_scale(c);
    softmax(p, n);
    mix_reference(ctx_lat, p, n, kv_latent(cache, l, 0), (size_t)lw, dc);  /* sum_j p_j c_j */
    matvec_reference(out, mat_block(w->wuv_heads, h, hd), 0, hd, ctx_lat);
    free(p);
}

void attention_query_reference(const Model *m, const KVCache *cache, int layer, int head, const float *q, int pos,
                               MlaForm form, float *out) {
    if (m->cfg.variant != VARIANT_MLA) kv_heads_query_reference(m, cache, layer, head, q, pos, out);
    else if (form == MLA_ABSORBED) mla_absorbed_query_reference(m, cache, layer, head, q, pos, out);
    else mla_expanded_query_reference(m, cache, layer, head, q, pos, out);
}

/* ---- the fast path ---- */

/* Row stride of k_exp and v_exp: n_heads*head_dim and 16 floats more. A head reads its
 * slice of every row; at a stride of 2 KB those slices would all fall in the same few L1
 * sets and evict each other before the next query reads them again. */
static int mla_exp_stride(const Config *c) { return c->n_heads * c->head_dim + 16; }

int attn_scratch_init(AttnScratch *a, const Config *c, int max_tokens, int max_keys) {
    memset(a, 0, sizeof *a);
    const size_t T = (size_t)max_tokens, H = (size_t)c->n_heads, hd = (size_t)c->head_dim;
    const size_t kv = (size_t)c->n_kv_heads * hd, dc = (size_t)c->kv_latent, rd = (size_t)c->rope_dim;
    const size_t expanded = dc ? (size_t)max_keys * (size_t)mla_exp_stride(c) : 0;
    struct { float **p; size_t n; } bufs[] = {
        {&a->q, T * H * (size_t)config_query_width(c)}, {&a->k, T * kv}, {&a->v, T * kv},
        {&a->latent, T * dc}, {&a->k_rope, T * rd}, {&a->q_abs, T * H * (dc + rd)}, {&a->ctx_lat, T * H * dc},
        {&a->k_exp, expanded}, {&a->v_exp, expanded},
    };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        if (bufs[i].n == 0) continue;
        if (!(*bufs[i].p = alloc_floats_touched(bufs[i].n))) {
            attn_scratch_free(a);
            return -1;
        }
    }
    return 0;
}

void attn_scratch_free(AttnScratch *a) {
    float *bufs[] = {a->q, a->k, a->v, a->latent, a->k_rope, a->q_abs, a->ctx_lat, a->k_exp, a->v_exp};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    memset(a, 0, sizeof *a);
}

/* One layer's attention over T tokens at positions pos0.., shared by the stages below. */
typedef struct {
    const Model *m;
    AttnScratch *a;
    KVCache *cache;
    float *heads;
    int l, T, pos0;
    float scale;
} AttnPass;

/* -- the arithmetic of one (head h, query t) item: scores into att, then the mix of the
 * probabilities softmax made of them -- */

static void kv_heads_scores(const AttnPass *p, int h, int t, float *att) {
    const Config *c = &p->m->cfg;
    const int hd = c->head_dim;
    float *q = p->a->q + ((size_t)t * c->n_heads + h) * hd;
    rope(&p->m->rope, c, q, p->pos0 + t);
    dot_rows(att, q, kv_key(p->cache, p->l, kv_head_of(c, h), 0), (size_t)hd, p->pos0 + t + 1, hd, p->scale);
}

static void kv_heads_mix(const AttnPass *p, int h, int t, const float *att) {
    const Config *c = &p->m->cfg;
    const int hd = c->head_dim;
    weighted_sum_rows(p->heads + ((size_t)t * c->n_heads + h) * hd, att, kv_value(p->cache, p->l, kv_head_of(c, h), 0),
                      (size_t)hd, p->pos0 + t + 1, hd);
}

static void mla_expanded_scores(const AttnPass *p, int h, int t, float *att) {
    const Config *c = &p->m->cfg;
    const int hd = c->head_dim, rd = c->rope_dim, dc = c->kv_latent;
    const float *q = p->a->q + ((size_t)t * c->n_heads + h) * (hd + rd);  /* [q_C ; q_R] */
    dot_rows_cat(att, p->pos0 + t + 1, p->scale, q, p->a->k_exp + (size_t)h * hd, (size_t)mla_exp_stride(c), hd,
                 q + hd, kv_latent(p->cache, p->l, 0) + dc, (size_t)(dc + rd), rd);
}

static void mla_expanded_mix(const AttnPass *p, int h, int t, const float *att) {
    const Config *c = &p->m->cfg;
    const int hd = c->head_dim;
    weighted_sum_rows(p->heads + ((size_t)t * c->n_heads + h) * hd, att, p->a->v_exp + (size_t)h * hd,
                      (size_t)mla_exp_stride(c), p->pos0 + t + 1, hd);
}

static void mla_absorbed_scores(const AttnPass *p, int h, int t, float *att) {
    const Config *c = &p->m->cfg;
    const int H = c->n_heads, hd = c->head_dim, rd = c->rope_dim, dc = c->kv_latent, lw = dc + rd;
    const float *q = p->a->q + ((size_t)t * H + h) * (hd + rd);  /* [q_C ; q_R] */
    float *q_abs = p->a->q_abs + ((size_t)t * H + h) * lw;       /* [q_lat ; q_R] */
    matmul_serial(q_abs, dc, q, hd, mat_block(p->m->w.layers[p->l].wuk_t, h, dc), 1);
    memcpy(q_abs + dc, q + hd, (size_t)rd * sizeof(float));
    dot_rows(att, q_abs, kv_latent(p->cache, p->l, 0), (size_t)lw, p->pos0 + t + 1, lw, p->scale);
}

static void mla_absorbed_mix(const AttnPass *p, int h, int t, const float *att) {
    const Config *c = &p->m->cfg;
    const int H = c->n_heads, hd = c->head_dim, dc = c->kv_latent;
    float *ctx_lat = p->a->ctx_lat + ((size_t)t * H + h) * dc;  /* sum_j p_j c_j */
    weighted_sum_rows(ctx_lat, att, kv_latent(p->cache, p->l, 0), (size_t)(dc + c->rope_dim), p->pos0 + t + 1, dc);
    matmul_serial(p->heads + ((size_t)t * H + h) * hd, hd, ctx_lat, dc, mat_block(p->m->w.layers[p->l].wuv_heads, h, hd), 1);
}

/* -- the scheduling of the n_heads*T items (head-major) among the threads -- */

typedef void (*ScoresFn)(const AttnPass *p, int h, int t, float *att);
typedef void (*MixFn)(const AttnPass *p, int h, int t, const float *att);
typedef struct {
    const AttnPass *p;
    ScoresFn scores;
    MixFn mix;
} Queries;

static long queries_part_count(const void *ctx, int part, int parts) {
    const Queries *qs = ctx;
    long lo, hi;
    parallel_share((long)qs->p->m->cfg.n_heads * qs->p->T, part, parts, &lo, &hi);
    return hi - lo;
}

/* Items [lo, hi) of a part, software-pipelined: item i+1's scores are computed before
 * item i's softmax and mix, so softmax's first load never waits on the scores just
 * stored. */
static void queries_part_items(const void *ctx, int part, int parts, long lo, long hi) {
    const Queries *qs = ctx;
    const int T = qs->p->T;
    long first, last;
    parallel_share((long)qs->p->m->cfg.n_heads * T, part, parts, &first, &last);
    lo += first;
    hi += first;
    _Alignas(64) float att[2][MAX_SEQ_LEN];  /* two items' scores, then probabilities: in L1 on this thread's stack */
    if (lo < hi) qs->scores(qs->p, (int)(lo / T), (int)(lo % T), att[0]);
    for (long i = lo; i < hi; i++) {
        float *probs = att[(i - lo) % 2];
        if (i + 1 < hi) qs->scores(qs->p, (int)((i + 1) / T), (int)((i + 1) % T), att[(i + 1 - lo) % 2]);
        softmax(probs, qs->p->pos0 + (int)(i % T) + 1);
        qs->mix(qs->p, (int)(i / T), (int)(i % T), probs);
    }
}

static void run_queries(const AttnPass *p, ScoresFn scores, MixFn mix) {
    const Queries qs = {p, scores, mix};
    const ParallelParts parts = {queries_part_count, queries_part_items, &qs};
    const long work = (long)p->m->cfg.n_heads * p->T * (p->pos0 + p->T) * p->m->cfg.head_dim;
    parallel_run_parts(&parts, parallel_mode(work, p->T));
}

/* -- each variant: its projections, its cache writes, then its queries -- */

/* Item tg = (t, g): token t's key for KV head g, rotated, and its value, into the cache. */
static void kv_heads_store(const void *ctx, long tg) {
    const AttnPass *p = ctx;
    const Config *c = &p->m->cfg;
    const int Hkv = c->n_kv_heads, hd = c->head_dim, t = (int)(tg / Hkv), g = (int)(tg % Hkv);
    float *k = p->a->k + ((size_t)t * Hkv + g) * hd;
    rope(&p->m->rope, c, k, p->pos0 + t);
    memcpy(kv_key(p->cache, p->l, g, p->pos0 + t), k, (size_t)hd * sizeof(float));
    memcpy(kv_value(p->cache, p->l, g, p->pos0 + t), p->a->v + ((size_t)t * Hkv + g) * hd, (size_t)hd * sizeof(float));
}

static void attention_kv_heads(const AttnPass *p, const float *xb) {
    const Config *c = &p->m->cfg;
    const LayerWeights *w = &p->m->w.layers[p->l];
    AttnScratch *a = p->a;
    const int H = c->n_heads, Hkv = c->n_kv_heads, hd = c->head_dim, T = p->T;
    const MatmulJob qkv[] = {
        {a->q, H * hd, xb, c->dim, w->wq, T},    /* q: (T, H*hd) */
        {a->k, Hkv * hd, xb, c->dim, w->wk, T},  /* k: (T, Hkv*hd) */
        {a->v, Hkv * hd, xb, c->dim, w->wv, T},  /* v: (T, Hkv*hd) */
    };
    matmul_jobs(qkv, 3);
    parallel_for((long)T * Hkv, kv_heads_store, p, parallel_mode((long)T * Hkv * hd, T));
    run_queries(p, kv_heads_scores, kv_heads_mix);
}

/* Item t: token t's queries get q_R rotated; [RMSNorm(c) ; RoPE(k_R)] goes into the cache. */
static void mla_store(const void *ctx, long t) {
    const AttnPass *p = ctx;
    const Config *c = &p->m->cfg;
    const int H = c->n_heads, qw = c->head_dim + c->rope_dim, dc = c->kv_latent, rd = c->rope_dim;
    const int pos = p->pos0 + (int)t;
    for (int h = 0; h < H; h++) rope(&p->m->rope, c, p->a->q + ((size_t)t * H + h) * qw + c->head_dim, pos);
    float *row = kv_latent(p->cache, p->l, pos);
    rmsnorm(row, p->a->latent + (size_t)t * dc, p->m->w.layers[p->l].kv_norm, dc, c->norm_eps);
    memcpy(row + dc, p->a->k_rope + (size_t)t * rd, (size_t)rd * sizeof(float));
    rope(&p->m->rope, c, row + dc, pos);
}

static void mla_project_and_store(const AttnPass *p, const float *xb) {
    const Config *c = &p->m->cfg;
    const LayerWeights *w = &p->m->w.layers[p->l];
    AttnScratch *a = p->a;
    const int H = c->n_heads, qw = c->head_dim + c->rope_dim, dc = c->kv_latent, rd = c->rope_dim, T = p->T;
    const MatmulJob projections[] = {
        {a->q, H * qw, xb, c->dim, w->wq, T},         /* q: (T, H*(hd+rd)) */
        {a->latent, dc, xb, c->dim, w->wdkv, T},      /* c: (T, dc) */
        {a->k_rope, rd, xb, c->dim, w->wkr, T},       /* k_R: (T, rd) */
    };
    matmul_jobs(projections, 3);
    parallel_for(T, mla_store, p, parallel_mode((long)T * (H * rd + dc + rd), T));
}

static void attention_mla_expanded(const AttnPass *p, const float *xb) {
    const Config *c = &p->m->cfg;
    const LayerWeights *w = &p->m->w.layers[p->l];
    const int lw = c->kv_latent + c->rope_dim, n_keys = p->pos0 + p->T, es = mla_exp_stride(c);
    mla_project_and_store(p, xb);
    /* rows of the cache are [c ; k_R]: the products read the first dc floats of each */
    const MatmulJob expand[] = {
        {p->a->k_exp, es, kv_latent(p->cache, p->l, 0), lw, w->wuk, n_keys},  /* k_C: (n_keys, H*hd), stride es */
        {p->a->v_exp, es, kv_latent(p->cache, p->l, 0), lw, w->wuv, n_keys},  /* v:   (n_keys, H*hd), stride es */
    };
    matmul_jobs(expand, 2);
    run_queries(p, mla_expanded_scores, mla_expanded_mix);
}

static void attention_mla_absorbed(const AttnPass *p, const float *xb) {
    mla_project_and_store(p, xb);
    run_queries(p, mla_absorbed_scores, mla_absorbed_mix);
}

void attention(const Model *m, AttnScratch *a, KVCache *cache, int layer, const float *xb, float *heads, int T,
               MlaForm form) {
    const AttnPass p = {m, a, cache, heads, layer, T, cache->len, score_scale(&m->cfg)};
    if (m->cfg.variant != VARIANT_MLA) attention_kv_heads(&p, xb);
    else if (form == MLA_ABSORBED) attention_mla_absorbed(&p, xb);
    else attention_mla_expanded(&p, xb);
}
