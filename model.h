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
    AttnScratch attn;
} RunState;

/* Returns -1 when out of memory. */
int runstate_init(RunState *s, const Config *c, int max_tokens);
void runstate_free(RunState *s);

/* Runs T tokens at the cache's next positions, cache->len .. cache->len+T-1, and
 * advances cache->len by T. Writes the logits of the last token into logits
 * (vocab_size floats), or of all T tokens ((T, vocab_size)) when all_logits. Returns -1,
 * touching nothing, when T is not in 1..s->max_tokens or the cache has no room for T
 * more positions. The kernels share the work among the threads of a team (parallel.h):
 * the caller's, or one opened for this pass. */
int model_forward(const Model *m, RunState *s, KVCache *cache, const int *tokens, int T, MlaForm form, float *logits,
                  int all_logits);

#endif /* MODEL_H */
