/* scheduler.c: continuous batching over the paged KV cache, a step at a time (scheduler.h). */
#include "serve/scheduler.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/timer.h"
#include "serve/draft.h"

struct SchedulerRun {
    Scheduler *sch;
    RunState state;    /* the model's scratch: scheduler_max_tokens and each slot's drafts */
    int prompt_budget; /* prompt tokens a pass computes: the context, at most SCHEDULER_PASS_TOKENS */
    Team *team;
    Request *queue, *queue_tail; /* waiting, in order; a preempted one goes back to the front */
    Request **running;           /* (max_batch) in the order of admission */
    int n_running;
    int *computed_prompt; /* (max_batch) 1 when the step computes that sequence's prompt */
    int n_tokens;         /* the step's tokens through the passes */
    int prefill_tokens;   /* of them, prompt tokens (or a preempted sequence's recompute) */
    /* the step's passes: pass p runs running[pass_first[p] .. pass_first[p + 1]) */
    int n_passes;
    int *pass_first;   /* (max_batch + 1) */
    int *ids;          /* (max_tokens) the pass's tokens */
    KVCache **caches;  /* (max_tokens) */
    int *logit_tokens; /* (max_tokens) */
    int *record_sequence; /* (max_tokens) the request index a token is recorded under, or -1 */
    int passes, logit_rows;
    long keys_read, sequence_keys;
    Batch batch;       /* the pass being run */
    int row0;          /* its first row of logits */
    /* what the step reports */
    StepRow *rows; /* (max_tokens) */
    int n_rows;
    float *logits;    /* (max_tokens, vocab_size) */
    int *sample_rows; /* (max_batch) each sampled sequence's first row: its drafts' rows follow */
    int *sample_slots; /* (max_batch) and its slot */
    int *drafts;      /* (max_batch * draft_k) the step's draft tokens, draft_k a slot */
    int n_sample;
    float *scratch;   /* (threads, 3 * vocab_size) speculative sampling's p, residual and a point mass */
    /* the draft model's passes (draft_model), draft_k a step */
    RunState draft_state;
    Batch draft_batch;
    int *draft_ids, *draft_logit_tokens; /* (max_tokens) */
    KVCache **draft_caches;              /* (max_tokens) */
    float *draft_logits; /* (max_batch, vocab_size) a pass's rows, one a drafting sequence */
    int *draft_slots;    /* (max_batch) the slot of each row */
    int n_draft_rows;
    int draft_catch_up;  /* the pass laid out leaves a sequence's draft cache short of its tokens */
    int *n_drafts;       /* (max_batch) the draft tokens of each slot this step */
    float *q;            /* (max_batch * draft_k, vocab_size) sampling: the distribution each draft
                          * token was drawn from, for the target's acceptance test */
    double draft_ms;     /* this step's drafting: the draft model's passes and draws, or prompt lookup */
    Request **finished; /* (max_batch) */
    int rc;             /* of the step's passes: 0, or model.h's error */
    int rc_in_draft;    /* rc came from the draft model's passes */
    int more;           /* the group being run has another pass (without the cache) */
    double fill_ms;     /* this step's admissions spent generating --fill entries */
    double start;       /* the first step's start */
    int evicts;         /* the window gives up positions by attention (kvcache.h's KVEvict) */
    AttnRecord paid;    /* then every token's attention weights, each pass */
    long short_steps_before; /* the team's short steps before scheduler_restart_figures */
};

static int min_int(int a, int b) { return a < b ? a : b; }

/* Prompt tokens a pass computes: the context, at most SCHEDULER_PASS_TOKENS. */
static int pass_tokens(const Config *c) { return min_int(c->max_seq_len, SCHEDULER_PASS_TOKENS); }

/* ---- the queue ---- */

static void queue_push_back(SchedulerRun *run, Request *r) {
    r->next = NULL;
    if (run->queue_tail)
        run->queue_tail->next = r;
    else
        run->queue = r;
    run->queue_tail = r;
}

static void queue_push_front(SchedulerRun *run, Request *r) {
    r->next = run->queue;
    run->queue = r;
    if (!run->queue_tail) run->queue_tail = r;
}

static void queue_pop(SchedulerRun *run) {
    run->queue = run->queue->next;
    if (!run->queue) run->queue_tail = NULL;
}

/* ---- admission, preemption, retirement ---- */

/* The tokens a and b begin with alike. */
static int common_prefix(const Request *a, const Request *b) {
    const int n = min_int(a->n_tokens, b->n_tokens);
    int i = 0;
    while (i < n && a->tokens[i] == b->tokens[i]) i++;
    return i;
}

/* Blocks the running sequences' next tokens take from the pool. */
static int blocks_for_running(const SchedulerRun *run) {
    int need = 0;
    for (int i = 0; i < run->n_running; i++)
        need += kv_blocks_needed(&run->running[i]->live->cache, run->running[i]->n_tokens);
    return need;
}

/* q, computed this step, goes on after it: it does not sample its last token now. */
static int outlives_step(const Scheduler *sch, const Request *q) {
    return !q->score && !(sch->max_new && q->generated + 1 >= sch->max_new);
}

