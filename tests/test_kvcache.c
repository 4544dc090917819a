/* The paged KV cache: layout, accounting, block tables, sharing and copy on write. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache.h"
#include "testutil.h"

/* fp32 rows as floats */
static float *K(const KVCache *c, int l, int h, int pos) { return kv_key(c, l, h, pos).data; }
static float *V(const KVCache *c, int l, int h, int pos) { return kv_value(c, l, h, pos).data; }
static float *LAT(const KVCache *c, int l, int pos) { return kv_latent(c, l, pos).data; }

/* The shipped shape (4 layers, 16 heads of 32) of a variant. */
static Config shipped(Variant v, int kv_heads, int latent) {
    Config c = {.variant = v,
                .n_layers = 4,
                .n_heads = 16,
                .head_dim = 32,
                .n_kv_heads = kv_heads,
                .kv_latent = latent,
                .rope_dim = latent ? 16 : 0,
                .max_seq_len = 256};
    return c;
}

/* bytes per token follow the formulas of the posts: 2*L*H_kv*d_h*4 and L*(d_c+d_R)*4 */
static void test_bytes_per_token(void **state) {
    KVPool p;
    const struct {
        Config cfg;
        size_t expect;
    } cases[] = {
        {shipped(VARIANT_MHA, 16, 0), 2 * 4 * 16 * 32 * 4}, /* 16 KiB */
        {shipped(VARIANT_GQA, 4, 0), 2 * 4 * 4 * 32 * 4},   {shipped(VARIANT_MQA, 1, 0), 2 * 4 * 1 * 32 * 4},
        {shipped(VARIANT_MLA, 0, 64), 4 * 80 * 4},          {shipped(VARIANT_MLA, 0, 128), 4 * 144 * 4},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        assert_int_equal(kv_pool_init(&p, &cases[i].cfg, DTYPE_F32, 16), 0);
        assert_int_equal(kv_bytes_per_token(&p), cases[i].expect);
        assert_int_equal(kv_block_bytes(&p), cases[i].expect * KV_BLOCK_TOKENS);
        assert_int_equal(kv_block_bytes_for(&cases[i].cfg, DTYPE_F32), kv_block_bytes(&p));
        kv_pool_free(&p);
    }
}

/* every (layer, K/V, head, position) has its own head_dim floats; a head's positions in
 * one block are contiguous (attention streams them) */
static void test_layout_disjoint(void **state) {
    Config c = shipped(VARIANT_GQA, 2, 0);
    c.n_layers = 3;
    c.head_dim = 4;
    KVPool p;
    KVCache s;
    const int S = 40, L = 3, H = 2, D = 4;
    assert_int_equal(kv_pool_init(&p, &c, DTYPE_F32, kv_blocks_for(S)), 0);
    assert_int_equal(kv_init(&s, &p, S), 0);
    assert_int_equal(kv_reserve(&s, S), 0);
    for (int l = 0; l < L; l++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < S; t++)
                for (int d = 0; d < D; d++) {
                    K(&s, l, h, t)[d] = (float)(((l * H + h) * S + t) * D + d);
                    V(&s, l, h, t)[d] = -(float)(((l * H + h) * S + t) * D + d);
                }
    for (int l = 0; l < L; l++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < S; t++)
                for (int d = 0; d < D; d++) {
                    assert_true(K(&s, l, h, t)[d] == (float)(((l * H + h) * S + t) * D + d));
                    assert_true(V(&s, l, h, t)[d] == -(float)(((l * H + h) * S + t) * D + d));
                }
    assert_ptr_equal(K(&s, 1, 1, 3) + D, K(&s, 1, 1, 4));
    assert_ptr_equal(K(&s, 2, 0, 16) + D, K(&s, 2, 0, 17));
    kv_free(&s);
    kv_pool_free(&p);
}

static void test_latent_layout(void **state) {
    Config c = shipped(VARIANT_MLA, 0, 16);
    c.n_layers = 2;
    c.rope_dim = 8;
    KVPool p;
    KVCache s;
    assert_int_equal(kv_pool_init(&p, &c, DTYPE_F32, 2), 0);
    assert_int_equal(kv_init(&s, &p, 32), 0);
    assert_int_equal(kv_reserve(&s, 32), 0);
    assert_ptr_equal(LAT(&s, 0, 1), LAT(&s, 0, 0) + 24);
    assert_ptr_equal(LAT(&s, 1, 0), LAT(&s, 0, 15) + 24); /* the next layer of the same block */
    kv_free(&s);
    kv_pool_free(&p);
}

/* Blocks are taken as positions are reserved and all come back on reset; a reservation
 * the pool or the table cannot hold is refused and changes nothing. */
