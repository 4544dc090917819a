/* model.h: the forward pass of the transformer, and its scratch state.
 *
 *   x = embedding(tokens)
 *   for each layer:  x += W_O attention(RMSNorm(x))      (attention.h)
 *                    x += W_2 (silu(W_1 xn) * W_3 xn),   xn = RMSNorm(x)
 *   logits = embedding^T RMSNorm(x)                       (the tied head)
 *
 * config.h has the shapes and weights; loader.h reads them from a checkpoint. */
#ifndef MODEL_H
#define MODEL_H

#include <stddef.h>

#include "attention.h"
#include "config.h"
#include "kvcache.h"

/* Scratch for forward passes of up to max_tokens tokens (T in the comments). */
typedef struct {
    int max_tokens;
    float *x;           /* (T, dim) residual stream */
    float *xb;          /* (T, dim) normalized input / sublayer output */
    float *heads;       /* (T, n_heads*head_dim) attention output, heads concatenated */
    float *hb, *hb2;    /* (T, hidden_dim) */
    int *pos;           /* (T) each token's position in its sequence */
    KVCache **caches;   /* (T) model_forward's one cache, once per token */
    int *logit_tokens;  /* (T) model_forward's rows of logits */
    AttnScratch attn;
} RunState;

/* Returns -1 when out of memory. */
int runstate_init(RunState *s, const Config *c, int max_tokens);
void runstate_free(RunState *s);

/* The tokens of one forward pass: token t is appended to the sequence whose cache is
 * cache[t], at its next position. The tokens of a sequence are consecutive in the pass,
 * in order. The pass writes the logits of tokens logit_tokens[0 .. n_logits), ascending,
 * as (n_logits, vocab_size). */
typedef struct {
    int n_tokens;
    const int *ids;          /* (T) */
    KVCache *const *cache;   /* (T) */
    int n_logits;
    const int *logit_tokens; /* (n_logits) */
} Batch;

/* What a forward pass can fail with: a batch it cannot run, or logits that are not finite
 * numbers (finite weights whose arithmetic overflows float), which no sampler or NLL may
 * take for a result. */
enum { MODEL_ERR_BATCH = -1, MODEL_ERR_NONFINITE = -2 };

/* Runs a batch: every token through the projections and the FFN together (the weights are
 * read once for all), each token's attention over its own sequence's cache. Reserves the
 * caches' positions (kv_reserve) and advances their len. Returns MODEL_ERR_BATCH before
 * computing anything when the batch is malformed or larger than s->max_tokens, or a cache
 * cannot reserve its positions (caches reserved before it keep their new blocks);
 * MODEL_ERR_NONFINITE after the pass when a logit is NaN or infinite. The kernels share the work among the threads of a team (parallel.h):
 * the caller's, or one opened for this pass. Batch invariance: every token's logits are
 * the same bits whatever else the batch holds. */
int model_forward_batch(const Model *m, RunState *s, const Batch *b, MlaForm form, float *logits);

/* One sequence: T tokens appended to cache; the logits of the last token (vocab_size
 * floats), or of all T ((T, vocab_size)) when all_logits. Returns as model_forward_batch. */
int model_forward(const Model *m, RunState *s, KVCache *cache, const int *tokens, int T, MlaForm form, float *logits,
                  int all_logits);

#endif /* MODEL_H */
