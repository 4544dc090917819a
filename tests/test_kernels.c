/* Kernels against a naive double-precision reference, and the canonical order:
 * SIMD == scalar reference bit for bit, matmul independent of batch size and threads. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#endif

#include "kernels/kernels.h"
#include "kernels/threads.h"
#include "kernels/simd.h"
#include "testutil.h"

static uint16_t to_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static float *random_floats(int n, uint64_t seed) {
    float *p = malloc((size_t)n * sizeof *p);
    uint64_t s = seed;
    for (int i = 0; i < n; i++) p[i] = test_uniform(&s);
    return p;
}

static uint16_t *random_bf16(int n, uint64_t seed, float scale) {
    uint16_t *p = malloc((size_t)n * sizeof *p);
    uint64_t s = seed;
    for (int i = 0; i < n; i++) p[i] = to_bf16(scale * test_uniform(&s));
    return p;
}

static float bf(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* A packed copy (kernels.h) of a row-major matrix; the caller frees .data. */
static Mat packed(const void *rowmajor, int rows, int cols, DType dt) {
    void *p = malloc((size_t)rows * cols * dtype_size(dt));
    mat_pack(p, rowmajor, rows, cols, dt);
    return (Mat){p, rows, cols, dt};
}

/* The packed layout is a permutation of the elements; mat_get and mat_row_f32 read
 * element (r, c) wherever it went, for group and chunk edges in both directions. */
static void test_mat_pack(void **state) {
    const int shapes[][2] = {{1, 5}, {1, 40}, {4, 16}, {3, 7}, {5, 33}, {7, 100}, {9, 17}, {12, 64}, {6, 95}};
    for (int bf16_weights = 0; bf16_weights <= 1; bf16_weights++)
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
            int rows = shapes[i][0], cols = shapes[i][1];
            DType dt = bf16_weights ? DTYPE_BF16 : DTYPE_F32;
            float *src = random_floats(rows * cols, 61 + i);
            uint16_t *src16 = random_bf16(rows * cols, 61 + i, 1.0f);
            Mat w = packed(bf16_weights ? (void *)src16 : (void *)src, rows, cols, dt);
            { /* packed two rows at a time, in any order, it is the same bytes */
                const size_t es = dtype_size(dt), bytes = (size_t)rows * cols * es;
                const char *from = bf16_weights ? (const char *)src16 : (const char *)src;
                char *by_rows = malloc(bytes);
                for (int r0 = (rows - 1) / 2 * 2; r0 >= 0; r0 -= 2) {
                    const int r1 = r0 + 2 < rows ? r0 + 2 : rows;
                    mat_pack_rows(by_rows, from + (size_t)r0 * cols * es, rows, cols, dt, r0, r1);
                }
                assert_memory_equal(by_rows, w.data, bytes);
                free(by_rows);
            }
            char *hit = calloc((size_t)rows * cols, 1);
            float *row = malloc((size_t)cols * sizeof(float));
            for (int r = 0; r < rows; r++) {
                mat_row_f32(row, w, r);
                for (int c = 0; c < cols; c++) {
                    float want = bf16_weights ? bf(src16[(size_t)r * cols + c]) : src[(size_t)r * cols + c];
                    size_t off = mat_packed_offset(rows, cols, dt, r, c);
                    assert_true(off < (size_t)rows * cols);
                    assert_int_equal(hit[off], 0);
                    hit[off] = 1;
                    assert_true(mat_get(w, r, c) == want);
                    assert_true(row[c] == want);
                    if (rows == 1) assert_int_equal(off, c); /* vectors stay plain */
                }
            }
            free(src);
            free(src16);
            free((void *)w.data);
            free(hit);
            free(row);
        }
    /* a full bf16 chunk holds the pairs (c0 + l, c0 + 16 + l) */
    assert_int_equal(mat_packed_offset(8, 64, DTYPE_BF16, 5, 32 + 3), 4 * 64 + 32 * 4 + 1 * 32 + 2 * 3);
    assert_int_equal(mat_packed_offset(8, 64, DTYPE_BF16, 5, 32 + 16 + 3), 4 * 64 + 32 * 4 + 1 * 32 + 2 * 3 + 1);
    /* a stack of blocks: each block of n rows packed on its own, handed out by mat_block */
    const int blocks = 3, n = 6, cols = 21;
    uint16_t *src = random_bf16(blocks * n * cols, 71, 1.0f), *dst = malloc((size_t)blocks * n * cols * 2);
    mat_pack_blocks(dst, src, blocks, n, cols, DTYPE_BF16);
    Mat stack = {dst, blocks * n, cols, DTYPE_BF16};
    for (int b = 0; b < blocks; b++)
        for (int r = 0; r < n; r++)
            for (int c = 0; c < cols; c++)
                assert_true(mat_get(mat_block(stack, b, n), r, c) == bf(src[((size_t)b * n + r) * cols + c]));
    free(src);
    free(dst);
}

/* dot() equals the scalar canonical order bit for bit, for lengths with and without tails */
static void test_dot_matches_canonical_scalar(void **state) {
    const int lengths[] = {1, 7, 15, 16, 17, 31, 32, 48, 80, 144, 512, 1344, 1000};
    for (size_t i = 0; i < sizeof lengths / sizeof lengths[0]; i++) {
        int n = lengths[i];
        float *a = random_floats(n, 11 + i), *b = random_floats(n, 99 + i);
        float simd = dot(a, b, n), scalar = dot_canonical_scalar(a, b, n);
        assert_memory_equal(&simd, &scalar, sizeof(float));
        double ref = 0;
        for (int k = 0; k < n; k++) ref += (double)a[k] * b[k];
        assert_true(fabs(simd - ref) <= 1e-5 * (1 + sqrt((double)n)));
        free(a);
        free(b);
    }
}

/* dot_cat on a split at a multiple of 16 equals dot on the concatenation */
static void test_dot_cat(void **state) {
    float *a = random_floats(48, 1), *b = random_floats(48, 2);
    float whole = dot(a, b, 48), split = dot_cat(a, b, 32, a + 32, b + 32, 16);
    assert_memory_equal(&whole, &split, sizeof(float));
    free(a);
    free(b);
}

/* matmul against double precision, bf16 and fp32 weights, shapes with edge tiles; and
 * every output equal, bit for bit, to the scalar canonical dot of its weight row (the
 * packed layout and the tile reorder memory, never the order of one dot product) */