/* A request's sampler and block table, made when it is first admitted. */
static int start_request(const Scheduler *sch, Request *r) {
    if (r->live) return 0;
    const int max_len = kv_rotates_by_place(sch->pool) ? INT32_MAX / 2 : sch->model->cfg.max_seq_len;
    RequestLive *live = calloc(1, sizeof *live);
    if (!live) return -1;
    const int vocab = sch->model->cfg.vocab_size;
    if (sampler_init(&live->sampler, vocab, sch->top_k, sch->top_p, sch->temperature, r->seed) != 0) {
        free(live);
        return -1;
    }
    if (kv_init(&live->cache, sch->pool, max_len) != 0) {
        sampler_free(&live->sampler);
        free(live);
        return -1;
    }
    if (sch->draft_model && kv_init(&live->draft_cache, sch->draft_pool, sch->draft_model->cfg.max_seq_len) != 0) {
        sampler_free(&live->sampler);
        kv_free(&live->cache);
        free(live);
        return -1;
    }
    r->live = live;
    return 0;
}

static void end_request(const Scheduler *sch, Request *r) {
    if (r->live->swapped.n_blocks) kv_swap_drop(sch->pool->tier, &r->live->swapped);
    if (sch->pool->stream) kv_stream_drop(sch->pool->stream, &r->live->cache);
    sampler_free(&r->live->sampler);
    kv_free(&r->live->cache);
    if (sch->draft_model) kv_free(&r->live->draft_cache);
    free(r->live);
    r->live = NULL;
}

/* A swap that failed leaves the sequence to be recomputed, which gives the same bits: a
 * warning, the first time, and the run goes on. */
static void swap_failed(Scheduler *sch, const char *what) {
    if (!sch->swap_failures++)
        fprintf(stderr, "run: warning: %s the KV tier failed (%s); the sequence is recomputed instead\n", what,
                strerror(errno));
}

/* Reserves r's positions up to new_len; where the pool is short and the sequence streams
 * (kvtier.h), its oldest blocks go to the tier first. Returns 0; -1 when it does not fit;
 * MODEL_ERR_TIER when a write to the tier failed (errno in sch->tier_errno). */
static int reserve_streaming(Scheduler *sch, Request *r, int new_len) {
    while (kv_reserve(&r->live->cache, new_len) != 0) {
        const int short_by = kv_blocks_needed(&r->live->cache, new_len) - sch->pool->n_free;
        const int moved = sch->pool->stream ? kv_stream_spill(sch->pool->stream, &r->live->cache, short_by) : 0;
        if (moved < 0) {
            sch->tier_errno = errno;
            return MODEL_ERR_TIER;
        }
        if (moved == 0) return -1;
    }
    return 0;
}

/* Admits waiting requests into free slots while the pool and the step's prompt budget
 * allow. With the cache, a request shares the longest prefix another running sequence's
 * cache holds (all but its last token at most: that one's logits are needed); it waits a
 * step instead, once, when a sequence computed in this step will hold at least half of it
 * more and goes on after the step. Returns -1 when out of memory. */
static int admit(SchedulerRun *run) {
    Scheduler *sch = run->sch;
    const int first_new = run->n_running;
    int budget = run->prompt_budget; /* prompt tokens computed in one step */
    while (run->n_running < sch->max_batch && run->queue) {
        Request *r = run->queue;
        Request *source = NULL;
        int shared = 0, pending = 0;
        /* a window's slots are never shared, a scored request computes all its positions, and
         * generated entries are each sequence's own */
        const int swapped = r->live ? r->live->swapped.len : 0; /* positions it gets back from the tier */
        for (int i = 0; i < run->n_running && sch->kv && !sch->pool->window && !r->score && !sch->fill && !swapped;
             i++) {
            Request *q = run->running[i];
            const int common = min_int(common_prefix(r, q), r->n_tokens - 1);
            if (i >= first_new) { /* computed this step */
                if (outlives_step(sch, q) && common > pending) pending = common;
            } else if (min_int(common, q->live->cache.len) > shared) {
                shared = min_int(common, q->live->cache.len), source = q;
            }
        }
        if (dtype_packed(sch->pool->dtype)) shared -= shared % KV_BLOCK_TOKENS; /* int4, int2: whole blocks (kvcache.h) */
        /* waiting one step for a prompt being computed now saves at least half of this one
         * (and more than BOS) */
        if (!r->waited && pending > shared && pending >= 2 && 2 * (pending - shared) >= r->n_tokens) {
            r->waited = 1;
            break;
        }
        const int compute = r->n_tokens - (swapped ? swapped : shared + sch->fill); /* a fill is not computed */
        if (sch->kv && run->n_running > first_new && compute > budget) break;
        if (start_request(sch, r) != 0) return -1;
        if (source) kv_share_prefix(&r->live->cache, &source->live->cache, shared);
        /* a sequence that streams is alone: it makes room by spilling its oldest blocks */
        if (sch->kv && !sch->pool->stream &&
            kv_blocks_needed(&r->live->cache, r->n_tokens) - r->live->swapped.n_kept + blocks_for_running(run) >
                sch->pool->n_free) {
            kv_reset(&r->live->cache);
            break;
        }
        if (swapped && kv_swap_in(&r->live->cache, sch->pool->tier, &r->live->swapped) != 0)
            swap_failed(sch, "reading a preempted sequence's blocks from");
        if (sch->fill && r->live->cache.len == 0) {
            const double t0 = now_ms();
            /* a block at a time, so that a streamed cache spills the ones filled already */
            for (int to = 0; to < sch->fill;) {
                to = min_int(sch->fill, to + KV_BLOCK_TOKENS);
                const int rc = reserve_streaming(sch, r, to); /* counted in the blocks needed */
                if (rc != 0) return rc;
                if (kv_fill_generated(&r->live->cache, to, r->seed) != 0) return -1;
            }
            run->fill_ms += now_ms() - t0;
        }
        queue_pop(run);
        run->running[run->n_running++] = r;
        budget -= compute;
    }
    return 0;
}

