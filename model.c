/* model.c: the forward pass (model.h). */
#include "model.h"

#include "kvtier.h"

#include <stdlib.h>
#include <string.h>

int runstate_init(RunState *s, const Config *c, int max_tokens) {
    memset(s, 0, sizeof *s);
    s->max_tokens = max_tokens;
    const size_t T = (size_t)max_tokens;
    struct {
        float **p;
        size_t n;
    } bufs[] = {
        {&s->x, T * c->dim},         {&s->xb, T * c->dim},         {&s->heads, T * c->n_heads * c->head_dim},
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
 * out = RMSNorm(x) w, a thread's share of the rows each. out may be dx. */
static void residual_rmsnorm(Worker *wk, float *x, const float *dx, float *out, Mat w, int T, const Config *c) {
    const int D = c->dim;
    Share sh = share_begin(wk, T, SHARE_SPLIT, parallel_mode((long)T * D));
    for (long lo, hi; share_next(&sh, &lo, &hi);)
        for (long t = lo; t < hi; t++) {
            float *row = x + (size_t)t * D;
            if (dx)
                for (int i = 0; i < D; i++) row[i] += dx[(size_t)t * D + i];
            rmsnorm(out + (size_t)t * D, row, w, D, c->norm_eps);
        }
    share_end(&sh);
}

void model_forward_pass(const Model *m, RunState *s, const Batch *b, MlaForm form, float *logits, Worker *wk) {
    const Config *c = &m->cfg;
    const int T = b->n_tokens, D = c->dim, F = c->hidden_dim, HD = c->n_heads * c->head_dim;
    const TokenSlots slots = {T, b->cache, s->pos};
    StageClock *clock = s->attn.clock;

    stage_begin(clock, wk);
    if (team_alone(wk))
        for (int t = 0; t < T; t++) mat_row_f32(s->x + (size_t)t * D, m->w.tok_embeddings, b->ids[t]); /* x: (T, D) */
    residual_rmsnorm(wk, s->x, NULL, s->xb, m->w.layers[0].attn_norm, T, c); /* xb = RMSNorm(x): (T, D) */
    stage_end(clock, wk, pass_stage_slot(c, PASS_STAGE_EMBEDDING));

    int streamed = 0; /* a cache whose oldest blocks are on the tier (kvtier.h) */
    for (int t = 0; t < T; t++) streamed |= b->cache[t]->n_disk > 0;
    for (int l = 0; l < c->n_layers; l++) {
        const LayerWeights *w = &m->w.layers[l];
        const Layer layer = {c, w, &m->rope, l};
        /* a streamed cache's oldest blocks: this layer of them, read while the last one ran */
        if (streamed && team_alone(wk))
            for (int t = 0; t < T; t++)
                if (t == 0 || b->cache[t] != b->cache[t - 1]) kv_stream_layer(b->cache[t], l);
        /* x += W_O Attn(xb), then xb = RMSNorm(x) */
        attention(&layer, &s->attn, &slots, s->xb, s->heads, form, wk); /* heads: (T, HD) */
        matmul(wk, s->xb, D, s->heads, HD, w->wo, T);                   /* (T, D) */
        stage_end(clock, wk, stage_slot(l, STAGE_PROJECTIONS));
        residual_rmsnorm(wk, s->x, s->xb, s->xb, w->ffn_norm, T, c);

        /* x += W2 (silu(W1 xb) * W3 xb), then xb = RMSNorm(x), with the next layer's norm
         * or the final one */
        matmul_swiglu(wk, s->hb, s->hb2, s->xb, D, w->w1, w->w3, T); /* hb = silu(W1 xb) * W3 xb: (T, F) */
        matmul(wk, s->xb, D, s->hb, F, w->w2, T);                    /* (T, D) */
        Mat next_norm = l + 1 < c->n_layers ? m->w.layers[l + 1].attn_norm : m->w.final_norm;
        residual_rmsnorm(wk, s->x, s->xb, s->xb, next_norm, T, c);
        stage_end(clock, wk, stage_slot(l, STAGE_FFN));
    }

    /* the head (tied or untied), for the tokens asked for: their rows gathered into x, which is free now */
    const float *rows = s->xb;
    if (b->n_logits < T || b->logit_tokens[0] != 0) {
        if (team_alone(wk))
            for (int i = 0; i < b->n_logits; i++)
                memcpy(s->x + (size_t)i * D, s->xb + (size_t)b->logit_tokens[i] * D, (size_t)D * sizeof(float));
        rows = s->x;
    }
    matmul(wk, logits, c->vocab_size, rows, D, weights_head(c, &m->w), b->n_logits); /* (n_logits, vocab) */
    stage_end(clock, wk, pass_stage_slot(c, PASS_STAGE_HEAD));
}

int model_prepare(const Model *m, RunState *s, const Batch *b) {
    const int T = b->n_tokens;
    if (T < 1 || T > s->max_tokens || b->n_logits < 1 || b->n_logits > T) return MODEL_ERR_BATCH;
    for (int i = 0; i < b->n_logits; i++)
        if (b->logit_tokens[i] < 0 || b->logit_tokens[i] >= T ||
            (i > 0 && b->logit_tokens[i] <= b->logit_tokens[i - 1]))
            return MODEL_ERR_BATCH;
    for (int t = 0; t < T; t++) {
        if (b->ids[t] < 0 || b->ids[t] >= m->cfg.vocab_size) return MODEL_ERR_BATCH;
        const int same = t > 0 && b->cache[t] == b->cache[t - 1];
        if (!same)
            for (int u = 0; u < t; u++) /* a sequence's tokens are consecutive */
                if (b->cache[u] == b->cache[t]) return MODEL_ERR_BATCH;
        s->pos[t] = same ? s->pos[t - 1] + 1 : b->cache[t]->len;
        /* past the context only through a window, which rotates by place: RoPE's tables end there */
        if (s->pos[t] >= m->cfg.max_seq_len && !kv_rotates_by_place(b->cache[t]->pool)) return MODEL_ERR_BATCH;
    }
    for (int t = 0; t < T; t++)
        if ((t + 1 == T || b->cache[t + 1] != b->cache[t]) &&
            (kv_reserve(b->cache[t], s->pos[t] + 1) != 0 ||
             (b->cache[t]->slot_pos && s->pos[t] >= b->cache[t]->placed))) /* one a pass once a window is full */
            return MODEL_ERR_BATCH;
    if (s->attn.record) {
        const TokenSlots slots = {T, b->cache, s->pos};
        if (attn_record_plan(s->attn.record, &m->cfg, &slots, b->record_sequence) != 0) return MODEL_ERR_BATCH;
    }
    for (int t = 0; t < T; t++)
        if (t == 0 || b->cache[t] != b->cache[t - 1]) kv_stream_begin(b->cache[t]);
    return 0;
}

int model_finish(const Model *m, RunState *s, const Batch *b, const float *logits) {
    int tier = 0;
    for (int t = 0; t < b->n_tokens; t++)
        if (t == 0 || b->cache[t] != b->cache[t - 1]) tier |= kv_stream_end(b->cache[t]);
    for (int t = 0; t < b->n_tokens; t++) b->cache[t]->len = s->pos[t] + 1;
    if (s->attn.record) attn_record_finish(s->attn.record);
    if (tier) return MODEL_ERR_TIER;
    if (first_nonfinite(logits, (size_t)b->n_logits * (size_t)m->cfg.vocab_size, DTYPE_F32) >= 0)
        return MODEL_ERR_NONFINITE;
    return 0;
}

int model_forward(const Model *m, RunState *s, KVCache *cache, const int *tokens, int T, MlaForm form, float *logits,
                  int all_logits) {
    if (T < 1 || T > s->max_tokens) return MODEL_ERR_BATCH;
    for (int t = 0; t < T; t++) {
        s->caches[t] = cache;
        s->logit_tokens[t] = t;
    }
    const Batch b = {.n_tokens = T,
                     .ids = tokens,
                     .cache = s->caches,
                     .n_logits = all_logits ? T : 1,
                     .logit_tokens = all_logits ? s->logit_tokens : s->logit_tokens + T - 1};
    const int rc = model_prepare(m, s, &b);
    if (rc != 0) return rc;
    Worker alone = worker_alone();
    model_forward_pass(m, s, &b, form, logits, &alone);
    return model_finish(m, s, &b, logits);
}
