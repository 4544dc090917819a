/* kvcache.h: the paged KV cache.
 *
 * One pool of fixed-size blocks (KVPool) holds the cache of every sequence; a
 * sequence's cache (KVCache) is a block table that maps its positions to blocks.
 * A block holds KV_BLOCK_TOKENS slots of one sequence, every layer; per layer:
 *
 *   MHA / GQA / MQA: rows [K, V][kv_head][KV_BLOCK_TOKENS] of head_dim elements
 *   MLA:             rows [KV_BLOCK_TOKENS] of kv_latent + rope_dim elements (c ; k_R)
 *
 * then, for int8, each row's scales (one a KV head row; two an MLA row, for c and for
 * k_R). A head's rows of one block are one contiguous run that attention streams.
 * Elements are fp32, bf16 or int8 (the pool's dtype): bytes per token are 2 * n_layers *
 * n_kv_heads * head_dim * size (+ 4 per int8 row), or n_layers * (kv_latent + rope_dim) *
 * size (+ 8) for MLA.
 *
 * int4 and int2 (KIVI): a layer of a block holds each row group (a KV head's keys, its
 * values, or MLA's [c ; k_R] rows) as one packed group of its KV_BLOCK_TOKENS rows
 * (kernels.h's block_quantize): keys per channel over the block's 16 tokens, values per
 * token in groups of 32 channels; MLA's latent and k_R count as keys, since the score reads
 * them as keys (the weighted sum of the absorbed form reads c as values too). A block is
 * quantized when its 16th position is written, from its 16 fp32 rows: until then its rows
 * live in the sequence's tail, a ring of fp32 rows of the last tail_positions written,
 * and a query reads its own block's rows in fp32 and every earlier block packed. So what a
 * query at pos reads depends on pos alone (bitwise --check-kv), and the pool still shares
 * and frees whole blocks. KIVI's full-precision window R is thus 0 .. 15 here, not 128.
 *
 * Sequences may share blocks (a common prompt prefix): each block has a reference
 * count, and a sequence about to write into a shared block first copies it (copy on
 * write), so sharing never changes what another sequence reads. The cache owns its
 * positions: it has seen [0, len), a forward pass appends at len and advances it
 * (model.h); kv_reserve provides the blocks beforehand. A run without the cache empties it
 * before each step's passes, so both modes share every line of attention code.
 *
 * A window (kv_pool_set_window) bounds what a sequence keeps: W slots, the first `sinks`
 * positions forever and the most recent W - sinks in a ring, where the oldest position
 * is overwritten (sinks = 0: a plain ring buffer; sinks > 0: StreamingLLM). Or a
 * full window gives up what has been attended to least (kv_attend): one position (H2O,
 * keeping the most recent half of the window besides), or a whole block of 16 slots
 * (block-wise, as PagedEviction), which the next 16 positions then fill, so no block is
 * left with holes. A ring or sinks stores keys before RoPE and rotates them by their place
 * in the window when read, so it runs past the context; eviction by attention keeps every
 * position's own rotation, as H2O does, so its positions stay within the context. */
#ifndef KVCACHE_H
#define KVCACHE_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"

/* 16 positions a block: a multiple of the 16 keys attention's score kernel takes at a
 * time, and even, so the weighted sum's two chains (even and odd positions) run on
 * across blocks; a sequence wastes at most 15 positions in its last block. */
enum { KV_BLOCK_TOKENS = 16 };

/* What a full window gives up for a new position. */
typedef enum {
    KV_EVICT_OLDEST, /* the oldest position after the sinks (ring, sinks) */
    KV_EVICT_H2O,    /* the least attended position older than the window's recent half */
    KV_EVICT_BLOCK,  /* the least attended block of 16 slots holding none of the recent half */
} KVEvict;