static void check_matmul(int T, int rows, int cols, DType dt) {
    float *x = random_floats(T * cols, 5), *wrow = malloc((size_t)cols * sizeof(float));
    void *wdata;
    if (dt == DTYPE_BF16)
        wdata = random_bf16(rows * cols, 7, 0.5f);
    else
        wdata = random_floats(rows * cols, 7);
    Mat w = packed(wdata, rows, cols, dt);
    float *out = calloc((size_t)T * rows, sizeof(float));
    Worker alone = worker_alone();
    matmul(&alone, out, rows, x, cols, w, T);
    for (int r = 0; r < rows; r++) {
        for (int k = 0; k < cols; k++)
            wrow[k] = dt == DTYPE_BF16 ? bf(((uint16_t *)wdata)[(size_t)r * cols + k])
                                       : ((float *)wdata)[(size_t)r * cols + k];
        for (int t = 0; t < T; t++) {
            double ref = 0;
            for (int k = 0; k < cols; k++) ref += (double)wrow[k] * x[(size_t)t * cols + k];
            float got = out[(size_t)t * rows + r], canonical = dot_canonical_scalar(wrow, x + (size_t)t * cols, cols);
            assert_true(fabs(got - ref) <= 1e-5 * (1 + sqrt((double)cols)));
            assert_memory_equal(&got, &canonical, sizeof(float));
        }
    }
    free(x);
    free(wrow);
    free(wdata);
    free((void *)w.data);
    free(out);
}

/* checks() with and without AVX-512's wide tiles, whichever this processor takes. */
static void with_each_tile(void (*checks)(void)) {
    const int machine = matmul_wide_tiles();
    for (int wide = 0; wide < 2; wide++) {
        matmul_set_wide_tiles(wide);
        checks();
    }
    matmul_set_wide_tiles(machine);
}

static void matmul_reference_checks(void) {
    check_matmul(1, 64, 512, DTYPE_BF16);
    check_matmul(5, 67, 100, DTYPE_BF16);
    check_matmul(13, 30, 1344, DTYPE_BF16);
    check_matmul(64, 16, 512, DTYPE_BF16); /* many tokens: wide tiles, where taken */
    check_matmul(7, 9, 33, DTYPE_F32);
    check_matmul(256, 16, 64, DTYPE_F32);
    check_matmul(3, 2, 20, DTYPE_BF16); /* fewer rows than a group */
    check_matmul(2, 6, 63, DTYPE_BF16); /* a last chunk of 31 columns: 16 + 15 */
    check_matmul(4, 5, 48, DTYPE_BF16); /* one pair chunk and a last chunk of 16 */
}

static void test_matmul_reference(void **state) { with_each_tile(matmul_reference_checks); }

/* Batch invariance: row t of a T-token matmul equals the 1-token matmul of row t, and the
 * canonical scalar dot, bit for bit. */
static void check_matmul_batch_invariant(int T, int rows, int cols) {
    float *x = random_floats(T * cols, 21);
    uint16_t *wb = random_bf16(rows * cols, 22, 0.3f);
    Mat w = packed(wb, rows, cols, DTYPE_BF16);
    float *all = malloc((size_t)T * rows * sizeof(float)), *one = malloc((size_t)rows * sizeof(float));
    float *wrow = malloc((size_t)cols * sizeof(float));
    Worker alone = worker_alone();
    matmul(&alone, all, rows, x, cols, w, T);
    for (int t = 0; t < T; t++) {
        matmul(&alone, one, rows, x + (size_t)t * cols, cols, w, 1);
        assert_memory_equal(one, all + (size_t)t * rows, (size_t)rows * sizeof(float));
    }
    for (int r = 0; r < rows; r++) {
        for (int k = 0; k < cols; k++) wrow[k] = bf(wb[(size_t)r * cols + k]);
        for (int t = 0; t < T; t += 6) {
            float s = dot_canonical_scalar(wrow, x + (size_t)t * cols, cols);
            assert_memory_equal(&s, &all[(size_t)t * rows + r], sizeof(float));
        }
    }
    /* strided input and output (ldx, ldo wider than the matrix) give the same numbers */
    float *xs = calloc((size_t)T * (cols + 8), sizeof(float)), *os = calloc((size_t)T * (rows + 3), sizeof(float));
    for (int t = 0; t < T; t++) memcpy(xs + (size_t)t * (cols + 8), x + (size_t)t * cols, (size_t)cols * sizeof(float));
    matmul(&alone, os, rows + 3, xs, cols + 8, w, T);
    for (int t = 0; t < T; t++)
        assert_memory_equal(os + (size_t)t * (rows + 3), all + (size_t)t * rows, (size_t)rows * sizeof(float));
    free(xs);
    free(os);
    free(x);
    free(wb);
    free((void *)w.data);
    free(all);
    free(one);
    free(wrow);
}

static void matmul_batch_invariant_checks(void) {
    check_matmul_batch_invariant(37, 45, 528); /* a last chunk of 16 columns: no wide tiles */
    check_matmul_batch_invariant(37, 45, 512);
}

static void test_matmul_batch_invariant(void **state) { with_each_tile(matmul_batch_invariant_checks); }

/* matmul_jobs gives every product exactly what matmul gives it, whatever the thread count
 * and wherever the threads' shares cut the concatenated tile list, in a forward pass's team
 * (threads.h) or alone; matmul_swiglu equals matmul, matmul and swiglu. T tokens;
 * cols is wide enough that every call is threaded. */
typedef struct {
    int T, cols;
    const float *x;
    MatmulJob jobs[3];
    float *want[3];
    Mat w3;                   /* a second matrix of w[2]'s shape: W1 = w[2], W3 = w3 */
    const float *ref1, *ref3; /* silu(W1 x) * W3 x, W3 x */
    float *h1, *h3;           /* what matmul_swiglu gives */
} JobsCheck;

