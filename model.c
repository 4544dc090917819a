/* model.c: the forward pass (model.h). */
#include "model.h"

#include <stdlib.h>
#include <string.h>

#include "parallel.h"

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
    if (attn_scratch_init(&s->attn, c, max_tokens, c->max_seq_len) != 0) {
        runstate_free(s);
        return -1;
    }
    parallel_warm_up();
    return 0;
}

void runstate_free(RunState *s) {
    float *bufs[] = {s->x, s->xb, s->heads, s->hb, s->hb2};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
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

/* The forward pass (model.h's model_forward), on thread 0 of a team (parallel.h). */
static void forward(const Model *m, RunState *s, KVCache *cache, const int *tokens, int T, MlaForm form,
                    float *logits, int all_logits) {
    const Config *c = &m->cfg;
    const int D = c->dim, F = c->hidden_dim, HD = c->n_heads * c->head_dim;

    for (int t = 0; t < T; t++) mat_row_f32(s->x + (size_t)t * D, m->w.tok_embeddings, tokens[t]);  /* x: (T, D) */
    residual_rmsnorm(s->x, NULL, s->xb, m->w.layers[0].attn_norm, T, c);  /* xb = RMSNorm(x): (T, D) */

    for (int l = 0; l < c->n_layers; l++) {
        const LayerWeights *w = &m->w.layers[l];
        /* x += W_O Attn(xb), then xb = RMSNorm(x) */
        attention(m, &s->attn, cache, l, s->xb, s->heads, T, form);  /* heads: (T, HD) */
        matmul(s->xb, D, s->heads, HD, w->wo, T);                      /* (T, D) */
        residual_rmsnorm(s->x, s->xb, s->xb, w->ffn_norm, T, c);

        /* x += W2 (silu(W1 xb) * W3 xb), then xb = RMSNorm(x), with the next layer's norm
         * or the final one */
        matmul_swiglu(s->hb, s->hb2, s->xb, D, w->w1, w->w3, T);       /* hb = silu(W1 xb) * W3 xb: (T, F) */
        matmul(s->xb, D, s->hb, F, w->w2, T);                          /* (T, D) */
        Mat next_norm = l + 1 < c->n_layers ? m->w.layers[l + 1].attn_norm : m->w.final_norm;
        residual_rmsnorm(s->x, s->xb, s->xb, next_norm, T, c);
    }
    cache->len += T;

    /* the tied head, for the last token or for all */
    int first = all_logits ? 0 : T - 1;
    matmul(logits, c->vocab_size, s->xb + (size_t)first * D, D, m->w.tok_embeddings, T - first);
}

typedef struct {
    const Model *m;
    RunState *s;
    KVCache *cache;
    const int *tokens;
    int T;
    MlaForm form;
    float *logits;
    int all_logits;
} ForwardArgs;

static void forward_in_team(void *arg) {
    const ForwardArgs *f = arg;
    forward(f->m, f->s, f->cache, f->tokens, f->T, f->form, f->logits, f->all_logits);
}

int model_forward(const Model *m, RunState *s, KVCache *cache, const int *tokens, int T, MlaForm form, float *logits,
                  int all_logits) {
    if (T < 1 || T > s->max_tokens || T > cache->capacity - cache->len) return -1;
    ForwardArgs f = {m, s, cache, tokens, T, form, logits, all_logits};
    parallel_team(forward_in_team, &f);  /* inside a team already (run.c's generation): just runs it */
    return 0;
}
