/* The sampler: -k 1 is the argmax; top-k draws follow the distribution on a fixed seed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>

#include "sampler.h"
#include "testutil.h"

static void test_greedy_is_argmax(void **state) {
    float logits[100];
    uint64_t s = 5;
    for (int i = 0; i < 100; i++) logits[i] = test_uniform(&s);
    logits[63] = 3.0f;
    Sampler sm;
    assert_int_equal(sampler_init(&sm, 100, 1, 1.0f, 42), 0);
    for (int i = 0; i < 10; i++) assert_int_equal(sampler_sample(&sm, logits), 63);
    sampler_free(&sm);
    assert_int_equal(sampler_init(&sm, 100, 40, 0.0f, 42), 0);  /* temperature 0 is greedy too */
    assert_int_equal(sampler_sample(&sm, logits), 63);
    sampler_free(&sm);
    /* ties go to the first index */
    logits[10] = 3.0f;
    assert_int_equal(sampler_argmax(logits, 100), 10);
}

/* With k = 4 over logits log(1,2,3,4) plus much smaller ones, the frequencies match
 * 0.1, 0.2, 0.3, 0.4 and nothing outside the top 4 is ever drawn. */
static void test_top_k_distribution(void **state) {
    enum { V = 50, DRAWS = 200000 };
    float logits[V];
    for (int i = 0; i < V; i++) logits[i] = -1.0f + 0.001f * i;  /* all below log(1) = 0 */
    logits[7] = logf(1.0f);
    logits[30] = logf(2.0f);
    logits[2] = logf(3.0f);
    logits[45] = logf(4.0f);
    Sampler sm;
    assert_int_equal(sampler_init(&sm, V, 4, 1.0f, 1234), 0);
    int count[V] = {0};
    for (int i = 0; i < DRAWS; i++) count[sampler_sample(&sm, logits)]++;
    const int ids[4] = {7, 30, 2, 45};
    int inside = 0;
    for (int i = 0; i < 4; i++) {
        double p = (i + 1) / 10.0, f = (double)count[ids[i]] / DRAWS;
        double sigma = sqrt(p * (1 - p) / DRAWS);
        if (fabs(f - p) > 5 * sigma) fail_msg("token %d: frequency %.4f, expected %.4f", ids[i], f, p);
        inside += count[ids[i]];
    }
    assert_int_equal(inside, DRAWS);
    sampler_free(&sm);
}

/* the same seed gives the same draws; temperature flattens the distribution */
static void test_seed_and_temperature(void **state) {
    float logits[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    Sampler a, b;
    assert_int_equal(sampler_init(&a, 8, 8, 1.0f, 99), 0);
    assert_int_equal(sampler_init(&b, 8, 8, 1.0f, 99), 0);
    for (int i = 0; i < 1000; i++) assert_int_equal(sampler_sample(&a, logits), sampler_sample(&b, logits));
    sampler_free(&a);
    sampler_free(&b);
    int top_low = 0, top_high = 0;
    assert_int_equal(sampler_init(&a, 8, 8, 0.25f, 7), 0);
    assert_int_equal(sampler_init(&b, 8, 8, 4.0f, 7), 0);
    for (int i = 0; i < 20000; i++) {
        top_low += sampler_sample(&a, logits) == 7;
        top_high += sampler_sample(&b, logits) == 7;
    }
    assert_true(top_low > 19000);            /* p = 0.98 */
    assert_true(top_high < 6000 && top_high > 3000);  /* p ~ 0.23 */
    sampler_free(&a);
    sampler_free(&b);
}

static void test_rejects_bad_parameters(void **state) {
    Sampler sm;
    assert_int_equal(sampler_init(&sm, 100, 0, 1.0f, 1), -1);
    assert_int_equal(sampler_init(&sm, 100, 101, 1.0f, 1), -1);
    assert_int_equal(sampler_init(&sm, 100, 5, -0.5f, 1), -1);
    assert_int_equal(sampler_init(&sm, 100, 5, NAN, 1), -1);
    assert_int_equal(sampler_init(&sm, 100, 5, INFINITY, 1), -1);
}

static void test_random_range(void **state) {
    uint64_t s = 3;
    double sum = 0;
    for (int i = 0; i < 100000; i++) {
        float r = sampler_random_f32(&s);
        assert_true(r >= 0.0f && r < 1.0f);
        sum += r;
    }
    assert_true(fabs(sum / 100000 - 0.5) < 0.01);
}

int main(int argc, char **argv) {
    (void)argc; (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_is_argmax),    cmocka_unit_test(test_top_k_distribution),
        cmocka_unit_test(test_seed_and_temperature), cmocka_unit_test(test_rejects_bad_parameters),
        cmocka_unit_test(test_random_range),
    };
    return cmocka_run_group_tests_name("sampler", tests, NULL, NULL);
}