/* Every thread of the team runs the products; thread 0 checks them once they are whole. */
static void check_jobs(void *arg, Worker *wk) {
    JobsCheck *c = arg;
    const int T = c->T;
    if (team_alone(wk))
        for (int j = 0; j < 3; j++) memset(c->jobs[j].out, 0xff, (size_t)T * c->jobs[j].w.rows * sizeof(float));
    matmul_jobs(wk, c->jobs, 3);
    matmul_swiglu(wk, c->h1, c->h3, c->x, c->cols, c->jobs[2].w, c->w3, T);
    team_barrier(wk);
    if (wk->thread != 0) return;
    for (int j = 0; j < 3; j++)
        assert_memory_equal(c->jobs[j].out, c->want[j], (size_t)T * c->jobs[j].w.rows * sizeof(float));
    assert_memory_equal(c->h3, c->ref3, (size_t)T * 64 * sizeof(float));
    assert_memory_equal(c->h1, c->ref1, (size_t)T * 64 * sizeof(float));
}

static void check_jobs_and_swiglu(int T) {
    const int cols = 288, rows[3] = {37, 8, 64};
    float *x = random_floats(T * cols, 41);
    JobsCheck c = {.T = T, .cols = cols, .x = x};
    uint16_t *wb[3];
    for (int j = 0; j < 3; j++) {
        wb[j] = random_bf16(rows[j] * cols, 42 + j, 0.3f);
        Mat w = packed(wb[j], rows[j], cols, DTYPE_BF16);
        c.want[j] = malloc((size_t)T * rows[j] * sizeof(float));
        Worker alone = worker_alone();
        matmul(&alone, c.want[j], rows[j], x, cols, w, T);
        c.jobs[j] = (MatmulJob){malloc((size_t)T * rows[j] * sizeof(float)), rows[j], x, cols, w, T};
    }
    uint16_t *w3b = random_bf16(64 * cols, 49, 0.3f);
    c.w3 = packed(w3b, 64, cols, DTYPE_BF16);
    float *ref1 = malloc((size_t)T * 64 * sizeof(float)), *ref3 = malloc((size_t)T * 64 * sizeof(float));
    Worker alone = worker_alone();
    matmul(&alone, ref3, 64, x, cols, c.w3, T);
    memcpy(ref1, c.want[2], (size_t)T * 64 * sizeof(float));
    swiglu(ref1, ref3, T * 64);
    c.ref1 = ref1;
    c.ref3 = ref3;

    c.h1 = malloc((size_t)T * 64 * sizeof(float));
    c.h3 = malloc((size_t)T * 64 * sizeof(float));
    for (int threads = 1; threads <= 5; threads++) run_on_team(threads, check_jobs, &c);
    free(c.h1);
    free(c.h3);
    for (int j = 0; j < 3; j++) {
        free(wb[j]);
        free((void *)c.jobs[j].w.data);
        free(c.jobs[j].out);
        free(c.want[j]);
    }
    free(w3b);
    free((void *)c.w3.data);
    free(ref1);
    free(ref3);
    free(x);
}

/* Every token count from 1 to 19 on one thread: each tile shape a product can take (the
 * wide tiles of 4 to 6 tokens and the 8x3 tiles of 1 to 3 after them, in both loop
 * orders) gives every output the canonical scalar dot, bit for bit. */
static void test_matmul_every_token_count(void **state) {
    const int rows = 24, cols = 512, max_T = 19;
    float *x = random_floats(max_T * cols, 41), *wrow = malloc((size_t)cols * sizeof(float));
    uint16_t *wb = random_bf16(rows * cols, 42, 0.3f);
    Mat w = packed(wb, rows, cols, DTYPE_BF16);
    float *out = malloc((size_t)max_T * rows * sizeof(float));
    for (int T = 1; T <= max_T; T++) {
        Worker alone = worker_alone();
        matmul(&alone, out, rows, x, cols, w, T);
        for (int r = 0; r < rows; r++) {
            for (int k = 0; k < cols; k++) wrow[k] = bf(wb[(size_t)r * cols + k]);
            for (int t = 0; t < T; t++) {
                float s = dot_canonical_scalar(wrow, x + (size_t)t * cols, cols);
                assert_memory_equal(&s, &out[(size_t)t * rows + r], sizeof(float));
            }
        }
    }
    free(x);
    free(wrow);
    free(wb);
    free((void *)w.data);
    free(out);
}

static void test_matmul_jobs_and_swiglu(void **state) {
    check_jobs_and_swiglu(2); /* two token blocks: split by rows */
    check_jobs_and_swiglu(7); /* more: split by tokens (3 blocks: with 4 or 5 threads some get none) */
}

/* A product shared among 3 threads (with take-overs: 20 tokens) equals it on one. */
typedef struct {
    int T, rows, cols;
    const float *x;
    Mat w;
    float *out;
} ThreadedMatmul;

static void threaded_matmul(void *arg, Worker *wk) {
    ThreadedMatmul *m = arg;
    matmul(wk, m->out, m->rows, m->x, m->cols, m->w, m->T);
}

static void test_matmul_thread_invariant(void **state) {
    const int T = 20, rows = 300, cols = 512;
    float *x = random_floats(T * cols, 31);
    uint16_t *wb = random_bf16(rows * cols, 32, 0.3f);
    Mat w = packed(wb, rows, cols, DTYPE_BF16);
    float *a = malloc((size_t)T * rows * sizeof(float)), *b = malloc((size_t)T * rows * sizeof(float));
    ThreadedMatmul one = {T, rows, cols, x, w, a}, three = {T, rows, cols, x, w, b};
    run_on_team(1, threaded_matmul, &one);
    run_on_team(3, threaded_matmul, &three);
    assert_memory_equal(a, b, (size_t)T * rows * sizeof(float));
    free(x);
    free(wb);
    free((void *)w.data);
    free(a);
    free(b);
}

