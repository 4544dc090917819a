/* The loader accepts a valid file and refuses every bad one with a message:
 * truncated at every header field and inside every section, bad magic, version,
 * variant, dtype, absurd or inconsistent dimensions, non-zero reserved bytes, bad
 * offsets, corrupt or mismatched tokenizers, NaN or infinite weights, special files;
 * a long path never costs the message its reason. The files are made here. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "loader.h"
#include "model.h"
#include "testutil.h"

static unsigned char *g_valid; /* a valid small GQA checkpoint */
static size_t g_size;
static int g_vocab;

static int setup(void **state) {
    char err[256];
    SpmTokenizer *tok = spm_load_file(g_tokenizer_path, err, sizeof err);
    if (!tok) return -1;
    g_vocab = spm_vocab_size(tok);
    spm_free(tok);
    Config c = test_config(VARIANT_GQA, 0, g_vocab, DTYPE_BF16);
    const char *path = temp_path("valid.bin");
    if (write_test_checkpoint(path, &c, g_tokenizer_path, 3) != 0) return -1;
    g_valid = read_whole_file(path, &g_size);
    return g_valid ? 0 : -1;
}

static int teardown(void **state) {
    free(g_valid);
    return 0;
}

/* Loads bytes as a checkpoint; returns 0 or -1, and the message. */
static int load_bytes(const unsigned char *data, size_t n, char *err, size_t errlen) {
    const char *path = temp_path("case.bin");
    assert_int_equal(write_whole_file(path, data, n), 0);
    Model m;
    err[0] = '\0';
    int rc = model_load(&m, path, err, errlen);
    if (rc == 0) model_free(&m);
    return rc;
}

static void expect_refused(const unsigned char *data, size_t n, const char *needle) {
    char err[512];
    int rc = load_bytes(data, n, err, sizeof err);
    if (rc != -1) fail_msg("accepted a bad file (expected an error about '%s')", needle);
    assert_true(strlen(err) > 10);
    assert_null(strchr(err, '\n')); /* one line */
    if (needle && !strstr(err, needle)) fail_msg("message '%s' does not mention '%s'", err, needle);
}

static void test_valid_loads(void **state) {
    char err[512];
    assert_int_equal(load_bytes(g_valid, g_size, err, sizeof err), 0);
    Model m;
    assert_int_equal(model_load(&m, temp_path("case.bin"), err, sizeof err), 0);
    assert_int_equal(m.cfg.variant, VARIANT_GQA);
    assert_int_equal(m.cfg.n_kv_heads, 2);
    assert_int_equal(m.cfg.vocab_size, g_vocab);
    assert_non_null(m.tokenizer);
    model_free(&m);
}

static void test_missing_file(void **state) {
    Model m;
    char err[512];
    assert_int_equal(model_load(&m, "/nonexistent/model.bin", err, sizeof err), -1);
    assert_non_null(strstr(err, "cannot open"));
}

/* A path of 4000 bytes is shortened in the message (run.c's buffer holds 512), never the
 * reason after it. */
static void test_long_path_keeps_the_reason(void **state) {
    char path[4001];
    long_missing_path(path);
    Model m;
    char err[512];
    assert_int_equal(model_load(&m, path, err, sizeof err), -1);
    const char *reason = ": No such file or directory";
    assert_true(strlen(err) > strlen(reason));
    assert_string_equal(err + strlen(err) - strlen(reason), reason);
    assert_non_null(strstr(err, "cannot open checkpoint ...d/d/d")); /* the path's end */
}

static int load_path(const char *path, char *err, size_t errlen) {
    Model m;
    const int rc = model_load(&m, path, err, errlen);
    if (rc == 0) model_free(&m);
    return rc;
}

/* a FIFO, a device, a directory: refused at once */
static void test_special_files(void **state) { expect_special_files_refused(load_path); }

/* truncated at every header field (every 4 bytes), then inside the tokenizer and the weights */
static void test_truncated_everywhere(void **state) {
    for (size_t n = 0; n < 128; n += 4) expect_refused(g_valid, n, n < 128 ? "truncated" : NULL);
    size_t cuts[] = {128, 200, 1000, g_size / 2, g_size - 64, g_size - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) expect_refused(g_valid, cuts[i], NULL);
    /* and one byte too many */
    unsigned char *longer = calloc(1, g_size + 1);
    memcpy(longer, g_valid, g_size);
    expect_refused(longer, g_size + 1, NULL);
    free(longer);
}

