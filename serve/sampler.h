/* sampler.h: greedy, top-k and top-p (nucleus) sampling with a seeded xorshift64*
 * generator. The filters run in llama.cpp's default order: top-k keeps the k most
 * likely tokens, top-p then keeps the fewest of them (most likely first) whose
 * probabilities, at temperature 1, sum to at least p, and the temperature then scales
 * the logits of those that remain before one is drawn. A sampler reads nothing but its
 * own logits and generator, so a sequence's draws do not depend on its batch. */
#ifndef SAMPLER_H
#define SAMPLER_H

#include <stdint.h>

typedef struct {
    float value;
    int index;
} ProbIndex;

typedef struct {
    int vocab_size;
    int top_k;         /* 1 = greedy (argmax) */
    float top_p;       /* 1 = off; 0 keeps the most likely token only */
    float temperature; /* 0 = greedy */
    uint64_t rng_state;
    ProbIndex *top; /* (top_k) scratch */
} Sampler;

/* Returns -1 when top_k is not in 1..vocab_size, top_p not in 0..1, or temperature is
 * negative or not finite. */
int sampler_init(Sampler *s, int vocab_size, int top_k, float top_p, float temperature, uint64_t seed);
void sampler_free(Sampler *s);
int sampler_argmax(const float *logits, int n); /* the first index of the maximum */
int sampler_sample(Sampler *s, const float *logits);
float sampler_random_f32(uint64_t *state); /* uniform in [0, 1) */

#endif /* SAMPLER_H */