/* simd.h's exp, the same IEEE operations in plain scalar C: every path must give these bits */
static float exp_nonpositive_scalar(float x) {
    x = x > -87.3f ? x : -87.3f;
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(n, 2.12194440e-4f, fmaf(n, -0.693359375f, x));
    const float c[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                       4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
    float p = c[0];
    for (int i = 1; i < 6; i++) p = fmaf(p, r, c[i]);
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return (fmaf(p, r * r, r) + 1.0f) * two_n;
}

static void test_exp_nonpositive(void **state) {
    uint64_t seed = 5;
    for (int i = 0; i < 4096; i += 16) {
        float x[16], e[16];
        for (int l = 0; l < 16; l++) x[l] = -100.0f * (float)(test_uniform(&seed) * 0.5 + 0.5);
        if (i == 0) x[0] = 0.0f, x[1] = -0.0f, x[2] = -87.3f, x[3] = -1e-30f;
        v16_store(e, v16_exp_nonpositive(v16_load_f32(x, 16)), 16);
        for (int l = 0; l < 16; l++) {
            float want = exp_nonpositive_scalar(x[l]);
            assert_memory_equal(&e[l], &want, sizeof(float));
            if (x[l] > -87.0f) assert_true(fabs(e[l] - exp((double)x[l])) <= 3e-7 * exp((double)x[l]));
        }
    }
}

static void test_rmsnorm_softmax_swiglu(void **state) {
    const int n = 100;
    float *x = random_floats(n, 41), out[100], w[100];
    for (int i = 0; i < n; i++) w[i] = 0.5f + 0.01f * i;
    Mat wm = {w, 1, n, DTYPE_F32};
    rmsnorm(out, x, wm, n, 1e-5f);
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    double s = 1.0 / sqrt(ss / n + 1e-5);
    for (int i = 0; i < n; i++) assert_true(fabs(out[i] - w[i] * x[i] * s) < 1e-5);

    float p[100];
    memcpy(p, x, sizeof p);
    softmax(p, n);
    double mx = x[0], z = 0;
    for (int i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    for (int i = 0; i < n; i++) z += exp(x[i] - mx);
    for (int i = 0; i < n; i++) assert_true(fabs(p[i] - exp(x[i] - mx) / z) < 1e-6);
    /* lengths around the 16-lane tail, and scores far apart (e^x down to the clamp) */
    const int lengths[] = {1, 5, 16, 17, 31, 33, 255};
    for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
        int m = lengths[li];
        float *y = random_floats(m, 90 + li), *q = malloc((size_t)m * sizeof(float));
        for (int i = 0; i < m; i++) y[i] *= 60.0f;
        memcpy(q, y, (size_t)m * sizeof(float));
        softmax(q, m);
        double ym = y[0], zz = 0, total = 0;
        for (int i = 1; i < m; i++) ym = y[i] > ym ? y[i] : ym;
        for (int i = 0; i < m; i++) zz += exp((double)y[i] - ym);
        for (int i = 0; i < m; i++) {
            /* y - max is rounded to fp32 first: a relative error of |y - max| * 2^-24 */
            double d = (double)y[i] - ym, want = exp(d) / zz;
            assert_true(fabs(q[i] - want) <= want * (1e-6 + fabs(d) * 6e-8) + 1e-30);
            total += q[i];
        }
        assert_true(fabs(total - 1.0) < 1e-5);
        free(y);
        free(q);
    }

    /* SwiGLU over both signs and far into both tails (n = 100: a 4-element last vector) */
    float h1[100], h3[100], a[100];
    for (int i = 0; i < n; i++) a[i] = h1[i] = 40.0f * x[i], h3[i] = 2.0f;
    swiglu(h1, h3, n);
    for (int i = 0; i < n; i++) {
        double want = 2.0 * a[i] / (1.0 + exp(-(double)a[i]));
        assert_true(fabs(h1[i] - want) <= 1e-6 * fabs(want) + 1e-30);
    }
    free(x);
}

/* Attention's two loops: dot_rows (dot_rows_cat) equals dot() (dot_cat()) * scale bit for
 * bit (the 16-row transposed reduction and the tail), weighted_sum_rows equals two scalar
 * fmaf chains (even and odd j) added. */
static void test_dot_rows_and_weighted_sum(void **state) {
    const int widths[] = {7, 16, 32, 48, 80, 100, 144};
    const int n = 37, stride = 150;
    float *rows = random_floats(n * stride, 81), *q = random_floats(144, 82), *p = random_floats(n, 83);
    float out[37], sum[144];
    for (size_t i = 0; i < sizeof widths / sizeof widths[0]; i++) {
        int w = widths[i];
        dot_rows(out, q, rows, stride, n, w, 0.125f);
        for (int j = 0; j < n; j++) {
            float ref = dot(q, rows + (size_t)j * stride, w) * 0.125f;
            assert_memory_equal(&out[j], &ref, sizeof(float));
        }
        /* keys in two parts (rows of two tables), as MLA's expanded [k_C ; k_R] */
        for (int w2 = 5; w2 <= 16; w2 += 11) {
            dot_rows_cat(out, n, 0.25f, q, rows, stride, w, q + 5, rows + 130, 3, w2);
            for (int j = 0; j < n; j++) {
                float ref = dot_cat(q, rows + (size_t)j * stride, w, q + 5, rows + 130 + (size_t)j * 3, w2) * 0.25f;
                assert_memory_equal(&out[j], &ref, sizeof(float));
            }
        }
        for (int m = n - 1; m <= n; m++) { /* an even and an odd number of rows */
            weighted_sum_rows(sum, p, rows, stride, m, w);
            for (int d = 0; d < w; d++) {
                float even = 0.0f, odd = 0.0f;
                for (int j = 0; j < m; j += 2) even = fmaf(p[j], rows[(size_t)j * stride + d], even);
                for (int j = 1; j < m; j += 2) odd = fmaf(p[j], rows[(size_t)j * stride + d], odd);
                float ref = even + odd;
                assert_memory_equal(&sum[d], &ref, sizeof(float));
            }
        }
    }
    free(rows);
    free(q);
    free(p);
}

/* Reads `rows` with n_heads heads at once (head h's query at q + h*ld_q, probabilities at
 * p + h*ld_p) and checks that each head gets what dot_rows and weighted_sum_rows give it
 * alone on `floats`, the rows they stand for, `stride` apart. */
static void check_heads_read_alike(RowBlocks rows, const float *floats, size_t stride, int n, int width, int n_heads,
                                   const float *q, size_t ld_q, const float *p, size_t ld_p, float scale) {
    float *scores = malloc(sizeof(float) * (size_t)n_heads * (size_t)n);
    float *sums = malloc(sizeof(float) * (size_t)n_heads * (size_t)width);
    float *alone = malloc(sizeof(float) * (size_t)(n > width ? n : width));
    dot_row_blocks(scores, (size_t)n, q, ld_q, n_heads, rows, n, width, scale);
    weighted_sum_row_blocks(sums, (size_t)width, p, ld_p, n_heads, rows, n, width);
    for (int h = 0; h < n_heads; h++) {
        dot_rows(alone, q + h * ld_q, floats, stride, n, width, scale);
        assert_memory_equal(alone, scores + (size_t)h * n, (size_t)n * sizeof(float));
        weighted_sum_rows(alone, p + h * ld_p, floats, stride, n, width);
        assert_memory_equal(alone, sums + (size_t)h * width, (size_t)width * sizeof(float));
    }
    free(scores);
    free(sums);
    free(alone);
}

/* The paged cache's rows: the same rows copied into scattered blocks of 16 give the same
 * scores and weighted sums, bit for bit, for any number of rows (whole blocks, a part of
 * one, an odd count), and for any number of heads reading them at once, each head as
 * when it reads them alone. */
static void test_row_blocks_equal_contiguous_rows(void **state) {
    enum { N = 70, STRIDE = 144, BLOCK = 16, BLOCKS = (N + BLOCK - 1) / BLOCK, HEADS = 3, LDQ = 150, LDP = 75 };
    float *rows = random_floats(N * STRIDE, 91), *q = random_floats(HEADS * LDQ, 92),
          *p = random_floats(HEADS * LDP, 93);
    float *store = random_floats((size_t)(BLOCKS + 3) * BLOCK * STRIDE, 94); /* blocks in a scrambled order */
    const void *blocks[BLOCKS];
    for (int b = 0; b < BLOCKS; b++) {
        float *dst = store + (size_t)((b * 3 + 2) % (BLOCKS + 3)) * BLOCK * STRIDE;
        for (int r = 0; r < BLOCK && b * BLOCK + r < N; r++)
            memcpy(dst + (size_t)r * STRIDE, rows + (size_t)(b * BLOCK + r) * STRIDE, STRIDE * sizeof(float));
        blocks[b] = dst;
    }
    const RowBlocks paged = {blocks, NULL, BLOCK, STRIDE, DTYPE_F32, 0, 0, 0, 0, 1, 1};
    const int widths[] = {16, 32, 80, 144, 100}, counts[] = {1, 15, 16, 17, 32, 33, 70};
    for (size_t i = 0; i < sizeof widths / sizeof widths[0]; i++)
        for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++)
            for (int nh = 1; nh <= HEADS; nh++)
                check_heads_read_alike(paged, rows, STRIDE, counts[k], widths[i], nh, q, LDQ, p, LDP, 0.3f);
    free(rows);
    free(q);
    free(p);
    free(store);
}

