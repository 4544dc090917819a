/* check.c: the checks of the bitwise promise (modes.h): --check-batch, each sequence of a
 * batch against itself run alone; --check-kv, greedy with the cache against without;
 * --check-spec, greedy with speculation against without. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "loader.h"
#include "serve/check.h"
#include "serve/json.h"
#include "serve/modes.h"
#include "serve/session.h"

/* ---- --check-batch ---- */

uint64_t hash_logits(const float *logits, int vocab) {
    const unsigned char *bytes = (const unsigned char *)logits;
    uint64_t x = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < (size_t)vocab * sizeof(float); i++) x = (x ^ bytes[i]) * 0x100000001b3ull;
    return x;
}

BatchVerdict compare_hashed_runs(const HashedRun *a, const HashedRun *b) {
    int same_tokens = 0;
    while (same_tokens < a->n_tokens && same_tokens < b->n_tokens && a->tokens[same_tokens] == b->tokens[same_tokens])
        same_tokens++;
    int first_difference = -1;
    const int steps = a->generated < b->generated ? a->generated : b->generated;
    for (int s = 0; s < steps && first_difference < 0; s++)
        if (a->step_hashes[s] != b->step_hashes[s]) first_difference = s;
    if (first_difference < 0 && a->generated != b->generated) first_difference = steps;
    const int identical = first_difference < 0 && a->n_tokens == b->n_tokens && same_tokens == a->n_tokens;
    return (BatchVerdict){a->generated, same_tokens - a->n_prompt, identical, first_difference};
}

/* Runs the requests through max_batch slots to their ends; the hash of the logits that
 * sample a request's generated token s goes to hashes[index * stride + s] (a step of
 * speculation samples several). */
static void run_hashed(const Model *m, KVPool *pool, const Drafter *draft, const Options *o, Request *requests, int n,
                       int max_batch, uint64_t *hashes, int stride) {
    Scheduler sch;
    scheduler_open(&sch, m, pool, draft, o, max_batch);
    for (int i = 0; i < n; i++)
        if (scheduler_add(&sch, &requests[i]) != 0) die(1, "out of memory");
    StepResult st;
    int rc;
    while ((rc = scheduler_step(&sch, &st)) > 0)
        for (int k = 0; k < st.n_rows; k++) {
            const Request *r = st.rows[k].request; /* the row after position pos samples token pos + 1 */
            hashes[(size_t)r->index * stride + st.rows[k].pos + 1 - r->n_prompt] =
                hash_logits(st.logits + (size_t)k * m->cfg.vocab_size, m->cfg.vocab_size);
        }
    check_model(rc);
    scheduler_free(&sch);
}

int mode_check_batch(const Model *m, KVPool *pool, const Options *o) {
    RequestList batch = requests_of(m, o);
    const int B = batch.n, stride = (o->steps > m->cfg.max_seq_len ? o->steps : m->cfg.max_seq_len) + 1;
    uint64_t *in_batch = calloc((size_t)B * stride, sizeof(uint64_t)),
             *alone = calloc((size_t)B * stride, sizeof(uint64_t));
    BatchVerdict *verdicts = malloc((size_t)B * sizeof *verdicts);
    if (!in_batch || !alone || !verdicts) die(1, "out of memory");
    run_hashed(m, pool, NULL, o, batch.requests, B, o->batch, in_batch, stride);
    int differ = 0, n_identical = 0;
    for (int i = 0; i < B; i++) {
        const Request *a = &batch.requests[i];
        Request b = {.index = i, .n_prompt = a->n_prompt, .cap_tokens = a->n_prompt + 1, .seed = a->seed};
        if (!(b.tokens = malloc((size_t)b.cap_tokens * sizeof(int)))) die(1, "out of memory");
        memcpy(b.tokens, a->tokens, (size_t)a->n_prompt * sizeof(int));
        run_hashed(m, pool, NULL, o, &b, 1, 1, alone, stride);
        const HashedRun batched = {a->tokens, a->n_tokens, a->n_prompt, in_batch + (size_t)i * stride, a->generated},
                        solo = {b.tokens, b.n_tokens, b.n_prompt, alone + (size_t)i * stride, b.generated};
        verdicts[i] = compare_hashed_runs(&batched, &solo);
        differ |= !verdicts[i].identical;
        n_identical += verdicts[i].identical;
        free(b.tokens);
    }
    const char *what = o->prompts_path ? o->prompts_path : o->prompt;
    if (o->json) {
        json_begin("check-batch", m, o, o->kv ? "kv" : "no-kv");
        printf(", \"batch\": %d, \"slots\": %d, \"identical\": %s, \"sequences_identical\": %d, \"sequences\": [", B,
               o->batch, differ ? "false" : "true", n_identical);
        for (int i = 0; i < B; i++)
            printf(
                "%s{\"index\": %d, \"seed\": %llu, \"steps\": %d, \"identical_tokens\": %d, \"bitwise_identical\": %s, "
                "\"first_difference\": %d}",
                i ? ", " : "", i, (unsigned long long)batch.requests[i].seed, verdicts[i].steps,
                verdicts[i].same_tokens, verdicts[i].identical ? "true" : "false", verdicts[i].first_difference);
        putchar(']');
        json_end();
    } else {
        printf(
            "%s %s, %d sequences of %s\"%s\" in %d slots: %d of %d give the same tokens and bitwise the same logits as "
            "run alone\n",
            variant_name(&m->cfg), o->kv ? "kv" : "no-kv", B, o->prompts_path ? "the prompts of " : "", what, o->batch,
            n_identical, B);
        for (int i = 0; i < B; i++)
            printf("check-batch variant=%s mode=%s batch=%d index=%d seed=%llu steps=%d identical_tokens=%d "
                   "bitwise_identical=%d first_difference=%d\n",
                   variant_name(&m->cfg), o->kv ? "kv" : "no-kv", B, i, (unsigned long long)batch.requests[i].seed,
                   verdicts[i].steps, verdicts[i].same_tokens, verdicts[i].identical, verdicts[i].first_difference);
    }
    free(verdicts);
    free(in_batch);
    free(alone);
    requests_free(&batch);
    return differ;
}

