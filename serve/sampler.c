/* sampler.c: greedy, top-k and top-p sampling (sampler.h). */
#include "serve/sampler.h"

#include <math.h>
#include <stdlib.h>

int sampler_init(Sampler *s, int vocab_size, int top_k, float top_p, float temperature, uint64_t seed) {
    if (top_k < 1 || top_k > vocab_size || !(top_p >= 0.0f && top_p <= 1.0f) || !(temperature >= 0.0f) ||
        !isfinite(temperature))
        return -1;
    s->vocab_size = vocab_size;
    s->top_k = top_k;
    s->top_p = top_p;
    s->temperature = temperature;
    s->rng_state = seed ? seed : 0x9E3779B97F4A7C15ull; /* xorshift needs a nonzero state */
    s->top = malloc((size_t)top_k * sizeof *s->top);
    return s->top ? 0 : -1;
}

void sampler_free(Sampler *s) {
    free(s->top);
    s->top = NULL;
}

static uint32_t random_u32(uint64_t *state) {
    /* xorshift64*, as in llama2.c */
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return (uint32_t)((*state * 0x2545F4914F6CDD1Dull) >> 32);
}

float sampler_random_f32(uint64_t *state) { return (float)(random_u32(state) >> 8) / 16777216.0f; }

int sampler_argmax(const float *logits, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}

/* a ranks before b: larger value, then smaller index */
static int ranks_before(ProbIndex a, ProbIndex b) {
    return a.value > b.value || (a.value == b.value && a.index < b.index);
}

/* Puts x at the root of the min-heap top[0..size) (root = the worst) and sifts it down. */
static void sift_down(ProbIndex *top, int size, ProbIndex x) {
    int j = 0;
    for (;;) {
        int c = 2 * j + 1;
        if (c >= size) break;
        if (c + 1 < size && ranks_before(top[c], top[c + 1])) c++;
        if (!ranks_before(x, top[c])) break;
        top[j] = top[c];
        j = c;
    }
    top[j] = x;
}

/* The k best logits, best first: a min-heap of size k over the vocabulary, then sorted. */
static void select_top_k(ProbIndex *top, int k, const float *logits, int n) {
    int size = 0;
    for (int i = 0; i < n; i++) {
        ProbIndex x = {logits[i], i};
        if (size < k) { /* sift up */
            int j = size++;
            while (j > 0 && ranks_before(top[(j - 1) / 2], x)) {
                top[j] = top[(j - 1) / 2];
                j = (j - 1) / 2;
            }
            top[j] = x;
        } else if (ranks_before(x, top[0])) {
            sift_down(top, k, x); /* replaces the worst */
        }
    }
    for (int end = size - 1; end > 0; end--) { /* heap sort: the worst goes to the end */
        ProbIndex worst = top[0];
        sift_down(top, end, top[end]);
        top[end] = worst;
    }
}

/* How many of the n candidates (best first) top-p keeps: the fewest whose probabilities at
 * temperature 1 (a softmax over the candidates) sum to at least p, and at least one. */
static int top_p_count(const ProbIndex *top, int n, float p) {
    if (p >= 1.0f) return n;
    const float max = top[0].value;
    double total = 0.0, sum = 0.0;
    for (int i = 0; i < n; i++) total += exp((double)top[i].value - max);
    for (int i = 0; i < n; i++) {
        sum += exp((double)top[i].value - max);
        if (sum >= p * total) return i + 1;
    }
    return n; /* rounding */
}

int sampler_sample(Sampler *s, const float *logits) {
    if (s->top_k == 1 || s->temperature == 0.0f) return sampler_argmax(logits, s->vocab_size);
    select_top_k(s->top, s->top_k, logits, s->vocab_size);
    const int n = top_p_count(s->top, s->top_k, s->top_p);
    float max = s->top[0].value, sum = 0.0f;
    for (int i = 0; i < n; i++) {
        s->top[i].value = expf((s->top[i].value - max) / s->temperature);
        sum += s->top[i].value;
    }
    float r = sampler_random_f32(&s->rng_state) * sum, cdf = 0.0f;
    for (int i = 0; i < n; i++) {
        cdf += s->top[i].value;
        if (r < cdf) return s->top[i].index;
    }
    return s->top[n - 1].index; /* rounding */
}

void sampler_probs(Sampler *s, const float *logits, float *probs) {
    for (int i = 0; i < s->vocab_size; i++) probs[i] = 0.0f;
    if (s->top_k == 1 || s->temperature == 0.0f) {
        probs[sampler_argmax(logits, s->vocab_size)] = 1.0f;
        return;
    }
    select_top_k(s->top, s->top_k, logits, s->vocab_size);
    const int n = top_p_count(s->top, s->top_k, s->top_p);
    const float max = s->top[0].value;
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += probs[s->top[i].index] = expf((s->top[i].value - max) / s->temperature);
    for (int i = 0; i < n; i++) probs[s->top[i].index] /= sum;
}

int sampler_draw(Sampler *s, const float *probs) {
    float sum = 0.0f, cdf = 0.0f;
    int last = 0;
    for (int i = 0; i < s->vocab_size; i++) sum += probs[i];
    const float r = sampler_random_f32(&s->rng_state) * sum;
    for (int i = 0; i < s->vocab_size; i++) {
        if (probs[i] <= 0.0f) continue;
        cdf += probs[i];
        last = i;
        if (r < cdf) return i;
    }
    return last; /* rounding */
}

int sampler_accept(Sampler *s, const float *p, const float *q, int x, float *residual, int *accepted) {
    /* q[x] > 0 since x was drawn from q; r < p/q without dividing, and never for p[x] = 0 */
    *accepted = p[x] > 0.0f && (p[x] >= q[x] || sampler_random_f32(&s->rng_state) * q[x] < p[x]);
    if (*accepted) return x;
    float sum = 0.0f;
    for (int i = 0; i < s->vocab_size; i++) sum += residual[i] = p[i] > q[i] ? p[i] - q[i] : 0.0f;
    return sum > 0.0f ? sampler_draw(s, residual) : sampler_draw(s, p); /* p = q: only by rounding */
}
