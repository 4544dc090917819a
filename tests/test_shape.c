/* --shape (shape.h): the presets against the posts' figures and our shipped checkpoints,
 * overrides and the variant they imply, every kind of bad SPEC refused with its reason,
 * and generated weights (loader.h): deterministic from the seed, norms of 1, finite logits. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvcache.h"
#include "loader.h"
#include "model.h"
#include "shape.h"
#include "testutil.h"

static Config parsed(const char *spec) {
    Config c;
    char err[256] = "";
    if (shape_parse(&c, spec, err, sizeof err) != 0) fail_msg("'%s' refused: %s", spec, err);
    return c;
}

static void expect_refused(const char *spec, const char *needle) {
    Config c;
    char err[512] = "";
    const int rc = shape_parse(&c, spec, err, sizeof err);
    if (rc != 2) fail_msg("'%s' accepted (expected an error about '%s')", spec, needle);
    assert_null(strchr(err, '\n'));
    if (!strstr(err, needle)) fail_msg("'%s': message '%s' does not mention '%s'", spec, err, needle);
}

/* The posts' figures: a llama2-7b token holds 2 x 32 layers x 32 heads x 128 x 2 bytes of
 * bf16 keys and values, a llama2-70b one 2 x 80 x 8 x 128 x 2; the 70b's MHA twin holds 80
 * GiB for one sequence of 32768 tokens. */
static void test_posts_figures(void **state) {
    const Config l7 = parsed("llama2-7b");
    assert_int_equal(l7.variant, VARIANT_MHA);
    assert_int_equal(l7.n_layers, 32);
    assert_int_equal(l7.dim, 4096);
    assert_int_equal(l7.hidden_dim, 11008);
    assert_int_equal(l7.max_seq_len, 4096);
    assert_int_equal(kv_bytes_per_token_for(&l7, DTYPE_BF16), 524288);
    const Config l70 = parsed("llama2-70b");
    assert_int_equal(l70.variant, VARIANT_GQA);
    assert_int_equal(kv_bytes_per_token_for(&l70, DTYPE_BF16), 327680);
    const Config twin = parsed("llama2-70b,kv_heads=64,ctx=32768");
    assert_int_equal(twin.variant, VARIANT_MHA);
    assert_true(kv_bytes_per_token_for(&twin, DTYPE_BF16) * (size_t)twin.max_seq_len == 85899345920ull);
    /* fp32 doubles it, int8 is a byte an element and a 4-byte scale a vector */
    assert_int_equal(kv_bytes_per_token_for(&l7, DTYPE_F32), 2 * 524288);
    assert_int_equal(kv_bytes_per_token_for(&l7, DTYPE_I8), 2 * 32 * 32 * (128 + 4));
    /* the pool's blocks hold exactly the formula when rows fill whole cache lines */
    assert_int_equal(kv_block_bytes_for(&l7, DTYPE_BF16), 16 * 524288);
}

static void test_other_presets(void **state) {
    const Config tiny = parsed("tinyllama-1.1b");
    assert_int_equal(tiny.variant, VARIANT_GQA);
    assert_int_equal(tiny.n_kv_heads, 4);
    assert_int_equal(tiny.head_dim, 64);
    assert_int_equal(tiny.max_seq_len, 2048);
    const Config mistral = parsed("mistral-7b");
    assert_int_equal(mistral.window, 4096);
    assert_int_equal(mistral.max_seq_len, 32768);
    assert_true(mistral.rope_theta == 1e6f);
    assert_int_equal(mistral.n_kv_heads, 8);
    const Config ds = parsed("deepseek-v2-lite-attn");
    assert_int_equal(ds.variant, VARIANT_MLA);
    assert_int_equal(ds.kv_latent, 512);
    assert_int_equal(ds.rope_dim, 64);
    assert_int_equal(ds.n_kv_heads, 0);
    assert_int_equal(ds.vocab_size, 102400);
    /* MLA caches the latent and the shared RoPE key: 27 x (512 + 64) bf16 */
    assert_int_equal(kv_bytes_per_token_for(&ds, DTYPE_BF16), 27 * (512 + 64) * 2);
}