/* int8: each part's scale is max|x| / 127, every element within half a step of its value;
 * a zero part gets scale 0 and reads back as zeros; a part with Inf or NaN reads back as
 * NaN; the two parts of a row keep their own scales. bf16 rounds to nearest even. */
static void test_row_quantize(void **state) {
    float x[40], back[40], scales[2];
    int8_t q[40];
    uint64_t seed = 5;
    for (int i = 0; i < 40; i++) x[i] = test_uniform(&seed) * (i < 24 ? 3.0f : 0.01f);
    row_quantize(q, scales, x, 40, 24, DTYPE_I8);
    row_dequantize(back, q, scales, 40, 24, DTYPE_I8);
    float max0 = 0, max1 = 0;
    for (int i = 0; i < 40; i++) *(i < 24 ? &max0 : &max1) = fmaxf(i < 24 ? max0 : max1, fabsf(x[i]));
    assert_true(scales[0] == max0 / 127.0f && scales[1] == max1 / 127.0f);
    for (int i = 0; i < 40; i++) {
        const float s = scales[i < 24 ? 0 : 1];
        assert_true(fabsf(back[i] - x[i]) <= 0.5f * s * 1.0001f);
        assert_true(back[i] == (float)q[i] * s); /* the stored value is scale * int8, one product */
    }
    /* zeros, extremes, non-finite */
    float zero[16] = {0}, big[16], bad[16];
    for (int i = 0; i < 16; i++) big[i] = i % 2 ? 3e38f : -1e-40f, bad[i] = 1.0f;
    bad[7] = INFINITY;
    row_quantize(q, scales, zero, 16, 16, DTYPE_I8);
    row_dequantize(back, q, scales, 16, 16, DTYPE_I8);
    assert_true(scales[0] == 0.0f);
    for (int i = 0; i < 16; i++) assert_true(back[i] == 0.0f && q[i] == 0);
    row_quantize(q, scales, big, 16, 16, DTYPE_I8);
    row_dequantize(back, q, scales, 16, 16, DTYPE_I8);
    for (int i = 0; i < 16; i++) assert_true(i % 2 ? fabsf(back[i] - 3e38f) <= 0.5f * scales[0] : back[i] == 0.0f);
    row_quantize(q, scales, bad, 16, 16, DTYPE_I8);
    row_dequantize(back, q, scales, 16, 16, DTYPE_I8);
    for (int i = 0; i < 16; i++) assert_true(isnan(back[i]));
    /* bf16: to nearest, ties to even; NaN stays NaN */
    const float in[4] = {1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -2.5f, NAN};
    bf16 h[4];
    row_quantize(h, NULL, in, 4, 4, DTYPE_BF16);
    row_dequantize(back, h, NULL, 4, 4, DTYPE_BF16);
    assert_true(back[0] == 1.0f && back[1] == 1.0f + 4.0f / 256 && back[2] == -2.5f && isnan(back[3]));
}

/* e4m3 by its definition (bias 7, 3 mantissa bits, no infinities, 0x7F NaN), from the bits */
static double e4m3_value(uint8_t c) {
    const int e = (c >> 3) & 15, m = c & 7;
    const double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
    return c & 0x80 ? -v : v;
}

/* fp8: scale = max|x| / 448, every element the nearest e4m3 of x / scale (ties to even),
 * so within half a step, a step being 2^-3 of its binade (2^-9 below 2^-6); the largest
 * element is exact; zero and non-finite parts as int8; the loaders widen every code exactly. */