static void remove_running(SchedulerRun *run, int i) {
    memmove(run->running + i, run->running + i + 1, (size_t)(run->n_running - i - 1) * sizeof *run->running);
    run->n_running--;
}

/* --preempt's default: swap r when writing its blocks and reading them back, at the
 * tier's own pace so far (its writes' and reads' time a block), takes less than
 * recomputing its positions at the prefill's pace so far; until both are measured, swap
 * (the first swap measures the tier). The recompute's pace is the prefill's of shorter
 * prompts, so long contexts, whose attention costs more a token, lean to swap the more. */
static int swap_pays(const Scheduler *sch, const Request *r) {
    const KVTier *t = sch->pool->tier;
    const long blocks = t->blocks_written + t->blocks_read;
    if (blocks == 0 || sch->prefill_tokens == 0) return 1;
    const double swap_ms = 2.0 * kv_blocks_for(r->live->cache.len) * (t->wait_ms / (double)blocks);
    return swap_ms < r->live->cache.len * (sch->prefill_ms / (double)sch->prefill_tokens);
}

/* The draft tokens r may take this step: drafts follow a decoding sequence's last token (its
 * cache holds the rest) while the context has room for them; 0 without speculation. */
static int draft_room(const Scheduler *sch, const Request *r) {
    if (!sch->draft_k || r->live->cache.len != r->n_tokens - 1 || r->generated == 0 || r->score) return 0;
    return min_int(sch->draft_k, sch->model->cfg.max_seq_len - r->n_tokens);
}

/* Reserves every running sequence's positions, preempting the latest admitted while the
 * pool is short. Returns 0, -1 when even one sequence alone does not fit, or with a
 * streamed cache reserve_streaming's error. */
static int reserve_or_preempt(SchedulerRun *run) {
    /* a streamed sequence (alone) spills for its drafts' room as for its own tokens, so that a
     * cache larger than the pool still drafts */
    if (run->sch->pool->stream && run->n_running == 1) {
        Request *r = run->running[0];
        const int room = draft_room(run->sch, r);
        if (room > 0 && reserve_streaming(run->sch, r, r->n_tokens + room) == MODEL_ERR_TIER) return MODEL_ERR_TIER;
    }
    for (int i = 0; i < run->n_running; i++) {
        Request *r = run->running[i];
        while (kv_reserve(&r->live->cache, r->n_tokens) != 0) {
            if (run->n_running == 1) /* alone: a streamed prompt comes a pool's worth a step */
                return reserve_streaming(run->sch, r, min_int(r->n_tokens, r->live->cache.len + run->prompt_budget));
            Request *victim = run->running[run->n_running - 1]; /* running is in admission order */
            if (!run->sch->pool->tier)
                kv_reset(&victim->live->cache);
            else if (run->sch->preempt_rule && !swap_pays(run->sch, victim))
                kv_reset(&victim->live->cache), run->sch->rule_recomputes++;
            else if (kv_swap_out(&victim->live->cache, run->sch->pool->tier, &victim->live->swapped) == 0)
                run->sch->swaps++;
            else
                swap_failed(run->sch, "writing a preempted sequence's blocks to");
            if (run->sch->draft_model) kv_reset(&victim->live->draft_cache); /* rebuilt from its tokens */
            victim->preemptions++;
            run->sch->preemptions++;
            queue_push_front(run, victim);
            run->n_running--;
            if (victim == r) break;
        }
    }
    return 0;
}

/* ---- the passes of a step ---- */

/* Lays out the next pass of group p: with the cache, every running sequence's new tokens
 * (with a window, at most what it takes without sliding); without, each of the group's
 * sequences whole, on a cache emptied before the group. Prompt tokens (more than one a
 * sequence) take at most prompt_budget in all; the rest of a prompt comes in the next
 * pass, or with the cache the next step. A row of logits for each sequence that samples,
 * and for each scored position. Counts the step's tokens and its prompt tokens as it goes.
 * Returns 1 while the group has tokens left to compute (without the cache). */
