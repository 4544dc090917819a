/* scheduler.c: continuous batching over the paged KV cache (scheduler.h). */
#include "serve/scheduler.h"

#include <stdlib.h>
#include <string.h>

#include "kernels/parallel.h"
#include "kernels/timer.h"

/* The requests that wait, in order; a preempted one goes back to the front. */
typedef struct {
    Request **slot;  /* (2 * n): the front grows down from the middle */
    int head, tail;
} Queue;

static int queue_empty(const Queue *q) { return q->head == q->tail; }
static Request *queue_front(const Queue *q) { return q->slot[q->head]; }
static void queue_pop(Queue *q) { q->head++; }
static void queue_push_front(Queue *q, Request *r) { q->slot[--q->head] = r; }

typedef struct {
    Scheduler *sch;
    Queue queue;
    Request **running;    /* (max_batch) in the order of admission */
    int n_running;
    int admissions;
    int *ids;             /* (max_tokens) the batch's tokens */
    KVCache **caches;     /* (max_tokens) */
    int *logit_tokens;    /* (max_batch) */
    int *computed_prompt; /* (max_batch) 1 when the step computes that sequence's prompt */
    int *sampling;        /* (max_batch) the running sequences that sample this step, in order */
    int n_sampling;
    double start;
} Run;

/* The tokens a and b begin with alike. */
static int common_prefix(const Request *a, const Request *b) {
    const int n = a->n_tokens < b->n_tokens ? a->n_tokens : b->n_tokens;
    int i = 0;
    while (i < n && a->tokens[i] == b->tokens[i]) i++;
    return i;
}

static int min_int(int a, int b) { return a < b ? a : b; }

/* Blocks the running sequences' next tokens take from the pool. */
static int blocks_for_running(const Run *run, int n) {
    int need = 0;
    for (int i = 0; i < n; i++) need += kv_blocks_needed(&run->running[i]->cache, run->running[i]->n_tokens);
    return need;
}

/* Admits waiting requests into free slots while the pool and the step's prompt budget
 * allow; returns how many. A request shares the longest prefix another running
 * sequence's cache holds (all but its last token at most: that one's logits are needed). */
static int admit(Run *run) {
    Scheduler *sch = run->sch;
    const int first_new = run->n_running;
    int budget = sch->model->cfg.max_seq_len;  /* prompt tokens computed in one step */
    while (run->n_running < sch->max_batch && !queue_empty(&run->queue)) {
        Request *r = queue_front(&run->queue);
        Request *source = NULL;
        int shared = 0, pending = 0;
        for (int i = 0; i < run->n_running && !sch->pool->window; i++) {  /* a window's slots are never shared */
            Request *q = run->running[i];
            const int common = min_int(common_prefix(r, q), r->n_tokens - 1);
            if (i >= first_new) pending = common > pending ? common : pending;  /* computed this step */
            else if (min_int(common, q->cache.len) > shared) shared = min_int(common, q->cache.len), source = q;
        }
        /* waiting one step for a prompt being computed now saves at least half of this one */
        if (pending > shared && 2 * (pending - shared) >= r->n_tokens) break;
        const int compute = r->n_tokens - shared;
        if (run->n_running > first_new && compute > budget) break;
        if (source) kv_share_prefix(&r->cache, &source->cache, shared);
        if (kv_blocks_needed(&r->cache, r->n_tokens) + blocks_for_running(run, run->n_running) > sch->pool->n_free) {
            kv_reset(&r->cache);
            break;
        }
        queue_pop(&run->queue);
        r->admitted = ++run->admissions;
        run->running[run->n_running++] = r;
        budget -= compute;
    }
    return run->n_running - first_new;
}

static void remove_running(Run *run, int i) {
    memmove(run->running + i, run->running + i + 1, (size_t)(run->n_running - i - 1) * sizeof *run->running);
    run->n_running--;
}

/* Reserves every running sequence's positions, preempting the latest admitted while the
 * pool is short. Returns -1 when even one sequence alone does not fit. */
static int reserve_or_preempt(Run *run) {
    for (int i = 0; i < run->n_running; i++) {
        Request *r = run->running[i];
        while (kv_reserve(&r->cache, r->n_tokens) != 0) {
            if (run->n_running == 1) return -1;
            Request *victim = run->running[run->n_running - 1];  /* running is in admission order */
            kv_reset(&victim->cache);
            victim->preemptions++;
            run->sch->preemptions++;
            queue_push_front(&run->queue, victim);
            run->n_running--;
            if (victim == r) break;
        }
    }
    return 0;
}

typedef struct {
    Run *run;
    const float *logits;
    int *next;
} Sampling;