static void test_row_quantize_fp8(void **state) {
    uint8_t all[256];
    float back[256], ones[256];
    for (int i = 0; i < 256; i++) all[i] = (uint8_t)i, ones[i] = 1.0f;
    row_dequantize(back, all, ones, 256, 256, DTYPE_F8);
    for (int i = 0; i < 256; i++)
        if ((i & 0x7F) != 0x7F) assert_true(back[i] == (float)e4m3_value((uint8_t)i));
    float x[40], scales[2], out[40];
    uint8_t q[40];
    uint64_t seed = 9;
    for (int i = 0; i < 40; i++) x[i] = test_uniform(&seed) * (i < 24 ? 3.0f : 1e-3f) * (i % 5 ? 1.0f : 1e-4f);
    row_quantize(q, scales, x, 40, 24, DTYPE_F8);
    row_dequantize(out, q, scales, 40, 24, DTYPE_F8);
    float max0 = 0, max1 = 0;
    for (int i = 0; i < 40; i++) *(i < 24 ? &max0 : &max1) = fmaxf(i < 24 ? max0 : max1, fabsf(x[i]));
    assert_true(scales[0] == max0 / 448.0f && scales[1] == max1 / 448.0f);
    for (int i = 0; i < 40; i++) {
        const float s = scales[i < 24 ? 0 : 1];
        const double y = fabs(x[i] / s), step = y < 0x1p-6 ? 0x1p-9 : ldexp(1.0, ilogb(y) - 3);
        assert_true(fabs(out[i] / s - x[i] / s) <= 0.5 * step * 1.0001);
        assert_true(out[i] == (float)(e4m3_value(q[i]) * s)); /* one product */
        if (fabsf(x[i]) == (i < 24 ? max0 : max1)) assert_true((q[i] & 0x7F) == 126);
        /* no nearer code: the neighbours are at least as far */
        for (int d = -1; d <= 1; d += 2) {
            const int c = (q[i] & 0x7F) + d;
            if (c >= 0 && c <= 126) assert_true(fabs(e4m3_value((uint8_t)c) - y) >= fabs(e4m3_value(q[i] & 0x7F) - y));
        }
    }
    /* ties go to the even code: 1 + 1/16 lies between 1 (code 56) and 1 + 1/8 (57) */
    const float tie[2] = {448.0f, 1.0f + 1.0f / 16};
    row_quantize(q, scales, tie, 2, 2, DTYPE_F8);
    assert_true(scales[0] == 1.0f && q[0] == 126 && q[1] == 56);
    float zero[16] = {0}, bad[16];
    for (int i = 0; i < 16; i++) bad[i] = -1.0f;
    bad[3] = NAN;
    row_quantize(q, scales, zero, 16, 16, DTYPE_F8);
    row_dequantize(out, q, scales, 16, 16, DTYPE_F8);
    for (int i = 0; i < 16; i++) assert_true(out[i] == 0.0f && scales[0] == 0.0f);
    row_quantize(q, scales, bad, 16, 16, DTYPE_F8);
    row_dequantize(out, q, scales, 16, 16, DTYPE_F8);
    for (int i = 0; i < 16; i++) assert_true(isnan(out[i]));
}

/* Rows stored as bf16, int8 or fp8 (two scale parts, meeting inside a 16-lane chunk) give the
 * scores and weighted sums of the floats they stand for, bit for bit, for one head and
 * for several reading them at once: rows narrower than the score kernel's slab of 320
 * columns and wider (340 = 320 + 20), and more heads than it carries at once (17). */
static void test_typed_rows_equal_their_floats(void **state) {
    enum { N = 37, W_MAX = 340, SPLIT = 24, BLOCK = 16, BLOCKS = (N + BLOCK - 1) / BLOCK, HEADS = 17 };
    float *x = random_floats(N * W_MAX, 71), *q = random_floats(HEADS * W_MAX, 72), *p = random_floats(HEADS * N, 73);
    float *floats = malloc(sizeof(float) * N * W_MAX), scales[N * 2];
    int8_t *i8 = malloc(N * W_MAX);
    bf16 *h = malloc(sizeof(bf16) * N * W_MAX);
    const DType types[] = {DTYPE_BF16, DTYPE_I8, DTYPE_F8};
    const int widths[] = {40, W_MAX}, heads[] = {1, 2, 3, HEADS};
    for (size_t k = 0; k < 3; k++)
        for (size_t w = 0; w < 2; w++) {
            const DType dt = types[k];
            const int W = widths[w];
            void *store = dtype_scaled(dt) ? (void *)i8 : (void *)h;
            for (int j = 0; j < N; j++) {
                row_quantize((char *)store + (size_t)j * W * dtype_size(dt), scales + 2 * j, x + (size_t)j * W, W,
                             SPLIT, dt);
                row_dequantize(floats + (size_t)j * W, (char *)store + (size_t)j * W * dtype_size(dt), scales + 2 * j,
                               W, SPLIT, dt);
            }
            const void *blocks[BLOCKS];
            const float *block_scales[BLOCKS];
            for (int b = 0; b < BLOCKS; b++) {
                blocks[b] = (char *)store + (size_t)b * BLOCK * W * dtype_size(dt);
                block_scales[b] = scales + (size_t)b * BLOCK * 2;
            }
            const RowBlocks rows = {
                blocks, block_scales, BLOCK, (size_t)W, dt, dtype_scaled(dt) ? 2 : 0, SPLIT, 0, 0, 1, 1};
            for (int n = 1; n <= N; n += 9)
                for (size_t i = 0; i < sizeof heads / sizeof heads[0]; i++)
                    check_heads_read_alike(rows, floats, W, n, W, heads[i], q, W, p, N, 0.7f);
        }
    free(x);
    free(q);
    free(p);
    free(floats);
    free(i8);
    free(h);
}

/* A packed group's scale and min of element (j, c), read by kernels.h's layout. */
static void packed_params(const void *group, int j, int c, int width, DType dt, int per_channel, float *scale,
                          float *min) {
    const bf16 *params = (const bf16 *)((const char *)group + (size_t)PACK_ROWS * width * dtype_bits(dt) / 8);
    const int groups = (width + PACK_VALUE_GROUP - 1) / PACK_VALUE_GROUP, k = j * groups + c / PACK_VALUE_GROUP;
    *scale = bf(per_channel ? params[c] : params[k]);
    *min = bf(per_channel ? params[width + c] : params[PACK_ROWS * groups + k]);
}

/* int4 and int2 (KIVI): every element within half a step of its group (a step the group's
 * scale), the scale no more than the group's range over the levels rounded up to bf16, the
 * min at or below the group's; a zero group exact, a constant group within half a step of
 * a step below 2^-8 of it; a group holding NaN or Inf all NaN, the other groups as before;
 * values near the float range stay finite. Keys per channel, values per token, a width
 * whose last value group is narrower (80 = 32 + 32 + 16). */
