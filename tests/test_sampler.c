/* The sampler: -k 1 is the argmax; top-k draws follow the distribution on a fixed seed;
 * top-p keeps the nucleus, after top-k and before the temperature (llama.cpp's order),
 * checked draw by draw against probabilities worked out by hand. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "serve/draft.h"
#include "serve/sampler.h"
#include "testutil.h"

static void test_greedy_is_argmax(void **state) {
    float logits[100];
    uint64_t s = 5;
    for (int i = 0; i < 100; i++) logits[i] = test_uniform(&s);
    logits[63] = 3.0f;
    Sampler sm;
    assert_int_equal(sampler_init(&sm, 100, 1, 1.0f, 1.0f, 42), 0);
    for (int i = 0; i < 10; i++) assert_int_equal(sampler_sample(&sm, logits), 63);
    sampler_free(&sm);
    assert_int_equal(sampler_init(&sm, 100, 40, 1.0f, 0.0f, 42), 0); /* temperature 0 is greedy too */
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
    for (int i = 0; i < V; i++) logits[i] = -1.0f + 0.001f * i; /* all below log(1) = 0 */
    logits[7] = logf(1.0f);
    logits[30] = logf(2.0f);
    logits[2] = logf(3.0f);
    logits[45] = logf(4.0f);
    Sampler sm;
    assert_int_equal(sampler_init(&sm, V, 4, 1.0f, 1.0f, 1234), 0);
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
    assert_int_equal(sampler_init(&a, 8, 8, 1.0f, 1.0f, 99), 0);
    assert_int_equal(sampler_init(&b, 8, 8, 1.0f, 1.0f, 99), 0);
    for (int i = 0; i < 1000; i++) assert_int_equal(sampler_sample(&a, logits), sampler_sample(&b, logits));
    sampler_free(&a);
    sampler_free(&b);
    int top_low = 0, top_high = 0;
    assert_int_equal(sampler_init(&a, 8, 8, 1.0f, 0.25f, 7), 0);
    assert_int_equal(sampler_init(&b, 8, 8, 1.0f, 4.0f, 7), 0);
    for (int i = 0; i < 20000; i++) {
        top_low += sampler_sample(&a, logits) == 7;
        top_high += sampler_sample(&b, logits) == 7;
    }
    assert_true(top_low > 19000);                    /* p = 0.98 */
    assert_true(top_high < 6000 && top_high > 3000); /* p ~ 0.23 */
    sampler_free(&a);
    sampler_free(&b);
}

/* The token a draw of r in [0, 1) picks from probabilities p[0..n) (best first) of ids. */
static int pick(double r, const double *p, const int *ids, int n) {
    double cdf = 0.0;
    for (int i = 0; i < n; i++) {
        cdf += p[i];
        if (r < cdf) return ids[i];
    }
    return ids[n - 1];
}

/* Draws from sm and checks each against the token the same random number picks from the
 * expected distribution; ids outside it are never drawn. */
static void expect_draws(Sampler *sm, const float *logits, const double *p, const int *ids, int n, int draws) {
    for (int i = 0; i < draws; i++) {
        uint64_t next = sm->rng_state;
        const double r = sampler_random_f32(&next);
        const int want = pick(r, p, ids, n), got = sampler_sample(sm, logits);
        if (got != want) fail_msg("draw %d (r = %.6f): token %d, expected %d", i, r, got, want);
    }
}

/* Four tokens of probability 0.1, 0.2, 0.3, 0.4 (ids 7, 30, 2, 45). top-p 0.6: 0.4 alone is
 * short of it, 0.4 + 0.3 reaches it, so ids 45 and 2 remain, drawn with 4/7 and 3/7. */
static void test_top_p_keeps_the_nucleus(void **state) {
    float logits[50];
    for (int i = 0; i < 50; i++) logits[i] = -1e30f; /* probability 0 */
    logits[7] = logf(0.1f), logits[30] = logf(0.2f), logits[2] = logf(0.3f), logits[45] = logf(0.4f);
    Sampler sm;
    assert_int_equal(sampler_init(&sm, 50, 50, 0.6f, 1.0f, 2024), 0);
    const double p[2] = {4.0 / 7.0, 3.0 / 7.0};
    const int ids[2] = {45, 2};
    expect_draws(&sm, logits, p, ids, 2, 5000);
    sampler_free(&sm);
    /* top-p 0.95: all four (0.9 is short of it), with their own probabilities */
    assert_int_equal(sampler_init(&sm, 50, 50, 0.95f, 1.0f, 77), 0);
    const double all[4] = {0.4, 0.3, 0.2, 0.1};
    const int all_ids[4] = {45, 2, 30, 7};
    expect_draws(&sm, logits, all, all_ids, 4, 5000);
    sampler_free(&sm);
    /* top-p 0: the most likely token only, whatever the temperature */
    assert_int_equal(sampler_init(&sm, 50, 50, 0.0f, 5.0f, 9), 0);
    for (int i = 0; i < 100; i++) assert_int_equal(sampler_sample(&sm, logits), 45);
    sampler_free(&sm);
}

