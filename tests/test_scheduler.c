/* test_scheduler.c: the scheduler on its own (serve/scheduler.h), on a small random GQA
 * checkpoint: admission into the slots and retirement, a prompt computed once and shared,
 * preemption when the pool runs short (exactly when, and with nothing changed), and the
 * step's rows of logits. Greedy with EOS ignored, so every request's length is known. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "serve/scheduler.h"
#include "testutil.h"

static Model model;

static int setup(void **state) {
    (void)state;
    Config c = test_config(VARIANT_GQA, 0, 320, DTYPE_BF16);
    char err[256];
    SpmTokenizer *tok = spm_load_file(g_tokenizer_path, err, sizeof err);
    if (!tok) return -1;
    c.vocab_size = spm_vocab_size(tok);
    spm_free(tok);
    const char *path = temp_path("sched.bin");
    if (write_test_checkpoint(path, &c, g_tokenizer_path, 77) != 0) return -1;
    return model_load(&model, path, err, sizeof err);
}

static int teardown(void **state) {
    (void)state;
    model_free(&model);
    return 0;
}

/* A request of prompt tokens 1 (BOS), then 3, 4, 5, ... up to n tokens. */
static Request request(int index, int n) {
    Request r = {.index = index, .n_prompt = n, .cap_tokens = n + 1};
    r.tokens = malloc((size_t)r.cap_tokens * sizeof(int));
    r.tokens[0] = 1;
    for (int i = 1; i < n; i++) r.tokens[i] = 2 + i;
    return r;
}

static Scheduler greedy(KVPool *pool, int slots, int max_new) {
    return (Scheduler){.model = &model,
                       .pool = pool,
                       .kv = 1,
                       .form = MLA_ABSORBED,
                       .max_batch = slots,
                       .max_new = max_new,
                       .ignore_eos = 1,
                       .top_k = 1,
                       .top_p = 1.0f,
                       .temperature = 1.0f};
}

/* What a run's steps showed. */
typedef struct {
    int steps, max_running, tokens[8], finished_order[8], n_finished, prefill_tokens[64], step_tokens[64];
} Trace;

static Trace run_all(Scheduler *sch, Request *requests, int n) {
    Trace tr = {0};
    assert_int_equal(scheduler_init(sch), 0);
    for (int i = 0; i < n; i++) scheduler_add(sch, &requests[i]);
    StepResult st;
    int rc;
    while ((rc = scheduler_step(sch, &st)) > 0) {
        assert_true(tr.steps < 64);
        tr.prefill_tokens[tr.steps] = st.prefill_tokens;
        tr.step_tokens[tr.steps] = st.n_tokens;
        tr.steps++;
        if (st.running > tr.max_running) tr.max_running = st.running;
        for (int k = 0; k < st.n_rows; k++) {
            assert_int_equal(st.rows[k].pos, st.rows[k].request->n_tokens - 2); /* the row of its last token */
            tr.tokens[st.rows[k].request->index]++;
        }
        for (int k = 0; k < st.n_finished; k++) tr.finished_order[tr.n_finished++] = st.finished[k]->index;
    }
    assert_int_equal(rc, 0);
    scheduler_free(sch);
    return tr;
}

/* Five requests through two slots: never more than two run, each ends after exactly -n
 * tokens, in the order they came, and its tokens are its run alone. */
static void test_admission_and_retirement(void **state) {
    (void)state;
    KVPool pool;
    assert_int_equal(kv_pool_init(&pool, &model.cfg, DTYPE_F32, 2 * kv_blocks_for(model.cfg.max_seq_len)), 0);
    Request rs[5];
    for (int i = 0; i < 5; i++) rs[i] = request(i, 2 + i);
    Scheduler sch = greedy(&pool, 2, 6);
    const Trace tr = run_all(&sch, rs, 5);
    assert_int_equal(tr.max_running, 2);
    assert_int_equal(tr.n_finished, 5);
    for (int i = 0; i < 5; i++) {
        assert_int_equal(tr.finished_order[i], i);
        assert_int_equal(tr.tokens[i], 6);
        assert_int_equal(rs[i].generated, 6);
        assert_int_equal(rs[i].stop, STOP_STEPS);
        Request alone = request(i, 2 + i);
        Scheduler solo = greedy(&pool, 1, 6);
        run_all(&solo, &alone, 1);
        assert_memory_equal(alone.tokens, rs[i].tokens, (size_t)rs[i].n_tokens * sizeof(int));
        free(alone.tokens);
        free(rs[i].tokens);
    }
    /* 5 requests of 6 tokens, 2 at a time: three rounds of 6 steps */
    assert_int_equal(tr.steps, 18);
    assert_int_equal(kv_blocks_in_use(&pool), 0); /* every block back in the pool */
    kv_pool_free(&pool);
}