/* Our five presets are the shipped checkpoints' shapes, read from their headers. */
static void test_shipped_presets_match_the_checkpoints(void **state) {
    const char *names[] = {"mha", "gqa", "mqa", "mla64", "mla128"};
    for (int i = 0; i < 5; i++) {
        char path[64];
        snprintf(path, sizeof path, "weights/%s.bin", names[i]);
        if (access(path, R_OK) != 0) continue; /* a checkout without the weights */
        Config file;
        char err[256];
        assert_int_equal(model_read_config(&file, path, err, sizeof err), 0);
        const Config c = parsed(names[i]);
        assert_int_equal(c.variant, file.variant);
        assert_int_equal(c.dim, file.dim);
        assert_int_equal(c.n_layers, file.n_layers);
        assert_int_equal(c.n_heads, file.n_heads);
        assert_int_equal(c.head_dim, file.head_dim);
        assert_int_equal(c.n_kv_heads, file.n_kv_heads);
        assert_int_equal(c.kv_latent, file.kv_latent);
        assert_int_equal(c.rope_dim, file.rope_dim);
        assert_int_equal(c.hidden_dim, file.hidden_dim);
        assert_int_equal(c.vocab_size, file.vocab_size);
        assert_int_equal(c.max_seq_len, file.max_seq_len);
        assert_true(c.rope_theta == file.rope_theta);
        assert_int_equal(c.bos_id, file.bos_id);
        assert_int_equal(c.eos_id, file.eos_id);
        assert_int_equal(model_param_count(&c), model_param_count(&file));
    }
}

static void test_overrides_and_twins(void **state) {
    const Config mha = parsed("tinyllama-1.1b,kv_heads=32");
    assert_int_equal(mha.variant, VARIANT_MHA);
    assert_int_equal(mha.n_layers, 22);
    const Config mqa = parsed("tinyllama-1.1b,kv_heads=1");
    assert_int_equal(mqa.variant, VARIANT_MQA);
    const Config mla = parsed("tinyllama-1.1b,latent=256");
    assert_int_equal(mla.variant, VARIANT_MLA);
    assert_int_equal(mla.n_kv_heads, 0);
    assert_int_equal(mla.kv_latent, 256);
    assert_int_equal(mla.rope_dim, 32); /* head_dim / 2 */
    assert_int_equal(parsed("tinyllama-1.1b,latent=256,rope_dim=16").rope_dim, 16);
    assert_int_equal(parsed("mla64,latent=32").rope_dim, 16); /* an MLA preset keeps its own */
    const Config gqa = parsed("deepseek-v2-lite-attn,latent=0,kv_heads=4"); /* MLA's GQA twin */
    assert_int_equal(gqa.variant, VARIANT_GQA);
    assert_int_equal(gqa.rope_dim, 0);
    assert_int_equal(parsed("mla128,latent=0").variant, VARIANT_MHA);
    const Config small = parsed("llama2-7b,layers=2,ctx=131072,window=1024,rope_theta=5e5");
    assert_int_equal(small.n_layers, 2);
    assert_int_equal(small.max_seq_len, 131072);
    assert_int_equal(small.window, 1024);
    assert_true(small.rope_theta == 5e5f);
    const Config own = parsed("layers=2,dim=256,heads=8");
    assert_int_equal(own.variant, VARIANT_MHA);
    assert_int_equal(own.head_dim, 32);
    assert_int_equal(own.hidden_dim, 704); /* 8/3 of dim, up to a multiple of 64 */
    assert_int_equal(own.vocab_size, 32000);
    assert_int_equal(own.dtype, DTYPE_BF16);
}

static void test_bad_specs(void **state) {
    expect_refused("", "needs a preset");
    expect_refused("llama3-8b", "unknown preset 'llama3-8b' (presets: llama2-7b, llama2-70b");
    expect_refused("llama2-7b,foo=1", "unknown key 'foo' (keys: layers, dim,");
    expect_refused("llama2-7b,layers", "'layers' is not key=value");
    expect_refused("layers=2,llama2-7b", "'llama2-7b' is not key=value");
    expect_refused("llama2-7b,,layers=2", "an empty item");
    expect_refused("llama2-7b,layers=2,layers=3", "layers is given twice");
    expect_refused("llama2-7b,layers=two", "layers needs an integer, got 'two'");
    expect_refused("llama2-7b,layers=", "layers needs a number");
    expect_refused("llama2-7b,layers=-1", "layers = -1 is out of range");
    expect_refused("llama2-7b,layers=99999999999", "out of range");
    expect_refused("llama2-7b,layers=0", "--shape: layers = 0 is out of range (1..256)");
    expect_refused("llama2-7b,layers=257", "--shape: layers = 257 is out of range (1..256)");
    expect_refused("llama2-7b,heads=0", "--shape: heads = 0 is out of range");
    expect_refused("llama2-7b,dim=70000", "dim = 70000 is out of range (1..65536)");
    expect_refused("llama2-7b,ctx=131073", "--shape: ctx = 131073 is out of range (1..131072)");
    expect_refused("llama2-7b,vocab=300000", "--shape: vocab = 300000 is out of range (1..262144)");
    expect_refused("llama2-7b,vocab=2", "eos_id"); /* BOS 1 and EOS 2 need three tokens */
    expect_refused("llama2-7b,kv_heads=5", "kv_heads = 5 does not divide heads = 32");
    expect_refused("llama2-7b,kv_heads=64", "kv_heads = 64 is more than heads = 32");
    expect_refused("llama2-7b,kv_heads=0", "a GQA model needs 1 < kv_heads < heads"); /* 0 KV heads without a latent */
    expect_refused("layers=2,dim=30000,heads=2", "--shape: ffn = 80000 is out of range"); /* the default from dim */
    expect_refused("tinyllama-1.1b,latent=256,kv_heads=4", "MLA, which has no KV heads");
    expect_refused("llama2-7b,rope_dim=64", "rope_dim is MLA's");
    expect_refused("tinyllama-1.1b,latent=256,rope_dim=15", "even rope_dim");
    expect_refused("llama2-7b,head_dim=127", "head_dim = 127 is odd");
    expect_refused("llama2-7b,rope_theta=0.5", "rope_theta 0.5 is out of range");
    expect_refused("llama2-7b,rope_theta=abc", "rope_theta needs a number");
    expect_refused("llama2-7b,window=5000", "window = 5000 is out of range (0..4096");
    expect_refused("llama2-7b,ctx=131072,head_dim=256", "RoPE tables");
    expect_refused("llama2-7b,heads=1024", "--shape: heads * (head_dim + rope_dim) = 131072 is over 65536");
    expect_refused("layers=2,dim=256", "heads is not given");
    expect_refused("layers=2,dim=250,heads=8", "heads = 8 does not divide dim = 250");
}