/* a copy of the valid file with one u32 field changed */
static void expect_field_refused(size_t offset, uint32_t value, const char *needle) {
    unsigned char *b = malloc(g_size);
    memcpy(b, g_valid, g_size);
    for (int i = 0; i < 4; i++) b[offset + i] = (unsigned char)(value >> (8 * i));
    expect_refused(b, g_size, needle);
    free(b);
}

static uint64_t rd_u64_at(const unsigned char *b, size_t offset) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | b[offset + i];
    return v;
}

/* where a tensor starts among the weights, in elements, found by walking the file order */
typedef struct {
    const char *name;
    int layer;
    size_t elements_before, found;
    int seen;
} TensorSearch;

static void find_tensor(void *ctx, const TensorRef *t) {
    TensorSearch *s = ctx;
    if (!s->seen && t->layer == s->layer && strcmp(t->name, s->name) == 0) {
        s->found = s->elements_before;
        s->seen = 1;
    }
    s->elements_before += (size_t)t->rows * (size_t)t->cols;
}

static size_t tensor_start(const Config *c, const char *name, int layer) {
    TensorSearch s = {name, layer, 0, 0, 0};
    Weights w = {0};
    w.layers = calloc((size_t)c->n_layers, sizeof *w.layers);
    model_walk_tensors(c, &w, find_tensor, &s);
    free(w.layers);
    assert_true(s.seen);
    return s.found;
}

/* A valid checkpoint of c with the weight at `element` of tensor `name` (of `layer`) set
 * to the bits `bits` (a bf16 or fp32 pattern), expected to be refused with `needle`. */
static void expect_weight_refused(const Config *c, const char *name, int layer, size_t element, uint32_t bits,
                                  const char *needle) {
    const char *path = temp_path("nonfinite.bin");
    assert_int_equal(write_test_checkpoint(path, c, g_tokenizer_path, 6), 0);
    size_t n;
    unsigned char *b = read_whole_file(path, &n);
    assert_non_null(b);
    const size_t es = dtype_size(c->dtype), at = rd_u64_at(b, 88) + (tensor_start(c, name, layer) + element) * es;
    for (size_t i = 0; i < es; i++) b[at + i] = (unsigned char)(bits >> (8 * i));
    expect_refused(b, n, needle);
    free(b);
}

/* NaN and infinite weights are refused at load, naming the tensor and the element: no run
 * may compute with them. */
static void test_nonfinite_weights(void **state) {
    const Config bf = test_config(VARIANT_GQA, 0, g_vocab, DTYPE_BF16);
    expect_weight_refused(&bf, "tok_embeddings", -1, 0, 0x7FC0, "weight [0][0] of tok_embeddings is NaN");
    expect_weight_refused(&bf, "tok_embeddings", -1, (size_t)5 * bf.dim + 7, 0xFF80,
                          "weight [5][7] of tok_embeddings is infinite");
    expect_weight_refused(&bf, "wv", 1, (size_t)3 * bf.dim + 2, 0x7F81, "weight [3][2] of wv in layer 1 is NaN");
    expect_weight_refused(&bf, "final_norm", -1, (size_t)bf.dim - 1, 0x7F80,
                          "weight [0][63] of final_norm is infinite");
    const Config f32 = test_config(VARIANT_MLA, 16, g_vocab, DTYPE_F32);
    expect_weight_refused(&f32, "wuk", 0, 17, 0x7FC00000u, "weight [1][1] of wuk in layer 0 is NaN");
    expect_weight_refused(&f32, "w2", 1, (size_t)f32.hidden_dim * f32.dim - 1, 0xFF800000u,
                          "of w2 in layer 1 is infinite");
    /* the largest finite numbers load: they are numbers */
    const char *path = temp_path("largest.bin");
    assert_int_equal(write_test_checkpoint(path, &bf, g_tokenizer_path, 6), 0);
    size_t n;
    unsigned char *b = read_whole_file(path, &n);
    const size_t at = rd_u64_at(b, 88);
    b[at] = 0x7F, b[at + 1] = 0x7F; /* bf16 0x7F7F, about 3.4e38 */
    char err[512];
    assert_int_equal(load_bytes(b, n, err, sizeof err), 0);
    free(b);
}

/* docs/FORMAT.md: the header's last 16 bytes are reserved and zero; a file that uses them
 * is of a format this program does not know. */
static void test_reserved_header_bytes(void **state) {
    for (size_t at = 112; at < 128; at += 15) {
        unsigned char *b = malloc(g_size);
        memcpy(b, g_valid, g_size);
        b[at] = 0x01;
        char needle[64];
        snprintf(needle, sizeof needle, "reserved header byte %zu is 1, not 0", at);
        expect_refused(b, g_size, needle);
        free(b);
    }
}