/* Three copies of a 40-token prompt: the first step computes it once, the other two wait
 * that step and then share its blocks, computing only their last token. */
static void test_prompt_computed_once_and_shared(void **state) {
    (void)state;
    KVPool pool;
    assert_int_equal(kv_pool_init(&pool, &model.cfg, DTYPE_F32, 3 * kv_blocks_for(model.cfg.max_seq_len)), 0);
    Request rs[3];
    for (int i = 0; i < 3; i++) rs[i] = request(i, 40);
    Scheduler sch = greedy(&pool, 3, 4);
    const Trace tr = run_all(&sch, rs, 3);
    assert_int_equal(tr.step_tokens[0], 40);   /* the prompt, once */
    assert_int_equal(tr.prefill_tokens[1], 2); /* the others' last prompt token each */
    assert_int_equal(tr.step_tokens[1], 3);    /* and the first one's new token */
    /* the two full blocks of the prompt shared three ways, each sequence's third block its own */
    assert_int_equal(pool.peak_in_use, 2 + 3);
    for (int i = 1; i < 3; i++) assert_memory_equal(rs[i].tokens, rs[0].tokens, (size_t)rs[0].n_tokens * sizeof(int));
    for (int i = 0; i < 3; i++) free(rs[i].tokens);
    kv_pool_free(&pool);
}

/* A pool of one full context (4 blocks of 16) for two one-token prompts of 40 new tokens
 * each: both grow together until each holds 2 blocks (32 positions); the first then needs
 * a third, and the second, admitted last, is preempted, exactly once, and recomputed after
 * the first ends. Both end with their solo runs' tokens. Admission that let a sequence in
 * one block short, or preempted the wrong one, changes the count. */
static void test_preemption_exactly_when_the_pool_runs_out(void **state) {
    (void)state;
    KVPool pool;
    const int per_sequence = kv_blocks_for(model.cfg.max_seq_len);
    assert_int_equal(per_sequence, 4);
    assert_int_equal(kv_pool_init(&pool, &model.cfg, DTYPE_F32, per_sequence), 0);
    Request rs[2] = {request(0, 1), request(1, 1)};
    rs[1].tokens[0] = 1;
    Scheduler sch = greedy(&pool, 2, 40);
    const Trace tr = run_all(&sch, rs, 2);
    assert_int_equal(sch.preemptions, 1);
    assert_int_equal(rs[0].preemptions, 0);
    assert_int_equal(rs[1].preemptions, 1);
    assert_int_equal(tr.finished_order[0], 0);
    assert_int_equal(tr.finished_order[1], 1);
    KVPool roomy;
    assert_int_equal(kv_pool_init(&roomy, &model.cfg, DTYPE_F32, per_sequence), 0);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(rs[i].generated, 40);
        Request alone = request(i, 1);
        Scheduler solo = greedy(&roomy, 1, 40);
        run_all(&solo, &alone, 1);
        assert_memory_equal(alone.tokens, rs[i].tokens, (size_t)rs[i].n_tokens * sizeof(int));
        free(alone.tokens);
        free(rs[i].tokens);
    }
    kv_pool_free(&roomy);
    kv_pool_free(&pool);
}

/* Admission waits for room: a one-token request runs in a pool of one full context (4
 * blocks); a prompt of 49 tokens needs all 4 blocks, one more than is free beside it, so it
 * waits until the first request ends, with no preemption. (Admitted one block short, it
 * would be preempted at once, step after step.) */