/* A model of shape spec generated from seed; its weights' bytes in *bytes. */
static void generate(Model *m, const char *spec, uint64_t seed) {
    const Config c = parsed(spec);
    char err[256];
    if (model_generate(m, &c, seed, err, sizeof err) != 0) fail_msg("%s", err);
    assert_null(m->tokenizer);
}

static size_t weight_bytes(const Model *m) { return model_param_count(&m->cfg) * dtype_size(m->cfg.dtype); }

static void test_generated_weights(void **state) {
    const char *specs[] = {"gqa,layers=2,vocab=512,ctx=64", "mla64,layers=2,vocab=512,ctx=64"};
    for (int i = 0; i < 2; i++) {
        Model a, b, other;
        generate(&a, specs[i], 7);
        generate(&b, specs[i], 7);
        generate(&other, specs[i], 8);
        const size_t n = weight_bytes(&a);
        assert_memory_equal(a.weights, b.weights, n);          /* the seed decides */
        assert_memory_not_equal(a.weights, other.weights, n); /* and another seed differs */
        const Config *c = &a.cfg;
        for (int k = 0; k < c->dim; k++) {
            assert_true(mat_get(a.w.layers[1].attn_norm, 0, k) == 1.0f);
            assert_true(mat_get(a.w.final_norm, 0, k) == 1.0f);
        }
        /* a matrix's values: centred, of the intended spread, never all alike */
        double sum = 0, sum2 = 0;
        const Mat w1 = a.w.layers[0].w1;
        for (int r = 0; r < w1.rows; r++)
            for (int k = 0; k < w1.cols; k++) {
                const double x = mat_get(w1, r, k);
                sum += x, sum2 += x * x;
            }
        const double count = (double)w1.rows * w1.cols, mean = sum / count, sd = sqrt(sum2 / count - mean * mean);
        assert_true(fabs(mean) < 0.001 && sd > 0.019 && sd < 0.021);
        if (c->variant == VARIANT_MLA) /* the absorbed form's W_UK,h transposed, derived as for a file */
            assert_true(mat_get(mat_block(a.w.layers[0].wuk_t, 1, c->kv_latent), 3, 5) ==
                        mat_get(a.w.layers[0].wuk, 1 * c->head_dim + 5, 3));
        /* a forward pass gives finite logits */
        KVPool pool;
        KVCache cache;
        RunState s;
        assert_int_equal(kv_pool_init(&pool, c, DTYPE_F32, kv_blocks_for(c->max_seq_len)), 0);
        assert_int_equal(kv_init(&cache, &pool, c->max_seq_len), 0);
        assert_int_equal(runstate_init(&s, c, 8), 0);
        float *logits = malloc((size_t)c->vocab_size * sizeof(float));
        const int tokens[] = {1, 100, 200, 300};
        assert_int_equal(model_forward(&a, &s, &cache, tokens, 4, MLA_ABSORBED, logits, 0), 0);
        for (int v = 0; v < c->vocab_size; v++) assert_true(isfinite(logits[v]));
        free(logits);
        runstate_free(&s);
        kv_free(&cache);
        kv_pool_free(&pool);
        model_free(&a);
        model_free(&b);
        model_free(&other);
    }
}

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_posts_figures),
        cmocka_unit_test(test_other_presets),
        cmocka_unit_test(test_shipped_presets_match_the_checkpoints),
        cmocka_unit_test(test_overrides_and_twins),
        cmocka_unit_test(test_bad_specs),
        cmocka_unit_test(test_generated_weights),
    };
    return cmocka_run_group_tests_name("shape", tests, NULL, NULL);
}
