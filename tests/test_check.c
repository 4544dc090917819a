/* The comparators of --check-batch and --check-kv (serve/check.h), shown runs that differ:
 * equal tokens whose logits differ in one bit, different tokens, a run that stops early,
 * and runs alike in every bit. A check that only compared tokens would pass the first. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <stdint.h>
#include <string.h>

#include "serve/check.h"
#include "testutil.h"

enum { VOCAB = 64, STEPS = 6, PROMPT = 3 };

/* Flips the lowest mantissa bit of *x: the nearest float, which no argmax notices unless
 * *x is the largest logit or ties it. */
static void flip_low_bit(float *x) {
    uint32_t bits;
    memcpy(&bits, x, sizeof bits);
    bits ^= 1u;
    memcpy(x, &bits, sizeof bits);
}

/* STEPS rows of logits, each with one clear maximum at token_of(s): the tokens a greedy
 * run would pick. */
static int token_of(int s) { return (7 * s + 3) % VOCAB; }
static void fill_logits(float *logits) {
    uint64_t seed = 11;
    for (int s = 0; s < STEPS; s++) {
        for (int i = 0; i < VOCAB; i++) logits[s * VOCAB + i] = test_uniform(&seed);
        logits[s * VOCAB + token_of(s)] = 5.0f;
    }
}

/* ---- --check-kv ---- */

typedef struct {
    float a[STEPS * VOCAB], b[STEPS * VOCAB];
} TwoRuns;

static KvComparison compare(TwoRuns *r, int steps_a, int steps_b, int same_form) {
    const GreedyRun a = {r->a, steps_a}, b = {r->b, steps_b};
    KvComparison c = compare_greedy_runs(&a, &b, VOCAB);
    c.same_form = same_form;
    return c;
}

static void two_equal_runs(TwoRuns *r) {
    fill_logits(r->a);
    memcpy(r->b, r->a, sizeof r->a);
}

static void test_kv_equal_everything_is_identical(void **state) {
    TwoRuns r;
    two_equal_runs(&r);
    const KvComparison c = compare(&r, STEPS, STEPS, 1);
    assert_int_equal(c.steps, STEPS);
    assert_int_equal(c.identical_tokens, STEPS);
    assert_int_equal(c.divergent_step, -1);
    assert_int_equal(c.first_bitwise_difference, -1);
    assert_true(c.max_abs_logit_diff == 0.0);
    assert_false(comparison_fails(&c));
}

/* The same tokens at every step, and one logit of step 4 one bit apart: the same
 * arithmetic promised the same bits, so the check fails; across MLA forms (different
 * arithmetic) only the tokens count. */
static void test_kv_one_bit_of_logits_differs(void **state) {
    TwoRuns r;
    two_equal_runs(&r);
    flip_low_bit(&r.b[4 * VOCAB + (token_of(4) + 1) % VOCAB]);
    KvComparison c = compare(&r, STEPS, STEPS, 1);
    assert_int_equal(c.divergent_step, -1); /* the tokens agree */
    assert_int_equal(c.identical_tokens, STEPS);
    assert_int_equal(c.first_bitwise_difference, 4);
    assert_true(c.max_abs_logit_diff > 0.0);
    assert_true(comparison_fails(&c));
    c.same_form = 0;
    assert_false(comparison_fails(&c));
}

/* Step 2's largest logit moves: the runs diverge there, whatever the form. */
static void test_kv_different_tokens(void **state) {
    TwoRuns r;
    two_equal_runs(&r);
    const int other = (token_of(2) + 5) % VOCAB;
    r.b[2 * VOCAB + other] = 9.0f;
    KvComparison c = compare(&r, STEPS, STEPS, 0);
    assert_int_equal(c.divergent_step, 2);
    assert_int_equal(c.identical_tokens, 2);
    assert_int_equal(c.token_a, token_of(2));
    assert_int_equal(c.token_b, other);
    assert_int_equal(c.first_bitwise_difference, 2);
    assert_true(comparison_fails(&c));
}

/* One run stops (EOS) after 4 steps, the other goes on: the same bits as far as both go,
 * and still not the same run. */
static void test_kv_different_lengths(void **state) {
    TwoRuns r;
    two_equal_runs(&r);
    KvComparison c = compare(&r, STEPS, STEPS - 2, 1);
    assert_int_equal(c.steps, STEPS - 2);
    assert_int_equal(c.first_bitwise_difference, -1);
    assert_int_equal(c.divergent_step, STEPS - 2);
    assert_int_equal(c.token_a, token_of(STEPS - 2));
    assert_int_equal(c.token_b, -1);
    assert_true(comparison_fails(&c));
}

/* ---- --check-batch ---- */

typedef struct {
    int tokens[PROMPT + STEPS];
    uint64_t hashes[STEPS];
    float logits[STEPS * VOCAB];
    HashedRun run;
} Hashed;