static void test_reserve_and_release(void **state) {
    Config c = shipped(VARIANT_MQA, 1, 0);
    KVPool p;
    KVCache a, b;
    assert_int_equal(kv_pool_init(&p, &c, DTYPE_F32, 5), 0);
    assert_int_equal(kv_init(&a, &p, 64), 0);
    assert_int_equal(kv_init(&b, &p, 64), 0);
    assert_int_equal(kv_reserve(&a, 17), 0);
    assert_int_equal(a.n_blocks, 2);
    assert_int_equal(kv_blocks_in_use(&p), 2);
    assert_int_equal(kv_reserve(&a, 65), -1); /* past max_len */
    assert_int_equal(kv_reserve(&b, 64), -1); /* 4 blocks, 3 free */
    assert_int_equal(b.n_blocks, 0);
    assert_int_equal(kv_blocks_in_use(&p), 2);
    assert_int_equal(kv_reserve(&b, 48), 0);
    assert_int_equal(p.n_free, 0);
    assert_int_equal(p.peak_in_use, 5);
    kv_reset(&a);
    assert_int_equal(a.len, 0);
    assert_int_equal(p.n_free, 2);
    kv_free(&b);
    assert_int_equal(p.n_free, 5);
    assert_int_equal(p.peak_in_use, 5);
    kv_free(&a);
    kv_pool_free(&p);
}

/* A shared prefix holds the same blocks; the first write into a shared block copies it, so
 * neither sequence ever sees the other's later positions. */
static void test_share_and_copy_on_write(void **state) {
    Config c = shipped(VARIANT_MQA, 1, 0);
    KVPool p;
    KVCache a, b;
    assert_int_equal(kv_pool_init(&p, &c, DTYPE_F32, 8), 0);
    assert_int_equal(kv_init(&a, &p, 64), 0);
    assert_int_equal(kv_init(&b, &p, 64), 0);
    assert_int_equal(kv_reserve(&a, 20), 0);
    for (int t = 0; t < 20; t++) K(&a, 3, 0, t)[0] = (float)t;
    a.len = 20;
    kv_share_prefix(&b, &a, 18); /* a full block and 2 positions of the second */
    assert_int_equal(b.len, 18);
    assert_int_equal(b.n_blocks, 2);
    assert_int_equal(b.blocks[0], a.blocks[0]);
    assert_int_equal(b.blocks[1], a.blocks[1]);
    assert_int_equal(p.refs[a.blocks[1]], 2);
    assert_int_equal(kv_blocks_in_use(&p), 2);
    assert_int_equal(p.shared_blocks, 2); /* held twice each: 2 blocks saved */
    assert_int_equal(p.saved_blocks, 2);
    /* b writes position 18: its second block becomes its own copy, the first stays shared */
    assert_int_equal(kv_blocks_needed(&b, 19), 1);
    assert_int_equal(kv_reserve(&b, 19), 0);
    assert_int_not_equal(b.blocks[1], a.blocks[1]);
    assert_int_equal(b.blocks[0], a.blocks[0]);
    assert_int_equal(p.refs[a.blocks[1]], 1);
    assert_int_equal(p.refs[a.blocks[0]], 2);
    assert_int_equal(p.shared_blocks, 1); /* the copy ended the second block's sharing */
    assert_int_equal(p.saved_blocks, 1);
    for (int t = 0; t < 18; t++) assert_true(K(&b, 3, 0, t)[0] == (float)t); /* the copy holds the prefix */
    K(&b, 3, 0, 18)[0] = -1.0f;
    assert_true(K(&a, 3, 0, 18)[0] == 18.0f); /* a's own position untouched */
    /* a exclusive owner writes in place: no copy */
    assert_int_equal(kv_blocks_needed(&a, 21), 0);
    const int before = a.blocks[1];
    assert_int_equal(kv_reserve(&a, 21), 0);
    assert_int_equal(a.blocks[1], before);
    kv_free(&b);
    assert_int_equal(p.refs[a.blocks[0]], 1);
    assert_int_equal(p.shared_blocks, 0);
    assert_int_equal(p.saved_blocks, 0);
    assert_int_equal(p.peak_shared_blocks, 2);
    assert_int_equal(p.peak_saved_blocks, 2);
    kv_free(&a);
    assert_int_equal(p.n_free, 8);
    kv_pool_free(&p);
}