/* ---- --check-kv ---- */

/* Greedy from the prompt, with the cache (kv) or without, in MLA form `form`, on pool. */
static GreedyRun greedy_run(const Model *m, KVPool *pool, const Options *o, const int *prompt, int n_prompt, int kv,
                            MlaForm form) {
    const int V = m->cfg.vocab_size;
    Options greedy = *o;
    greedy.top_k = 1;
    greedy.kv = kv;
    greedy.mla_form = form;
    GreedyRun g = {malloc((size_t)(m->cfg.max_seq_len + 1) * V * sizeof(float)), 0};
    Request r = {.n_prompt = n_prompt, .cap_tokens = n_prompt + 1};
    if (!g.logits || !(r.tokens = malloc((size_t)r.cap_tokens * sizeof(int)))) die(1, "out of memory");
    memcpy(r.tokens, prompt, (size_t)n_prompt * sizeof(int));
    Scheduler sch;
    scheduler_open(&sch, m, pool, NULL, &greedy, 1);
    if (scheduler_add(&sch, &r) != 0) die(1, "out of memory");
    StepResult st;
    int rc;
    while ((rc = scheduler_step(&sch, &st)) > 0)
        if (st.n_rows) memcpy(g.logits + (size_t)g.steps++ * V, st.logits, (size_t)V * sizeof(float));
    check_model(rc);
    scheduler_free(&sch);
    free(r.tokens);
    return g;
}

int comparison_fails(const KvComparison *c) {
    return c->divergent_step >= 0 || (c->same_form && c->first_bitwise_difference >= 0);
}

KvComparison compare_greedy_runs(const GreedyRun *a, const GreedyRun *b, int V) {
    KvComparison c = {.divergent_step = -1, .token_a = -1, .token_b = -1, .first_bitwise_difference = -1};
    c.steps = a->steps < b->steps ? a->steps : b->steps;
    for (int s = 0; s < c.steps; s++) {
        const float *la = a->logits + (size_t)s * V, *lb = b->logits + (size_t)s * V;
        if (c.first_bitwise_difference < 0 && memcmp(la, lb, (size_t)V * sizeof(float)) != 0)
            c.first_bitwise_difference = s;
        for (int i = 0; i < V; i++) {
            double d = fabs((double)la[i] - (double)lb[i]);
            if (d > c.max_abs_logit_diff) c.max_abs_logit_diff = d;
        }
        if (sampler_argmax(la, V) != sampler_argmax(lb, V)) {
            c.divergent_step = s;
            break;
        }
    }
    if (c.divergent_step < 0 && a->steps != b->steps)
        c.divergent_step = c.steps; /* one stopped at EOS, the other not */
    const int d = c.divergent_step;
    c.identical_tokens = d < 0 ? c.steps : d;
    if (d >= 0 && d < a->steps) c.token_a = sampler_argmax(a->logits + (size_t)d * V, V);
    if (d >= 0 && d < b->steps) c.token_b = sampler_argmax(b->logits + (size_t)d * V, V);
    return c;
}

