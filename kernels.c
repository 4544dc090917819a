/* kernels.c: matmul, dot products, norms, softmax, in the canonical order of simd.h. */
#include "kernels.h"

#include <math.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

size_t dtype_size(DType dt) { return dt == DTYPE_BF16 ? 2 : 4; }

const char *kernels_simd_name(void) { return SIMD_NAME; }

Mat mat_rows(Mat w, int r0, int n) {
    Mat m = w;
    m.data = (const char *)w.data + (size_t)r0 * (size_t)w.cols * dtype_size(w.dtype);
    m.rows = n;
    return m;
}

float mat_get(Mat w, size_t i) {
    return w.dtype == DTYPE_BF16 ? bf16_to_f32(((const bf16 *)w.data)[i]) : ((const float *)w.data)[i];
}

static inline v16 load_w(const void *row, DType dt, int k, int n) {
    return dt == DTYPE_BF16 ? v16_load_bf16((const bf16 *)row + k, n) : v16_load_f32((const float *)row + k, n);
}

/* ---- dot products ---- */

static inline v16 dot_accumulate(v16 acc, const float *a, const float *b, int n) {
    int k = 0;
    for (; k + 16 <= n; k += 16) acc = v16_fma(v16_load_f32(a + k, 16), v16_load_f32(b + k, 16), acc);
    if (k < n) acc = v16_fma(v16_load_f32(a + k, n - k), v16_load_f32(b + k, n - k), acc);
    return acc;
}

float dot(const float *a, const float *b, int n) { return v16_reduce(dot_accumulate(v16_zero(), a, b, n)); }

float dot_cat(const float *a1, const float *b1, int n1, const float *a2, const float *b2, int n2) {
    return v16_reduce(dot_accumulate(dot_accumulate(v16_zero(), a1, b1, n1), a2, b2, n2));
}

float dot_canonical_scalar(const float *a, const float *b, int n) {
    float lane[16] = {0};
    int padded = (n + 15) / 16 * 16;
    for (int i = 0; i < padded; i++) {
        float ai = i < n ? a[i] : 0.0f, bi = i < n ? b[i] : 0.0f;
        lane[i % 16] = fmaf(ai, bi, lane[i % 16]);
    }
    for (int h = 8; h >= 1; h /= 2)
        for (int l = 0; l < h; l++) lane[l] = lane[l] + lane[l + h];
    return lane[0];
}

/* ---- matmul ----
 * A tile is RB weight rows x TB tokens, RB*TB accumulators of 16 lanes. Each
 * accumulator is one output's dot product in the canonical order, whatever the
 * tile shape: the blocking changes which outputs are computed together, never
 * the order inside one. */
enum { RB = 4, TB = 6 };

static inline __attribute__((always_inline)) void
tile(float *out, int ldo, const float *x, int ldx, const Mat *w, int r0, int t0, const int nr, const int nt) {
    const int n = w->cols;
    const size_t row_bytes = (size_t)n * dtype_size(w->dtype);
    const char *wr[RB];
    v16 acc[RB][TB];
    for (int r = 0; r < nr; r++) {
        wr[r] = (const char *)w->data + (size_t)(r0 + r) * row_bytes;
        for (int t = 0; t < nt; t++) acc[r][t] = v16_zero();
    }
    int k = 0;
    for (; k + 16 <= n; k += 16) {
        v16 wv[RB];
        for (int r = 0; r < nr; r++) wv[r] = load_w(wr[r], w->dtype, k, 16);
        for (int t = 0; t < nt; t++) {
            v16 xv = v16_load_f32(x + (size_t)(t0 + t) * ldx + k, 16);
            for (int r = 0; r < nr; r++) acc[r][t] = v16_fma(wv[r], xv, acc[r][t]);
        }
    }
    if (k < n) {
        v16 wv[RB];
        for (int r = 0; r < nr; r++) wv[r] = load_w(wr[r], w->dtype, k, n - k);
        for (int t = 0; t < nt; t++) {
            v16 xv = v16_load_f32(x + (size_t)(t0 + t) * ldx + k, n - k);
            for (int r = 0; r < nr; r++) acc[r][t] = v16_fma(wv[r], xv, acc[r][t]);
        }
    }
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++) out[(size_t)(t0 + t) * ldo + r0 + r] = v16_reduce(acc[r][t]);
}