static void test_block_quantize_packed(void **state) {
    enum { W = 80, ROWS = PACK_ROWS };
    const DType types[] = {DTYPE_I4, DTYPE_I2};
    uint64_t seed = 5;
    for (int k = 0; k < 2; k++)
        for (int per_channel = 0; per_channel <= 1; per_channel++) {
            const DType dt = types[k];
            const int levels = (1 << dtype_bits(dt)) - 1;
            float x[ROWS * W], out[W];
            for (int i = 0; i < ROWS * W; i++) x[i] = test_uniform(&seed) * (i % 7 == 0 ? 20.0f : 1.0f) + (i % W) * 0.01f;
            for (int j = 0; j < ROWS; j++) x[j * W + 5] = 0.0f;      /* channel 5: zero */
            for (int j = 0; j < ROWS; j++) x[j * W + 6] = 0.3f;      /* channel 6: constant */
            for (int c = 0; c < W; c++) x[3 * W + c] = 0.0f;         /* row 3: zero */
            for (int c = 0; c < W; c++) x[4 * W + c] = -0.7f;        /* row 4: constant */
            for (int c = 0; c < W; c++) x[9 * W + c] = c % 2 ? 3e38f : -3e38f; /* row 9: extremes */
            x[11 * W + 40] = 2e38f, x[11 * W + 41] = -3.3e38f;
            unsigned char group[4096];
            assert_true(packed_group_bytes(W, dt, per_channel) <= sizeof group);
            memset(group, 0xA5, sizeof group);
            block_quantize(group, x, W, W, dt, per_channel);
            for (int j = 0; j < ROWS; j++) {
                block_dequantize_row(out, group, j, W, dt, per_channel);
                for (int c = 0; c < W; c++) {
                    const float v = x[j * W + c];
                    float scale, min, lo = INFINITY, hi = -INFINITY;
                    packed_params(group, j, c, W, dt, per_channel, &scale, &min);
                    for (int i = 0; i < (per_channel ? ROWS : W); i++) { /* the group's values */
                        const int jj = per_channel ? i : j, cc = per_channel ? c : i;
                        if (!per_channel && cc / PACK_VALUE_GROUP != c / PACK_VALUE_GROUP) continue;
                        lo = fminf(lo, x[jj * W + cc]), hi = fmaxf(hi, x[jj * W + cc]);
                    }
                    assert_true(isfinite(out[c]));
                    assert_true(fabs((double)out[c] - v) <= 0.5 * scale * (1 + 1e-6) + 1e-30);
                    assert_true(min <= lo && (double)min >= lo - fabs(lo) * 0x1p-7);
                    assert_true((double)scale <= ((double)hi - lo) / levels * (1 + 0x1p-6) + fabs(lo) * 0x1p-7 / levels);
                    if (lo == 0.0f && hi == 0.0f) assert_true(out[c] == 0.0f);
                    if (lo == hi) assert_true(scale <= fabsf(lo) * 0x1p-8f);
                }
            }
            /* one NaN (or Inf) poisons its group only */
            x[2 * W + 33] = NAN;
            x[7 * W + 70] = INFINITY;
            block_quantize(group, x, W, W, dt, per_channel);
            for (int j = 0; j < ROWS; j++) {
                block_dequantize_row(out, group, j, W, dt, per_channel);
                for (int c = 0; c < W; c++) {
                    const int poisoned = per_channel ? c == 33 || c == 70
                                                     : (j == 2 && c / 32 == 1) || (j == 7 && c / 32 == 2);
                    assert_true(poisoned ? isnan(out[c]) : isfinite(out[c]));
                }
            }
        }
}

/* Packed groups (and an fp32 last block, KIVI's residual) give the scores and weighted
 * sums of the floats they stand for, bit for bit, for one to three heads: dequantizing in
 * the loops keeps the fp32 path's order. */
static void test_packed_rows_equal_their_floats(void **state) {
    enum { W = 80, BLOCK = PACK_ROWS, BLOCKS = 4, N = BLOCKS * BLOCK, HEADS = 3 };
    float *x = random_floats(N * W, 81), *q = random_floats(HEADS * W, 82), *p = random_floats(HEADS * N, 83);
    float floats[N * W];
    const DType types[] = {DTYPE_I4, DTYPE_I2};
    for (int k = 0; k < 2; k++)
        for (int per_channel = 0; per_channel <= 1; per_channel++) {
            const DType dt = types[k];
            const size_t bytes = packed_group_bytes(W, dt, per_channel);
            unsigned char *store = malloc(bytes * BLOCKS);
            const void *blocks[BLOCKS];
            for (int b = 0; b < BLOCKS; b++) {
                block_quantize(store + (BLOCKS - 1 - b) * bytes, x + (size_t)b * BLOCK * W, W, W, dt, per_channel);
                blocks[b] = store + (BLOCKS - 1 - b) * bytes; /* scrambled */
                for (int j = 0; j < BLOCK; j++)
                    block_dequantize_row(floats + ((size_t)b * BLOCK + j) * W, blocks[b], j, W, dt, per_channel);
            }
            for (int n = 1; n <= N; n += 7)
                for (int nh = 1; nh <= HEADS; nh++) {
                    for (int width = 16; width <= W; width += 64) { /* all columns, or the first (absorbed MLA's c) */
                        const RowBlocks rows = {blocks, NULL, BLOCK, W, dt, 0, 0, per_channel, 0, 1, 1};
                        check_heads_read_alike(rows, floats, W, n, width, nh, q, W, p, N, 0.7f);
                    }
                    /* the last block fp32 rows: the block a query's own position is in */
                    const void *mixed[BLOCKS];
                    float expect[N * W];
                    memcpy(mixed, blocks, sizeof mixed);
                    memcpy(expect, floats, sizeof expect);
                    const int last = (n - 1) / BLOCK;
                    mixed[last] = x + (size_t)last * BLOCK * W;
                    memcpy(expect + (size_t)last * BLOCK * W, mixed[last], sizeof(float) * BLOCK * W);
                    const RowBlocks rows = {mixed, NULL, BLOCK, W, dt, 0, 0, per_channel, 1, 1, 1};
                    check_heads_read_alike(rows, expect, W, n, W, nh, q, W, p, N, 0.7f);
                }
            free(store);
        }
    free(x);
    free(q);
    free(p);
}

