/* scheduler.h: many sequences generated together on the paged KV cache, a step at a time.
 *
 * The caller adds requests (a prompt and a seed each) and calls scheduler_step until it
 * returns 0; each step reports what happened (the tokens sampled, their logits, the
 * requests that finished) and the caller prints, logs and dumps from that. Nothing calls
 * back up: the loop is the caller's.
 *
 *     scheduler_init(&sch);
 *     for (...) scheduler_add(&sch, &requests[i]);
 *     while ((rc = scheduler_step(&sch, &step)) > 0) ... print step ...
 *     scheduler_free(&sch);
 *
 * Requests wait in a queue and run in up to max_batch slots. Every step is one forward
 * pass (model.h's batch): the new tokens of every running sequence go through the weights
 * together, and each attends over its own cache. When a sequence ends, its blocks go back
 * to the pool and the next waiting request is admitted into its slot at the next step
 * (continuous batching). A request's context-sized state (its sampler and block table)
 * exists only from its admission to its end.
 *
 * Prefix sharing: a request admitted while another sequence's cache already holds a
 * prefix of its tokens shares those blocks instead of computing them (copy on write
 * keeps them apart afterwards). A request that shares a long prefix with one being
 * prefilled in the same step waits one step for it, once, and only for a sequence that
 * goes on after this step; so B copies of one prompt compute the prompt once.
 *
 * When the pool runs out, the most recently admitted running sequence is preempted: its
 * blocks are freed and it goes back to the front of the queue with its tokens and its
 * sampler's state, to be recomputed when it is admitted again. A running sequence is
 * never corrupted, and because every forward pass is batch-invariant the recomputed
 * sequence continues with exactly the bits it would have had. With a tier (kvtier.h), its
 * blocks are written to disk instead and read back when it is admitted again; a swap that
 * fails (a full disk, a short read, a checksum) warns and falls back to the recompute.
 * With one slot and a stream (the pool's, kvtier.h), nothing is preempted: the sequence
 * that outgrows the pool spills its oldest blocks to the tier and reads them back every
 * pass; a tier that fails then ends the run, since the blocks it lost have no copy.
 *
 * Without the cache (kv = 0), each step recomputes every sequence over its whole length
 * on a cache emptied before and after, as many sequences a pass as the pass holds (a
 * sequence longer than a pass in several).
 *
 * A long prompt is computed SCHEDULER_PASS_TOKENS tokens a step, through the cache.
 *
 * With a window (kvcache.h), sequences share no blocks and run past the context; a
 * sequence computes at most what its window holds in one step (a long prompt takes
 * several), since a window slides only one position a pass.
 *
 * A step runs on the scheduler's team of threads (threads.h): every thread runs the
 * forward pass and then samples its share of the sequences. */
#ifndef SCHEDULER_H
#define SCHEDULER_H

#include <stdint.h>

#include "kernels/threads.h"
#include "kvcache.h"
#include "kvtier.h"
#include "model.h"
#include "serve/draft.h"
#include "serve/sampler.h"

typedef enum { STOP_NONE, STOP_EOS, STOP_STEPS, STOP_CONTEXT } StopReason;

/* What a request holds from its first admission to its end, preemptions included (the
 * sampler's random state goes on where it stopped). */
typedef struct {
    Sampler sampler;
    KVCache cache;
    KVCache draft_cache; /* the draft model's (--draft CKPT): every token but the last, like
                          * cache, or fewer; rebuilt from the tokens after a preemption */
    KVSwapped swapped;   /* its cache on the tier while preempted with swap; n_blocks 0 otherwise */
} RequestLive;

typedef struct Request Request;
struct Request {
    /* the request, set by the caller */
    int index;
    int *tokens; /* (cap_tokens, malloc'd): the prompt, then each token sampled; grown as needed */
    int cap_tokens;
    int n_prompt;
    uint64_t seed;
    int score; /* compute the prompt and report the logits of each of its positions,
                * sampling nothing (--ppl, the warm-up); without the cache, at most
                * SCHEDULER_PASS_TOKENS positions, as a step holds the rows of one pass */
    /* its state */
    int n_tokens;  /* tokens[0 .. n_tokens) known; the cache holds all but the last */
    int generated; /* tokens sampled (an EOS that ends it included) */
    StopReason stop;
    int waited;        /* it waited a step for a prefix being computed */
    RequestLive *live; /* from its first admission to its end, NULL before and after: a
                        * queue of a million prompts holds none */
    Request *next; /* in the queue */
    /* its timing, from the start of the first step */
    double first_token_ms; /* when its first token was sampled */
    double prefill_ms;     /* the step that computed its prompt */
    double decode_ms;      /* its decode steps, summed */
    int decode_steps;
    int preemptions;
    int drafted; /* draft tokens in this step's pass (speculation) */
};

/* The prompt tokens one pass computes at most (a sequence's prompt, or its recompute
 * without the cache, longer than that takes several passes), besides one token for each
 * sequence that decodes: it bounds the passes' scratch, rows of activations and logits,
 * whatever the context. */
enum { SCHEDULER_PASS_TOKENS = 2048 };

/* A row of a step's logits: the prediction after position pos of a request's tokens, and
 * the token sampled from it (-1: a scored position). */
typedef struct {
    Request *request;
    int pos;
    int token;
    int draft; /* speculation: the draft token the pass put at pos + 1, or -1 */
} StepRow;

