/* sampler.h: greedy and top-k sampling with a seeded xorshift64* generator. */
#ifndef SAMPLER_H
#define SAMPLER_H

#include <stdint.h>

typedef struct {
    float value;
    int index;
} ProbIndex;

typedef struct {
    int vocab_size;
    int top_k;          /* 1 = greedy (argmax) */
    float temperature;  /* 0 = greedy */
    uint64_t rng_state;
    ProbIndex *top;     /* (top_k) scratch */
} Sampler;

/* Returns -1 when top_k is not in 1..vocab_size or temperature is negative or not finite. */
int sampler_init(Sampler *s, int vocab_size, int top_k, float temperature, uint64_t seed);
void sampler_free(Sampler *s);
int sampler_argmax(const float *logits, int n);     /* the first index of the maximum */
int sampler_sample(Sampler *s, const float *logits);
float sampler_random_f32(uint64_t *state);          /* uniform in [0, 1) */

#endif /* SAMPLER_H */
