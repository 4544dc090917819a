/* model.c: the forward pass (model.h). */
#include "model.h"

#include <stdlib.h>
#include <string.h>

#include "kernels/parallel.h"

int runstate_init(RunState *s, const Config *c, int max_tokens) {
    memset(s, 0, sizeof *s);
    s->max_tokens = max_tokens;
    const size_t T = (size_t)max_tokens;
    struct { float **p; size_t n; } bufs[] = {
        {&s->x, T * c->dim}, {&s->xb, T * c->dim}, {&s->heads, T * c->n_heads * c->head_dim},
        {&s->hb, T * c->hidden_dim}, {&s->hb2, T * c->hidden_dim},
    };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (!(*bufs[i].p = alloc_floats_touched(bufs[i].n))) {
            runstate_free(s);
            return -1;
        }
    s->pos = malloc(T * sizeof *s->pos);
    s->caches = malloc(T * sizeof *s->caches);
    s->logit_tokens = malloc(T * sizeof *s->logit_tokens);
    if (!s->pos || !s->caches || !s->logit_tokens || attn_scratch_init(&s->attn, c, max_tokens, c->max_seq_len) != 0) {
        runstate_free(s);
        return -1;
    }
    parallel_warm_up();
    return 0;
}

void runstate_free(RunState *s) {
    float *bufs[] = {s->x, s->xb, s->heads, s->hb, s->hb2};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    free(s->pos);
    free(s->caches);
    free(s->logit_tokens);
    attn_scratch_free(&s->attn);
    memset(s, 0, sizeof *s);
}

/* Rows t < T of the residual stream (T, dim): x += dx (unless dx is NULL), then
 * out = RMSNorm(x) w. out may be dx. */
typedef struct {
    float *x;
    const float *dx;
    float *out;
    Mat w;
    const Config *c;
} ResidualNorm;

static void residual_rmsnorm_row(const void *ctx, long t) {
    const ResidualNorm *r = ctx;
    const int D = r->c->dim;
    float *row = r->x + (size_t)t * D;
    if (r->dx)
        for (int i = 0; i < D; i++) row[i] += r->dx[(size_t)t * D + i];
    rmsnorm(r->out + (size_t)t * D, row, r->w, D, r->c->norm_eps);
}

static void residual_rmsnorm(float *x, const float *dx, float *out, Mat w, int T, const Config *c) {
    const ResidualNorm r = {x, dx, out, w, c};
    parallel_for(T, residual_rmsnorm_row, &r, parallel_mode((long)T * c->dim, T));
}

/* The forward pass (model.h's model_forward_batch), on thread 0 of a team (parallel.h). */
static void forward(const Model *m, RunState *s, const Batch *b, const TokenSlots *slots, MlaForm form, float *logits) {
    const Config *c = &m->cfg;
    const int T = b->n_tokens, D = c->dim, F = c->hidden_dim, HD = c->n_heads * c->head_dim;

    for (int t = 0; t < T; t++) mat_row_f32(s->x + (size_t)t * D, m->w.tok_embeddings, b->ids[t]);  /* x: (T, D) */
    residual_rmsnorm(s->x, NULL, s->xb, m->w.layers[0].attn_norm, T, c);  /* xb = RMSNorm(x): (T, D) */

    for (int l = 0; l < c->n_layers; l++) {
        const LayerWeights *w = &m->w.layers[l];
        /* x += W_O Attn(xb), then xb = RMSNorm(x) */
        attention(m, &s->attn, slots, l, s->xb, s->heads, form);       /* heads: (T, HD) */
        matmul(s->xb, D, s->heads, HD, w->wo, T);                      /* (T, D) */
        residual_rmsnorm(s->x, s->xb, s->xb, w->ffn_norm, T, c);

        /* x += W2 (silu(W1 xb) * W3 xb), then xb = RMSNorm(x), with the next layer's norm
         * or the final one */
        matmul_swiglu(s->hb, s->hb2, s->xb, D, w->w1, w->w3, T);       /* hb = silu(W1 xb) * W3 xb: (T, F) */
        matmul(s->xb, D, s->hb, F, w->w2, T);                          /* (T, D) */
        Mat next_norm = l + 1 < c->n_layers ? m->w.layers[l + 1].attn_norm : m->w.final_norm;
        residual_rmsnorm(s->x, s->xb, s->xb, next_norm, T, c);
    }

    /* the tied head, for the tokens asked for: their rows gathered into x, which is free now */
    const float *rows = s->xb;
    if (b->n_logits < T || b->logit_tokens[0] != 0) {
        for (int i = 0; i < b->n_logits; i++)
            memcpy(s->x + (size_t)i * D, s->xb + (size_t)b->logit_tokens[i] * D, (size_t)D * sizeof(float));
        rows = s->x;
    }
    matmul(logits, c->vocab_size, rows, D, m->w.tok_embeddings, b->n_logits);  /* (n_logits, vocab) */
}