static void tile_any(float *out, int ldo, const float *x, int ldx, const Mat *w, int r0, int t0, int nr, int nt) {
    if (nr == RB) {
        switch (nt) {
        case 6: tile(out, ldo, x, ldx, w, r0, t0, RB, 6); return;
        case 5: tile(out, ldo, x, ldx, w, r0, t0, RB, 5); return;
        case 4: tile(out, ldo, x, ldx, w, r0, t0, RB, 4); return;
        case 3: tile(out, ldo, x, ldx, w, r0, t0, RB, 3); return;
        case 2: tile(out, ldo, x, ldx, w, r0, t0, RB, 2); return;
        default: tile(out, ldo, x, ldx, w, r0, t0, RB, 1); return;
        }
    }
    for (int r = 0; r < nr; r++)  /* the last rows of a matrix whose height is not a multiple of RB */
        for (int t = 0; t < nt; t++) tile(out, ldo, x, ldx, w, r0 + r, t0 + t, 1, 1);
}

/* Tiles [tile_lo, tile_hi) of RB rows: token blocks outside (a block of x stays in L1),
 * this thread's rows inside (its share of w stays in L2). */
static void matmul_rows(float *out, int ldo, const float *x, int ldx, const Mat *w, int T, int tile_lo, int tile_hi) {
    for (int t0 = 0; t0 < T; t0 += TB) {
        int nt = T - t0 < TB ? T - t0 : TB;
        for (int tl = tile_lo; tl < tile_hi; tl++) {
            int r0 = tl * RB;
            int nr = w->rows - r0 < RB ? w->rows - r0 : RB;
            tile_any(out, ldo, x, ldx, w, r0, t0, nr, nt);
        }
    }
}

void matmul_serial(float *out, int ldo, const float *x, int ldx, Mat w, int T) {
    matmul_rows(out, ldo, x, ldx, &w, T, 0, (w.rows + RB - 1) / RB);
}

void matmul(float *out, int ldo, const float *x, int ldx, Mat w, int T) {
    int tiles = (w.rows + RB - 1) / RB;
#ifdef _OPENMP
    /* small products are not worth waking the other threads */
    long work = (long)T * w.rows * w.cols;
#pragma omp parallel if (work >= 32768)
    {
        int nth = omp_get_num_threads(), id = omp_get_thread_num();
        matmul_rows(out, ldo, x, ldx, &w, T, (int)((long)tiles * id / nth), (int)((long)tiles * (id + 1) / nth));
    }
#else
    matmul_rows(out, ldo, x, ldx, &w, T, 0, tiles);
#endif
}

/* ---- elementwise ---- */

void axpy(float *y, float a, const float *x, int n) {
    v16 av = v16_set1(a);
    for (int k = 0; k < n; k += 16) {
        int len = n - k < 16 ? n - k : 16;
        v16_store(y + k, v16_fma(av, v16_load_f32(x + k, len), v16_load_f32(y + k, len)), len);
    }
}

void rmsnorm(float *out, const float *x, Mat w, int n, float eps) {
    float ss = dot(x, x, n) / (float)n + eps;
    float s = 1.0f / sqrtf(ss);
    for (int i = 0; i < n; i++) out[i] = mat_get(w, (size_t)i) * (x[i] * s);
}

void softmax(float *x, int n) {
    float max = x[0];
    for (int i = 1; i < n; i++) max = x[i] > max ? x[i] : max;
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - max);
        sum += x[i];
    }
    float inv = 1.0f / sum;
    for (int i = 0; i < n; i++) x[i] *= inv;
}

void swiglu(float *h1, const float *h3, int n) {
    for (int i = 0; i < n; i++) {
        float a = h1[i];
        h1[i] = a / (1.0f + expf(-a)) * h3[i];
    }
}

void mat_row_f32(float *out, Mat w, int r) {
    for (int i = 0; i < w.cols; i++) out[i] = mat_get(w, (size_t)r * (size_t)w.cols + (size_t)i);
}