/* A copy needs a free block: when there is none the reservation is refused, unchanged. */
static void test_copy_needs_a_block(void **state) {
    Config c = shipped(VARIANT_MQA, 1, 0);
    KVPool p;
    KVCache a, b;
    assert_int_equal(kv_pool_init(&p, &c, DTYPE_F32, 1), 0);
    assert_int_equal(kv_init(&a, &p, 16), 0);
    assert_int_equal(kv_init(&b, &p, 16), 0);
    assert_int_equal(kv_reserve(&a, 5), 0);
    a.len = 5;
    kv_share_prefix(&b, &a, 4);
    assert_int_equal(kv_reserve(&b, 5), -1);
    assert_int_equal(b.blocks[0], a.blocks[0]);
    assert_int_equal(p.refs[a.blocks[0]], 2);
    kv_free(&a);
    assert_int_equal(kv_reserve(&b, 5), 0); /* now alone with it: in place */
    kv_free(&b);
    kv_pool_free(&p);
}

/* int8, fp8 and bf16 shrink a token's bytes as the formulas say: 2*L*H_kv*(d_h+4) and
 * L*(d_c+d_R+8) with a 4-byte scale a vector, and half of fp32 for bf16. */
static void test_bytes_per_token_by_dtype(void **state) {
    const struct {
        Config cfg;
        DType dt;
        size_t expect;
    } cases[] = {
        {shipped(VARIANT_MHA, 16, 0), DTYPE_BF16, 2 * 4 * 16 * 32 * 2},
        {shipped(VARIANT_MHA, 16, 0), DTYPE_I8, 2 * 4 * 16 * (32 + 4)},
        {shipped(VARIANT_MQA, 1, 0), DTYPE_I8, 2 * 4 * 1 * (32 + 4)},
        {shipped(VARIANT_MLA, 0, 64), DTYPE_BF16, 4 * 80 * 2},
        {shipped(VARIANT_MLA, 0, 64), DTYPE_I8, 4 * (80 + 8)},
        {shipped(VARIANT_MLA, 0, 128), DTYPE_I8, 4 * (144 + 8)},
        {shipped(VARIANT_MHA, 16, 0), DTYPE_F8, 2 * 4 * 16 * (32 + 4)},
        {shipped(VARIANT_MLA, 0, 64), DTYPE_F8, 4 * (80 + 8)},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        KVPool p;
        assert_int_equal(kv_pool_init(&p, &cases[i].cfg, cases[i].dt, 4), 0);
        assert_int_equal(kv_bytes_per_token(&p), cases[i].expect);
        kv_pool_free(&p);
    }
    /* int4, int2 (KIVI): a token's codes, plus per channel a bf16 scale and min shared by a
     * block's 16 tokens (keys, MLA's rows), per token one for each 32 channels (values),
     * plus the 16 fp32 rows of a sequence's tail spread over its 256 positions */
    const struct {
        Config cfg;
        DType dt;
        size_t expect;
    } packed[] = {
        {shipped(VARIANT_MHA, 16, 0), DTYPE_I4, 4 * 16 * ((16 + 2 * 32 * 2 / 16) + (16 + 2 * 2)) + 2 * 4 * 16 * 32 * 4 * 16 / 256},
        {shipped(VARIANT_MHA, 16, 0), DTYPE_I2, 4 * 16 * ((8 + 2 * 32 * 2 / 16) + (8 + 2 * 2)) + 2 * 4 * 16 * 32 * 4 * 16 / 256},
        {shipped(VARIANT_GQA, 4, 0), DTYPE_I4, 4 * 4 * ((16 + 8) + (16 + 4)) + 2 * 4 * 4 * 32 * 4 * 16 / 256},
        {shipped(VARIANT_MLA, 0, 64), DTYPE_I4, 4 * (40 + 2 * 80 * 2 / 16) + 4 * 80 * 4 * 16 / 256},
        {shipped(VARIANT_MLA, 0, 128), DTYPE_I2, 4 * (36 + 2 * 144 * 2 / 16) + 4 * 144 * 4 * 16 / 256},
    };
    for (size_t i = 0; i < sizeof packed / sizeof packed[0]; i++)
        assert_int_equal(kv_bytes_per_token_for(&packed[i].cfg, packed[i].dt), packed[i].expect);
}

/* int4: a block's rows stay fp32 in the tail until its 16th position is written, its
 * pool block untouched; from then on the block is the packed group of those 16 rows
 * (block_quantize; keys per channel, values per token), and the next block starts in the
 * tail. Positions are written one at a time, as decoding does. */
