/* scheduler.h: many sequences generated together on the paged KV cache.
 *
 * Requests (a prompt and a seed each) wait in a queue and run in up to max_batch slots.
 * Every step is one forward pass (model.h's batch): the new tokens of every running
 * sequence go through the weights together, and each attends over its own cache. When a
 * sequence ends, its blocks go back to the pool and the next waiting request is admitted
 * into its slot at the next step (continuous batching).
 *
 * Prefix sharing: a request admitted while another sequence's cache already holds a
 * prefix of its tokens shares those blocks instead of computing them (copy on write
 * keeps them apart afterwards). A request that shares a long prefix with one being
 * prefilled in the same step waits one step for it, so B copies of one prompt compute
 * the prompt once.
 *
 * When the pool runs out, the most recently admitted running sequence is preempted: its
 * blocks are freed and it goes back to the front of the queue with its tokens and its
 * sampler's state, to be recomputed when it is admitted again. A running sequence is
 * never corrupted, and because every forward pass is batch-invariant the recomputed
 * sequence continues with exactly the bits it would have had.
 *
 * Without the cache (kv = 0), each step recomputes each sequence alone over its whole
 * length, on a cache emptied before and after.
 *
 * With a window (kvcache.h), sequences share no blocks and run past the context; a
 * sequence computes at most what its window holds in one step (a long prompt takes
 * several), since a window slides only one position a pass. */
#ifndef SCHEDULER_H
#define SCHEDULER_H

#include <signal.h>
#include <stdint.h>

#include "config.h"
#include "kvcache.h"
#include "model.h"
#include "serve/sampler.h"

typedef enum { STOP_NONE, STOP_EOS, STOP_STEPS, STOP_CONTEXT } StopReason;

typedef struct {
    /* the request, set by the caller */
    int index;
    int *tokens;          /* (cap_tokens, malloc'd): the prompt, then each token sampled; grown as needed */
    int cap_tokens;
    int n_prompt;
    uint64_t seed;
    /* its state */
    int n_tokens;         /* tokens[0 .. n_tokens) known; the cache holds all but the last */
    int generated;        /* tokens sampled (an EOS that ends it included) */
    StopReason stop;
    Sampler sampler;
    KVCache cache;
    int admitted;         /* the order of its latest admission (0 = never admitted) */
    /* its timing, from the start of scheduler_run */
    double first_token_ms;   /* when its first token was sampled */
    double prefill_ms;       /* the step that computed its prompt */
    double decode_ms;        /* its decode steps, summed */
    int decode_steps;
    int preemptions;
} Request;

/* What one step did, for the per-step log. */
typedef struct {
    int step;             /* 0, 1, ... */
    int sequences;        /* sequences that got a token */
    int n_tokens;         /* tokens through the forward pass(es) */
    int prefill_tokens;   /* of them, prompt tokens (or a preempted sequence's recompute) */
    double ms;
    const Request *only;  /* the one sequence when sequences == 1 */
    int pos;              /* the position of its last token through the pass, when only */
    int next_token;       /* its new token, when only */
} StepInfo;

typedef struct {
    const Model *model;
    RunState *state;      /* max_tokens >= max_seq_len + max_batch */
    KVPool *pool;
    int kv;               /* keep the cache between steps */
    MlaForm form;
    int max_batch;        /* slots */
    int max_new;          /* tokens to sample per sequence; 0 = until EOS or the context is full (or
                           * with a window, until EOS) */
    int ignore_eos;
    int top_k;
    float top_p;
    float temperature;
    Request *requests;    /* admitted in this order */
    int n_requests;
    float *logits;        /* (max_batch, vocab_size) scratch */
    /* called on the thread that runs scheduler_run, in this order within a step; any may be NULL */
    void (*on_logits)(void *ctx, Request *r, const float *logits);  /* before r samples from them */
    void (*on_token)(void *ctx, Request *r, int token);             /* a token sampled and kept (not an ending EOS) */
    void (*on_done)(void *ctx, Request *r);                         /* r has ended; its blocks are free again */
    void (*on_step)(void *ctx, const StepInfo *step);
    void *ctx;
    /* when it points at a nonzero value (set by a signal handler), the run ends after the
     * current step; sequences cut short keep stop = STOP_NONE. May be NULL. */
    const volatile sig_atomic_t *stop;
    /* results */
    int steps;
    double total_ms;      /* from the first step to the last */
    int preemptions;
} Scheduler;

/* The RunState a scheduler of max_batch slots needs. */
static inline int scheduler_max_tokens(const Config *c, int max_batch) { return c->max_seq_len + max_batch; }

/* Runs every request to its end. Each request's tokens, cap_tokens and n_prompt must be
 * set; the rest of it is initialized here. Returns 0, -1 when out of memory or when the
 * pool cannot hold one sequence of the full context, or MODEL_ERR_NONFINITE (model.h) when
 * a forward pass gives logits that are not finite (nothing is sampled from them). */
int scheduler_run(Scheduler *sch);
/* Frees what scheduler_run allocated in the requests. */
void scheduler_free_requests(Scheduler *sch);

#endif /* SCHEDULER_H */
