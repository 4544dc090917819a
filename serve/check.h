/* check.h: the comparators behind --check-batch and --check-kv (modes.h), apart from the
 * runs that feed them, so that the unit tests can show them runs that differ in one bit. */
#ifndef CHECK_H
#define CHECK_H

#include <stdint.h>

/* ---- --check-batch: a sequence in the batch against the same sequence run alone ---- */

/* FNV-1a of a row of logits' bytes: two rows hash alike only when (barring a collision)
 * every bit agrees. --check-batch keeps a hash a step, not the logits, to hold a whole
 * batch's runs. */
uint64_t hash_logits(const float *logits, int vocab);

/* One sequence's run: its tokens (the prompt's n_prompt first) and the hash of each of its
 * steps' logits (`generated` steps). */
typedef struct {
    const int *tokens;
    int n_tokens, n_prompt;
    const uint64_t *step_hashes;
    int generated;
} HashedRun;

/* What --check-batch found for one sequence: its steps, the tokens it generated alike, its
 * verdict, and the first step whose logits differ (-1: none). */
typedef struct {
    int steps, same_tokens, identical, first_difference;
} BatchVerdict;

/* in_batch against alone: identical only when both have the same tokens, the same number
 * of steps and every step's logits hash alike. */
BatchVerdict compare_hashed_runs(const HashedRun *in_batch, const HashedRun *alone);

/* ---- --check-kv: greedy with the cache against greedy without ---- */

/* A greedy run: its logits, step by step (its tokens are their argmaxes). */
typedef struct {
    float *logits; /* (steps, vocab) */
    int steps;
} GreedyRun;

/* Two greedy runs compared step by step while both have seen the same tokens. */
typedef struct {
    char a[32], b[32]; /* the runs' names: kv[-form], no-kv[-form] */
    int same_form;     /* the same arithmetic: the logits should be the same bits */
    int steps;         /* compared */
    int identical_tokens, divergent_step, token_a, token_b; /* -1: none */
    int first_bitwise_difference;                           /* -1: none */
    double max_abs_logit_diff;
} KvComparison;

/* a against b (names and same_form left for the caller). */
KvComparison compare_greedy_runs(const GreedyRun *a, const GreedyRun *b, int vocab);
/* The comparison fails on different tokens or lengths, and for the same form on logits
 * whose bits differ. */
int comparison_fails(const KvComparison *c);

#endif /* CHECK_H */
