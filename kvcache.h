/* kvcache.h: the KV cache. fp32, allocated once for `capacity` positions.
 *
 * MHA / GQA / MQA: per layer and KV head, keys and values of every position:
 *     k, v: [n_layers][n_kv_heads][capacity][head_dim]   (k after RoPE)
 *     bytes per token = 2 * n_layers * n_kv_heads * head_dim * 4
 * MLA: per layer and position, the latent c and the shared RoPE key k_R, side by side:
 *     k: [n_layers][capacity][kv_latent + rope_dim]       (v is unused)
 *     bytes per token = n_layers * (kv_latent + rope_dim) * 4
 *
 * The cache owns its positions: it holds [0, len), a forward pass appends the next T
 * at len and advances len (model.h). A run without the cache resets it before every
 * pass, so both modes share every line of attention code. */
#ifndef KVCACHE_H
#define KVCACHE_H

#include <stddef.h>

#include "config.h"

typedef struct {
    int n_layers, capacity;
    int n_kv_heads, head_dim;  /* 0 heads for MLA */
    int latent_width;          /* MLA: kv_latent + rope_dim; otherwise 0 */
    float *k, *v;
    int len;                   /* positions held: [0, len) */
} KVCache;

/* A cache for `capacity` positions of model c. Returns -1 when the allocation fails. */
int kv_init(KVCache *cache, const Config *c, int capacity);
void kv_free(KVCache *cache);
void kv_reset(KVCache *cache);                    /* forgets every position */
size_t kv_bytes_per_token(const KVCache *cache);
size_t kv_bytes_allocated(const KVCache *cache);

static inline float *kv_key(const KVCache *c, int layer, int head, int pos) {
    return c->k + (((size_t)layer * c->n_kv_heads + head) * c->capacity + pos) * c->head_dim;
}
static inline float *kv_value(const KVCache *c, int layer, int head, int pos) {
    return c->v + (((size_t)layer * c->n_kv_heads + head) * c->capacity + pos) * c->head_dim;
}
/* MLA: [c (kv_latent) ; k_R (rope_dim)] of one position */
static inline float *kv_latent(const KVCache *c, int layer, int pos) {
    return c->k + ((size_t)layer * c->capacity + pos) * c->latent_width;
}

#endif /* KVCACHE_H */