static int lay_out_pass(SchedulerRun *run, int p) {
    const Scheduler *sch = run->sch;
    int T = 0, n_logits = 0, budget = run->prompt_budget, left = 0;
    run->row0 = run->n_rows;
    for (int i = run->pass_first[p]; i < run->pass_first[p + 1]; i++) {
        Request *r = run->running[i];
        const int from = r->live->cache.len, want = kv_tokens_per_pass(&r->live->cache, r->n_tokens - from);
        const int count = want > 1 ? min_int(want, budget) : want;
        /* a decoding sequence's drafts follow its last token, if the context and the pool
         * have room for them (kv_reserve changes nothing when it has not) */
        int *draft = run->drafts + (size_t)i * sch->draft_k, d = 0;
        const int room = draft_room(sch, r);
        if (room > 0) {
            const double t0 = now_ms();
            d = sch->draft_model   ? run->n_drafts[i]
                : sch->draft_table ? draft_table(sch->draft_table, r->tokens, r->n_tokens, room, draft)
                                   : draft_ngram(r->tokens, r->n_tokens, room, draft);
            if (!sch->draft_model) run->draft_ms += now_ms() - t0;
            if (d > 0 && kv_reserve(&r->live->cache, r->n_tokens + d) != 0) d = 0, run->sch->drafts_without_room++;
        }
        r->drafted = d;
        if (count > 1) budget -= count;
        left |= from + count < r->n_tokens;
        run->computed_prompt[i] = r->generated == 0;
        if (r->generated == 0 || (sch->kv && count > 1)) run->prefill_tokens += count; /* prompt, or a recompute */
        run->n_tokens += count;
        if (count > 0) run->sequence_keys += kv_keys_seen(&r->live->cache, from + count - 1);
        for (int pos = from; pos < from + count; pos++, T++) {
            run->ids[T] = r->tokens[pos];
            run->caches[T] = &r->live->cache;
            run->keys_read += kv_keys_seen(&r->live->cache, pos);
            /* a prompt's positions and each new token, once: not a recompute */
            run->record_sequence[T] =
                run->evicts || (sch->record_step && (r->generated == 0 || pos + 1 == r->n_tokens)) ? r->index : -1;
            if (r->score || (pos + 1 == r->n_tokens)) {
                if (!r->score) run->sample_slots[run->n_sample] = i, run->sample_rows[run->n_sample++] = run->n_rows;
                run->rows[run->n_rows++] = (StepRow){r, pos, -1, d ? draft[0] : -1};
                run->logit_tokens[n_logits++] = T;
            }
        }
        for (int j = 0; j < d; j++, T++) { /* the drafts, a row of logits each */
            run->ids[T] = draft[j];
            run->caches[T] = &r->live->cache;
            run->keys_read += kv_keys_seen(&r->live->cache, from + count + j);
            run->record_sequence[T] = -1;
            run->rows[run->n_rows++] = (StepRow){r, from + count + j, -1, j + 1 < d ? draft[j + 1] : -1};
            run->logit_tokens[n_logits++] = T;
        }
        run->n_tokens += d;
        if (d > 0)
            run->sequence_keys +=
                kv_keys_seen(&r->live->cache, from + count + d - 1) - kv_keys_seen(&r->live->cache, from + count - 1);
    }
    /* a pass in which every sequence is still inside its prompt reports nothing, but
     * computes at least one row of logits */
    run->batch = (Batch){T,
                         run->ids,
                         run->caches,
                         n_logits ? n_logits : 1,
                         run->logit_tokens,
                         (sch->record && sch->record_step) || run->evicts ? run->record_sequence : NULL};
    if (!n_logits) run->logit_tokens[0] = T - 1;
    run->passes++;
    run->logit_rows += run->batch.n_logits;
    return !sch->kv && left;
}

/* A window that evicts by attention: what each token of the pass paid every position its
 * cache keeps, over every layer and head, added to the cache's scores token by token (in
 * that order, so the scores do not depend on how the tokens were grouped into passes). */
static void pay_attention(SchedulerRun *run) {
    const Config *c = &run->sch->model->cfg;
    const AttnRecord *rec = &run->paid;
    const Batch *b = &run->batch;
    for (int t = 0; t < b->n_tokens; t++)
        for (int l = 0; l < c->n_layers; l++)
            for (int h = 0; h < c->n_heads; h++) {
                const int e = rec->slot[((size_t)l * b->n_tokens + t) * c->n_heads + h];
                if (e < 0) continue;
                const AttnRecordEntry *en = &rec->entries[e];
                kv_attend(b->cache[t], en->pos, rec->probs + en->offset, en->n_keys);
            }
}

/* Groups the running sequences: with the cache, all in one pass; without, whole sequences
 * while a pass's tokens and rows and the pool's blocks allow (a sequence longer than a
 * pass alone, in several). */
static void plan_passes(SchedulerRun *run) {
    const Scheduler *sch = run->sch;
    run->n_passes = 0;
    int tokens = 0, blocks = 0, rows = 0;
    for (int i = 0; i < run->n_running; i++) {
        const Request *r = run->running[i];
        const int t = r->n_tokens, b = kv_blocks_for(t), w = r->score ? t : 1;
        if (i == 0 || (!sch->kv && (tokens + t > run->prompt_budget || blocks + b > sch->pool->n_blocks ||
                                    rows + w > run->prompt_budget))) {
            run->pass_first[run->n_passes++] = i;
            tokens = blocks = rows = 0;
        }
        tokens += t, blocks += b, rows += w;
    }
    run->pass_first[run->n_passes] = run->n_running;
}

/* Lays out the draft model's pass j of the step (thread 0). Pass 0 brings each drafting
 * sequence's draft cache up to its tokens (its last one at least; after its prompt, or a
 * preemption, all it has not seen), in as many passes as the tokens take, a pass holding
 * one token of each sequence and up to the context (at most SCHEDULER_PASS_TOKENS) more,
 * first come first served: a sequence's row of logits comes in the pass that takes its last
 * token, so who drafts never depends on the others in the batch. Pass j > 0: each drafting
 * sequence's draft token j - 1. A sequence drafts while its positions fit both contexts and
 * the draft's pool has room for them, as the step's first pass (`first`) finds it. Returns
 * the pass's tokens (0: nothing to run). */
