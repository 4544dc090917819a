/* kvcache.c: allocation and accounting of the KV cache (layout in kvcache.h). */
#include "kvcache.h"

#include "kernels.h"

#include <stdlib.h>
#include <string.h>

static size_t floats_per_layer_token(const KVCache *c) {
    return c->latent_width > 0 ? (size_t)c->latent_width : (size_t)c->n_kv_heads * c->head_dim;
}

int kv_init(KVCache *c, int n_layers, int max_seq_len, int n_kv_heads, int head_dim, int latent_width) {
    memset(c, 0, sizeof *c);
    c->n_layers = n_layers;
    c->max_seq_len = max_seq_len;
    c->n_kv_heads = latent_width > 0 ? 0 : n_kv_heads;
    c->head_dim = head_dim;
    c->latent_width = latent_width;
    size_t n = (size_t)n_layers * max_seq_len * floats_per_layer_token(c);
    c->k = alloc_floats_touched(n);
    c->v = latent_width > 0 ? NULL : alloc_floats_touched(n);
    if (!c->k || (latent_width == 0 && !c->v)) {
        kv_free(c);
        return -1;
    }
    return 0;
}

void kv_free(KVCache *c) {
    free(c->k);
    free(c->v);
    c->k = c->v = NULL;
    c->len = 0;
}

void kv_reset(KVCache *c) { c->len = 0; }

size_t kv_bytes_per_token(const KVCache *c) {
    size_t per_layer = floats_per_layer_token(c) * sizeof(float) * (c->latent_width > 0 ? 1 : 2);
    return per_layer * (size_t)c->n_layers;
}

size_t kv_bytes_allocated(const KVCache *c) {
    if (!c->k) return 0;
    return kv_bytes_per_token(c) * (size_t)c->max_seq_len;
}