static void test_bad_header_fields(void **state) {
    expect_field_refused(0, 0x46554747, "magic"); /* "GGUF" */
    expect_field_refused(4, 2, "version");
    expect_field_refused(4, 0, "version");
    expect_field_refused(8, 4, "variant");
    expect_field_refused(8, 0, "MHA"); /* GQA head counts under the MHA name */
    expect_field_refused(8, 2, "MQA");
    expect_field_refused(8, 3, "MLA");
    expect_field_refused(12, 2, "dtype");
    expect_field_refused(12, 0, "weights"); /* fp32 doubles the expected size */
    expect_field_refused(16, 0, "dim");     /* zero */
    expect_field_refused(16, 0xFFFFFFFF, "dim = 4294967295 is out of range (1..65536)"); /* the file's number */
    expect_field_refused(16, 65536, "weights"); /* plausible but does not add up */
    expect_field_refused(20, 1000000, "n_layers = 1000000 is out of range");
    expect_field_refused(24, 0, "n_heads");
    expect_field_refused(24, 3, "GQA");        /* 2 KV heads do not divide 3 heads */
    expect_field_refused(28, 15, "odd");       /* head_dim odd */
    expect_field_refused(32, 4, "GQA");        /* n_kv_heads == n_heads */
    expect_field_refused(36, 16, "kv_latent"); /* a latent on a GQA model */
    expect_field_refused(44, 97, "weights");   /* hidden_dim */
    expect_field_refused(48, 0x7FFFFFFF, "vocab_size = 2147483647 is out of range");
    expect_field_refused(52, 200000, "max_seq_len = 200000 is out of range (1..131072)");
    expect_field_refused(36, 70000, "kv_latent = 70000 is out of range (0..65536)");
    expect_field_refused(56, 0x7FC00000, "rope_theta"); /* NaN */
    { /* a valid 530 KB file (dim 1, context 8192, heads 4 x 16384) once made the loader fill two
         * 256 MB RoPE tables, 4 s of cos/sin (docs/ROBUSTNESS.md); now its header is refused */
        unsigned char *b = malloc(g_size);
        memcpy(b, g_valid, g_size);
        const uint32_t f[][2] = {{24, 4}, {28, 16384}, {32, 2}, {52, 8192}};
        for (size_t k = 0; k < 4; k++)
            for (int i = 0; i < 4; i++) b[f[k][0] + i] = (unsigned char)(f[k][1] >> (8 * i));
        expect_refused(b, g_size, "RoPE tables");
        free(b);
    }
    expect_field_refused(60, 0, "norm_eps");
    expect_field_refused(64, 5000, "bos_id");
    expect_field_refused(68, 1, "tokenizer"); /* eos id that the tokenizer does not have */
}

static void test_bad_offsets(void **state) {
    expect_field_refused(72, 7, "tokenizer");             /* tokenizer inside the header */
    expect_field_refused(76, 1, "tokenizer");             /* offset >= 4 GiB */
    expect_field_refused(80, 0, "tokenizer");             /* empty tokenizer */
    expect_field_refused(80, 0xFFFFFFF0u, "tokenizer");   /* runs past the end */
    expect_field_refused(88, 64, "weights");              /* overlaps the tokenizer */
    expect_field_refused(88, 63 + 128 * 1024, "weights"); /* not aligned */
    expect_field_refused(96, 12345, "weights");
    expect_field_refused(100, 1, "weights"); /* size >= 4 GiB */
}

static void test_corrupt_tokenizer(void **state) {
    unsigned char *b = malloc(g_size);
    memcpy(b, g_valid, g_size);
    uint64_t off = 0, n = 0;
    for (int i = 7; i >= 0; i--) off = off << 8 | b[72 + i];
    for (int i = 7; i >= 0; i--) n = n << 8 | b[80 + i];
    memset(b + off, 0xFF, (size_t)n);
    expect_refused(b, g_size, "tokenizer");
    free(b);
}

/* a checkpoint whose vocabulary differs from its tokenizer's piece count */
static void test_vocab_mismatch(void **state) {
    Config c = test_config(VARIANT_MHA, 0, g_vocab + 16, DTYPE_BF16);
    const char *path = temp_path("vocab.bin");
    assert_int_equal(write_test_checkpoint(path, &c, g_tokenizer_path, 4), 0);
    size_t n;
    unsigned char *b = read_whole_file(path, &n);
    expect_refused(b, n, "does not match");
    free(b);
}