static int lay_out_draft_pass(SchedulerRun *run, int j, int first) {
    const Scheduler *sch = run->sch;
    const int K = sch->draft_k, draft_ctx = sch->draft_model->cfg.max_seq_len;
    int T = 0, budget = pass_tokens(&sch->model->cfg);
    run->n_draft_rows = 0;
    run->draft_catch_up = 0;
    for (int i = 0; i < run->n_running; i++) {
        Request *r = run->running[i];
        KVCache *dc = &r->live->draft_cache;
        if (first) {
            const int draft_left = draft_ctx + 1 - r->n_tokens; /* past the draft's context: none */
            int want = min_int(draft_room(sch, r), draft_left > 0 ? draft_left : 0);
            if (want > 0 && kv_reserve(dc, r->n_tokens + want - 1) != 0) want = 0, run->sch->drafts_without_room++;
            run->n_drafts[i] = want;
        }
        if (run->n_drafts[i] <= j) continue;
        if (j == 0) {
            const int unseen = r->n_tokens - dc->len; /* 0 once an earlier catch-up pass took them all */
            const int take = unseen < 1 ? 0 : 1 + min_int(unseen - 1, budget);
            budget -= take > 0 ? take - 1 : 0;
            for (int pos = dc->len; pos < dc->len + take; pos++, T++)
                run->draft_ids[T] = r->tokens[pos], run->draft_caches[T] = dc;
            if (take < unseen) run->draft_catch_up = 1;
            if (take == 0 || take < unseen) continue; /* caught up before, or its row comes later */
        } else {
            run->draft_ids[T] = run->drafts[(size_t)i * K + j - 1], run->draft_caches[T] = dc;
            T++;
        }
        run->draft_slots[run->n_draft_rows] = i;
        run->draft_logit_tokens[run->n_draft_rows++] = T - 1;
    }
    /* a catch-up pass with no sequence's last token samples nothing, but computes a row */
    if (run->n_draft_rows == 0 && T > 0) run->draft_logit_tokens[0] = T - 1;
    run->draft_batch = (Batch){
        T, run->draft_ids, run->draft_caches, run->n_draft_rows ? run->n_draft_rows : 1, run->draft_logit_tokens, NULL};
    return T;
}

/* The draft model's passes of a step, up to draft_k: after each, every drafting sequence
 * draws its next draft token from the pass's row (greedy: the argmax; sampling: from q,
 * its sampler's distribution, kept for the target's acceptance test). */
static void draft_share(SchedulerRun *run, Worker *wk) {
    const Scheduler *sch = run->sch;
    const Model *dm = sch->draft_model;
    const int V = dm->cfg.vocab_size, K = sch->draft_k;
    const double t0 = now_ms();
    for (int j = 0, catch_up = 0; j < K;) {
        /* an error (of this lay-out, or the last pass's model_finish) lays out no tokens: the
         * members stop on the count alone, since thread 0 writes rc again before the next barrier */
        if (team_alone(wk)) {
            if (run->rc == 0 && lay_out_draft_pass(run, j, j == 0 && !catch_up))
                run->rc = model_prepare(dm, &run->draft_state, &run->draft_batch);
            if (run->rc != 0) run->draft_batch.n_tokens = 0;
        }
        team_barrier(wk);
        const int n = run->n_draft_rows;
        catch_up = run->draft_catch_up;
        if (run->draft_batch.n_tokens == 0) break;
        model_forward_pass(dm, &run->draft_state, &run->draft_batch, sch->form, run->draft_logits, wk);
        team_settle(wk); /* thread 0 writes rc, then the next pass's rows */
        if (team_alone(wk)) {
            run->rc = model_finish(dm, &run->draft_state, &run->draft_batch, run->draft_logits);
            run->rc_in_draft = run->rc != 0;
        }
        Share sh = share_begin(wk, n, SHARE_SPLIT, parallel_mode((long)n * V * 4));
        for (long lo, hi; share_next(&sh, &lo, &hi);)
            for (long k = lo; k < hi; k++) {
                const int i = run->draft_slots[k];
                Sampler *s = &run->running[i]->live->sampler;
                const float *logits = run->draft_logits + (size_t)k * V;
                if (!run->q) {
                    run->drafts[(size_t)i * K + j] = sampler_sample(s, logits);
                } else {
                    float *q = run->q + ((size_t)i * K + j) * V;
                    sampler_probs(s, logits, q);
                    run->drafts[(size_t)i * K + j] = sampler_draw(s, q);
                }
            }
        share_end(&sh);
        j += !catch_up;
    }
    if (team_alone(wk)) run->draft_ms += now_ms() - t0;
}

/* Samples the rows of sampled sequence k (on thread `thread`): its last token's, then,
 * while the target keeps the draft token a row was computed on, the row after it. Greedy
 * keeps a draft exactly when it is the argmax; sampling keeps it by sampler_accept's test
 * against q (prompt lookup's q is a point mass at its token), and a rejection draws from
 * the residual, so the tokens follow the target's distribution exactly. */
static void sample_chain(SchedulerRun *run, long k, int thread) {
    const Scheduler *sch = run->sch;
    const int V = sch->model->cfg.vocab_size, K = sch->draft_k, slot = run->sample_slots[k];
    Sampler *s = &run->rows[run->sample_rows[k]].request->live->sampler;
    float *p = run->scratch + (size_t)thread * 3 * V, *residual = p + V, *point = residual + V;
    for (int row = run->sample_rows[k], j = 0;; row++, j++) {
        StepRow *sr = &run->rows[row];
        const float *logits = run->logits + (size_t)row * V;
        if (sr->draft < 0 || s->top_k == 1 || s->temperature == 0.0f) {
            sr->token = sampler_sample(s, logits);
        } else {
            const float *q = run->q ? run->q + ((size_t)slot * K + j) * V : point;
            point[sr->draft] = 1.0f; /* unused with the draft model's q */
            sampler_probs(s, logits, p);
            int accepted;
            sr->token = sampler_accept(s, p, q, sr->draft, residual, &accepted);
            point[sr->draft] = 0.0f;
        }
        if (sr->draft < 0 || sr->token != sr->draft) break;
    }
}

