/* kvcache.h: the KV cache. fp32, allocated once for the whole context.
 *
 * MHA / GQA / MQA: per layer and KV head, keys and values of every position:
 *     k, v: [n_layers][n_kv_heads][max_seq_len][head_dim]   (k after RoPE)
 *     bytes per token = 2 * n_layers * n_kv_heads * head_dim * 4
 * MLA: per layer and position, the latent c and the shared RoPE key k_R, side by side:
 *     k: [n_layers][max_seq_len][kv_latent + rope_dim]      (v is unused)
 *     bytes per token = n_layers * (kv_latent + rope_dim) * 4
 *
 * A run without the cache uses the same structure as scratch for the one pass it
 * recomputes at every step, so both modes share every line of attention code. */
#ifndef KVCACHE_H
#define KVCACHE_H

#include <stddef.h>

typedef struct {
    int n_layers, max_seq_len;
    int n_kv_heads, head_dim;  /* 0 heads for MLA */
    int latent_width;          /* MLA: kv_latent + rope_dim; otherwise 0 */
    float *k, *v;
    int len;                   /* positions held: [0, len) */
} KVCache;

/* Returns -1 when the allocation fails. */
int kv_init(KVCache *c, int n_layers, int max_seq_len, int n_kv_heads, int head_dim, int latent_width);
void kv_free(KVCache *c);
void kv_reset(KVCache *c);                    /* forgets every position */
size_t kv_bytes_per_token(const KVCache *c);
size_t kv_bytes_allocated(const KVCache *c);

static inline float *kv_key(const KVCache *c, int layer, int head, int pos) {
    return c->k + (((size_t)layer * c->n_kv_heads + head) * c->max_seq_len + pos) * c->head_dim;
}
static inline float *kv_value(const KVCache *c, int layer, int head, int pos) {
    return c->v + (((size_t)layer * c->n_kv_heads + head) * c->max_seq_len + pos) * c->head_dim;
}
/* MLA: [c (kv_latent) ; k_R (rope_dim)] of one position */
static inline float *kv_latent(const KVCache *c, int layer, int pos) {
    return c->k + ((size_t)layer * c->max_seq_len + pos) * c->latent_width;
}

#endif /* KVCACHE_H */