static void print_check_kv(const Model *m, const KVPool *pool, const Options *o, const KvComparison *c, int n_pairs,
                           int steps, int fails) {
    char window[32] = "";
    if (pool->window) snprintf(window, sizeof window, " (window %d)", pool->window);
    if (o->json) {
        json_begin("check-kv", m, o, "kv-vs-no-kv");
        printf(", \"steps_requested\": %d, \"identical\": %s, \"comparisons\": [", steps, fails ? "false" : "true");
        for (int i = 0; i < n_pairs; i++) {
            printf("%s{\"a\": \"%s\", \"b\": \"%s\", \"same_form\": %s, \"steps\": %d, \"identical_tokens\": %d, "
                   "\"first_divergent_step\": ",
                   i ? ", " : "", c[i].a, c[i].b, c[i].same_form ? "true" : "false", c[i].steps, c[i].identical_tokens);
            json_number(stdout, c[i].divergent_step < 0 ? NAN : c[i].divergent_step);
            fputs(", \"token_a\": ", stdout);
            json_number(stdout, c[i].token_a < 0 ? NAN : c[i].token_a);
            fputs(", \"token_b\": ", stdout);
            json_number(stdout, c[i].token_b < 0 ? NAN : c[i].token_b);
            printf(", \"bitwise_identical\": %s, \"first_bitwise_difference\": ",
                   c[i].first_bitwise_difference < 0 ? "true" : "false");
            json_number(stdout, c[i].first_bitwise_difference < 0 ? NAN : c[i].first_bitwise_difference);
            json_field("max_abs_logit_diff", c[i].max_abs_logit_diff);
            putchar('}');
        }
        putchar(']');
        json_end();
        return;
    }
    for (int i = 0; i < n_pairs; i++) {
        printf("%s: %s%s vs %s: identical for %d tokens", variant_name(&m->cfg), c[i].a, window, c[i].b,
               c[i].identical_tokens);
        if (c[i].divergent_step >= 0)
            printf(", then step %d diverges: %s gives token %d, %s gives token %d", c[i].divergent_step, c[i].a,
                   c[i].token_a, c[i].b, c[i].token_b);
        printf("; logits %s; max |logit difference| %.3g\n",
               c[i].first_bitwise_difference < 0 ? "bitwise identical" : "not bitwise identical",
               c[i].max_abs_logit_diff);
    }
    for (int i = 0; i < n_pairs; i++)
        printf(
            "check-kv variant=%s a=%s b=%s window=%d steps=%d identical_tokens=%d first_divergent_step=%d token_a=%d "
            "token_b=%d bitwise_identical=%d first_bitwise_difference=%d max_abs_logit_diff=%.6g\n",
            variant_name(&m->cfg), c[i].a, c[i].b, pool->window, c[i].steps, c[i].identical_tokens, c[i].divergent_step,
            c[i].token_a, c[i].token_b, c[i].first_bitwise_difference < 0, c[i].first_bitwise_difference,
            c[i].max_abs_logit_diff);
}

/* One line for people, then the machine-readable key=value lines (or one JSON object).
 * For MLA two comparisons: the cached run in --mla's form (absorbed unless given) against
 * expanded without the cache (the KV-cache post's setup) and against absorbed without it;
 * the one in its own form is the same arithmetic. With
 * --window the cached run keeps only the window and the uncached one recomputes the whole
 * sequence: they agree until the window is full (for a ring or sinks in fp32 only: they
 * store keys before RoPE, so a lossy --kv-dtype rounds other numbers from the start). A
 * model's own window is part of the model, so both runs keep it (and agree throughout
 * without --window). Returns 1 when a comparison fails. */
int mode_check_kv(const Model *m, KVPool *pool, const Options *o) {
    const int V = m->cfg.vocab_size, is_mla = m->cfg.variant == VARIANT_MLA;
    int *prompt = malloc((size_t)(m->cfg.max_seq_len + 1) * sizeof(int));
    if (!prompt) die(1, "out of memory");
    const int n = encode_prompt(m, o->prompt, 0, prompt, m->cfg.max_seq_len + 1, "");
    const int steps = o->steps ? o->steps : m->cfg.max_seq_len;
    Options run = *o;
    run.steps = steps;
    KVPool whole; /* without --window, with the model's own window */
    if (kv_pool_init(&whole, &m->cfg, pool->dtype, kv_blocks_for(m->cfg.max_seq_len)) != 0) die(1, "out of memory");
    if (m->cfg.window) kv_pool_set_window(&whole, m->cfg.window, 0, KV_EVICT_OLDEST);
    const MlaForm uncached_forms[2] = {MLA_EXPANDED, MLA_ABSORBED};
    const int n_pairs = is_mla ? 2 : 1;
    KvComparison c[2];
    int fails = 0;
    const MlaForm cached_form = o->mla_given ? o->mla_form : MLA_ABSORBED;
    GreedyRun cached = greedy_run(m, pool, &run, prompt, n, 1, cached_form);
    for (int i = 0; i < n_pairs; i++) {
        GreedyRun uncached = greedy_run(m, &whole, &run, prompt, n, 0, uncached_forms[i]);
        c[i] = compare_greedy_runs(&cached, &uncached, V);
        c[i].same_form = !is_mla || uncached_forms[i] == cached_form;
        snprintf(c[i].a, sizeof c[i].a, is_mla ? "kv-%s" : "kv", mla_form_name(cached_form));
        snprintf(c[i].b, sizeof c[i].b, is_mla ? "no-kv-%s" : "no-kv", mla_form_name(uncached_forms[i]));
        fails |= comparison_fails(&c[i]);
        free(uncached.logits);
    }
    print_check_kv(m, pool, o, c, n_pairs, steps, fails);
    free(cached.logits);
    kv_pool_free(&whole);
    free(prompt);
    return fails;
}

