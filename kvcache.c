/* kvcache.c: the block pool and the block tables (kvcache.h). */
#include "kvcache.h"

#include <stdlib.h>
#include <string.h>

/* Rows a layer of a block holds, and each row's width and scales. */
static void row_shape(const Config *c, DType dtype, int *rows, int *width, int *split, int *n_scales) {
    const int is_mla = c->variant == VARIANT_MLA;
    *rows = KV_BLOCK_TOKENS * (is_mla ? 1 : 2 * c->n_kv_heads);
    *width = is_mla ? c->kv_latent + c->rope_dim : c->head_dim;
    *split = is_mla ? c->kv_latent : *width;
    *n_scales = !dtype_scaled(dtype) ? 0 : is_mla ? 2 : 1;
}

/* int4, int2: a row group's bytes in a layer of a block, keys' (per channel) or values' */
static size_t group_bytes(const Config *c, DType dtype, int keys) {
    int rows, width, split, n_scales;
    row_shape(c, dtype, &rows, &width, &split, &n_scales);
    return packed_group_bytes(width, dtype, keys || c->variant == VARIANT_MLA);
}

/* Bytes of one layer's packed groups in one block (int4, int2): MLA's one row group, or
 * each KV head's keys and values. */
static size_t packed_layer_groups(const Config *c, DType dtype) {
    return c->variant == VARIANT_MLA ? group_bytes(c, dtype, 1)
                                     : (size_t)c->n_kv_heads * (group_bytes(c, dtype, 1) + group_bytes(c, dtype, 0));
}

/* Bytes of one layer of one block; *scales_offset: where its scales start. */
static size_t layer_bytes(const Config *c, DType dtype, size_t *scales_offset) {
    int rows, width, split, n_scales;
    row_shape(c, dtype, &rows, &width, &split, &n_scales);
    if (dtype_packed(dtype)) {
        const size_t groups = packed_layer_groups(c, dtype);
        *scales_offset = 0;
        return (groups + 63) / 64 * 64;
    }
    const size_t data = (size_t)rows * width * dtype_size(dtype);
    *scales_offset = (data + 3) / 4 * 4;
    return (*scales_offset + (size_t)rows * n_scales * sizeof(float) + 63) / 64 * 64; /* layers on cache lines */
}

size_t kv_block_bytes_for(const Config *c, DType dtype) {
    size_t offset;
    return (size_t)c->n_layers * layer_bytes(c, dtype, &offset);
}