typedef struct {
    const Model *m;
    RunState *s;
    const Batch *b;
    const TokenSlots *slots;
    MlaForm form;
    float *logits;
} ForwardArgs;

static void forward_in_team(void *arg) {
    const ForwardArgs *f = arg;
    forward(f->m, f->s, f->b, f->slots, f->form, f->logits);
}

/* Positions of the batch's tokens, or -1 when the batch breaks model.h's rules or a cache
 * cannot reserve its positions. */
static int place_tokens(const Model *m, RunState *s, const Batch *b) {
    const int T = b->n_tokens;
    if (T < 1 || T > s->max_tokens || b->n_logits < 1 || b->n_logits > T) return -1;
    for (int i = 0; i < b->n_logits; i++)
        if (b->logit_tokens[i] < 0 || b->logit_tokens[i] >= T || (i > 0 && b->logit_tokens[i] <= b->logit_tokens[i - 1]))
            return -1;
    for (int t = 0; t < T; t++) {
        if (b->ids[t] < 0 || b->ids[t] >= m->cfg.vocab_size) return -1;
        const int same = t > 0 && b->cache[t] == b->cache[t - 1];
        if (!same)
            for (int u = 0; u < t; u++)  /* a sequence's tokens are consecutive */
                if (b->cache[u] == b->cache[t]) return -1;
        s->pos[t] = same ? s->pos[t - 1] + 1 : b->cache[t]->len;
        /* past the context only through a window, which rotates by place: RoPE's tables end there */
        if (s->pos[t] >= m->cfg.max_seq_len && !b->cache[t]->pool->window) return -1;
    }
    for (int t = 0; t < T; t++)
        if ((t + 1 == T || b->cache[t + 1] != b->cache[t]) && kv_reserve(b->cache[t], s->pos[t] + 1) != 0) return -1;
    return 0;
}

int model_forward_batch(const Model *m, RunState *s, const Batch *b, MlaForm form, float *logits) {
    if (place_tokens(m, s, b) != 0) return MODEL_ERR_BATCH;
    const TokenSlots slots = {b->n_tokens, b->cache, s->pos};
    ForwardArgs f = {m, s, b, &slots, form, logits};
    parallel_team(forward_in_team, &f);  /* inside a team already (run.c's generation): just runs it */
    for (int t = 0; t < b->n_tokens; t++) b->cache[t]->len = s->pos[t] + 1;
    if (first_nonfinite(logits, (size_t)b->n_logits * (size_t)m->cfg.vocab_size, DTYPE_F32) >= 0) return MODEL_ERR_NONFINITE;
    return 0;
}

int model_forward(const Model *m, RunState *s, KVCache *cache, const int *tokens, int T, MlaForm form, float *logits,
                  int all_logits) {
    if (T < 1 || T > s->max_tokens) return MODEL_ERR_BATCH;
    for (int t = 0; t < T; t++) {
        s->caches[t] = cache;
        s->logit_tokens[t] = t;
    }
    const Batch b = {T, tokens, s->caches, all_logits ? T : 1, all_logits ? s->logit_tokens : s->logit_tokens + T - 1};
    return model_forward_batch(m, s, &b, form, logits);
}
