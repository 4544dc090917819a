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

/* The distribution sampler_sample draws from, over the whole vocabulary: zero outside the
 * tokens top-k and top-p keep, softmax at the temperature inside; greedy: one-hot at the
 * argmax. Speculative decoding transforms draft and target logits by the same sampler
 * settings, so that acceptance compares the two distributions the tokens come from. */
void sampler_probs(Sampler *s, const float *logits, float *probs);
/* Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft token x was drawn
 * from q; it is kept with probability min(1, p[x] / q[x]), else a token is drawn from
 * max(0, p - q) normalized. Either way the token returned follows p exactly. *accepted
 * says which; residual: (vocab_size) scratch. With one-hot p and q (greedy) x is kept
 * exactly when it is the target's argmax, which is returned otherwise. */
int sampler_accept(Sampler *s, const float *p, const float *q, int x, float *residual, int *accepted);
/* A draw from probs (vocab_size, summing to about 1). */
int sampler_draw(Sampler *s, const float *probs);

#endif /* SAMPLER_H */