/* Top-k, then top-p, then the temperature. Probabilities 0.04, 0.26, 0.11, 0.33, 0.16, 0.10
 * (ids 0..5). -k 4 keeps ids 3, 1, 4, 2 (0.86 in all: 0.384, 0.302, 0.186, 0.128 among
 * them); --top-p 0.6 then keeps ids 3 and 1 (0.384 < 0.6 <= 0.686); -t 2 draws them with
 * weights sqrt(0.33) and sqrt(0.26). Had the temperature come first (llama2.c's order), the
 * flatter distribution (0.316, 0.281, 0.220, 0.183) would have kept id 4 as well. */
static void test_top_k_then_top_p_then_temperature(void **state) {
    const double prob[6] = {0.04, 0.26, 0.11, 0.33, 0.16, 0.10};
    float logits[6];
    for (int i = 0; i < 6; i++) logits[i] = (float)log(prob[i]) + 3.0f; /* a shift changes nothing */
    Sampler sm;
    assert_int_equal(sampler_init(&sm, 6, 4, 0.6f, 2.0f, 31337), 0);
    const double w3 = sqrt(0.33), w1 = sqrt(0.26);
    const double p[2] = {w3 / (w3 + w1), w1 / (w3 + w1)};
    const int ids[2] = {3, 1};
    expect_draws(&sm, logits, p, ids, 2, 5000);
    sampler_free(&sm);
    /* top-p 0.7 reaches past 0.686: ids 3, 1 and 4, weighted sqrt(p) */
    assert_int_equal(sampler_init(&sm, 6, 4, 0.7f, 2.0f, 5), 0);
    const double w4 = sqrt(0.16), sum = w3 + w1 + w4;
    const double q[3] = {w3 / sum, w1 / sum, w4 / sum};
    const int ids3[3] = {3, 1, 4};
    expect_draws(&sm, logits, q, ids3, 3, 5000);
    sampler_free(&sm);
}

/* top-p at an exact boundary: four equal logits give probabilities of exactly 1/4, so the
 * running total reaches p = 0.5 exactly at the second token, and p = 0.75 at the third:
 * top-p keeps exactly 2 (then 3), never one more. Ties rank by index, so the kept tokens
 * are the first ones. */