static void test_admission_waits_for_room(void **state) {
    (void)state;
    KVPool pool;
    assert_int_equal(kv_pool_init(&pool, &model.cfg, DTYPE_F32, kv_blocks_for(model.cfg.max_seq_len)), 0);
    Request rs[2] = {request(0, 1), request(1, 49)};
    Scheduler sch = greedy(&pool, 2, 8);
    const Trace tr = run_all(&sch, rs, 2);
    assert_int_equal(sch.preemptions, 0);
    assert_int_equal(tr.max_running, 1);
    assert_int_equal(tr.steps, 8 + 8);
    assert_int_equal(tr.step_tokens[8], 49); /* its prompt, once the first has ended */
    for (int i = 0; i < 2; i++) free(rs[i].tokens);
    kv_pool_free(&pool);
}

/* A scored request reports a row of logits for every position it computes, and samples
 * nothing. */
static void test_scored_request_reports_every_position(void **state) {
    (void)state;
    KVPool pool;
    assert_int_equal(kv_pool_init(&pool, &model.cfg, DTYPE_F32, kv_blocks_for(model.cfg.max_seq_len)), 0);
    Request r = request(0, 20);
    r.score = 1;
    Scheduler sch = greedy(&pool, 1, 0);
    assert_int_equal(scheduler_init(&sch), 0);
    scheduler_add(&sch, &r);
    StepResult st;
    assert_int_equal(scheduler_step(&sch, &st), 1);
    assert_int_equal(st.n_rows, 20);
    assert_int_equal(st.sequences, 0);
    for (int k = 0; k < 20; k++) {
        assert_int_equal(st.rows[k].pos, k);
        assert_int_equal(st.rows[k].token, -1);
    }
    assert_int_equal(st.n_finished, 1);
    assert_int_equal(r.n_tokens, 20);
    assert_int_equal(scheduler_step(&sch, &st), 0);
    scheduler_free(&sch);
    free(r.tokens);
    kv_pool_free(&pool);
}

/* A model of the same shape with a context of two passes' prompt budgets and more. */
static void load_long_model(Model *m, int context) {
    Config c = model.cfg;
    c.max_seq_len = context;
    char err[256];
    const char *path = temp_path("sched-long.bin");
    assert_int_equal(write_test_checkpoint(path, &c, g_tokenizer_path, 78), 0);
    assert_int_equal(model_load(m, path, err, sizeof err), 0);
}

/* The tokens and the rows of logits a run of one request sampled from, in order. */
typedef struct {
    int steps, step_tokens[16], n_rows;
    float *logits; /* (n_rows, vocab) */
} Rows;

static Rows run_collecting(Scheduler *sch, Request *r) {
    const int V = sch->model->cfg.vocab_size;
    Rows out = {0};
    out.logits = malloc((size_t)(sch->max_new + 1) * V * sizeof(float));
    assert_int_equal(scheduler_init(sch), 0);
    assert_int_equal(scheduler_add(sch, r), 0);
    StepResult st;
    int rc;
    while ((rc = scheduler_step(sch, &st)) > 0) {
        assert_true(out.steps < 16);
        out.step_tokens[out.steps++] = st.n_tokens;
        for (int k = 0; k < st.n_rows; k++)
            memcpy(out.logits + (size_t)out.n_rows++ * V, st.logits + (size_t)k * V, (size_t)V * sizeof(float));
    }
    assert_int_equal(rc, 0);
    scheduler_free(sch);
    return out;
}

/* A prompt longer than two passes' budget: with the cache it takes three steps of at most
 * SCHEDULER_PASS_TOKENS prompt tokens; without, each step recomputes it in three passes.
 * Every row of logits is the same bits either way. */