/* Each group's passes (thread 0 lays each out and finishes it, every thread computes it).
 * Returns 0, or -1 after an error. */
static int passes_share(SchedulerRun *run, Worker *wk) {
    const Scheduler *sch = run->sch;
    const int V = sch->model->cfg.vocab_size;
    for (int p = 0; p < run->n_passes; p++) {
        if (team_alone(wk) && !sch->kv)
            for (int i = run->pass_first[p]; i < run->pass_first[p + 1]; i++) kv_reset(&run->running[i]->live->cache);
        for (int more = 1; more;) {
            if (team_alone(wk) && run->rc == 0) { /* an earlier pass's error ends the step */
                run->more = lay_out_pass(run, p);
                run->rc = model_prepare(sch->model, &run->state, &run->batch);
            }
            team_barrier(wk);
            if (run->rc != 0) return -1;
            more = run->more;
            float *logits = run->logits + (size_t)run->row0 * V;
            model_forward_pass(sch->model, &run->state, &run->batch, sch->form, logits, wk);
            /* thread 0 goes on to write rc, more and the next pass's batch, which a member
             * still in this pass reads */
            team_settle(wk);
            if (team_alone(wk)) run->rc = model_finish(sch->model, &run->state, &run->batch, logits);
            if (team_alone(wk) && run->rc == 0 && run->evicts) pay_attention(run);
        }
        if (team_alone(wk) && !sch->kv)
            for (int i = run->pass_first[p]; i < run->pass_first[p + 1]; i++) kv_reset(&run->running[i]->live->cache);
    }
    return 0;
}

/* A step as thread wk->thread of the team runs it: the draft model's passes, the model's,
 * then every thread samples its share of the sequences (rows whose pass failed in
 * model_finish too: the step returns the error, and no thread but 0 could know of it). */
static void step_share(SchedulerRun *run, Worker *wk) {
    const Scheduler *sch = run->sch;
    if (sch->draft_model) draft_share(run, wk);
    const int S = passes_share(run, wk) == 0 ? run->n_sample : 0; /* as the last pass laid them out */
    if (S > 0) {
        stage_begin(sch->clock, wk);
        Share sh = share_begin(wk, S, SHARE_SPLIT, parallel_mode((long)S * sch->model->cfg.vocab_size * 4));
        for (long lo, hi; share_next(&sh, &lo, &hi);)
            for (long k = lo; k < hi; k++) sample_chain(run, k, wk->thread);
        share_end(&sh);
        stage_end(sch->clock, wk, pass_stage_slot(&sch->model->cfg, PASS_STAGE_SAMPLING));
    }
    /* the step ends together: past here thread 0 plans and lays out the next one, and a
     * member still reading this one's plan (its count of passes, its clock) would race it */
    team_barrier(wk);
}

/* The team's threads 1..: a step each time thread 0 posts one. */
static void team_member(void *arg, Worker *wk) {
    SchedulerRun *run = arg;
    while (team_wait(wk)) step_share(run, wk);
}

/* ---- the step ---- */

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

/* After the passes, on thread 0: the sampled tokens kept, the step's time charged to each
 * sequence, and those that end leave their slot. */
static int retire(SchedulerRun *run, StepResult *out, double step_ms) {
    Scheduler *sch = run->sch;
    const Config *c = &sch->model->cfg;
    const double elapsed = now_ms() - run->start;
    for (int i = 0; i < run->n_running; i++) {
        Request *r = run->running[i];
        if (run->computed_prompt[i])
            r->prefill_ms += step_ms;
        else
            r->decode_ms += step_ms, r->decode_steps++;
    }
    /* speculation: a sequence's rows after its first draft token the target disagrees
     * with (or after its end) were computed on a wrong token; they are dropped, the rows
     * and logits that stay moved up in order */
    const int V = c->vocab_size;
    int kept = 0;
    Request *dropping = NULL;
    for (int k = 0; k < run->n_rows; k++) {
        Request *r = run->rows[k].request;
        if (r == dropping || (!r->score && r->stop != STOP_NONE)) continue; /* ended at an earlier row */
        dropping = NULL;
        if (kept != k) {
            run->rows[kept] = run->rows[k];
            memmove(run->logits + (size_t)kept * V, run->logits + (size_t)k * V, (size_t)V * sizeof(float));
        }
        kept++;
        if (r->score) {
            if (!sch->kv || r->live->cache.len == r->n_tokens) r->stop = STOP_STEPS; /* all of it computed */
            continue;
        }
        const int next = run->rows[k].token;
        if (r->generated++ == 0) r->first_token_ms = elapsed;
        if (next == c->eos_id && !sch->ignore_eos) {
            r->stop = STOP_EOS;
            continue;
        }
        if (append_token(r, next) != 0) return -1;
        if (sch->max_new && r->generated >= sch->max_new)
            r->stop = STOP_STEPS;
        else if (r->n_tokens > c->max_seq_len && (!kv_rotates_by_place(sch->pool) || !sch->max_new))
            r->stop = STOP_CONTEXT; /* no position left for it; a ring goes past only as far as -n says */
        /* the next row was computed on this row's draft: kept only if the target sampled it
         * and the sequence goes on (an EOS above ended it, and its later rows with it) */
        if (run->rows[k].draft >= 0) {
            if (r->stop == STOP_NONE && next == run->rows[k].draft)
                sch->accepted++;
            else
                dropping = r;
        }
    }
    run->n_rows = kept;
    /* the cache holds every token but the last: the rejected drafts' positions go */
    for (int i = 0; i < run->n_running; i++) {
        Request *r = run->running[i];
        if (sch->draft_model && r->live->draft_cache.len > r->n_tokens - 1)
            kv_truncate(&r->live->draft_cache, r->n_tokens - 1);
        if (!r->drafted) continue;
        sch->drafted += r->drafted;
        sch->verify_passes++;
        if (r->live->cache.len > r->n_tokens - 1) kv_truncate(&r->live->cache, r->n_tokens - 1);
    }
    out->n_finished = 0;
    for (int i = 0; i < run->n_running;) {
        Request *r = run->running[i];
        if (r->stop == STOP_NONE) {
            i++;
            continue;
        }
        end_request(sch, r);
        remove_running(run, i);
        run->finished[out->n_finished++] = r;
    }
    return 0;
}