static void test_packed_tail_hand_over(void **state) {
    Config c = shipped(VARIANT_GQA, 2, 0);
    KVPool p, f;
    KVCache s, r;
    assert_int_equal(kv_pool_init(&p, &c, DTYPE_I4, 4), 0);
    assert_int_equal(kv_pool_init(&f, &c, DTYPE_F32, 4), 0);
    assert_int_equal(kv_init(&s, &p, 64), 0);
    assert_int_equal(kv_init(&r, &f, 64), 0);
    assert_int_equal(kv_reserve(&s, 40), 0);
    assert_int_equal(kv_reserve(&r, 40), 0);
    unsigned char expect[1024], zero[1024] = {0};
    for (int n = 1; n <= 40; n++) {
        kv_fill_generated(&s, n, 7);
        kv_fill_generated(&r, n, 7); /* the same rows, in fp32 */
        for (int l = 0; l < c.n_layers; l++)
            for (int row = 0; row < 4; row++) {
                const int keys = row < 2;
                const size_t bytes = keys ? p.key_group_bytes : p.value_group_bytes;
                assert_true(bytes <= sizeof expect);
                for (int pos = n / 16 * 16; pos < n; pos++)
                    assert_memory_equal(kv_tail_row(&s, l, row, pos), kv_row(&r, l, row, pos).data, 32 * sizeof(float));
                for (int b = 0; b < n / 16; b++) {
                    block_quantize(expect, kv_row(&r, l, row, b * 16).data, 32, 32, DTYPE_I4, keys);
                    assert_memory_equal(kv_row(&s, l, row, b * 16).data, expect, bytes);
                }
                if (n % 16) assert_memory_equal(kv_row(&s, l, row, n / 16 * 16).data, zero, bytes);
            }
    }
    kv_free(&s);
    kv_free(&r);
    kv_pool_free(&p);
    kv_pool_free(&f);
}

/* A window of 8 slots: the ring overwrites the oldest position; with 3 sinks, positions
 * 0-2 stay and the other 5 slots ring. A query sees the window oldest first. */
static void test_window_slots_and_positions(void **state) {
    Config c = shipped(VARIANT_MQA, 1, 0);
    KVPool p;
    assert_int_equal(kv_pool_init(&p, &c, DTYPE_F32, 4), 0);
    kv_pool_set_window(&p, 8, 0, KV_EVICT_OLDEST);
    const int ring[] = {0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0};
    for (int pos = 0; pos < 17; pos++) assert_int_equal(kv_slot(&p, pos), ring[pos]);
    assert_int_equal(kv_window_length(&p, 5), 6);
    assert_int_equal(kv_window_length(&p, 20), 8);
    for (int i = 0; i < 8; i++) assert_int_equal(kv_window_position(&p, 20, i), 13 + i); /* 13 .. 20 */
    kv_pool_set_window(&p, 8, 3, KV_EVICT_OLDEST);
    const int sinks[] = {0, 1, 2, 3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3};
    for (int pos = 0; pos < 14; pos++) assert_int_equal(kv_slot(&p, pos), sinks[pos]);
    const int seen[] = {0, 1, 2, 16, 17, 18, 19, 20};
    for (int i = 0; i < 8; i++) assert_int_equal(kv_window_position(&p, 20, i), seen[i]);
    /* the position a slot holds is the one the window names */
    for (int i = 0; i < 8; i++) {
        const int pos = kv_window_position(&p, 20, i), slot = kv_slot(&p, pos);
        for (int later = pos + 1; later <= 20; later++) assert_true(kv_slot(&p, later) != slot || later < 8);
    }
    /* a sequence keeps 8 slots' blocks (one block), however long it runs */
    KVCache s;
    assert_int_equal(kv_init(&s, &p, 1 << 20), 0);
    assert_int_equal(s.max_blocks, 1);
    assert_int_equal(kv_reserve(&s, 5000), 0);
    assert_int_equal(s.n_blocks, 1);
    kv_free(&s);
    kv_pool_free(&p);
}

/* ---- eviction by attention ---- */

/* Advances c by one position, as a pass does: reserve (which places and may evict), then
 * the cache's length. */
static void step_one(KVCache *c) {
    assert_int_equal(kv_reserve(c, c->len + 1), 0);
    c->len++;
}

/* The positions c keeps, oldest first, as a query at pos sees them. */
static void kept_positions(const KVCache *c, int pos, int *out) {
    for (int i = 0; i < kv_keys_seen(c, pos); i++) out[i] = c->slot_pos[kv_kept_slot(c, pos, i)];
}

/* Pays every kept position of c its weight from `weights` (by position), as a query at pos would. */
static void pay(KVCache *c, int pos, const float *weights) {
    float probs[64];
    const int n = kv_keys_seen(c, pos);
    for (int i = 0; i < n; i++) probs[i] = weights[c->slot_pos[kv_kept_slot(c, pos, i)]];
    kv_attend(c, pos, probs, n);
}

/* H2O, a budget of 8: the recent half (4) stays; of the older, the least attended goes
 * (ties: the oldest), and the new position takes its slot. */
