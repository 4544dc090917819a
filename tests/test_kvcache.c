/* KV cache layout and accounting. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <stdlib.h>

#include "kvcache.h"
#include "testutil.h"

/* bytes per token follow the formulas of the posts: 2*L*H_kv*d_h*4 and L*(d_c+d_R)*4 */
static void test_bytes_per_token(void **state) {
    KVCache c;
    const struct { int kv_heads, latent; size_t expect; } cases[] = {
        {16, 0, 2 * 4 * 16 * 32 * 4}, /* mha: 16 KiB */
        {4, 0, 2 * 4 * 4 * 32 * 4},   /* gqa */
        {1, 0, 2 * 4 * 1 * 32 * 4},   /* mqa */
        {0, 64 + 16, 4 * 80 * 4},     /* mla64 */
        {0, 128 + 16, 4 * 144 * 4},   /* mla128 */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        assert_int_equal(kv_init(&c, 4, 256, cases[i].kv_heads, 32, cases[i].latent), 0);
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
    assert_int_equal(kv_init(&c, L, S, H, D, 0), 0);
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
    assert_int_equal(kv_init(&c, 2, 8, 0, 32, 24), 0);
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