static void sample_one(const void *ctx, long k) {
    const Sampling *s = ctx;
    const int V = s->run->sch->model->cfg.vocab_size;
    s->next[k] = sampler_sample(&s->run->running[s->run->sampling[k]]->sampler, s->logits + (size_t)k * V);
}

/* Keeps a token sampled for r (its array grows as needed). Returns -1 when out of memory. */
static int append_token(Request *r, int token) {
    if (r->n_tokens == r->cap_tokens) {
        int *grown = realloc(r->tokens, (size_t)r->cap_tokens * 2 * sizeof(int));
        if (!grown) return -1;
        r->tokens = grown;
        r->cap_tokens *= 2;
    }
    r->tokens[r->n_tokens++] = token;
    return 0;
}

/* After the forward pass: the sequences whose tokens are all in (run->sampling) sample
 * their next token from their rows of logits, and those that end leave their slot. */
static int sample_and_retire(Run *run, int step, int n_tokens, int prefill_tokens, double step_ms) {
    Scheduler *sch = run->sch;
    const Config *c = &sch->model->cfg;
    const int S = run->n_sampling;
    int next[S > 0 ? S : 1];
    const int fed_pos = run->running[0]->n_tokens - 1;  /* for the log of a single sequence */
    for (int k = 0; k < S; k++)
        if (sch->on_logits) sch->on_logits(sch->ctx, run->running[run->sampling[k]], sch->logits + (size_t)k * c->vocab_size);
    const Sampling sampling = {run, sch->logits, next};
    parallel_for(S, sample_one, &sampling, parallel_mode((long)S * c->vocab_size * 4, S));
    const double elapsed = now_ms() - run->start;
    for (int i = 0; i < run->n_running; i++) {
        Request *r = run->running[i];
        if (run->computed_prompt[i]) r->prefill_ms += step_ms;
        else r->decode_ms += step_ms, r->decode_steps++;
    }
    for (int k = 0; k < S; k++) {
        Request *r = run->running[run->sampling[k]];
        if (r->generated++ == 0) r->first_token_ms = elapsed;
        if (next[k] == c->eos_id && !sch->ignore_eos) {
            r->stop = STOP_EOS;
            continue;
        }
        if (append_token(r, next[k]) != 0) return -1;
        if (sch->on_token) sch->on_token(sch->ctx, r, next[k]);
        if (sch->max_new && r->generated >= sch->max_new) r->stop = STOP_STEPS;
        else if (!sch->pool->window && r->n_tokens > c->max_seq_len) r->stop = STOP_CONTEXT;  /* no position left for it */
    }
    if (sch->on_step) {
        const Request *only = run->n_running == 1 ? run->running[0] : NULL;
        const StepInfo info = {step, S, n_tokens, prefill_tokens, step_ms, only, only ? fed_pos : -1,
                               only && S ? next[0] : -1};
        sch->on_step(sch->ctx, &info);
    }
    for (int i = 0; i < run->n_running;) {
        Request *r = run->running[i];
        if (r->stop == STOP_NONE) {
            i++;
            continue;
        }
        kv_reset(&r->cache);
        remove_running(run, i);
        if (sch->on_done) sch->on_done(sch->ctx, r);
    }
    return 0;
}

/* One step with the cache: every running sequence's new tokens in one forward pass. With
 * a window, a sequence runs at most what its window can take without sliding (one token
 * once it is full). */
static int step_cached(Run *run, int step) {
    Scheduler *sch = run->sch;
    const double t0 = now_ms();
    admit(run);
    if (run->n_running == 0 || reserve_or_preempt(run) != 0) return -1;
    int T = 0, prefill_tokens = 0;
    run->n_sampling = 0;
    for (int i = 0; i < run->n_running; i++) {
        Request *r = run->running[i];
        const int from = r->cache.len, count = kv_tokens_per_pass(&r->cache, r->n_tokens - from);
        run->computed_prompt[i] = r->generated == 0;
        if (count > 1 || r->generated == 0) prefill_tokens += count;
        for (int p = from; p < from + count; p++, T++) {
            run->ids[T] = r->tokens[p];
            run->caches[T] = &r->cache;
        }
        if (from + count == r->n_tokens) {
            run->logit_tokens[run->n_sampling] = T - 1;
            run->sampling[run->n_sampling++] = i;
        }
    }
    /* a step in which every sequence is still inside its prompt samples nothing, but a pass
     * computes at least one row of logits */
    if (run->n_sampling == 0) run->logit_tokens[0] = T - 1;
    const Batch batch = {T, run->ids, run->caches, run->n_sampling ? run->n_sampling : 1, run->logit_tokens};
    const int rc = model_forward_batch(sch->model, sch->state, &batch, sch->form, sch->logits);
    if (rc != 0) return rc;
    return sample_and_retire(run, step, T, prefill_tokens, now_ms() - t0);
}