static void test_top_p_at_an_exact_boundary(void **state) {
    (void)state;
    const float logits[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    const struct { float p; int kept; } cases[] = {{0.5f, 2}, {0.75f, 3}, {0.25f, 1}, {1.0f, 4}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int seen[4] = {0};
        for (uint64_t seed = 1; seed <= 400; seed++) {
            Sampler s;
            assert_int_equal(sampler_init(&s, 4, 4, cases[c].p, 1.0f, seed), 0);
            seen[sampler_sample(&s, logits)]++;
            sampler_free(&s);
        }
        for (int i = 0; i < 4; i++)
            if ((seen[i] > 0) != (i < cases[c].kept))
                fail_msg("top-p %g: token %d drawn %d times; want the first %d only, each drawn", (double)cases[c].p, i,
                         seen[i], cases[c].kept);
    }
}

static void test_rejects_bad_parameters(void **state) {
    Sampler sm;
    assert_int_equal(sampler_init(&sm, 100, 0, 1.0f, 1.0f, 1), -1);
    assert_int_equal(sampler_init(&sm, 100, 101, 1.0f, 1.0f, 1), -1);
    assert_int_equal(sampler_init(&sm, 100, 5, 1.0f, -0.5f, 1), -1);
    assert_int_equal(sampler_init(&sm, 100, 5, 1.0f, NAN, 1), -1);
    assert_int_equal(sampler_init(&sm, 100, 5, 1.0f, INFINITY, 1), -1);
    assert_int_equal(sampler_init(&sm, 100, 5, -0.01f, 1.0f, 1), -1);
    assert_int_equal(sampler_init(&sm, 100, 5, 1.01f, 1.0f, 1), -1);
    assert_int_equal(sampler_init(&sm, 100, 5, NAN, 1.0f, 1), -1);
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

/* Speculative sampling: draft tokens drawn from q, kept or replaced by sampler_accept,
 * must come out distributed as the target's p. Pearson's chi-square over `draws` with
 * fixed seeds against the 99.99% point of its distribution (29.88 for 7 degrees of
 * freedom): a sampler that keeps every draft token (so follows q), or resamples from p
 * instead of the residual, lands in the thousands. */
static double chi_square_of_speculation(const float *target, const float *draft, int top_k, float temperature,
                                        const double *expect, int draws) {
    enum { N = 8 };
    Sampler ts, ds;
    assert_int_equal(sampler_init(&ts, N, top_k, 1.0f, temperature, 11), 0);
    assert_int_equal(sampler_init(&ds, N, top_k, 1.0f, temperature, 29), 0);
    float p[N], q[N], residual[N];
    sampler_probs(&ts, target, p);
    sampler_probs(&ds, draft, q);
    long count[N] = {0}, kept = 0;
    for (int i = 0; i < draws; i++) {
        const int x = sampler_draw(&ds, q);
        int accepted;
        count[sampler_accept(&ts, p, q, x, residual, &accepted)]++;
        kept += accepted;
    }
    double chi = 0.0;
    for (int i = 0; i < N; i++) {
        if (expect[i] == 0.0) {
            assert_int_equal(count[i], 0); /* outside top-k: never emitted */
            continue;
        }
        const double e = expect[i] * draws;
        chi += (count[i] - e) * (count[i] - e) / e;
    }
    assert_true(kept > 0 && kept < draws); /* both branches taken */
    sampler_free(&ts);
    sampler_free(&ds);
    return chi;
}

/* The expected distribution computed here, not by the sampler: softmax of logits / T over
 * the k largest. */
static void softmax_top_k(const float *logits, int n, int k, float t, double *out) {
    double sum = 0.0;
    for (int i = 0; i < n; i++) {
        int above = 0;
        for (int j = 0; j < n; j++) above += logits[j] > logits[i];
        out[i] = above < k ? exp(logits[i] / t) : 0.0;
        sum += out[i];
    }
    for (int i = 0; i < n; i++) out[i] /= sum;
}

static void test_speculative_sampling_follows_the_target(void **state) {
    const float target[8] = {2.0f, 1.0f, 0.5f, -1.0f, 0.0f, 1.5f, -0.5f, 0.2f};
    const float draft[8] = {0.0f, 2.0f, 0.5f, 1.0f, -1.0f, 0.0f, 1.0f, 0.3f}; /* quite another shape */
    double expect[8];
    softmax_top_k(target, 8, 8, 1.0f, expect);
    const double chi = chi_square_of_speculation(target, draft, 8, 1.0f, expect, 200000);
    if (chi > 29.88) fail_msg("chi-square %.1f over 7 degrees of freedom", chi);
    /* top-k 5 at temperature 0.7, the same transform for both; 4 degrees: 99.99% at 23.51 */
    softmax_top_k(target, 8, 5, 0.7f, expect);
    const double chi_k = chi_square_of_speculation(target, draft, 5, 0.7f, expect, 200000);
    if (chi_k > 23.51) fail_msg("top-k 5: chi-square %.1f over 4 degrees of freedom", chi_k);
}

/* Greedy: one-hot p and q keep x exactly when it is the target's argmax, else emit it. */
static void test_speculative_greedy(void **state) {
    Sampler s;
    assert_int_equal(sampler_init(&s, 4, 1, 1.0f, 0.0f, 1), 0);
    const float target[4] = {0.0f, 3.0f, 1.0f, 2.0f}, draft[4] = {0.0f, 1.0f, 1.0f, 2.0f};
    float p[4], q[4], residual[4];
    sampler_probs(&s, target, p);
    sampler_probs(&s, draft, q);
    int accepted;
    assert_int_equal(sampler_accept(&s, p, q, 3, residual, &accepted), 1);
    assert_int_equal(accepted, 0);
    assert_int_equal(sampler_accept(&s, p, p, 1, residual, &accepted), 1);
    assert_int_equal(accepted, 1);
    sampler_free(&s);
}

/* Prompt lookup: the longest suffix (up to NGRAM_MAX) found earlier, its most recent
 * occurrence, and up to k of the tokens that followed it. */
static void test_draft_ngram(void **state) {
    int out[8];
    /* ... 5 6 7 9 ... 6 7 8 1 2 ... 6 7: the 2-gram "6 7" last occurs at 5, so 8 1 2 */
    const int a[] = {5, 6, 7, 9, 4, 6, 7, 8, 1, 2, 3, 6, 7};
    assert_int_equal(draft_ngram(a, 13, 3, out), 3);
    assert_int_equal(out[0], 8);
    assert_int_equal(out[1], 1);
    assert_int_equal(out[2], 2);
    /* a 3-gram beats a more recent 1-gram: "1 2 3" at 0 is followed by 4 */
    const int b[] = {1, 2, 3, 4, 5, 3, 9, 1, 2, 3};
    assert_int_equal(draft_ngram(b, 10, 2, out), 2);
    assert_int_equal(out[0], 4);
    assert_int_equal(out[1], 5);
    /* the draft stops at the end of the sequence: "7" at 1 is followed by 8 and 7 only */
    const int c[] = {6, 7, 8, 7};
    assert_int_equal(draft_ngram(c, 4, 5, out), 2);
    assert_int_equal(out[0], 8);
    assert_int_equal(out[1], 7);
    /* no match, and too short a sequence: an empty draft */
    const int d[] = {1, 2, 3, 4};
    assert_int_equal(draft_ngram(d, 4, 4, out), 0);
    assert_int_equal(draft_ngram(d, 1, 4, out), 0);
}

/* A corpus table file (docs/FORMAT.md, "N-gram table") of orders 1 to 3 for tok: entries
 * given as {order, ids..., next}; the pieces' hash computed here, apart from draft.c's. */
static const char *write_table(const char *name, const SpmTokenizer *tok, const int (*entries)[5], int n,
                               uint32_t version, int break_hash) {
    unsigned char buf[4096];
    size_t at = 0;
    uint64_t h = 0xcbf29ce484222325ull;
    for (int id = 0; id < spm_vocab_size(tok); id++) {
        const unsigned char *p = (const unsigned char *)spm_piece(tok, id);
        do h = (h ^ *p) * 0x100000001b3ull;
        while (*p++);
    }
    if (break_hash) h ^= 1;
    const uint32_t head[4] = {version, (uint32_t)spm_vocab_size(tok), 3, 0};
    memcpy(buf, "RUNNGRAM", 8), at = 8;
    memcpy(buf + at, head, sizeof head), at += sizeof head; /* little-endian host, as the checkpoints */
    memcpy(buf + at, &h, 8), at += 8;
    for (int order = 1; order <= 3; order++) {
        uint32_t count = 0;
        for (int e = 0; e < n; e++) count += entries[e][0] == order;
        memcpy(buf + at, &count, 4), at += 4;
    }
    for (int order = 1; order <= 3; order++)
        for (int e = 0; e < n; e++)
            for (int i = 1; entries[e][0] == order && i <= order + 1; i++) {
                const uint16_t id = (uint16_t)entries[e][i];
                memcpy(buf + at, &id, 2), at += 2;
            }
    const char *path = temp_path(name);
    assert_int_equal(write_whole_file(path, buf, at), 0);
    return path;
}

static const int TABLE[][5] = {
    {1, 10, 11},        {1, 11, 12},    {1, 12, 13}, {1, 13, 10}, {1, 20, 21}, /* order 1 */
    {2, 10, 11, 30},    {2, 5, 12, 40},                                        /* order 2 */
    {3, 9, 10, 11, 50},                                                        /* order 3 */
};

static int drafts(const NgramTable *t, const int *tokens, int n, int k, int *out) {
    for (int i = 0; i < 8; i++) out[i] = -1;
    return draft_table(t, tokens, n, k, out);
}

/* The corpus table drafts the next token of the longest context it holds that ends the
 * sequence, the drafts so far included, until it holds none or k are drafted. */
static void test_draft_table(void **state) {
    (void)state;
    char err[256];
    SpmTokenizer *tok = spm_load_file(g_tokenizer_path, err, sizeof err);
    assert_non_null(tok);
    Model target;
    memset(&target, 0, sizeof target);
    target.cfg.vocab_size = spm_vocab_size(tok);
    target.tokenizer = tok;
    NgramTable t;
    const int n = (int)(sizeof TABLE / sizeof TABLE[0]);
    assert_int_equal(ngram_table_load(&t, write_table("table", tok, TABLE, n, 1, 0), &target, err, sizeof err), 0);
    int out[8];
    /* "1 10": no (1 10), so (10) -> 11; then (10 11) -> 30 beats (11) -> 12; then nothing */
    assert_int_equal(drafts(&t, (const int[]){1, 10}, 2, 4, out), 2);
    assert_int_equal(out[0], 11), assert_int_equal(out[1], 30);
    /* "9 10": 11, then the 3-token context (9 10 11) -> 50 */
    assert_int_equal(drafts(&t, (const int[]){9, 10}, 2, 4, out), 2);
    assert_int_equal(out[0], 11), assert_int_equal(out[1], 50);
    /* (5 12) -> 40 beats (12) -> 13 */
    assert_int_equal(drafts(&t, (const int[]){3, 5, 12}, 3, 4, out), 1);
    assert_int_equal(out[0], 40);
    /* a chain through the last 3 tokens only: 12 -> 13 -> 10 -> 11, then (10 11) -> 30 */
    assert_int_equal(drafts(&t, (const int[]){12}, 1, 6, out), 4);
    assert_int_equal(out[0], 13), assert_int_equal(out[1], 10), assert_int_equal(out[2], 11);
    assert_int_equal(out[3], 30);
    /* k ends it */
    assert_int_equal(drafts(&t, (const int[]){12}, 1, 2, out), 2);
    assert_int_equal(out[2], -1);
    /* no context of the last token: an empty draft */
    assert_int_equal(drafts(&t, (const int[]){10, 7}, 2, 4, out), 0);
    ngram_table_free(&t);

    /* bad tables: refused with one sentence, nothing kept */
    assert_int_equal(ngram_table_load(&t, write_table("hash", tok, TABLE, n, 1, 1), &target, err, sizeof err), -1);
    assert_non_null(strstr(err, "tokenizer"));
    assert_int_equal(ngram_table_load(&t, write_table("version", tok, TABLE, n, 2, 0), &target, err, sizeof err), -1);
    assert_non_null(strstr(err, "version 2"));
    const int twice[][5] = {{1, 10, 11}, {2, 10, 11, 30}, {2, 10, 11, 31}};
    assert_int_equal(ngram_table_load(&t, write_table("twice", tok, twice, 3, 1, 0), &target, err, sizeof err), -1);
    assert_non_null(strstr(err, "twice"));
    const int past[][5] = {{1, 10, 11}, {2, 10, 4096, 30}};
    assert_int_equal(ngram_table_load(&t, write_table("past", tok, past, 2, 1, 0), &target, err, sizeof err), -1);
    assert_non_null(strstr(err, "past the vocabulary"));
    size_t size;
    unsigned char *whole = read_whole_file(write_table("cut", tok, TABLE, n, 1, 0), &size);
    const char *cut = temp_path("cut");
    assert_int_equal(write_whole_file(cut, whole, size - 2), 0);
    free(whole);
    assert_int_equal(ngram_table_load(&t, cut, &target, err, sizeof err), -1);
    assert_non_null(strstr(err, "its header gives"));
    assert_int_equal(t.orders, 0);
    /* not a table (a checkpoint, a missing file): 1, for the checkpoint loader to read */
    const char *other = temp_path("other");
    assert_int_equal(write_whole_file(other, "RUNNGRAX and more", 17), 0);
    assert_int_equal(ngram_table_load(&t, other, &target, err, sizeof err), 1);
    assert_int_equal(ngram_table_load(&t, temp_path("missing"), &target, err, sizeof err), 1);
    spm_free(tok);
}

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_is_argmax),
        cmocka_unit_test(test_top_k_distribution),
        cmocka_unit_test(test_seed_and_temperature),
        cmocka_unit_test(test_rejects_bad_parameters),
        cmocka_unit_test(test_random_range),
        cmocka_unit_test(test_top_p_keeps_the_nucleus),
        cmocka_unit_test(test_top_p_at_an_exact_boundary),
        cmocka_unit_test(test_top_k_then_top_p_then_temperature),
        cmocka_unit_test(test_speculative_sampling_follows_the_target),
        cmocka_unit_test(test_speculative_greedy),
        cmocka_unit_test(test_draft_ngram),
        cmocka_unit_test(test_draft_table),
    };
    return cmocka_run_group_tests_name("sampler", tests, NULL, NULL);
}