static void test_h2o_evicts_least_attended_older_than_recent_half(void **state) {
    Config cfg = shipped(VARIANT_MQA, 1, 0);
    KVPool p;
    KVCache c;
    assert_int_equal(kv_pool_init(&p, &cfg, DTYPE_F32, 4), 0);
    kv_pool_set_window(&p, 8, 0, KV_EVICT_H2O);
    assert_int_equal(kv_init(&c, &p, 1 << 20), 0);
    for (int i = 0; i < 8; i++) step_one(&c); /* positions 0..7 in slots 0..7 */
    float w[64] = {0};
    w[0] = 5.0f, w[1] = 0.5f, w[2] = 3.0f, w[3] = 0.5f; /* 1 and 3 tie: 1 is older */
    w[4] = w[5] = w[6] = w[7] = 0.0f;                  /* least of all, but recent */
    pay(&c, 7, w);
    step_one(&c); /* position 8: recent are 4..7, so 1 goes */
    int kept[8];
    kept_positions(&c, 8, kept);
    const int expect[] = {0, 2, 3, 4, 5, 6, 7, 8};
    assert_memory_equal(kept, expect, sizeof expect);
    assert_int_equal(kv_slot_of(&c, 8), 1); /* the freed slot, where position 8 is written */
    assert_int_equal(kv_keys_seen(&c, 8), 8);
    /* position 9: recent are 5..8; 3 (0.5 twice) and 4 (0 then 1) tie at 1: the older, 3, goes */
    w[4] = 1.0f;
    pay(&c, 8, w);
    step_one(&c);
    kept_positions(&c, 9, kept);
    const int expect9[] = {0, 2, 4, 5, 6, 7, 8, 9};
    assert_memory_equal(kept, expect9, sizeof expect9);
    /* a reset forgets it all */
    kv_reset(&c);
    for (int i = 0; i < 3; i++) step_one(&c);
    kept_positions(&c, 2, kept);
    const int fresh[] = {0, 1, 2};
    assert_memory_equal(kept, fresh, sizeof fresh);
    kv_free(&c);
    kv_pool_free(&p);
}

/* Block-wise, a budget of 64 (4 blocks): the least attended whole block older than the
 * recent half (32) goes, and the next 16 positions fill its slots in order. */
static void test_block_evicts_least_attended_whole_block(void **state) {
    Config cfg = shipped(VARIANT_MQA, 1, 0);
    KVPool p;
    KVCache c;
    assert_int_equal(kv_pool_init(&p, &cfg, DTYPE_F32, 8), 0);
    kv_pool_set_window(&p, 64, 0, KV_EVICT_BLOCK);
    assert_int_equal(kv_init(&c, &p, 1 << 20), 0);
    for (int i = 0; i < 64; i++) step_one(&c);
    float w[64] = {0};
    for (int i = 0; i < 16; i++) w[i] = 1.0f;  /* block 0: 16 */
    for (int i = 16; i < 32; i++) w[i] = 0.5f; /* block 1: 8, the least of the old ones */
    /* blocks 2 and 3 (32..63) are the recent half: 0, but kept */
    pay(&c, 63, w);
    step_one(&c); /* position 64 */
    assert_int_equal(kv_slot_of(&c, 64), 16);
    assert_int_equal(kv_keys_seen(&c, 64), 49);
    for (int i = 0; i < 15; i++) step_one(&c); /* 65..79 fill slots 17..31, no eviction */
    assert_int_equal(kv_slot_of(&c, 79), 31);
    int kept[64];
    kept_positions(&c, 79, kept);
    for (int i = 0; i < 16; i++) assert_int_equal(kept[i], i);
    for (int i = 16; i < 64; i++) assert_int_equal(kept[i], i + 16); /* 32..79 */
    /* full again, recent half 48..79 (blocks 3 and 1): block 0 (16) against block 2 (32..47, 0 paid) */
    step_one(&c);
    assert_int_equal(kv_slot_of(&c, 80), 32);
    kv_free(&c);
    kv_pool_free(&p);
}

/* ---- block ids unlike their places in the table ---- */

/* The block and the layer of the pool that a row's bytes lie in. */
static int block_holding(const KVPool *p, const void *row) {
    return (int)(((const unsigned char *)row - p->data) / kv_block_bytes(p));
}
static int layer_holding(const KVPool *p, const void *row) {
    return (int)(((const unsigned char *)row - p->data) % kv_block_bytes(p) / p->layer_bytes);
}

/* Two sequences of a pool whose free blocks come out of order: each row lies in the block
 * its table names for its position (not the block of the table's index), and the two
 * sequences' writes never land on each other. */
