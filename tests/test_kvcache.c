/* KV cache layout and accounting. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <stdlib.h>

#include "kvcache.h"
#include "testutil.h"

/* The shipped shape (4 layers, 16 heads of 32) of a variant. */
static Config shipped(Variant v, int kv_heads, int latent) {
    Config c = {.variant = v, .n_layers = 4, .n_heads = 16, .head_dim = 32, .n_kv_heads = kv_heads,
                .kv_latent = latent, .rope_dim = latent ? 16 : 0, .max_seq_len = 256};
    return c;
}

/* A cache of L layers, H KV heads of D floats (or an MLA latent of width `latent` with no
 * RoPE part), for S positions. */
static int init_shape(KVCache *cache, int L, int S, int H, int D, int latent) {
    Config c = {.variant = latent ? VARIANT_MLA : VARIANT_MHA, .n_layers = L, .n_heads = H ? H : 1, .head_dim = D,
                .n_kv_heads = H, .kv_latent = latent, .max_seq_len = S};
    return kv_init(cache, &c, S);
}

/* bytes per token follow the formulas of the posts: 2*L*H_kv*d_h*4 and L*(d_c+d_R)*4 */
static void test_bytes_per_token(void **state) {
    KVCache c;
    const struct { Config cfg; size_t expect; } cases[] = {
        {shipped(VARIANT_MHA, 16, 0), 2 * 4 * 16 * 32 * 4}, /* 16 KiB */
        {shipped(VARIANT_GQA, 4, 0), 2 * 4 * 4 * 32 * 4},
        {shipped(VARIANT_MQA, 1, 0), 2 * 4 * 1 * 32 * 4},
        {shipped(VARIANT_MLA, 0, 64), 4 * 80 * 4},
        {shipped(VARIANT_MLA, 0, 128), 4 * 144 * 4},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        assert_int_equal(kv_init(&c, &cases[i].cfg, 256), 0);
        assert_int_equal(kv_bytes_per_token(&c), cases[i].expect);
        assert_int_equal(kv_bytes_allocated(&c), cases[i].expect * 256);
        kv_free(&c);
        assert_int_equal(kv_bytes_allocated(&c), 0);
    }
}

/* every (layer, head, position) has its own head_dim floats, keys and values apart */
static void test_layout_disjoint(void **state) {
    KVCache c;
    const int L = 3, S = 10, H = 2, D = 4;
    assert_int_equal(init_shape(&c, L, S, H, D, 0), 0);
    for (int l = 0; l < L; l++)
        for (int h = 0; h < H; h++)
            for (int p = 0; p < S; p++)
                for (int d = 0; d < D; d++) {
                    kv_key(&c, l, h, p)[d] = (float)(((l * H + h) * S + p) * D + d);
                    kv_value(&c, l, h, p)[d] = -(float)(((l * H + h) * S + p) * D + d);
                }
    for (int l = 0; l < L; l++)
        for (int h = 0; h < H; h++)
            for (int p = 0; p < S; p++)
                for (int d = 0; d < D; d++) {
                    assert_true(kv_key(&c, l, h, p)[d] == (float)(((l * H + h) * S + p) * D + d));
                    assert_true(kv_value(&c, l, h, p)[d] == -(float)(((l * H + h) * S + p) * D + d));
                }
    /* positions of one head are contiguous (the attention loop streams them) */
    assert_ptr_equal(kv_key(&c, 1, 1, 3) + D, kv_key(&c, 1, 1, 4));
    kv_free(&c);
}

static void test_latent_layout_and_reset(void **state) {
    KVCache c;
    assert_int_equal(init_shape(&c, 2, 8, 0, 32, 24), 0);
    assert_null(c.v);
    assert_ptr_equal(kv_latent(&c, 0, 1), kv_latent(&c, 0, 0) + 24);
    assert_ptr_equal(kv_latent(&c, 1, 0), kv_latent(&c, 0, 7) + 24);
    c.len = 5;
    kv_reset(&c);
    assert_int_equal(c.len, 0);
    kv_free(&c);
}

int main(int argc, char **argv) {
    (void)argc; (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bytes_per_token),
        cmocka_unit_test(test_layout_disjoint),
        cmocka_unit_test(test_latent_layout_and_reset),
    };
    return cmocka_run_group_tests_name("kvcache", tests, NULL, NULL);
}