size_t kv_tail_bytes_for(const Config *c, DType dtype) {
    int rows, width, split, n_scales;
    row_shape(c, dtype, &rows, &width, &split, &n_scales);
    return dtype_packed(dtype) ? (size_t)c->n_layers * (size_t)(rows / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS * width * sizeof(float) : 0;
}

size_t kv_bytes_per_token_for(const Config *c, DType dtype) {
    int rows, width, split, n_scales;
    row_shape(c, dtype, &rows, &width, &split, &n_scales);
    if (dtype_packed(dtype)) {
        const size_t groups = packed_layer_groups(c, dtype);
        const size_t seq = (size_t)(c->max_seq_len > 0 ? c->max_seq_len : 1);
        return (size_t)c->n_layers * groups / KV_BLOCK_TOKENS + (kv_tail_bytes_for(c, dtype) + seq - 1) / seq;
    }
    const size_t row_bytes = (size_t)width * dtype_size(dtype) + (size_t)n_scales * sizeof(float);
    return (size_t)c->n_layers * (size_t)(rows / KV_BLOCK_TOKENS) * row_bytes;
}

int kv_pool_init(KVPool *pool, const Config *c, DType dtype, int n_blocks) {
    memset(pool, 0, sizeof *pool);
    int rows;
    row_shape(c, dtype, &rows, &pool->row_width, &pool->split, &pool->n_scales);
    pool->n_layers = c->n_layers;
    pool->n_kv_heads = c->variant == VARIANT_MLA ? 0 : c->n_kv_heads;
    pool->head_dim = c->head_dim;
    pool->dtype = dtype;
    pool->row_bytes = (size_t)pool->row_width * dtype_size(dtype);
    pool->layer_bytes = layer_bytes(c, dtype, &pool->scales_offset);
    if (dtype_packed(dtype)) pool->key_group_bytes = group_bytes(c, dtype, 1), pool->value_group_bytes = group_bytes(c, dtype, 0);
    pool->tail_positions = KV_BLOCK_TOKENS;
    pool->n_blocks = n_blocks;
    const size_t bytes = (size_t)n_blocks * pool->n_layers * pool->layer_bytes;
    pool->data = alloc_touched(bytes);
    pool->refs = calloc((size_t)(n_blocks > 0 ? n_blocks : 1), sizeof(int));
    pool->free_blocks = malloc((size_t)(n_blocks > 0 ? n_blocks : 1) * sizeof(int));
    if (n_blocks < 1 || !pool->data || !pool->refs || !pool->free_blocks) {
        kv_pool_free(pool);
        return -1;
    }
    for (int i = 0; i < n_blocks; i++) pool->free_blocks[i] = n_blocks - 1 - i; /* block 0 first */
    pool->n_free = n_blocks;
    return 0;
}

void kv_pool_free(KVPool *pool) {
    free(pool->data);
    free(pool->refs);
    free(pool->free_blocks);
    memset(pool, 0, sizeof *pool);
}

void kv_pool_set_window(KVPool *pool, int window, int sinks, KVEvict evict) {
    pool->window = window;
    pool->sinks = sinks;
    pool->evict = evict;
}

void kv_pool_set_rollback(KVPool *pool) { pool->tail_positions = 2 * KV_BLOCK_TOKENS; }

size_t kv_block_bytes(const KVPool *pool) { return (size_t)pool->n_layers * pool->layer_bytes; }

size_t kv_bytes_per_token(const KVPool *pool) { return kv_block_bytes(pool) / KV_BLOCK_TOKENS; }

int kv_blocks_per_sequence(const KVPool *pool, int positions) {
    return kv_blocks_for(pool->window && pool->window < positions ? pool->window : positions);
}

static int take_block(KVPool *pool) {
    const int b = pool->free_blocks[--pool->n_free];
    pool->refs[b] = 1;
    if (kv_blocks_in_use(pool) > pool->peak_in_use) pool->peak_in_use = kv_blocks_in_use(pool);
    return b;
}

static void release_block(KVPool *pool, int b) {
    if (pool->refs[b] > 1) pool->saved_blocks--, pool->shared_blocks -= pool->refs[b] == 2;
    if (--pool->refs[b] == 0) pool->free_blocks[pool->n_free++] = b;
}

/* one more reference to a block in use: it is shared, and sharing saves a block */
static void share_block(KVPool *pool, int b) {
    pool->shared_blocks += ++pool->refs[b] == 2;
    pool->saved_blocks++;
    if (pool->shared_blocks > pool->peak_shared_blocks) pool->peak_shared_blocks = pool->shared_blocks;
    if (pool->saved_blocks > pool->peak_saved_blocks) pool->peak_saved_blocks = pool->saved_blocks;
}

void kv_block_hold(KVPool *pool, int b) { share_block(pool, b); }
void kv_block_release(KVPool *pool, int b) { release_block(pool, b); }

int kv_place_blocks(KVCache *cache, const int *held, int n) {
    int fresh = 0;
    for (int i = 0; i < n; i++) fresh += held[i] < 0;
    if (n > cache->max_blocks || fresh > cache->pool->n_free) return -1;
    for (int i = 0; i < n; i++) cache->blocks[i] = held[i] >= 0 ? held[i] : take_block(cache->pool);
    cache->n_blocks = n;
    return 0;
}

static void forget_slots(KVCache *cache) {
    cache->kept = cache->placed = 0;
    if (cache->slot_pos)
        for (int s = 0; s < cache->pool->window; s++) cache->slot_pos[s] = -1, cache->score[s] = 0.0f;
}

int kv_init(KVCache *cache, KVPool *pool, int max_len) {
    memset(cache, 0, sizeof *cache);
    cache->pool = pool;
    cache->max_blocks = kv_blocks_per_sequence(pool, max_len);
    cache->blocks = malloc((size_t)(cache->max_blocks ? cache->max_blocks : 1) * sizeof(int));
    if (!cache->blocks) return -1;
    if (dtype_packed(pool->dtype)) {
        const size_t rows = (size_t)kv_row_groups(pool);
        cache->tail = calloc((size_t)pool->n_layers * rows * pool->tail_positions * pool->row_width, sizeof(float));
        if (!cache->tail) {
            free(cache->blocks);
            return -1;
        }
    }
    if (kv_evicts_by_attention(pool)) {
        const size_t W = (size_t)pool->window;
        cache->slot_pos = malloc(W * sizeof *cache->slot_pos);
        cache->order = malloc(W * sizeof *cache->order);
        cache->score = malloc(W * sizeof *cache->score);
        if (!cache->slot_pos || !cache->order || !cache->score) {
            kv_free(cache);
            return -1;
        }
        forget_slots(cache);
    }
    return 0;
}

void kv_reset(KVCache *cache) {
    for (int i = cache->n_disk; i < cache->n_blocks; i++) release_block(cache->pool, cache->blocks[i]);
    cache->n_blocks = cache->n_disk = 0;
    cache->len = 0;
    cache->stage = NULL;
    forget_slots(cache);
}

void kv_drop_oldest(KVCache *cache) {
    release_block(cache->pool, cache->blocks[cache->n_disk]);
    cache->blocks[cache->n_disk++] = -1;
}

void kv_free(KVCache *cache) {
    if (cache->pool && cache->blocks) kv_reset(cache);
    free(cache->blocks);
    free(cache->slot_pos);
    free(cache->order);
    free(cache->score);
    free(cache->tail);
    memset(cache, 0, sizeof *cache);
}

/* Frees slots [first_slot, first_slot + n_slots) and drops them from the order, which stays oldest first. */
static void drop_slots(KVCache *c, int first_slot, int n_slots) {
    int kept = 0;
    for (int i = 0; i < c->kept; i++) {
        const int s = c->order[i];
        if (s >= first_slot && s < first_slot + n_slots)
            c->slot_pos[s] = -1, c->score[s] = 0.0f;
        else
            c->order[kept++] = s;
    }
    c->kept = kept;
}

/* What a full window gives up for position p, by the attention its positions received: the
 * least attended position older than the recent half (H2O's heavy hitters and recent
 * tokens), or the least attended block of 16 slots (summed in slot order) holding none of
 * the recent half. The oldest position, or the first block, on a tie. */
static void evict_for(KVCache *c, int p) {
    const int W = c->pool->window;
    if (c->pool->evict == KV_EVICT_H2O) {
        int victim = -1;
        for (int i = 0; i < c->kept && c->slot_pos[c->order[i]] < p - W / 2; i++)
            if (victim < 0 || c->score[c->order[i]] < c->score[victim]) victim = c->order[i];
        drop_slots(c, victim, 1);
        return;
    }
    int victim = -1;
    float least = 0.0f;
    for (int b = 0; b < W / KV_BLOCK_TOKENS; b++) {
        float sum = 0.0f;
        int candidate = 1;
        for (int s = b * KV_BLOCK_TOKENS; s < (b + 1) * KV_BLOCK_TOKENS && candidate; s++) {
            candidate = c->slot_pos[s] >= 0 && c->slot_pos[s] < p - W / 2;
            sum += c->score[s];
        }
        if (candidate && (victim < 0 || sum < least)) victim = b, least = sum;
    }
    /* every block holds a recent position only if blocks were refilled out of order, which
     * place_positions never does; the oldest position's block, to be safe */
    if (victim < 0) victim = c->order[0] / KV_BLOCK_TOKENS;
    drop_slots(c, victim * KV_BLOCK_TOKENS, KV_BLOCK_TOKENS);
}

/* Gives positions [placed, new_len) their slots: in order through the window's first fill,
 * then each the lowest free slot, evicting when there is none. */
static void place_positions(KVCache *c, int new_len) {
    for (; c->placed < new_len; c->placed++) {
        const int p = c->placed;
        int slot = p;
        if (p >= c->pool->window) {
            if (c->kept == c->pool->window) evict_for(c, p);
            for (slot = 0; c->slot_pos[slot] >= 0; slot++) {}
            c->write_slot = slot;
        }
        c->slot_pos[slot] = p;
        c->score[slot] = 0.0f;
        c->order[c->kept++] = slot;
    }
}

void kv_attend(KVCache *c, int pos, const float *probs, int n) {
    if (!c->slot_pos) return;
    for (int i = 0; i < n; i++) c->score[kv_kept_slot(c, pos, i)] += probs[i];
}

/* The block holding position len is written next: a private copy is needed when it is
 * shared. */
static int first_write_is_shared(const KVCache *cache) {
    const int b = kv_slot(cache->pool, cache->len) / KV_BLOCK_TOKENS;
    return b < cache->n_blocks && b >= cache->n_disk && cache->pool->refs[cache->blocks[b]] > 1;
}

int kv_blocks_needed(const KVCache *cache, int new_len) {
    const int more = kv_blocks_per_sequence(cache->pool, new_len) - cache->n_blocks;
    return (more > 0 ? more : 0) + (new_len > cache->len && first_write_is_shared(cache));
}

int kv_reserve(KVCache *cache, int new_len) {
    KVPool *pool = cache->pool;
    const int blocks = kv_blocks_per_sequence(pool, new_len);
    if (blocks > cache->max_blocks || kv_blocks_needed(cache, new_len) > pool->n_free) return -1;
    if (new_len > cache->len && first_write_is_shared(cache)) {
        int *slot = &cache->blocks[kv_slot(pool, cache->len) / KV_BLOCK_TOKENS];
        const int copy = take_block(pool);
        const size_t bytes = kv_block_bytes(pool);
        memcpy(pool->data + (size_t)copy * bytes, pool->data + (size_t)*slot * bytes, bytes);
        release_block(pool, *slot);
        *slot = copy;
    }
    while (cache->n_blocks < blocks) cache->blocks[cache->n_blocks++] = take_block(pool);
    /* the positions the next pass writes, as it lays them out: evicting for positions
     * further on would go by attention not yet paid */
    if (cache->slot_pos && new_len > cache->len)
        place_positions(cache, cache->len + kv_tokens_per_pass(cache, new_len - cache->len));
    return 0;
}

void kv_truncate(KVCache *cache, int len) {
    const int keep = kv_blocks_for(len);
    while (cache->n_blocks > keep && cache->n_blocks > cache->n_disk) release_block(cache->pool, cache->blocks[--cache->n_blocks]);
    cache->len = len;
}

void kv_share_prefix(KVCache *dst, const KVCache *src, int len) {
    kv_reset(dst);
    for (int i = 0; i < kv_blocks_for(len); i++) {
        dst->blocks[i] = src->blocks[i];
        share_block(dst->pool, src->blocks[i]);
    }
    dst->n_blocks = kv_blocks_for(len);
    dst->len = len;
}

void kv_store(const KVPool *p, KVRow row, const float *src) {
    row_quantize(row.data, row.scales, src, p->row_width, p->split, p->dtype);
}

void kv_store_block(const KVCache *c, int layer, int row, int pos, const float *rows, size_t stride) {
    const KVPool *p = c->pool;
    block_quantize(kv_row(c, layer, row, pos).data, rows, stride, p->row_width, p->dtype, kv_per_channel(p, row));
}

void kv_load(const KVPool *p, KVRow row, float *dst) {
    row_dequantize(dst, row.data, row.scales, p->row_width, p->split, p->dtype);
}

/* splitmix64's step: the golden-ratio increment, then kernels.h's finalizer */
static uint64_t splitmix64(uint64_t x) { return mix64(x + 0x9e3779b97f4a7c15ull); }

int kv_fill_generated(KVCache *cache, int n, uint64_t seed) {
    const KVPool *p = cache->pool;
    const int rows = kv_row_groups(p), w = p->row_width, packed = dtype_packed(p->dtype);
    float *row = malloc((size_t)w * sizeof *row); /* on the heap: a row may be wider than a small stack */
    if (!row) return -1;
    for (int pos = cache->len; pos < n; pos++)
        for (int l = 0; l < p->n_layers; l++)
            for (int r = 0; r < rows; r++) {
                uint64_t state = splitmix64(seed ^ splitmix64(((uint64_t)pos << 24) ^ ((uint64_t)l << 12) ^ (uint64_t)r));
                for (int e = 0; e < w; e += 2) {
                    const uint64_t bits = splitmix64(state + (uint64_t)e);
                    row[e] = (float)(int32_t)(uint32_t)bits * 0x1p-31f;
                    if (e + 1 < w) row[e + 1] = (float)(int32_t)(uint32_t)(bits >> 32) * 0x1p-31f;
                }
                if (!packed) {
                    kv_store(p, kv_row(cache, l, r, pos), row);
                    continue;
                }
                memcpy(kv_tail_row(cache, l, r, pos), row, (size_t)w * sizeof(float)); /* a block's rows, then the block */
                if (pos % KV_BLOCK_TOKENS == KV_BLOCK_TOKENS - 1)
                    kv_store_block(cache, l, r, pos, kv_tail_row(cache, l, r, pos - (KV_BLOCK_TOKENS - 1)), (size_t)w);
            }
    cache->len = n;
    free(row);
    return 0;
}