static void test_scrambled_blocks_rows_land_in_their_blocks(void **state) {
    Config c = shipped(VARIANT_GQA, 2, 0);
    c.n_layers = 2;
    c.head_dim = 4;
    KVPool p;
    KVCache a, b;
    const int S = 3 * KV_BLOCK_TOKENS, L = 2, H = 2, D = 4, N = 8;
    int order[8];
    assert_int_equal(kv_pool_init(&p, &c, DTYPE_F32, N), 0);
    assert_int_equal(scramble_free_blocks(&p, order), 0);
    assert_int_equal(kv_init(&a, &p, S), 0);
    assert_int_equal(kv_init(&b, &p, S), 0);
    assert_int_equal(kv_reserve(&a, S), 0);
    assert_int_equal(kv_reserve(&b, S), 0);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(a.blocks[i], order[i]);
        assert_int_equal(b.blocks[i], order[3 + i]);
        assert_int_not_equal(a.blocks[i], i); /* the fixture's premise */
        assert_int_not_equal(b.blocks[i], i);
    }
    KVCache *seqs[2] = {&a, &b};
    for (int q = 0; q < 2; q++)
        for (int l = 0; l < L; l++)
            for (int h = 0; h < H; h++)
                for (int t = 0; t < S; t++) {
                    float *k = K(seqs[q], l, h, t), *v = V(seqs[q], l, h, t);
                    const int block = seqs[q]->blocks[t / KV_BLOCK_TOKENS];
                    assert_int_equal(block_holding(&p, k), block);
                    assert_int_equal(block_holding(&p, v), block);
                    assert_int_equal(layer_holding(&p, k), l);
                    for (int d = 0; d < D; d++) {
                        k[d] = (float)((((q * L + l) * H + h) * S + t) * D + d);
                        v[d] = -k[d] - 1.0f;
                    }
                }
    for (int q = 0; q < 2; q++)
        for (int l = 0; l < L; l++)
            for (int h = 0; h < H; h++)
                for (int t = 0; t < S; t++)
                    for (int d = 0; d < D; d++) {
                        const float want = (float)((((q * L + l) * H + h) * S + t) * D + d);
                        assert_true(K(seqs[q], l, h, t)[d] == want);
                        assert_true(V(seqs[q], l, h, t)[d] == -want - 1.0f);
                    }
    kv_free(&a);
    kv_free(&b);
    kv_pool_free(&p);
}

/* MLA's latent rows, likewise. */
static void test_scrambled_blocks_latents_land_in_their_blocks(void **state) {
    Config c = shipped(VARIANT_MLA, 0, 16);
    c.n_layers = 2;
    c.rope_dim = 8;
    KVPool p;
    KVCache s;
    const int S = 4 * KV_BLOCK_TOKENS, W = 24;
    int order[4];
    assert_int_equal(kv_pool_init(&p, &c, DTYPE_F32, 4), 0);
    assert_int_equal(scramble_free_blocks(&p, order), 0);
    assert_int_equal(kv_init(&s, &p, S), 0);
    assert_int_equal(kv_reserve(&s, S), 0);
    for (int i = 0; i < 4; i++) assert_int_not_equal(s.blocks[i], i);
    for (int l = 0; l < 2; l++)
        for (int t = 0; t < S; t++) {
            float *row = LAT(&s, l, t);
            assert_int_equal(block_holding(&p, row), s.blocks[t / KV_BLOCK_TOKENS]);
            assert_int_equal(layer_holding(&p, row), l);
            for (int d = 0; d < W; d++) row[d] = (float)((l * S + t) * W + d);
        }
    for (int l = 0; l < 2; l++)
        for (int t = 0; t < S; t++)
            for (int d = 0; d < W; d++) assert_true(LAT(&s, l, t)[d] == (float)((l * S + t) * W + d));
    kv_free(&s);
    kv_pool_free(&p);
}

/* A shared prefix over out-of-order blocks: b's tables point at a's blocks (not at the
 * blocks of their indices), and the copy on b's first write holds the shared block's rows
 * (copied from the block the table names). */
