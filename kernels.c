/* kernels.c: matmul, dot products, norms, softmax, in the canonical order of simd.h. */
#include "kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

size_t dtype_size(DType dt) { return dt == DTYPE_BF16 ? 2 : 4; }

const char *kernels_simd_name(void) { return SIMD_NAME; }

size_t mat_packed_offset(int rows, int cols, int r, int c) {
    int g = r / MAT_GROUP_ROWS * MAT_GROUP_ROWS, c0 = c / MAT_CHUNK * MAT_CHUNK;
    int nr = rows - g < MAT_GROUP_ROWS ? rows - g : MAT_GROUP_ROWS;
    int cw = cols - c0 < MAT_CHUNK ? cols - c0 : MAT_CHUNK;
    return (size_t)g * (size_t)cols + (size_t)c0 * (size_t)nr + (size_t)(r - g) * (size_t)cw + (size_t)(c - c0);
}

void mat_pack(void *dst, const void *src, int rows, int cols, DType dt) {
    size_t es = dtype_size(dt);
    for (int r = 0; r < rows; r++)
        for (int c0 = 0; c0 < cols; c0 += MAT_CHUNK) {
            int cw = cols - c0 < MAT_CHUNK ? cols - c0 : MAT_CHUNK;
            memcpy((char *)dst + mat_packed_offset(rows, cols, r, c0) * es,
                   (const char *)src + ((size_t)r * (size_t)cols + (size_t)c0) * es, (size_t)cw * es);
        }
}

void mat_pack_blocks(void *dst, const void *src, int blocks, int n, int cols, DType dt) {
    size_t block_bytes = (size_t)n * (size_t)cols * dtype_size(dt);
    for (int b = 0; b < blocks; b++)
        mat_pack((char *)dst + (size_t)b * block_bytes, (const char *)src + (size_t)b * block_bytes, n, cols, dt);
}

Mat mat_block(Mat stack, int i, int n) {
    Mat m = stack;
    m.data = (const char *)stack.data + (size_t)i * (size_t)n * (size_t)stack.cols * dtype_size(stack.dtype);
    m.rows = n;
    return m;
}

/* stored element i of w, widened */
static inline float mat_elem(Mat w, size_t i) {
    return w.dtype == DTYPE_BF16 ? bf16_to_f32(((const bf16 *)w.data)[i]) : ((const float *)w.data)[i];
}

float mat_get(Mat w, int r, int c) {
    return mat_elem(w, w.rows == 1 ? (size_t)c : mat_packed_offset(w.rows, w.cols, r, c));  /* a vector is plain */
}

static inline v16 load_w(const void *p, DType dt, int n) {
    return dt == DTYPE_BF16 ? v16_load_bf16((const bf16 *)p, n) : v16_load_f32((const float *)p, n);
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

void dot_rows(float *out, const float *q, const float *rows, size_t stride, int n, int width, float scale) {
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        v16 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = dot_accumulate(v16_zero(), q, rows + (size_t)(j + i) * stride, width);
        float r[16];
        v16_store(r, v16_reduce16(acc), 16);
        for (int i = 0; i < 16; i++) out[j + i] = r[i] * scale;
    }
    for (; j < n; j++) out[j] = dot(q, rows + (size_t)j * stride, width) * scale;
}