/* What one step did. Valid until the next step. */
typedef struct {
    int step;           /* 0, 1, ... */
    int running;        /* sequences computed */
    int sequences;      /* of them, those that got a token */
    int n_tokens;       /* tokens through the forward pass(es) */
    int prefill_tokens; /* of them, prompt tokens (or a preempted sequence's recompute) */
    double ms;
    int n_rows;
    const StepRow *rows; /* (n_rows) the sampled sequences, in admission order, and scored positions */
    const float *logits; /* (n_rows, vocab_size) */
    int n_finished;
    Request *const *finished; /* (n_finished) requests that ended this step; their blocks are free */
    /* what the step's passes read, for --profile's bytes and FLOPs: */
    int passes;
    int logit_rows;     /* rows of logits the head computed */
    long keys_read;     /* over every token, the keys its attention read */
    long sequence_keys; /* over every sequence of every pass, the keys its last token read */
} StepResult;

typedef struct SchedulerRun SchedulerRun;

/* --draft: the draft model and the pool of its caches (CKPT), or a corpus table (TABLE);
 * all NULL: prompt lookup (ngram). */
typedef struct {
    const Model *model;
    KVPool *pool;
    const NgramTable *table;
} Drafter;

typedef struct {
    const Model *model;
    KVPool *pool;
    int kv; /* keep the cache between steps */
    MlaForm form;
    int max_batch; /* slots */
    int max_new;   /* tokens to sample per sequence; 0 = until EOS or the context is full (a
                    * ring goes past the context only this far) */
    int ignore_eos;
    int top_k;
    float top_p;
    float temperature;
    int draft_k; /* speculation: up to draft_k draft tokens after each decoding sequence's
                  * last one, verified in the same pass; the longest prefix the target
                  * accepts is kept (greedy: the tokens it would have sampled; sampling:
                  * sampler_accept's test, so that the tokens follow the target's
                  * distribution), the rest of the cache rolled back (kv_truncate).
                  * 0 = off; needs kv, no window. */
    const Model *draft_model; /* drafts by this model (draft_k passes of it a step, every
                               * drafting sequence in each), or NULL: draft_table's or prompt
                               * lookup's drafts (draft.h) */
    KVPool *draft_pool;       /* the draft model's caches */
    const NgramTable *draft_table; /* drafts by this corpus table, or NULL */
    int preempt_rule; /* with a tier, swap a preempted sequence only when the measured rule says
                       * it is faster than its recompute (--preempt's default; scheduler.c's
                       * swap_pays); 0: always swap */
    int fill; /* every request starts at this position, over a cache of generated entries
               * (kvcache.h's kv_fill_generated) that no pass computed: --fill */
    /* set by the caller between steps, NULL when off: */
    StageClock *clock;  /* --profile: the step's stages, model.h's slots */
    AttnRecord *record; /* --dump-attn: the attention weights of the tokens the step computes
                         * for the first time (a prompt's, then each new token; not a
                         * recompute), each under its request's index; emptied every step */
    int record_step;    /* record in the next step */
    /* results */
    int steps;
    double total_ms; /* from the first step to the last */
    int preemptions;
    long short_team_steps; /* steps run on fewer threads than the team's: the machine was
                            * busy (threads.h's adaptive team) */
    int swaps, swap_failures; /* preemptions swapped out, and swaps that fell back to recompute */
    int tier_errno;           /* why the step returned MODEL_ERR_TIER: streaming's tier failed */
    int failed_in_draft;      /* the step's MODEL_ERR_NONFINITE came from the draft model's logits */
    int rule_recomputes;      /* preemptions preempt_rule recomputed instead of swapping */
    /* the prefill's rate, measured over every step that computed only prompt tokens since
     * scheduler_init (the warm-up's included): the recompute's cost in preempt_rule */
    double prefill_ms;
    long prefill_tokens;
    double fill_ms; /* spent generating --fill entries, left out of every step's time */
    long drafted, accepted; /* speculation: draft tokens verified, and of them accepted */
    long verify_passes;     /* sequences' passes that verified at least one draft token */
    long drafts_without_room; /* sequences' steps whose drafts found no room in a pool: none drafted */
    double draft_ms;        /* drafting: the draft model's passes and draws, or prompt lookup */
    SchedulerRun *run; /* scheduler.c's own */
} Scheduler;

/* The most tokens a pass of max_batch slots holds: the rows of every pass-sized buffer. */
int scheduler_max_tokens(const Config *c, int max_batch);

/* Allocates the run (the model's scratch for max_batch slots, the logits) and opens the
 * team. Returns -1 when out of memory, when a thread cannot be started, or when the pool
 * cannot hold one sequence of the full context. */
int scheduler_init(Scheduler *sch);
/* Queues r: its tokens (malloc'd), cap_tokens and n_prompt must be set (cap_tokens >
 * n_prompt); the rest of it is initialized here (with a fill, its tokens are moved behind
 * the fill's). r must live until scheduler_free. Returns -1 when out of memory. */
int scheduler_add(Scheduler *sch, Request *r);
/* Runs one step. Returns 1 and fills *out; 0 when no request is left; -1 when out of
 * memory; MODEL_ERR_NONFINITE (model.h) when a forward pass gives logits that are not
 * finite (no token drawn from them is kept; failed_in_draft says whether the draft model's
 * did); MODEL_ERR_TIER when a streamed cache's tier failed (a write, a read or a checksum:
 * tier_errno), which the run cannot go on from. */
int scheduler_step(Scheduler *sch, StepResult *out);
/* Forgets the steps run so far (a warm-up's): the counts and times a run reports start from
 * zero again; the prefill's rate, the buffers, the team and the pool stay. */
void scheduler_restart_figures(Scheduler *sch);
/* Closes the team and frees the run, and what requests still running hold. */
void scheduler_free(Scheduler *sch);

#endif /* SCHEDULER_H */