typedef struct {
    int n_layers, n_kv_heads, head_dim; /* 0 heads for MLA */
    int row_width;                      /* elements a row: head_dim, or MLA's kv_latent + rope_dim */
    int split;                          /* int8: a row's second scale starts here (MLA's k_R); else row_width */
    size_t key_group_bytes, value_group_bytes; /* int4, int2: a row group's packed bytes in a layer */
    int tail_positions; /* int4, int2: KV_BLOCK_TOKENS, the block being filled; two blocks where a
                         * rollback (kv_truncate) of up to 17 positions (a verify pass of 16
                         * drafts) may reopen a block already quantized (kv_pool_set_rollback) */
    int n_scales;                       /* int8: scales a row (1 or 2); else 0 */
    DType dtype;
    size_t row_bytes, layer_bytes, scales_offset; /* within one layer of a block */
    int window, sinks;                            /* 0: no window */
    KVEvict evict;                                /* with a window */
    int n_blocks;
    unsigned char *data;      /* (n_blocks, n_layers, layer_bytes) */
    int *refs;                /* (n_blocks) sequences holding each block; 0 = free */
    int *free_blocks, n_free; /* a stack of the free block ids */
    int peak_in_use;          /* the most blocks in use at once */
    /* prefix sharing: blocks held by more than one sequence, and the references beyond the
     * first (the blocks sharing saves), now and at their most */
    int shared_blocks, saved_blocks;
    int peak_shared_blocks, peak_saved_blocks;
    struct KVTier *tier; /* kvtier.h: where a preempted sequence's blocks go (swap); NULL:
                          * it is recomputed. The pool neither opens nor closes it */
    struct KVStream *stream; /* kvtier.h: where the oldest blocks of a sequence the pool
                              * cannot hold go (one slot); NULL: a sequence must fit */
} KVPool;

/* A sequence's cache: it has seen positions [0, len); blocks[0 .. n_blocks) hold them, or
 * with a window the ones it keeps. */
typedef struct {
    KVPool *pool;
    int *blocks; /* (max_blocks) block table */
    int n_blocks, max_blocks;
    int len;     /* positions seen */
    float *tail; /* int4, int2: (n_layers, rows, tail_positions, row_width) the fp32 rows of the
                  * last tail_positions written, position q at q % tail_positions */
    /* a window that evicts by attention (KV_EVICT_H2O, KV_EVICT_BLOCK), else NULL: */
    int *slot_pos;  /* (window) the position a slot holds, -1: free */
    int *order;     /* (kept) the held slots, oldest position first */
    float *score;   /* (window) the attention a slot's position has received (kv_attend) */
    int kept;       /* slots held */
    int placed;     /* positions [0, placed) have been given a slot */
    int write_slot; /* the slot of position placed - 1, once past the window's first fill */
    /* streaming (kvtier.h's KVStream): blocks [0, n_disk) live on the tier, not in the pool
     * (their entries in blocks mean nothing), and attention reads the layer it is at from
     * stage, a copy of that layer of each of them, (n_disk, layer_bytes) */
    int n_disk;
    const unsigned char *stage;
    struct KVStream *stream;
} KVCache;

/* Bytes of one block for model c with elements in dtype. */
size_t kv_block_bytes_for(const Config *c, DType dtype);
/* Bytes a token's keys and values take in every layer, by the formula (no block padding):
 * 2 * n_layers * n_kv_heads * (head_dim * size + 4 for int8's scale), or for MLA
 * n_layers * ((kv_latent + rope_dim) * size + 8 for int8's two scales); int4 and int2: the
 * packed groups' bytes / KV_BLOCK_TOKENS plus a sequence's tail (kv_tail_bytes_for) spread
 * over the context (c->max_seq_len). A pool's bytes per
 * token (kv_bytes_per_token) are kv_block_bytes_for / KV_BLOCK_TOKENS, this rounded up so
 * that each layer of a block starts on a cache line. */
size_t kv_bytes_per_token_for(const Config *c, DType dtype);
/* Bytes of one sequence's fp32 tail of KV_BLOCK_TOKENS positions: 0 unless dtype is int4 or int2. */
size_t kv_tail_bytes_for(const Config *c, DType dtype);
/* A pool of n_blocks blocks for model c. Returns -1 when out of memory. */
int kv_pool_init(KVPool *pool, const Config *c, DType dtype, int n_blocks);
void kv_pool_free(KVPool *pool);
/* Bounds every sequence to `window` slots, the first `sinks` positions kept for good
 * (0 < window, 0 <= sinks < window), giving up positions by `evict` (with it sinks is 0;
 * KV_EVICT_H2O needs window >= 2, KV_EVICT_BLOCK a multiple of 16 from 32). Before any
 * cache is used. */