/* A run as --check-batch records it: the prompt, the greedy tokens of `logits`, the hash
 * of every step's row. */
static void hashed_run(Hashed *h, const float *logits, int steps) {
    memcpy(h->logits, logits, sizeof h->logits);
    for (int i = 0; i < PROMPT; i++) h->tokens[i] = 100 + i;
    for (int s = 0; s < steps; s++) {
        int best = 0;
        for (int i = 1; i < VOCAB; i++)
            if (logits[s * VOCAB + i] > logits[s * VOCAB + best]) best = i;
        h->tokens[PROMPT + s] = best;
        h->hashes[s] = hash_logits(logits + s * VOCAB, VOCAB);
    }
    h->run = (HashedRun){h->tokens, PROMPT + steps, PROMPT, h->hashes, steps};
}

static void test_batch_equal_everything_is_identical(void **state) {
    float logits[STEPS * VOCAB];
    fill_logits(logits);
    Hashed a, b;
    hashed_run(&a, logits, STEPS);
    hashed_run(&b, logits, STEPS);
    const BatchVerdict v = compare_hashed_runs(&a.run, &b.run);
    assert_true(v.identical);
    assert_int_equal(v.steps, STEPS);
    assert_int_equal(v.same_tokens, STEPS);
    assert_int_equal(v.first_difference, -1);
}

/* Equal tokens, one bit of step 3's logits apart: not identical, first difference step 3. */
static void test_batch_one_bit_of_logits_differs(void **state) {
    float logits[STEPS * VOCAB];
    fill_logits(logits);
    Hashed a, b;
    hashed_run(&a, logits, STEPS);
    flip_low_bit(&logits[3 * VOCAB + (token_of(3) + 1) % VOCAB]);
    hashed_run(&b, logits, STEPS);
    assert_memory_equal(a.tokens, b.tokens, sizeof a.tokens); /* the flip changed no token */
    const BatchVerdict v = compare_hashed_runs(&a.run, &b.run);
    assert_false(v.identical);
    assert_int_equal(v.same_tokens, STEPS);
    assert_int_equal(v.first_difference, 3);
}

/* Step 1 picks another token (and the run goes on from it): not identical, one token alike. */
static void test_batch_different_tokens(void **state) {
    float logits[STEPS * VOCAB];
    fill_logits(logits);
    Hashed a, b;
    hashed_run(&a, logits, STEPS);
    logits[1 * VOCAB + (token_of(1) + 9) % VOCAB] = 9.0f;
    hashed_run(&b, logits, STEPS);
    const BatchVerdict v = compare_hashed_runs(&a.run, &b.run);
    assert_false(v.identical);
    assert_int_equal(v.same_tokens, 1);
    assert_int_equal(v.first_difference, 1);
}

/* The run alone stops two steps early (EOS) with the same bits so far: not identical, the
 * first difference where it stopped; and the other way round. */
static void test_batch_different_lengths(void **state) {
    float logits[STEPS * VOCAB];
    fill_logits(logits);
    Hashed a, b;
    hashed_run(&a, logits, STEPS);
    hashed_run(&b, logits, STEPS - 2);
    BatchVerdict v = compare_hashed_runs(&a.run, &b.run);
    assert_false(v.identical);
    assert_int_equal(v.same_tokens, STEPS - 2);
    assert_int_equal(v.first_difference, STEPS - 2);
    v = compare_hashed_runs(&b.run, &a.run);
    assert_false(v.identical);
    assert_int_equal(v.steps, STEPS - 2);
    assert_int_equal(v.first_difference, STEPS - 2);
}

/* The hash sees a single bit anywhere in a row, and nothing outside it. */
static void test_hash_sees_every_bit(void **state) {
    float rows[STEPS * VOCAB], row[VOCAB], copy[VOCAB + 1];
    fill_logits(rows); /* any values */
    memcpy(row, rows, sizeof row);
    const uint64_t h = hash_logits(row, VOCAB);
    for (int i = 0; i < VOCAB; i += 9) {
        flip_low_bit(&row[i]);
        assert_true(hash_logits(row, VOCAB) != h);
        flip_low_bit(&row[i]);
    }
    memcpy(copy, row, sizeof row);
    copy[VOCAB] = 1.0f;
    assert_true(hash_logits(copy, VOCAB) == h);
}

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kv_equal_everything_is_identical),
        cmocka_unit_test(test_kv_one_bit_of_logits_differs),
        cmocka_unit_test(test_kv_different_tokens),
        cmocka_unit_test(test_kv_different_lengths),
        cmocka_unit_test(test_batch_equal_everything_is_identical),
        cmocka_unit_test(test_batch_one_bit_of_logits_differs),
        cmocka_unit_test(test_batch_different_tokens),
        cmocka_unit_test(test_batch_different_lengths),
        cmocka_unit_test(test_hash_sees_every_bit),
    };
    return cmocka_run_group_tests_name("check", tests, NULL, NULL);
}