static void test_long_prompt_in_passes(void **state) {
    (void)state;
    const int P = SCHEDULER_PASS_TOKENS, n = 2 * P + 40;
    Model long_model;
    load_long_model(&long_model, 2 * P + 64);
    KVPool pool;
    assert_int_equal(kv_pool_init(&pool, &long_model.cfg, DTYPE_F32, kv_blocks_for(long_model.cfg.max_seq_len)), 0);
    Rows runs[2];
    Request rs[2];
    for (int kv = 0; kv < 2; kv++) {
        rs[kv] = request(0, n);
        for (int i = 1; i < n; i++) rs[kv].tokens[i] = 3 + (i * 7) % 300;
        Scheduler sch = greedy(&pool, 1, 3);
        sch.model = &long_model;
        sch.kv = kv;
        runs[kv] = run_collecting(&sch, &rs[kv]);
    }
    const int expect_kv[] = {P, P, 40, 1, 1};
    assert_int_equal(runs[1].steps, 5);
    for (int i = 0; i < 5; i++) assert_int_equal(runs[1].step_tokens[i], expect_kv[i]);
    assert_int_equal(runs[0].steps, 3);
    assert_int_equal(runs[0].step_tokens[0], n);
    assert_int_equal(runs[0].n_rows, 3);
    assert_int_equal(runs[1].n_rows, 3);
    assert_memory_equal(runs[0].logits, runs[1].logits, 3 * (size_t)long_model.cfg.vocab_size * sizeof(float));
    assert_memory_equal(rs[0].tokens, rs[1].tokens, (size_t)rs[0].n_tokens * sizeof(int));
    for (int kv = 0; kv < 2; kv++) free(runs[kv].logits), free(rs[kv].tokens);
    kv_pool_free(&pool);
    model_free(&long_model);
}

/* Two requests over 2056 generated positions each in a pool of one full context: they fit
 * side by side until their growth runs the pool out, and the second is preempted; resumed,
 * its entries are generated again and its tokens are those of its run alone. The fill
 * comes before the prompt, and only the prompt is computed. */
static void test_fill_is_regenerated_after_preemption(void **state) {
    (void)state;
    const int fill = 2056, context = 2 * SCHEDULER_PASS_TOKENS + 64;
    Model long_model;
    load_long_model(&long_model, context);
    KVPool pool;
    assert_int_equal(kv_pool_init(&pool, &long_model.cfg, DTYPE_BF16, kv_blocks_for(context)), 0);
    Request rs[2] = {request(0, 1), request(1, 1)};
    rs[1].seed = 5;
    Scheduler sch = greedy(&pool, 2, 30);
    sch.model = &long_model;
    sch.fill = fill;
    const Trace tr = run_all(&sch, rs, 2);
    assert_int_equal(tr.step_tokens[0], 2); /* the prompts alone, not the fill */
    assert_int_equal(sch.preemptions, 1);
    assert_int_equal(rs[1].preemptions, 1);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(rs[i].n_prompt, fill + 1);
        assert_int_equal(rs[i].generated, 30);
        Request alone = request(i, 1);
        alone.seed = rs[i].seed;
        KVPool roomy;
        assert_int_equal(kv_pool_init(&roomy, &long_model.cfg, DTYPE_BF16, kv_blocks_for(context)), 0);
        Scheduler solo = greedy(&roomy, 1, 30);
        solo.model = &long_model;
        solo.fill = fill;
        run_all(&solo, &alone, 1);
        assert_memory_equal(alone.tokens, rs[i].tokens, (size_t)rs[i].n_tokens * sizeof(int));
        free(alone.tokens);
        free(rs[i].tokens);
        kv_pool_free(&roomy);
    }
    kv_pool_free(&pool);
    model_free(&long_model);
}

/* Two requests through the scheduler with a draft model on its own pool (--draft CKPT), K
 * 4, greedy. After every step each running sequence's target cache holds its tokens but
 * the last, its draft cache at most that (the rejected drafts rolled back) in exactly the
 * blocks those positions take, and the draft pool holds no other block; at the end, none.
 * Returns the steps; the tokens are left in rs. */