void kv_pool_set_window(KVPool *pool, int window, int sinks, KVEvict evict);
/* int4, int2: tails of two blocks, for speculation's rollbacks. Before any cache is used. */
void kv_pool_set_rollback(KVPool *pool);
size_t kv_block_bytes(const KVPool *pool);
size_t kv_bytes_per_token(const KVPool *pool);
static inline int kv_blocks_for(int positions) { return (positions + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS; }
static inline int kv_blocks_in_use(const KVPool *pool) { return pool->n_blocks - pool->n_free; }
/* Row groups a layer: each KV head's keys, then its values; MLA's one row of latents. */
static inline int kv_row_groups(const KVPool *pool) { return pool->n_kv_heads ? 2 * pool->n_kv_heads : 1; }
/* Blocks one sequence of `positions` positions holds at most. */
int kv_blocks_per_sequence(const KVPool *pool, int positions);

/* An empty cache of up to max_len positions in pool. Returns -1 when out of memory. */
int kv_init(KVCache *cache, KVPool *pool, int max_len);
/* Gives its blocks back and frees the table. */
void kv_free(KVCache *cache);
/* Gives its blocks back: len 0. Blocks on the tier (n_disk) are the stream's to give
 * back (kv_stream_drop), before. */
void kv_reset(KVCache *cache);
/* Another reference to block b (a swapped-out sequence keeps a block it shares), and one
 * given back. */
void kv_block_hold(KVPool *pool, int b);
void kv_block_release(KVPool *pool, int b);
/* An empty cache takes n blocks back, held[i] >= 0 the block its reference passes to it
 * (kv_block_hold), -1 a free block of the pool; len stays 0 until the caller has filled
 * them. Returns -1, changing nothing, when the pool has too few free blocks. */
int kv_place_blocks(KVCache *cache, const int *held, int n);
/* Streaming: the oldest block still in the pool, blocks[n_disk], goes back to it and
 * counts as on the tier from now on (kv_stream_spill has written it there). */
void kv_drop_oldest(KVCache *cache);
/* Makes positions [len, new_len) writable: new blocks, and a private copy of a shared
 * block that holds position len. Returns -1, changing nothing, when new_len is past
 * max_len or the pool has too few free blocks. */
int kv_reserve(KVCache *cache, int new_len);
/* Rolls the cache back to its first len positions (len <= cache->len; no window): blocks
 * past them go back to the pool, and a shared block that still holds position len is
 * copied by the next kv_reserve before it is written. Speculative decoding drops the
 * positions of rejected draft tokens with it. */
void kv_truncate(KVCache *cache, int len);
/* Blocks a reservation up to new_len would take from the pool (copies included). */
int kv_blocks_needed(const KVCache *cache, int new_len);
/* dst (empty, same pool, no window) shares src's positions [0, len): it holds len
 * positions without computing them. len <= src->len. */
void kv_share_prefix(KVCache *dst, const KVCache *src, int len);

/* A ring or sinks: keys rotated by their place in the window, so it may run past the context. */
static inline int kv_rotates_by_place(const KVPool *p) { return p->window && p->evict == KV_EVICT_OLDEST; }
/* A window that gives up positions by the attention they received (kv_attend). */
static inline int kv_evicts_by_attention(const KVPool *p) { return p->window && p->evict != KV_EVICT_OLDEST; }

/* The slot a position lives in: itself, or with a window its sink or its place in the ring. */
static inline int kv_slot(const KVPool *p, int pos) {
    return !p->window || pos < p->window ? pos : p->sinks + (pos - p->sinks) % (p->window - p->sinks);
}
/* How many positions a query at pos sees (its place in the window is one less), and the
 * i-th of them, oldest first: all of 0 .. pos, or with a full window the sinks and then
 * the most recent window - sinks. */
static inline int kv_window_length(const KVPool *p, int pos) {
    return !p->window || pos < p->window ? pos + 1 : p->window;
}
static inline int kv_window_position(const KVPool *p, int pos, int i) {
    return !p->window || pos < p->window || i < p->sinks ? i : pos + 1 - (p->window - p->sinks) + (i - p->sinks);
}

/* How many of `count` new tokens one pass may append: all, or with a window what it holds
 * without sliding (one token once it is full), since a window slides one position a pass. */
static inline int kv_tokens_per_pass(const KVCache *c, int count) {
    if (!c->pool->window || count <= 1) return count;
    const int room = c->pool->window - c->len;
    return room <= 1 ? 1 : room < count ? room : count;
}

/* The attention a query at pos gave the positions the cache keeps (probs, n of them, in
 * kv_kept_slot's order), added to their scores: what KV_EVICT_H2O and KV_EVICT_BLOCK give
 * up by. Nothing otherwise. */
void kv_attend(KVCache *c, int pos, const float *probs, int n);

/* Fills positions [len, n) of every layer with entries generated from seed (uniform in
 * [-1, 1), the same for a given seed, position and row), as if a prefill had computed
 * them: decoding at a long context without computing it (--fill). Reserved beforehand;
 * no window. Returns 0, or -1 when out of memory. */
int kv_fill_generated(KVCache *cache, int n, uint64_t seed);

/* One stored row: its elements (pool dtype) and, for int8, its scales. */
typedef struct {
    void *data;
    float *scales;
} KVRow;

/* A cache's slot of position pos, when it holds it: for a window that evicts by attention,
 * only positions in its first fill and the one placed last (the one being written). */
static inline int kv_slot_of(const KVCache *c, int pos) {
    return c->slot_pos && pos >= c->pool->window ? c->write_slot : kv_slot(c->pool, pos);
}
/* kv_window_length and kv_window_position's slot for cache c: the same for a ring and sinks;
 * for a window that evicts by attention, what it holds, oldest first. */
static inline int kv_keys_seen(const KVCache *c, int pos) {
    return c->slot_pos && pos >= c->pool->window ? c->kept : kv_window_length(c->pool, pos);
}
static inline int kv_kept_slot(const KVCache *c, int pos, int i) {
    return c->slot_pos ? c->order[i] : kv_slot(c->pool, kv_window_position(c->pool, pos, i));
}

static inline KVRow kv_row_in_slot(const KVCache *c, int layer, int row, int slot) {
    const KVPool *p = c->pool;
    const int b = slot / KV_BLOCK_TOKENS;
    unsigned char *l = b < c->n_disk ? (unsigned char *)c->stage + (size_t)b * p->layer_bytes /* streamed: this layer's copy */
                                     : p->data + ((size_t)c->blocks[b] * p->n_layers + layer) * p->layer_bytes;
    if (dtype_packed(p->dtype)) { /* int4, int2: the row group of the block that holds pos */
        const int keys = row < p->n_kv_heads ? row : p->n_kv_heads;
        const KVRow group = {l + (size_t)keys * p->key_group_bytes + (size_t)(row - keys) * p->value_group_bytes, NULL};
        return group;
    }
    const int r = row * KV_BLOCK_TOKENS + slot % KV_BLOCK_TOKENS;
    const KVRow out = {l + (size_t)r * p->row_bytes,
                       p->n_scales ? (float *)(l + p->scales_offset) + (size_t)r * p->n_scales : NULL};
    return out;
}
static inline KVRow kv_row(const KVCache *c, int layer, int row, int pos) {
    return kv_row_in_slot(c, layer, row, kv_slot_of(c, pos));
}
static inline KVRow kv_key(const KVCache *c, int layer, int head, int pos) { return kv_row(c, layer, head, pos); }
static inline KVRow kv_value(const KVCache *c, int layer, int head, int pos) {
    return kv_row(c, layer, c->pool->n_kv_heads + head, pos);
}
/* MLA: [c (kv_latent) ; k_R (rope_dim)] of one position */
static inline KVRow kv_latent(const KVCache *c, int layer, int pos) { return kv_row(c, layer, 0, pos); }

/* int4, int2: whether row group `row` is quantized per channel (keys, MLA's rows) */
static inline int kv_per_channel(const KVPool *p, int row) { return row < p->n_kv_heads || !p->n_kv_heads; }
/* int4, int2: position pos's fp32 row in the tail */
static inline float *kv_tail_row(const KVCache *c, int layer, int row, int pos) {
    const KVPool *p = c->pool;
    const int rows = p->n_kv_heads ? 2 * p->n_kv_heads : 1;
    const size_t n = (size_t)p->tail_positions;
    return c->tail + (((size_t)layer * rows + row) * n + (size_t)pos % n) * p->row_width;
}
/* int4, int2: the block holding position pos, row group `row`, from its KV_BLOCK_TOKENS
 * fp32 rows (`stride` floats apart). */
void kv_store_block(const KVCache *c, int layer, int row, int pos, const float *rows, size_t stride);

/* A row in the pool's dtype from floats / back to floats (kernels.h's row_quantize). */
void kv_store(const KVPool *p, KVRow row, const float *src);
void kv_load(const KVPool *p, KVRow row, float *dst);

#endif /* KVCACHE_H */