/* Row groups read side by side (several KV heads' rows in one item): each group's heads get,
 * bit for bit, what they get reading their group alone, for every dtype (packed ones with
 * the last block in fp32 too), any number of rows, groups of one head or several, and
 * widths whose chains the weighted sum carries between blocks (64) or, too many to carry
 * for 32 groups, takes group by group (144). */
static void test_row_groups_read_alike(void **state) {
    enum { N = 37, W_MAX = 144, BLOCK = 16, BLOCKS = (N + BLOCK - 1) / BLOCK, G_MAX = 32, GH_MAX = 3, SPLIT = 24 };
    enum { H_MAX = G_MAX * GH_MAX, ROW_BYTES = W_MAX * 4, BLOCK_BYTES = BLOCK * ROW_BYTES };
    float *x = random_floats(G_MAX * BLOCKS * BLOCK * W_MAX, 81), *q = random_floats(H_MAX * W_MAX, 82);
    float *p = random_floats(H_MAX * N, 83), *fp32 = random_floats(G_MAX * BLOCKS * BLOCK * W_MAX, 84);
    unsigned char *store = malloc((size_t)G_MAX * BLOCKS * BLOCK_BYTES);
    float *scales = malloc(sizeof(float) * G_MAX * BLOCKS * BLOCK * 2);
    const void *blocks[G_MAX * BLOCKS];
    const float *block_scales[G_MAX * BLOCKS];
    float *scores = malloc(sizeof(float) * H_MAX * N), *sums = malloc(sizeof(float) * H_MAX * W_MAX);
    float alone[N > W_MAX ? N : W_MAX];
    const DType types[] = {DTYPE_F32, DTYPE_BF16, DTYPE_I8, DTYPE_I4};
    const int widths[] = {64, W_MAX}, group_counts[] = {2, 3, G_MAX}, group_heads[] = {1, GH_MAX},
              counts[] = {1, 16, N};
    for (size_t k = 0; k < 4; k++)
        for (size_t w = 0; w < 2; w++)
            for (int last_f32 = 0; last_f32 <= dtype_packed(types[k]); last_f32++) {
                const DType dt = types[k];
                const int W = widths[w];
                for (int i = 0; i < G_MAX * BLOCKS; i++) { /* group g's block b at i = g * BLOCKS + b, scrambled */
                    const int at = (i * 7 + 3) % (G_MAX * BLOCKS);
                    unsigned char *dst = store + (size_t)at * BLOCK_BYTES;
                    const float *src = x + (size_t)i * BLOCK * W;
                    if (dt == DTYPE_I4) block_quantize(dst, src, (size_t)W, W, dt, 1);
                    for (int j = 0; j < BLOCK && dt != DTYPE_I4; j++)
                        row_quantize(dst + (size_t)j * W * dtype_size(dt), scales + ((size_t)at * BLOCK + j) * 2,
                                     src + (size_t)j * W, W, SPLIT, dt);
                    blocks[i] = dst, block_scales[i] = scales + (size_t)at * BLOCK * 2;
                }
                for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++)
                    for (size_t gc = 0; gc < sizeof group_counts / sizeof group_counts[0]; gc++)
                        for (size_t gh = 0; gh < sizeof group_heads / sizeof group_heads[0]; gh++) {
                            const int n = counts[c], nb = (n + BLOCK - 1) / BLOCK, G = group_counts[gc];
                            const int heads = group_heads[gh], H = G * heads;
                            const void *table[G_MAX * BLOCKS];
                            const float *table_scales[G_MAX * BLOCKS];
                            for (int g = 0; g < G; g++)
                                for (int b = 0; b < nb; b++) {
                                    const int last = last_f32 && b == nb - 1;
                                    table[g * nb + b] =
                                        last ? (const void *)(fp32 + (size_t)(g * BLOCKS + b) * BLOCK * W)
                                             : blocks[g * BLOCKS + b];
                                    table_scales[g * nb + b] = block_scales[g * BLOCKS + b];
                                }
                            const RowBlocks rows = {
                                table, table_scales, BLOCK, (size_t)W, dt, dtype_scaled(dt) ? 2 : 0, SPLIT,
                                1,     last_f32,     G,     1};
                            dot_row_blocks(scores, N, q, W, H, rows, n, W, 0.3f);
                            weighted_sum_row_blocks(sums, W, p, N, H, rows, n, W);
                            for (int g = 0; g < G; g++) {
                                RowBlocks one = rows;
                                one.block = table + g * nb, one.scales = table_scales + g * nb, one.groups = 1;
                                for (int h = g * heads; h < (g + 1) * heads; h++) {
                                    dot_row_blocks(alone, N, q + (size_t)h * W, W, 1, one, n, W, 0.3f);
                                    assert_memory_equal(alone, scores + (size_t)h * N, (size_t)n * sizeof(float));
                                    weighted_sum_row_blocks(alone, W, p + (size_t)h * N, N, 1, one, n, W);
                                    assert_memory_equal(alone, sums + (size_t)h * W, (size_t)W * sizeof(float));
                                }
                            }
                        }
            }
    free(x);
    free(q);
    free(p);
    free(fp32);
    free(store);
    free(scales);
    free(scores);
    free(sums);
}

int main(int argc, char **argv) {
    if (argc > 1) g_tokenizer_path = argv[1];
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mat_pack),
        cmocka_unit_test(test_dot_matches_canonical_scalar),
        cmocka_unit_test(test_dot_cat),
        cmocka_unit_test(test_matmul_reference),
        cmocka_unit_test(test_matmul_batch_invariant),
        cmocka_unit_test(test_matmul_every_token_count),
        cmocka_unit_test(test_matmul_thread_invariant),
        cmocka_unit_test(test_matmul_jobs_and_swiglu),
        cmocka_unit_test(test_exp_nonpositive),
        cmocka_unit_test(test_rmsnorm_softmax_swiglu),
        cmocka_unit_test(test_dot_rows_and_weighted_sum),
        cmocka_unit_test(test_row_blocks_equal_contiguous_rows),
        cmocka_unit_test(test_row_quantize),
        cmocka_unit_test(test_row_quantize_fp8),
        cmocka_unit_test(test_typed_rows_equal_their_floats),
        cmocka_unit_test(test_block_quantize_packed),
        cmocka_unit_test(test_packed_rows_equal_their_floats),
        cmocka_unit_test(test_row_groups_read_alike),
    };
    return cmocka_run_group_tests_name("kernels", tests, NULL, NULL);
}