/* One step without the cache: each running sequence recomputed alone over its whole
 * length; its blocks are free again right after. */
static int step_uncached(Run *run, int step) {
    Scheduler *sch = run->sch;
    const double t0 = now_ms();
    while (run->n_running < sch->max_batch && !queue_empty(&run->queue)) {
        Request *r = queue_front(&run->queue);
        queue_pop(&run->queue);
        r->admitted = ++run->admissions;
        run->running[run->n_running++] = r;
    }
    int T = 0, prefill_tokens = 0;
    for (int i = 0; i < run->n_running; i++) {
        Request *r = run->running[i];
        float *row = sch->logits + (size_t)i * sch->model->cfg.vocab_size;
        kv_reset(&r->cache);
        const int rc = model_forward(sch->model, sch->state, &r->cache, r->tokens, r->n_tokens, sch->form, row, 0);
        kv_reset(&r->cache);
        if (rc != 0) return rc;
        run->computed_prompt[i] = r->generated == 0;
        if (r->generated == 0) prefill_tokens += r->n_tokens;
        T += r->n_tokens;
        run->sampling[i] = i;
    }
    run->n_sampling = run->n_running;
    return sample_and_retire(run, step, T, prefill_tokens, now_ms() - t0);
}

int scheduler_run(Scheduler *sch) {
    const Config *c = &sch->model->cfg;
    if (sch->max_batch < 1 || sch->pool->n_blocks < kv_blocks_per_sequence(sch->pool, c->max_seq_len) ||
        sch->state->max_tokens < scheduler_max_tokens(c, sch->max_batch))
        return -1;
    Run run = {.sch = sch};
    run.queue.slot = malloc(2 * (size_t)(sch->n_requests ? sch->n_requests : 1) * sizeof *run.queue.slot);
    run.running = malloc((size_t)sch->max_batch * sizeof *run.running);
    run.ids = malloc((size_t)sch->state->max_tokens * sizeof *run.ids);
    run.caches = malloc((size_t)sch->state->max_tokens * sizeof *run.caches);
    run.logit_tokens = malloc((size_t)sch->max_batch * sizeof *run.logit_tokens);
    run.computed_prompt = malloc((size_t)sch->max_batch * sizeof *run.computed_prompt);
    run.sampling = malloc((size_t)sch->max_batch * sizeof *run.sampling);
    int rc = run.queue.slot && run.running && run.ids && run.caches && run.logit_tokens && run.computed_prompt &&
                     run.sampling ? 0 : -1;
    for (int i = 0; rc == 0 && i < sch->n_requests; i++) {
        Request *r = &sch->requests[i];
        r->n_tokens = r->n_prompt;
        r->generated = 0;
        r->stop = STOP_NONE;
        r->admitted = 0;
        r->first_token_ms = r->prefill_ms = r->decode_ms = 0.0;
        if (r->cap_tokens < r->n_prompt + 1) rc = -1;
        r->decode_steps = r->preemptions = 0;
        if (sampler_init(&r->sampler, c->vocab_size, sch->top_k, sch->top_p, sch->temperature, r->seed) != 0 ||
            kv_init(&r->cache, sch->pool, sch->pool->window ? INT32_MAX / 2 : c->max_seq_len) != 0)
            rc = -1;
    }
    if (rc == 0) {
        run.queue.head = run.queue.tail = sch->n_requests;
        for (int i = 0; i < sch->n_requests; i++) run.queue.slot[run.queue.tail++] = &sch->requests[i];
        sch->steps = sch->preemptions = 0;
        run.start = now_ms();
        while (rc == 0 && (run.n_running > 0 || !queue_empty(&run.queue)) && !(sch->stop && *sch->stop)) {
            rc = sch->kv ? step_cached(&run, sch->steps) : step_uncached(&run, sch->steps);
            sch->steps++;
        }
        sch->total_ms = now_ms() - run.start;
    }
    free(run.queue.slot);
    free(run.running);
    free(run.ids);
    free(run.caches);
    free(run.logit_tokens);
    free(run.computed_prompt);
    free(run.sampling);
    return rc;
}

void scheduler_free_requests(Scheduler *sch) {
    for (int i = 0; i < sch->n_requests; i++) {
        sampler_free(&sch->requests[i].sampler);
        kv_free(&sch->requests[i].cache);
    }
}
