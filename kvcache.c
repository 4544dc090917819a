/* kvcache.c: allocation and accounting of the KV cache (layout in kvcache.h). */
#include "kvcache.h"

#include <stdlib.h>
#include <string.h>

static size_t floats_per_layer_token(const KVCache *c) {
    return c->latent_width > 0 ? (size_t)c->latent_width : (size_t)c->n_kv_heads * c->head_dim;
}

int kv_init(KVCache *cache, const Config *c, int capacity) {
    memset(cache, 0, sizeof *cache);
    const int is_mla = c->variant == VARIANT_MLA;
    cache->n_layers = c->n_layers;
    cache->capacity = capacity;
    cache->n_kv_heads = is_mla ? 0 : c->n_kv_heads;
    cache->head_dim = c->head_dim;
    cache->latent_width = is_mla ? c->kv_latent + c->rope_dim : 0;
    size_t n = (size_t)c->n_layers * (size_t)capacity * floats_per_layer_token(cache);
    cache->k = alloc_floats_touched(n);
    cache->v = is_mla ? NULL : alloc_floats_touched(n);
    if (!cache->k || (!is_mla && !cache->v)) {
        kv_free(cache);
        return -1;
    }
    return 0;
}

void kv_free(KVCache *cache) {
    free(cache->k);
    free(cache->v);
    cache->k = cache->v = NULL;
    cache->len = 0;
}

void kv_reset(KVCache *cache) { cache->len = 0; }

size_t kv_bytes_per_token(const KVCache *cache) {
    size_t per_layer = floats_per_layer_token(cache) * sizeof(float) * (cache->latent_width > 0 ? 1 : 2);
    return per_layer * (size_t)cache->n_layers;
}

size_t kv_bytes_allocated(const KVCache *cache) {
    if (!cache->k) return 0;
    return kv_bytes_per_token(cache) * (size_t)cache->capacity;
}
