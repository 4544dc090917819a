/* kvcache.c: the block pool and the block tables (kvcache.h). */
#include "kvcache.h"

#include <stdlib.h>
#include <string.h>

int kv_pool_init(KVPool *pool, const Config *c, int n_blocks) {
    memset(pool, 0, sizeof *pool);
    const int is_mla = c->variant == VARIANT_MLA;
    pool->n_layers = c->n_layers;
    pool->n_kv_heads = is_mla ? 0 : c->n_kv_heads;
    pool->head_dim = c->head_dim;
    pool->latent_width = is_mla ? c->kv_latent + c->rope_dim : 0;
    pool->layer_floats = (size_t)KV_BLOCK_TOKENS *
                         (is_mla ? (size_t)pool->latent_width : 2 * (size_t)pool->n_kv_heads * pool->head_dim);
    pool->n_blocks = n_blocks;
    pool->data = alloc_floats_touched((size_t)n_blocks * pool->n_layers * pool->layer_floats);
    pool->refs = calloc((size_t)n_blocks, sizeof(int));
    pool->free_blocks = malloc((size_t)n_blocks * sizeof(int));
    if (n_blocks < 1 || !pool->data || !pool->refs || !pool->free_blocks) {
        kv_pool_free(pool);
        return -1;
    }
    for (int i = 0; i < n_blocks; i++) pool->free_blocks[i] = n_blocks - 1 - i;  /* block 0 first */
    pool->n_free = n_blocks;
    return 0;
}

void kv_pool_free(KVPool *pool) {
    free(pool->data);
    free(pool->refs);
    free(pool->free_blocks);
    memset(pool, 0, sizeof *pool);
}

size_t kv_block_bytes_for(const Config *c) {
    const size_t per_token = c->variant == VARIANT_MLA ? (size_t)(c->kv_latent + c->rope_dim)
                                                       : 2 * (size_t)c->n_kv_heads * (size_t)c->head_dim;
    return (size_t)c->n_layers * KV_BLOCK_TOKENS * per_token * sizeof(float);
}

size_t kv_block_bytes(const KVPool *pool) { return (size_t)pool->n_layers * pool->layer_floats * sizeof(float); }

size_t kv_bytes_per_token(const KVPool *pool) { return kv_block_bytes(pool) / KV_BLOCK_TOKENS; }

static int take_block(KVPool *pool) {
    const int b = pool->free_blocks[--pool->n_free];
    pool->refs[b] = 1;
    if (kv_blocks_in_use(pool) > pool->peak_in_use) pool->peak_in_use = kv_blocks_in_use(pool);
    return b;
}

static void release_block(KVPool *pool, int b) {
    if (--pool->refs[b] == 0) pool->free_blocks[pool->n_free++] = b;
}

int kv_init(KVCache *cache, KVPool *pool, int max_len) {
    memset(cache, 0, sizeof *cache);
    cache->pool = pool;
    cache->max_blocks = kv_blocks_for(max_len);
    cache->blocks = malloc((size_t)(cache->max_blocks ? cache->max_blocks : 1) * sizeof(int));
    return cache->blocks ? 0 : -1;
}

void kv_reset(KVCache *cache) {
    for (int i = 0; i < cache->n_blocks; i++) release_block(cache->pool, cache->blocks[i]);
    cache->n_blocks = 0;
    cache->len = 0;
}

void kv_free(KVCache *cache) {
    if (cache->pool) kv_reset(cache);
    free(cache->blocks);
    memset(cache, 0, sizeof *cache);
}

/* The block holding position len is written next: a private copy is needed when it is
 * shared. */
static int first_write_is_shared(const KVCache *cache) {
    const int b = cache->len / KV_BLOCK_TOKENS;
    return b < cache->n_blocks && cache->pool->refs[cache->blocks[b]] > 1;
}

int kv_blocks_needed(const KVCache *cache, int new_len) {
    const int more = kv_blocks_for(new_len) - cache->n_blocks;
    return (more > 0 ? more : 0) + (new_len > cache->len && first_write_is_shared(cache));
}

int kv_reserve(KVCache *cache, int new_len) {
    KVPool *pool = cache->pool;
    if (kv_blocks_for(new_len) > cache->max_blocks) return -1;
    if (kv_blocks_needed(cache, new_len) > pool->n_free) return -1;
    if (new_len > cache->len && first_write_is_shared(cache)) {
        int *slot = &cache->blocks[cache->len / KV_BLOCK_TOKENS];
        const int copy = take_block(pool);
        const size_t floats = (size_t)pool->n_layers * pool->layer_floats;
        memcpy(pool->data + (size_t)copy * floats, pool->data + (size_t)*slot * floats, floats * sizeof(float));
        release_block(pool, *slot);
        *slot = copy;
    }
    while (cache->n_blocks < kv_blocks_for(new_len)) cache->blocks[cache->n_blocks++] = take_block(pool);
    return 0;
}

void kv_share_prefix(KVCache *dst, const KVCache *src, int len) {
    kv_reset(dst);
    for (int i = 0; i < kv_blocks_for(len); i++) {
        dst->blocks[i] = src->blocks[i];
        dst->pool->refs[src->blocks[i]]++;
    }
    dst->n_blocks = kv_blocks_for(len);
    dst->len = len;
}