static void test_scrambled_blocks_share_and_copy(void **state) {
    Config c = shipped(VARIANT_MQA, 1, 0);
    KVPool p;
    KVCache a, b;
    int order[8];
    assert_int_equal(kv_pool_init(&p, &c, DTYPE_F32, 8), 0);
    assert_int_equal(scramble_free_blocks(&p, order), 0);
    assert_int_equal(kv_init(&a, &p, 64), 0);
    assert_int_equal(kv_init(&b, &p, 64), 0);
    assert_int_equal(kv_reserve(&a, 40), 0);
    for (int t = 0; t < 40; t++)
        for (int l = 0; l < 4; l++) K(&a, l, 0, t)[0] = (float)(100 * l + t), V(&a, l, 0, t)[0] = -(float)(100 * l + t);
    a.len = 40;
    kv_share_prefix(&b, &a, 37); /* two full blocks and 5 positions of the third */
    for (int i = 0; i < 3; i++) {
        assert_int_equal(b.blocks[i], a.blocks[i]);
        assert_int_not_equal(b.blocks[i], i);
    }
    for (int t = 0; t < 37; t++) assert_true(K(&b, 2, 0, t)[0] == (float)(200 + t));
    assert_int_equal(kv_reserve(&b, 38), 0); /* b writes position 37: a private copy of block 2 */
    assert_int_equal(b.blocks[2], order[3]);
    assert_int_not_equal(b.blocks[2], a.blocks[2]);
    assert_int_equal(block_holding(&p, K(&b, 0, 0, 37)), b.blocks[2]);
    for (int t = 32; t < 37; t++)
        for (int l = 0; l < 4; l++) {
            assert_true(K(&b, l, 0, t)[0] == (float)(100 * l + t));
            assert_true(V(&b, l, 0, t)[0] == -(float)(100 * l + t));
        }
    K(&b, 1, 0, 37)[0] = -5.0f;
    assert_true(K(&a, 1, 0, 37)[0] == 137.0f);
    kv_free(&a);
    kv_free(&b);
    kv_pool_free(&p);
}

/* A window of 40 slots (3 blocks, sinks 4) over out-of-order blocks: after 100 positions,
 * each position the window keeps reads back what was written for it. */
static void test_scrambled_blocks_window(void **state) {
    Config c = shipped(VARIANT_MQA, 1, 0);
    KVPool p;
    KVCache s;
    int order[4];
    assert_int_equal(kv_pool_init(&p, &c, DTYPE_F32, 4), 0);
    assert_int_equal(scramble_free_blocks(&p, order), 0);
    kv_pool_set_window(&p, 40, 4, KV_EVICT_OLDEST);
    assert_int_equal(kv_init(&s, &p, 1 << 20), 0);
    for (int pos = 0; pos < 100; pos++) {
        assert_int_equal(kv_reserve(&s, pos + 1), 0);
        K(&s, 3, 0, pos)[0] = (float)pos;
        s.len = pos + 1;
    }
    assert_int_equal(s.n_blocks, 3);
    for (int i = 0; i < 3; i++) assert_int_not_equal(s.blocks[i], i);
    for (int i = 0; i < kv_window_length(&p, 99); i++) {
        const int pos = kv_window_position(&p, 99, i);
        assert_true(K(&s, 3, 0, pos)[0] == (float)pos);
        assert_int_equal(block_holding(&p, K(&s, 3, 0, pos)), s.blocks[kv_slot(&p, pos) / KV_BLOCK_TOKENS]);
    }
    kv_free(&s);
    kv_pool_free(&p);
}

/* Rollback (speculative decoding): a verify pass appends K+1 positions, then the cache is
 * truncated to the accepted ones. Blocks past the new length go back to the pool, the
 * positions kept are untouched, and the next pass writes at the new length. */
static void test_truncate_positions_and_blocks(void **state) {
    Config c = shipped(VARIANT_MQA, 1, 0);
    KVPool p;
    KVCache a;
    assert_int_equal(kv_pool_init(&p, &c, DTYPE_F32, 4), 0);
    assert_int_equal(kv_init(&a, &p, 64), 0);
    /* 10 positions, then a verify pass of 5 (positions 10..14), all rejected at the first
     * draft token: only position 10 (the token the pass verified from) stays */
    assert_int_equal(kv_reserve(&a, 15), 0);
    for (int t = 0; t < 15; t++) K(&a, 0, 0, t)[0] = (float)t;
    a.len = 15;
    kv_truncate(&a, 11);
    assert_int_equal(a.len, 11);
    assert_int_equal(a.n_blocks, 1);
    assert_int_equal(kv_blocks_in_use(&p), 1);
    for (int t = 0; t < 11; t++) assert_true(K(&a, 0, 0, t)[0] == (float)t);
    /* a rejection at a block boundary: positions 11..19 written over two blocks, 16 kept,
     * so the second block goes back to the pool; 17 would have kept it */
    assert_int_equal(kv_reserve(&a, 20), 0);
    assert_int_equal(a.n_blocks, 2);
    const int second = a.blocks[1];
    a.len = 20;
    kv_truncate(&a, 17);
    assert_int_equal(a.n_blocks, 2);
    assert_int_equal(p.refs[second], 1);
    kv_truncate(&a, 16);
    assert_int_equal(a.n_blocks, 1);
    assert_int_equal(p.refs[second], 0);
    assert_int_equal(p.n_free, 3);
    /* the next pass reserves again from the new length: one block, then writes at 16 */
    assert_int_equal(kv_blocks_needed(&a, 18), 1);
    assert_int_equal(kv_reserve(&a, 18), 0);
    assert_int_equal(a.n_blocks, 2);
    kv_truncate(&a, 0);
    assert_int_equal(a.n_blocks, 0);
    assert_int_equal(p.n_free, 4);
    kv_free(&a);
    assert_int_equal(p.n_free, 4);
    kv_pool_free(&p);
}

