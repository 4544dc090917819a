/* kvcache.h: the paged KV cache.
 *
 * One pool of fixed-size blocks (KVPool) holds the cache of every sequence; a
 * sequence's cache (KVCache) is a block table that maps its positions to blocks.
 * A block holds KV_BLOCK_TOKENS consecutive positions of one sequence, every layer:
 *
 *   MHA / GQA / MQA: [layer][K, V][kv_head][KV_BLOCK_TOKENS][head_dim]   (K after RoPE)
 *   MLA:             [layer][KV_BLOCK_TOKENS][kv_latent + rope_dim]      (c ; k_R)
 *
 * so a head's keys of one block are one contiguous run that attention streams.
 * Bytes per token: 2 * n_layers * n_kv_heads * head_dim * 4, or n_layers * (kv_latent
 * + rope_dim) * 4 for MLA (fp32).
 *
 * Sequences may share blocks (a common prompt prefix): each block has a reference
 * count, and a sequence about to write into a shared block first copies it (copy on
 * write), so sharing never changes what another sequence reads. The cache owns its
 * positions: it holds [0, len), a forward pass appends at len and advances it
 * (model.h); kv_reserve provides the blocks beforehand. A run without the cache
 * resets it before every pass, so both modes share every line of attention code. */
#ifndef KVCACHE_H
#define KVCACHE_H

#include <stddef.h>

#include "config.h"

/* 16 positions a block: a multiple of the 16 keys attention's score kernel takes at a
 * time, and even, so the weighted sum's two chains (even and odd positions) run on
 * across blocks; a sequence wastes at most 15 positions in its last block. */
enum { KV_BLOCK_TOKENS = 16 };

typedef struct {
    int n_layers, n_kv_heads, head_dim;  /* 0 heads for MLA */
    int latent_width;                    /* MLA: kv_latent + rope_dim; otherwise 0 */
    size_t layer_floats;                 /* of one layer in one block */
    int n_blocks;
    float *data;                         /* (n_blocks, n_layers, layer_floats) */
    int *refs;                           /* (n_blocks) sequences holding each block; 0 = free */
    int *free_blocks, n_free;            /* a stack of the free block ids */
    int peak_in_use;                     /* the most blocks in use at once */
} KVPool;

/* A sequence's cache: positions [0, len) in blocks[0 .. n_blocks). */
typedef struct {
    KVPool *pool;
    int *blocks;          /* (max_blocks) block table */
    int n_blocks, max_blocks;
    int len;              /* positions held */
} KVCache;

/* A pool of n_blocks blocks for model c. Returns -1 when out of memory. */
int kv_pool_init(KVPool *pool, const Config *c, int n_blocks);
void kv_pool_free(KVPool *pool);
size_t kv_block_bytes(const KVPool *pool);
size_t kv_block_bytes_for(const Config *c);
size_t kv_bytes_per_token(const KVPool *pool);
static inline int kv_blocks_for(int positions) { return (positions + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS; }
static inline int kv_blocks_in_use(const KVPool *pool) { return pool->n_blocks - pool->n_free; }

/* An empty cache of up to max_len positions in pool. Returns -1 when out of memory. */
int kv_init(KVCache *cache, KVPool *pool, int max_len);
/* Gives its blocks back and frees the table. */
void kv_free(KVCache *cache);
/* Gives its blocks back: len 0. */
void kv_reset(KVCache *cache);
/* Makes positions [len, new_len) writable: new blocks, and a private copy of a shared
 * block that holds position len. Returns -1, changing nothing, when new_len is past
 * max_len or the pool has too few free blocks. */
int kv_reserve(KVCache *cache, int new_len);
/* Blocks a reservation up to new_len would take from the pool (copies included). */
int kv_blocks_needed(const KVCache *cache, int new_len);
/* dst (empty, same pool) shares src's positions [0, len): it holds len positions
 * without computing them. len <= src->len. */
void kv_share_prefix(KVCache *dst, const KVCache *src, int len);

/* Where one position's vectors are (the position must be reserved). */
static inline float *kv_block_layer(const KVCache *c, int layer, int pos) {
    const KVPool *p = c->pool;
    return p->data + ((size_t)c->blocks[pos / KV_BLOCK_TOKENS] * p->n_layers + layer) * p->layer_floats;
}
static inline float *kv_key(const KVCache *c, int layer, int head, int pos) {
    const KVPool *p = c->pool;
    return kv_block_layer(c, layer, pos) + ((size_t)head * KV_BLOCK_TOKENS + pos % KV_BLOCK_TOKENS) * p->head_dim;
}
static inline float *kv_value(const KVCache *c, int layer, int head, int pos) {
    const KVPool *p = c->pool;
    return kv_key(c, layer, head, pos) + (size_t)p->n_kv_heads * KV_BLOCK_TOKENS * p->head_dim;
}
/* MLA: [c (kv_latent) ; k_R (rope_dim)] of one position */
static inline float *kv_latent(const KVCache *c, int layer, int pos) {
    return kv_block_layer(c, layer, pos) + (size_t)(pos % KV_BLOCK_TOKENS) * c->pool->latent_width;
}

#endif /* KVCACHE_H */