int scheduler_step(Scheduler *sch, StepResult *out) {
    SchedulerRun *run = sch->run;
    const double t0 = now_ms();
    if (sch->steps == 0) run->start = t0;
    run->fill_ms = run->draft_ms = 0.0;
    int rc = admit(run);
    if (rc != 0) return rc == MODEL_ERR_TIER ? rc : -1;
    if (run->n_running == 0) return run->queue ? -1 : 0;
    if (sch->kv && (rc = reserve_or_preempt(run)) != 0) return rc == MODEL_ERR_TIER ? rc : -1;
    run->n_rows = run->n_sample = run->n_tokens = run->prefill_tokens = 0;
    run->passes = run->logit_rows = 0;
    run->keys_read = run->sequence_keys = 0;
    run->state.attn.clock = sch->clock;
    run->state.attn.record = sch->record ? sch->record : run->evicts ? &run->paid : NULL;
    if (run->state.attn.record) attn_record_clear(run->state.attn.record);
    plan_passes(run);
    run->rc = run->rc_in_draft = 0;
    Worker alone = worker_alone(), *leader = run->team ? team_leader(run->team) : &alone;
    if (run->team && sch->clock) team_time_barriers(run->team);
    if (run->team) team_post(run->team);
    /* thread 0's share; once it returns the members are done with the step too (its last
     * barrier) */
    step_share(run, leader);
    if (run->team) sch->short_team_steps = team_short_steps(run->team) - run->short_steps_before;
    if (run->rc == MODEL_ERR_TIER) sch->tier_errno = sch->pool->stream->err;
    sch->failed_in_draft = run->rc_in_draft;
    if (run->rc != 0) return run->rc == MODEL_ERR_NONFINITE || run->rc == MODEL_ERR_TIER ? run->rc : -1;
    /* generated entries stand for a prefill that never ran: no step's time */
    const double step_ms = now_ms() - t0 - run->fill_ms;
    sch->fill_ms += run->fill_ms;
    sch->draft_ms += run->draft_ms;
    run->start += run->fill_ms;
    if (run->prefill_tokens && run->prefill_tokens == run->n_tokens)
        sch->prefill_ms += step_ms, sch->prefill_tokens += run->prefill_tokens;
    const int sequences = run->n_sample, running = run->n_running;
    if (retire(run, out, step_ms) != 0) return -1;
    out->running = running;
    out->step = sch->steps++;
    out->sequences = sequences;
    out->n_tokens = run->n_tokens;
    out->prefill_tokens = run->prefill_tokens;
    out->ms = step_ms;
    out->n_rows = run->n_rows;
    out->rows = run->rows;
    out->logits = run->logits;
    out->finished = run->finished;
    out->passes = run->passes;
    out->logit_rows = run->logit_rows;
    out->keys_read = run->keys_read;
    out->sequence_keys = run->sequence_keys;
    sch->total_ms = now_ms() - run->start;
    return 1;
}

/* ---- setting up ---- */

int scheduler_max_tokens(const Config *c, int max_batch) { return pass_tokens(c) + max_batch; }

static void zero_figures(Scheduler *sch) {
    sch->steps = sch->preemptions = sch->swaps = sch->swap_failures = sch->rule_recomputes = 0;
    sch->short_team_steps = 0;
    sch->total_ms = sch->fill_ms = 0.0;
    sch->drafted = sch->accepted = sch->verify_passes = sch->drafts_without_room = 0;
    sch->draft_ms = 0.0;
}

void scheduler_restart_figures(Scheduler *sch) {
    zero_figures(sch);
    if (sch->run->team) sch->run->short_steps_before = team_short_steps(sch->run->team);
}