static int run_drafted(const Model *draft, Request *rs, int max_new, long *drafted, long *accepted) {
    KVPool pool, draft_pool;
    const int blocks = 2 * kv_blocks_for(model.cfg.max_seq_len);
    assert_int_equal(kv_pool_init(&pool, &model.cfg, DTYPE_F32, blocks), 0);
    assert_int_equal(kv_pool_init(&draft_pool, &draft->cfg, DTYPE_F32, blocks), 0);
    Scheduler sch = greedy(&pool, 2, max_new);
    sch.draft_k = 4, sch.draft_model = draft, sch.draft_pool = &draft_pool;
    assert_int_equal(scheduler_init(&sch), 0);
    for (int i = 0; i < 2; i++) scheduler_add(&sch, &rs[i]);
    StepResult st;
    int rc, steps = 0;
    while ((rc = scheduler_step(&sch, &st)) > 0) {
        steps++;
        int held = 0;
        for (int i = 0; i < 2; i++) {
            const Request *r = &rs[i];
            if (!r->live) continue;
            assert_int_equal(r->live->cache.len, r->n_tokens - 1);
            assert_true(r->live->draft_cache.len <= r->n_tokens - 1);
            assert_int_equal(r->live->draft_cache.n_blocks, kv_blocks_for(r->live->draft_cache.len));
            held += r->live->draft_cache.n_blocks;
        }
        assert_int_equal(kv_blocks_in_use(&draft_pool), held);
    }
    assert_int_equal(rc, 0);
    *drafted = sch.drafted, *accepted = sch.accepted;
    scheduler_free(&sch);
    assert_int_equal(kv_blocks_in_use(&draft_pool), 0);
    assert_int_equal(kv_blocks_in_use(&pool), 0);
    kv_pool_free(&draft_pool);
    kv_pool_free(&pool);
    return steps;
}

/* Two prompts that share only BOS, so that neither waits for the other. */
static Request apart(int i) {
    Request r = request(i, 2 + i);
    r.tokens[1] = 50 + i;
    return r;
}

/* Drafted by the target itself, every draft is kept (the same bits: batch invariance), so
 * 21 tokens take the prefill's step and 4 of K + 1 = 5 tokens. Drafted by another model,
 * most drafts are rejected and rolled back, and the tokens are still the plain run's. */
static void test_draft_model_rollback(void **state) {
    (void)state;
    Request same[2] = {apart(0), apart(1)};
    long drafted, accepted;
    assert_int_equal(run_drafted(&model, same, 21, &drafted, &accepted), 5);
    assert_true(drafted > 0);
    for (int i = 0; i < 2; i++) assert_int_equal(same[i].generated, 21);
    Config c = test_config(VARIANT_MQA, 0, 320, DTYPE_BF16);
    c.vocab_size = model.cfg.vocab_size;
    const char *path = temp_path("draft.bin");
    char err[256];
    Model other;
    assert_int_equal(write_test_checkpoint(path, &c, g_tokenizer_path, 78), 0);
    assert_int_equal(model_load(&other, path, err, sizeof err), 0);
    Request rs[2] = {apart(0), apart(1)};
    run_drafted(&other, rs, 30, &drafted, &accepted);
    assert_true(drafted > accepted); /* rejections happened, and were rolled back */
    for (int i = 0; i < 2; i++) {
        KVPool pool;
        assert_int_equal(kv_pool_init(&pool, &model.cfg, DTYPE_F32, kv_blocks_for(model.cfg.max_seq_len)), 0);
        Request alone = apart(i);
        Scheduler solo = greedy(&pool, 1, 30);
        run_all(&solo, &alone, 1);
        assert_int_equal(alone.n_tokens, rs[i].n_tokens);
        assert_memory_equal(alone.tokens, rs[i].tokens, (size_t)rs[i].n_tokens * sizeof(int));
        assert_memory_equal(same[i].tokens, rs[i].tokens, (size_t)same[i].n_tokens * sizeof(int));
        free(alone.tokens);
        free(rs[i].tokens);
        free(same[i].tokens);
        kv_pool_free(&pool);
    }
    model_free(&other);
}

/* A draft model catches up on a prompt longer than one pass's budget at its first decode
 * step, in passes of which the first has no row to sample (the target drafting for itself,
 * so every draft is kept): the step goes on, and the tokens are those of the run without
 * drafts. */