/* Rollback into a shared prefix: dropping a shared block lowers its count (and the
 * sharing figures), and writing again into a still-shared block copies it first, so the
 * sequence it shares with never sees the rolled-back or the new positions. */
static void test_truncate_shared_prefix(void **state) {
    Config c = shipped(VARIANT_MQA, 1, 0);
    KVPool p;
    KVCache a, b;
    assert_int_equal(kv_pool_init(&p, &c, DTYPE_F32, 8), 0);
    assert_int_equal(kv_init(&a, &p, 64), 0);
    assert_int_equal(kv_init(&b, &p, 64), 0);
    assert_int_equal(kv_reserve(&a, 20), 0);
    for (int t = 0; t < 20; t++) K(&a, 2, 0, t)[0] = (float)t;
    a.len = 20;
    kv_share_prefix(&b, &a, 20);
    assert_int_equal(p.shared_blocks, 2);
    /* b verifies 6 drafts at 20..25: its second block is copied before the write */
    assert_int_equal(kv_reserve(&b, 26), 0);
    assert_int_not_equal(b.blocks[1], a.blocks[1]);
    for (int t = 20; t < 26; t++) K(&b, 2, 0, t)[0] = -1.0f;
    b.len = 26;
    kv_truncate(&b, 21); /* keeps its own copy */
    assert_int_equal(b.n_blocks, 2);
    assert_int_equal(p.refs[b.blocks[1]], 1);
    /* b rolls back into the first block, still shared: its copy goes back to the pool */
    const int copy = b.blocks[1];
    kv_truncate(&b, 10);
    assert_int_equal(b.n_blocks, 1);
    assert_int_equal(p.refs[copy], 0);
    assert_int_equal(p.refs[a.blocks[0]], 2);
    assert_int_equal(p.shared_blocks, 1);
    assert_int_equal(p.saved_blocks, 1);
    /* and writing at 10 copies the shared block before it is written */
    assert_int_equal(kv_blocks_needed(&b, 12), 1);
    assert_int_equal(kv_reserve(&b, 12), 0);
    assert_int_not_equal(b.blocks[0], a.blocks[0]);
    assert_int_equal(p.refs[a.blocks[0]], 1);
    assert_int_equal(p.shared_blocks, 0);
    K(&b, 2, 0, 10)[0] = -2.0f;
    K(&b, 2, 0, 11)[0] = -2.0f;
    for (int t = 0; t < 10; t++) assert_true(K(&b, 2, 0, t)[0] == (float)t);
    for (int t = 0; t < 20; t++) assert_true(K(&a, 2, 0, t)[0] == (float)t); /* a untouched */
    kv_free(&b);
    kv_free(&a);
    assert_int_equal(p.n_free, 8);
    kv_pool_free(&p);
}

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bytes_per_token),
        cmocka_unit_test(test_layout_disjoint),
        cmocka_unit_test(test_latent_layout),
        cmocka_unit_test(test_reserve_and_release),
        cmocka_unit_test(test_share_and_copy_on_write),
        cmocka_unit_test(test_copy_needs_a_block),
        cmocka_unit_test(test_bytes_per_token_by_dtype),
        cmocka_unit_test(test_packed_tail_hand_over),
        cmocka_unit_test(test_window_slots_and_positions),
        cmocka_unit_test(test_scrambled_blocks_rows_land_in_their_blocks),
        cmocka_unit_test(test_scrambled_blocks_latents_land_in_their_blocks),
        cmocka_unit_test(test_scrambled_blocks_share_and_copy),
        cmocka_unit_test(test_scrambled_blocks_window),
        cmocka_unit_test(test_truncate_positions_and_blocks),
        cmocka_unit_test(test_truncate_shared_prefix),
        cmocka_unit_test(test_h2o_evicts_least_attended_older_than_recent_half),
        cmocka_unit_test(test_block_evicts_least_attended_whole_block),
    };
    return cmocka_run_group_tests_name("kvcache", tests, NULL, NULL);
}