void weighted_sum_rows(float *out, const float *p, const float *rows, size_t stride, int n, int width) {
    enum { NV = 4 };  /* 64 columns per pass, 4 registers of sums */
    for (int c = 0; c < width; c += 16 * NV) {
        int nv = (width - c + 15) / 16 < NV ? (width - c + 15) / 16 : NV;
        v16 acc[NV];
        for (int v = 0; v < nv; v++) acc[v] = v16_zero();
        for (int j = 0; j < n; j++) {
            v16 pj = v16_set1(p[j]);
            const float *row = rows + (size_t)j * stride + c;
            for (int v = 0; v < nv; v++) {
                int len = width - c - 16 * v < 16 ? width - c - 16 * v : 16;
                acc[v] = v16_fma(pj, v16_load_f32(row + 16 * v, len), acc[v]);
            }
        }
        for (int v = 0; v < nv; v++) v16_store(out + c + 16 * v, acc[v], width - c - 16 * v < 16 ? width - c - 16 * v : 16);
    }
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
 * A tile is one row group (RB = MAT_GROUP_ROWS weight rows) x TB tokens, RB*TB
 * accumulators of 16 lanes. Each accumulator is one output's dot product in the
 * canonical order, whatever the tile shape: the blocking changes which outputs are
 * computed together, never the order inside one. The group's weights are read as one
 * ascending stream (the packed layout of kernels.h). */
enum { RB = MAT_GROUP_ROWS, TB = 6 };
_Static_assert(MAT_CHUNK == 16, "a chunk is one 16-lane vector of the canonical order");

static inline __attribute__((always_inline)) void
tile(float *out, int ldo, const float *x, int ldx, const Mat *w, int r0, int t0, const int nr, const int nt) {
    const int n = w->cols;
    const DType dt = w->dtype;
    const size_t es = dtype_size(dt);
    const char *group = (const char *)w->data + (size_t)r0 * (size_t)n * es;  /* this group: nr rows, packed */
    v16 acc[RB][TB];
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) acc[r][t] = v16_zero();
    int k = 0;
    for (; k + 16 <= n; k += 16) {
        const char *chunk = group + (size_t)k * (size_t)nr * es;  /* nr rows x 16 */
        v16 wv[RB];
        for (int r = 0; r < nr; r++) wv[r] = load_w(chunk + (size_t)r * 16 * es, dt, 16);
        for (int t = 0; t < nt; t++) {
            v16 xv = v16_load_f32(x + (size_t)(t0 + t) * ldx + k, 16);
            for (int r = 0; r < nr; r++) acc[r][t] = v16_fma(wv[r], xv, acc[r][t]);
        }
    }
    if (k < n) {
        const int cw = n - k;
        const char *chunk = group + (size_t)k * (size_t)nr * es;  /* nr rows x cw */
        v16 wv[RB];
        for (int r = 0; r < nr; r++) wv[r] = load_w(chunk + (size_t)r * (size_t)cw * es, dt, cw);
        for (int t = 0; t < nt; t++) {
            v16 xv = v16_load_f32(x + (size_t)(t0 + t) * ldx + k, cw);
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
    tile(out, ldo, x, ldx, w, r0, t0, nr, nt);  /* the last, shorter group of a matrix */
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

void rmsnorm(float *out, const float *x, Mat w, int n, float eps) {
    float ss = dot(x, x, n) / (float)n + eps;
    float s = 1.0f / sqrtf(ss);
    for (int i = 0; i < n; i++) out[i] = mat_get(w, 0, i) * (x[i] * s);
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
#pragma omp parallel for schedule(static) if (n >= 1024)
    for (int i = 0; i < n; i++) {
        float a = h1[i];
        h1[i] = a / (1.0f + expf(-a)) * h3[i];
    }
}

void mat_row_f32(float *out, Mat w, int r) {
    for (int c0 = 0; c0 < w.cols; c0 += MAT_CHUNK) {  /* the row's run of each chunk is contiguous */
        int cw = w.cols - c0 < MAT_CHUNK ? w.cols - c0 : MAT_CHUNK;
        size_t base = mat_packed_offset(w.rows, w.cols, r, c0);
        for (int c = 0; c < cw; c++) out[c0 + c] = mat_elem(w, base + (size_t)c);
    }
}

float *alloc_floats_touched(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, (n ? n : 1) * sizeof(float)) != 0) return NULL;
    memset(p, 0, (n ? n : 1) * sizeof(float));  /* writes every page */
    return p;
}