static void test_draft_catches_up_on_a_prompt_past_a_pass(void **state) {
    (void)state;
    const int context = 2 * SCHEDULER_PASS_TOKENS + 64, n = SCHEDULER_PASS_TOKENS + 100;
    Model long_model;
    load_long_model(&long_model, context);
    int *tokens[2];
    long drafted = 0;
    for (int k = 0; k < 2; k++) {
        KVPool pool, draft_pool;
        assert_int_equal(kv_pool_init(&pool, &long_model.cfg, DTYPE_F32, kv_blocks_for(context)), 0);
        assert_int_equal(kv_pool_init(&draft_pool, &long_model.cfg, DTYPE_F32, kv_blocks_for(context)), 0);
        Request r = request(0, n);
        for (int i = 1; i < n; i++) r.tokens[i] = 3 + (i * 7) % 300; /* ids in the vocabulary */
        Scheduler sch = greedy(&pool, 1, 9);
        sch.model = &long_model;
        if (k) sch.draft_k = 4, sch.draft_model = &long_model, sch.draft_pool = &draft_pool;
        assert_int_equal(scheduler_init(&sch), 0);
        assert_int_equal(scheduler_add(&sch, &r), 0);
        StepResult st;
        int rc;
        while ((rc = scheduler_step(&sch, &st)) > 0) continue;
        assert_int_equal(rc, 0);
        assert_int_equal(r.generated, 9);
        drafted = sch.drafted;
        tokens[k] = r.tokens;
        scheduler_free(&sch);
        kv_pool_free(&draft_pool);
        kv_pool_free(&pool);
    }
    assert_true(drafted > 0);
    assert_memory_equal(tokens[0], tokens[1], (size_t)(n + 9) * sizeof(int));
    free(tokens[0]), free(tokens[1]);
    model_free(&long_model);
}

/* A draft model of a shorter context (64) than the target's (128): a sequence drafts while
 * its positions fit the draft's context, then decodes plainly; the tokens are those of the
 * run without drafts, and no step counts drafts it did not make. */
static void test_draft_of_a_shorter_context(void **state) {
    (void)state;
    Model long_model;
    load_long_model(&long_model, 2 * model.cfg.max_seq_len);
    int *tokens[2];
    long drafted = 0, accepted = 0, passes = 0;
    for (int k = 0; k < 2; k++) {
        KVPool pool, draft_pool;
        assert_int_equal(kv_pool_init(&pool, &long_model.cfg, DTYPE_F32, kv_blocks_for(long_model.cfg.max_seq_len)), 0);
        assert_int_equal(kv_pool_init(&draft_pool, &model.cfg, DTYPE_F32, kv_blocks_for(long_model.cfg.max_seq_len)),
                         0);
        Request r = request(0, 10);
        Scheduler sch = greedy(&pool, 1, 100);
        sch.model = &long_model;
        if (k) sch.draft_k = 4, sch.draft_model = &model, sch.draft_pool = &draft_pool;
        assert_int_equal(scheduler_init(&sch), 0);
        assert_int_equal(scheduler_add(&sch, &r), 0);
        StepResult st;
        int rc;
        while ((rc = scheduler_step(&sch, &st)) > 0)
            for (int i = 0; i < st.n_rows; i++) assert_true(st.rows[i].pos < r.n_tokens);
        assert_int_equal(rc, 0);
        assert_int_equal(r.generated, 100);
        drafted = sch.drafted, accepted = sch.accepted, passes = sch.verify_passes;
        tokens[k] = r.tokens;
        scheduler_free(&sch);
        kv_pool_free(&draft_pool);
        kv_pool_free(&pool);
    }
    assert_true(drafted > 0 && accepted >= 0 && accepted <= drafted && passes > 0 && passes <= drafted);
    assert_memory_equal(tokens[0], tokens[1], 110 * sizeof(int));
    free(tokens[0]), free(tokens[1]);
    model_free(&long_model);
}

int main(int argc, char **argv) {
    g_tokenizer_path = argc > 1 ? argv[1] : NULL;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_admission_and_retirement),
        cmocka_unit_test(test_prompt_computed_once_and_shared),
        cmocka_unit_test(test_preemption_exactly_when_the_pool_runs_out),
        cmocka_unit_test(test_admission_waits_for_room),
        cmocka_unit_test(test_scored_request_reports_every_position),
        cmocka_unit_test(test_long_prompt_in_passes),
        cmocka_unit_test(test_fill_is_regenerated_after_preemption),
        cmocka_unit_test(test_draft_model_rollback),
        cmocka_unit_test(test_draft_catches_up_on_a_prompt_past_a_pass),
        cmocka_unit_test(test_draft_of_a_shorter_context),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
