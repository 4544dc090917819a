/* kernels.h: the numeric building blocks (matmul, dot, norms, softmax).
 *
 * Batch invariance: every dot product here and in attention.c follows the one
 * canonical order of simd.h (16 lanes, element i in lane i % 16, ascending i,
 * then a fixed tree). An output never depends on how many tokens are in the
 * batch, on the thread count, or on whether a KV cache is used: each output
 * element is computed by one thread, from the same inputs, in the same order.
 * tests/test_kernels.c checks this bit for bit. */
#ifndef KERNELS_H
#define KERNELS_H

#include <stddef.h>
#include <stdint.h>

typedef uint16_t bf16;

typedef enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 } DType;

/* A row-major weight matrix [rows][cols] in the checkpoint's dtype (a vector is rows = 1). */
typedef struct {
    const void *data;
    int rows, cols;
    DType dtype;
} Mat;

size_t dtype_size(DType dt);
const char *kernels_simd_name(void);   /* "avx512", "avx2" or "portable" */

/* Rows [r0, r0+n) of w as a matrix of its own. */
Mat mat_rows(Mat w, int r0, int n);
/* Element i of a vector (rows = 1) or of row-major storage, widened to fp32. */
float mat_get(Mat w, size_t i);

/* out[t*ldo + i] = sum_k w[i][k] * x[t*ldx + k] for t < T, i < w.rows, k < w.cols.
 * A blocked matrix-matrix kernel (T = 1 is the matrix-vector case); OpenMP over rows. */
void matmul(float *out, int ldo, const float *x, int ldx, Mat w, int T);
/* The same, on the calling thread only (for use inside a parallel region). */
void matmul_serial(float *out, int ldo, const float *x, int ldx, Mat w, int T);

/* sum_i a[i] b[i] in the canonical order. */
float dot(const float *a, const float *b, int n);
/* dot of the concatenations [a1; a2] . [b1; b2]: part 2 continues in the same 16 lanes,
 * starting again at lane 0 (equal to dot() on the concatenation when n1 % 16 == 0). */
float dot_cat(const float *a1, const float *b1, int n1, const float *a2, const float *b2, int n2);
/* y[i] += a * x[i] */
void axpy(float *y, float a, const float *x, int n);

/* out = w * x / sqrt(mean(x^2) + eps); w is a vector of n (out may be x). */
void rmsnorm(float *out, const float *x, Mat w, int n, float eps);
/* In place; sum in ascending index order. */
void softmax(float *x, int n);
/* h1[i] = silu(h1[i]) * h3[i] */
void swiglu(float *h1, const float *h3, int n);
/* out[i] = row r of w, widened to fp32 */
void mat_row_f32(float *out, Mat w, int r);

/* The canonical dot in plain scalar C (fmaf, the same lane split and tree): the
 * reference the SIMD kernels must equal bit for bit. */
float dot_canonical_scalar(const float *a, const float *b, int n);

#endif /* KERNELS_H */
