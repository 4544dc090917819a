/* model.h: the forward pass of the transformer, and its scratch state.
 *
 *   x = embedding(tokens)
 *   for each layer:  x += W_O attention(RMSNorm(x))      (attention.h)
 *                    x += W_2 (silu(W_1 xn) * W_3 xn),   xn = RMSNorm(x)
 *   logits = W_head RMSNorm(x)          (W_head: the embedding, tied, or an untied head)
 *
 * config.h has the shapes and weights; loader.h reads them from a checkpoint. */
#ifndef MODEL_H
#define MODEL_H

#include <stddef.h>

#include "attention.h"
#include "config.h"
#include "kernels/threads.h"
#include "kvcache.h"

typedef struct SpmTokenizer SpmTokenizer;

/* A loaded checkpoint (loader.h); read-only once loaded. */
typedef struct {
    Config cfg;
    Weights w;
    SpmTokenizer *tokenizer; /* embedded in the checkpoint */
    RopeTables rope;
    void *weights; /* the file's weights, packed (kernels.h), on huge pages where possible */
    void *derived; /* storage of wuk_t and wuv_heads */
} Model;

/* Scratch for forward passes of up to max_tokens tokens (T in the comments). */
typedef struct {
    int max_tokens;
    float *x;          /* (T, dim) residual stream */
    float *xb;         /* (T, dim) normalized input / sublayer output */
    float *heads;      /* (T, n_heads*head_dim) attention output, heads concatenated */
    float *hb, *hb2;   /* (T, hidden_dim) */
    int *pos;          /* (T) each token's position in its sequence */
    KVCache **caches;  /* (T) model_forward's one cache, once per token */
    int *logit_tokens; /* (T) model_forward's rows of logits */
    AttnScratch attn;
} RunState;

/* A profiled pass's stage clock (kernels/timer.h) has a slot for each layer's stages
 * (attention.h's stage_slot), then these, at pass_stage_slot: the embedding and the first
 * norm, the output head, and the sampling after the pass (the scheduler's). */
enum { PASS_STAGE_EMBEDDING, PASS_STAGE_HEAD, PASS_STAGE_SAMPLING, PASS_STAGES };
static inline int pass_stage_slot(const Config *c, int stage) { return c->n_layers * STAGES_PER_LAYER + stage; }
static inline int stage_slots(const Config *c) { return c->n_layers * STAGES_PER_LAYER + PASS_STAGES; }

/* Returns -1 when out of memory. */
int runstate_init(RunState *s, const Config *c, int max_tokens);
void runstate_free(RunState *s);

/* The tokens of one forward pass: token t is appended to the sequence whose cache is
 * cache[t], at its next position. The tokens of a sequence are consecutive in the pass,
 * in order. The pass writes the logits of tokens logit_tokens[0 .. n_logits), ascending,
 * as (n_logits, vocab_size). */
typedef struct {
    int n_tokens;
    const int *ids;        /* (T) */
    KVCache *const *cache; /* (T) */
    int n_logits;
    const int *logit_tokens;    /* (n_logits) */
    const int *record_sequence; /* (T) or NULL: with s->attn.record, the sequence number token t's
                                 * attention weights are recorded under, or -1 for none */
} Batch;

/* What a forward pass can fail with: a batch it cannot run, logits that are not finite
 * numbers (finite weights whose arithmetic overflows float), which no sampler or NLL may
 * take for a result, or a streamed cache (kvtier.h) the tier did not give back whole
 * (errno says why): its logits are void. */
enum { MODEL_ERR_BATCH = -1, MODEL_ERR_NONFINITE = -2, MODEL_ERR_TIER = -3 };

/* A pass in three calls, so that a team of threads can run it (threads.h):
 *   model_prepare, on thread 0: checks the batch (MODEL_ERR_BATCH when it is malformed,
 *     larger than s->max_tokens, or a cache cannot reserve its positions: caches
 *     reserved before it keep their new blocks), places each token at its position and
 *     reserves the caches' blocks;
 *   model_forward_pass, on every thread of the team with the same arguments: every token
 *     through the projections and the FFN together (the weights are read once for all),
 *     each token's attention over its own sequence's cache; logits (n_logits, vocab) are
 *     whole when it returns on every thread;
 *   model_finish, on thread 0: advances each cache's len; MODEL_ERR_NONFINITE when a
 *     logit is NaN or infinite.
 * With s->attn.clock set, thread 0 charges the pass's stages to it (pass_stage_slot);
 * with s->attn.record set, model_prepare plans what the pass records and model_finish
 * completes it (attention.h).
 * Batch invariance: every token's logits are the same bits whatever else the batch holds,
 * and whatever the team's size. */
int model_prepare(const Model *m, RunState *s, const Batch *b);
void model_forward_pass(const Model *m, RunState *s, const Batch *b, MlaForm form, float *logits, Worker *wk);
int model_finish(const Model *m, RunState *s, const Batch *b, const float *logits);

/* One sequence, on the calling thread alone (the tests, fuzzing): T tokens appended to
 * cache; the logits of the last token (vocab_size floats), or of all T ((T, vocab_size))
 * when all_logits. Returns as model_prepare and model_finish. */
int model_forward(const Model *m, RunState *s, KVCache *cache, const int *tokens, int T, MlaForm form, float *logits,
                  int all_logits);

#endif /* MODEL_H */