/* ---- --check-spec ---- */

/* The batch (or --prompts) through its slots greedily, with speculation and without: each
 * sequence's tokens and the hashes of the logits of every emitted position compared. One
 * line for people, then one key=value line a sequence (or one JSON object). Returns 1 when
 * a sequence differs. */
int mode_check_spec(const Model *m, KVPool *pool, const Drafter *draft, const Options *o) {
    Options spec = *o, plain = *o;
    spec.top_k = plain.top_k = 1;
    plain.draft = 0;
    RequestList a = requests_of(m, o), b = requests_of(m, o);
    const int B = a.n, stride = (o->steps > m->cfg.max_seq_len ? o->steps : m->cfg.max_seq_len) + 1;
    uint64_t *with = calloc((size_t)B * stride, sizeof(uint64_t)), *without = calloc((size_t)B * stride, sizeof(uint64_t));
    BatchVerdict *verdicts = malloc((size_t)B * sizeof *verdicts);
    if (!with || !without || !verdicts) die(1, "out of memory");
    run_hashed(m, pool, draft, &spec, a.requests, B, o->batch, with, stride);
    run_hashed(m, pool, NULL, &plain, b.requests, B, o->batch, without, stride);
    int differ = 0, n_identical = 0;
    for (int i = 0; i < B; i++) {
        const Request *x = &a.requests[i], *y = &b.requests[i];
        const HashedRun hx = {x->tokens, x->n_tokens, x->n_prompt, with + (size_t)i * stride, x->generated},
                        hy = {y->tokens, y->n_tokens, y->n_prompt, without + (size_t)i * stride, y->generated};
        verdicts[i] = compare_hashed_runs(&hx, &hy);
        differ |= !verdicts[i].identical;
        n_identical += verdicts[i].identical;
    }
    const char *drafter = o->draft_path ? o->draft_path : "ngram";
    if (o->json) {
        json_begin("check-spec", m, o, "kv");
        fputs(", \"draft\": ", stdout);
        json_text(stdout, drafter);
        printf(", \"draft_k\": %d, \"batch\": %d, \"slots\": %d, \"identical\": %s, "
               "\"sequences_identical\": %d, \"sequences\": [",
               o->draft_k, B, o->batch, differ ? "false" : "true", n_identical);
        for (int i = 0; i < B; i++)
            printf("%s{\"index\": %d, \"seed\": %llu, \"steps\": %d, \"identical_tokens\": %d, "
                   "\"bitwise_identical\": %s, \"first_difference\": %d}",
                   i ? ", " : "", i, (unsigned long long)a.requests[i].seed, verdicts[i].steps, verdicts[i].same_tokens, verdicts[i].identical ? "true" : "false",
                   verdicts[i].first_difference);
        putchar(']');
        json_end();
    } else {
        printf("%s kv, %d sequences in %d slots, draft %s k %d: %d of %d give the same tokens and bitwise the same "
               "logits as without speculation\n",
               variant_name(&m->cfg), B, o->batch, drafter, o->draft_k, n_identical, B);
        for (int i = 0; i < B; i++)
            printf("check-spec variant=%s index=%d seed=%llu steps=%d identical_tokens=%d bitwise_identical=%d "
                   "first_difference=%d\n",
                   variant_name(&m->cfg), i, (unsigned long long)a.requests[i].seed, verdicts[i].steps, verdicts[i].same_tokens, verdicts[i].identical,
                   verdicts[i].first_difference);
    }
    free(verdicts);
    free(with);
    free(without);
    requests_free(&a);
    requests_free(&b);
    return differ;
}