int scheduler_init(Scheduler *sch) {
    const Config *c = &sch->model->cfg;
    sch->run = NULL;
    zero_figures(sch);
    sch->prefill_ms = 0.0, sch->prefill_tokens = 0;
    if (sch->max_batch < 1 ||
        (!sch->pool->stream && sch->pool->n_blocks < kv_blocks_per_sequence(sch->pool, c->max_seq_len)))
        return -1;
    SchedulerRun *run = calloc(1, sizeof *run);
    if (!run) return -1;
    run->sch = sch;
    sch->run = run;
    run->prompt_budget = pass_tokens(c);
    /* a streamed sequence's pass writes into the pool alone: what it holds, less the block in part written */
    if (sch->pool->stream) run->prompt_budget = min_int(run->prompt_budget, (sch->pool->n_blocks - 1) * KV_BLOCK_TOKENS);
    run->evicts = sch->kv && kv_evicts_by_attention(sch->pool);
    const int B = sch->max_batch, T = scheduler_max_tokens(c, B) + B * sch->draft_k;
    run->running = malloc((size_t)B * sizeof *run->running);
    run->computed_prompt = malloc((size_t)B * sizeof *run->computed_prompt);
    run->pass_first = malloc((size_t)(B + 1) * sizeof *run->pass_first);
    run->ids = malloc((size_t)T * sizeof *run->ids);
    run->caches = malloc((size_t)T * sizeof *run->caches);
    run->logit_tokens = malloc((size_t)T * sizeof *run->logit_tokens);
    run->record_sequence = malloc((size_t)T * sizeof *run->record_sequence);
    run->rows = malloc((size_t)T * sizeof *run->rows);
    run->logits = alloc_floats_touched((size_t)T * (size_t)c->vocab_size);
    run->sample_rows = malloc((size_t)B * sizeof *run->sample_rows);
    run->sample_slots = malloc((size_t)B * sizeof *run->sample_slots);
    run->drafts = malloc((size_t)(B * sch->draft_k + 1) * sizeof *run->drafts);
    run->scratch = calloc((size_t)threads_count() * 3 * c->vocab_size, sizeof(float));
    run->finished = malloc((size_t)B * sizeof *run->finished);
    if (!run->running || !run->computed_prompt || !run->pass_first || !run->ids || !run->caches || !run->logit_tokens ||
        !run->record_sequence || !run->rows || !run->logits || !run->sample_rows || !run->sample_slots ||
        !run->drafts || !run->scratch || !run->finished || runstate_init(&run->state, c, T) != 0) {
        scheduler_free(sch);
        return -1;
    }
    if (sch->draft_model) {
        const int sampling = sch->top_k != 1 && sch->temperature != 0.0f;
        run->draft_ids = malloc((size_t)T * sizeof *run->draft_ids);
        run->draft_logit_tokens = malloc((size_t)T * sizeof *run->draft_logit_tokens);
        run->draft_caches = malloc((size_t)T * sizeof *run->draft_caches);
        run->draft_logits = alloc_floats_touched((size_t)B * c->vocab_size);
        run->draft_slots = malloc((size_t)B * sizeof *run->draft_slots);
        run->n_drafts = calloc((size_t)B, sizeof *run->n_drafts);
        if (sampling) run->q = alloc_floats_touched((size_t)B * sch->draft_k * c->vocab_size);
        if (!run->draft_ids || !run->draft_logit_tokens || !run->draft_caches || !run->draft_logits ||
            !run->draft_slots || !run->n_drafts || (sampling && !run->q) ||
            runstate_init(&run->draft_state, &sch->draft_model->cfg, T) != 0) {
            scheduler_free(sch);
            return -1;
        }
    }
    const int threads = threads_count();
    if (threads > 1 && !(run->team = team_open(threads, team_member, run))) {
        scheduler_free(sch);
        return -1;
    }
    if (run->team && !threads_chosen()) team_adapt(run->team, (int)sysconf(_SC_NPROCESSORS_ONLN)); /* a count asked for is kept */
    return 0;
}

/* The fill's positions go before the prompt, as tokens no pass reads (0). */
static int prepend_fill(Request *r, int fill) {
    int *tokens = malloc((size_t)(fill + r->cap_tokens) * sizeof(int));
    if (!tokens) return -1;
    memset(tokens, 0, (size_t)fill * sizeof(int));
    memcpy(tokens + fill, r->tokens, (size_t)r->n_prompt * sizeof(int));
    free(r->tokens);
    r->tokens = tokens;
    r->cap_tokens += fill;
    r->n_prompt += fill;
    return 0;
}

int scheduler_add(Scheduler *sch, Request *r) {
    if (r->score && !sch->kv && r->n_prompt > SCHEDULER_PASS_TOKENS) return -1; /* its rows would overrun a step's */
    if (sch->fill && prepend_fill(r, sch->fill) != 0) return -1;
    r->n_tokens = r->n_prompt;
    r->generated = 0;
    r->stop = STOP_NONE;
    r->live = NULL;
    r->waited = 0;
    r->first_token_ms = r->prefill_ms = r->decode_ms = 0.0;
    r->decode_steps = r->preemptions = 0;
    queue_push_back(sch->run, r);
    return 0;
}

void scheduler_free(Scheduler *sch) {
    SchedulerRun *run = sch->run;
    if (!run) return;
    team_close(run->team);
    for (int i = 0; run->running && i < run->n_running; i++) end_request(sch, run->running[i]);
    for (Request *r = run->queue; r; r = r->next)
        if (r->live) end_request(sch, r);
    runstate_free(&run->state);
    if (sch->draft_model) runstate_free(&run->draft_state);
    free(run->draft_ids);
    free(run->draft_logit_tokens);
    free(run->draft_caches);
    free(run->draft_logits);
    free(run->draft_slots);
    free(run->n_drafts);
    free(run->q);
    free(run->sample_slots);
    free(run->scratch);
    free(run->running);
    free(run->computed_prompt);
    free(run->pass_first);
    free(run->ids);
    free(run->caches);
    free(run->logit_tokens);
    free(run->record_sequence);
    free(run->rows);
    free(run->logits);
    free(run->sample_rows);
    free(run->drafts);
    free(run->finished);
    attn_record_free(&run->paid);
    free(run);
    sch->run = NULL;
}