/* every variant and dtype loads, with the parameter count the layout implies */
static void test_every_variant_loads(void **state) {
    const struct {
        Variant v;
        int latent;
        DType dt;
    } cases[] = {
        {VARIANT_MHA, 0, DTYPE_BF16},  {VARIANT_GQA, 0, DTYPE_F32},  {VARIANT_MQA, 0, DTYPE_BF16},
        {VARIANT_MLA, 16, DTYPE_BF16}, {VARIANT_MLA, 32, DTYPE_F32},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        Config c = test_config(cases[i].v, cases[i].latent, g_vocab, cases[i].dt);
        const char *path = temp_path("variant.bin");
        assert_int_equal(write_test_checkpoint(path, &c, g_tokenizer_path, 5), 0);
        Model m;
        char err[512];
        if (model_load(&m, path, err, sizeof err) != 0) fail_msg("%s", err);
        assert_int_equal(m.cfg.variant, cases[i].v);
        assert_int_equal(m.cfg.dtype, cases[i].dt);
        assert_int_equal(m.cfg.kv_latent, cases[i].latent);
        model_free(&m);
    }
    /* the shipped shape: 4 layers, 512 wide; MHA has 14.5M parameters */
    Config big = test_config(VARIANT_MHA, 0, 4096, DTYPE_BF16);
    big.dim = 512;
    big.n_layers = 4;
    big.n_heads = 16;
    big.head_dim = 32;
    big.n_kv_heads = 16;
    big.hidden_dim = 1344;
    assert_int_equal(model_param_count(&big), 4096 * 512 + 4 * (512 + 4 * 512 * 512 + 512 + 3 * 512 * 1344) + 512);
}

/* The flags (offset 104) and the window (108): an unknown flag, an untied head the file does
 * not hold, a window over the context are refused; an untied file loads with its own head. */
static void test_flags_and_window(void **state) {
    expect_field_refused(104, 2, "unknown flags 0x2");
    expect_field_refused(104, 0x80000000u, "unknown flags");
    expect_field_refused(104, 1, "weights"); /* untied, but no output tensor in the file */
    expect_field_refused(108, 65, "window = 65 is over the context (max_seq_len 64)");
    expect_field_refused(108, 0xFFFFFFFFu, "window = 4294967295");
    char err[512];
    Config c = test_config(VARIANT_GQA, 0, g_vocab, DTYPE_BF16);
    c.window = 64; /* the whole context: allowed */
    c.untied_head = 1;
    const char *path = temp_path("untied.bin");
    assert_int_equal(write_test_checkpoint(path, &c, g_tokenizer_path, 6), 0);
    Model m;
    if (model_load(&m, path, err, sizeof err) != 0) fail_msg("%s", err);
    assert_int_equal(m.cfg.window, 64);
    assert_int_equal(m.cfg.untied_head, 1);
    assert_int_equal(m.w.output.rows, g_vocab);
    assert_int_equal(m.w.output.cols, 64);
    assert_ptr_not_equal(m.w.output.data, m.w.tok_embeddings.data);
    assert_ptr_equal(weights_head(&m.cfg, &m.w).data, m.w.output.data);
    model_free(&m);
    const size_t untied = model_param_count(&c);
    c.untied_head = 0;
    assert_int_equal(untied, model_param_count(&c) + (size_t)g_vocab * 64);
    /* the untied file cut to a tied one's length is refused: the head is not optional */
    size_t n;
    unsigned char *b = read_whole_file(path, &n);
    expect_refused(b, n - (size_t)g_vocab * 64 * 2, "weights");
    free(b);
}

int main(int argc, char **argv) {
    if (argc > 1) g_tokenizer_path = argv[1];
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_loads),
        cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_truncated_everywhere),
        cmocka_unit_test(test_bad_header_fields),
        cmocka_unit_test(test_bad_offsets),
        cmocka_unit_test(test_corrupt_tokenizer),
        cmocka_unit_test(test_vocab_mismatch),
        cmocka_unit_test(test_every_variant_loads),
        cmocka_unit_test(test_nonfinite_weights),
        cmocka_unit_test(test_reserved_header_bytes),
        cmocka_unit_test(test_flags_and_window), /* header offsets 104 and 108 */
        cmocka_unit_test(test_long_path_keeps_the_reason),
        cmocka_unit_test(test_special_files),
    };
    return cmocka_run_group_tests_name("loader", tests, setup, teardown);
}
