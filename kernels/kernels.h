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

#include "kernels/isa.h"
#include "kernels/threads.h"

/* Weights are fp32 or bf16; the KV cache may also hold int8 or fp8 with a scale per vector,
 * or int4 / int2 codes packed by blocks of PACK_ROWS rows (KIVI, below). */
typedef enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_I8 = 2, DTYPE_F8 = 3, DTYPE_I4 = 4, DTYPE_I2 = 5 } DType;
/* int8 and fp8 (e4m3) carry scales */
static inline int dtype_scaled(DType dt) { return dt == DTYPE_I8 || dt == DTYPE_F8; }
/* int4 and int2: a block of rows is quantized as one unit */
static inline int dtype_packed(DType dt) { return dt == DTYPE_I4 || dt == DTYPE_I2; }
static inline int dtype_bits(DType dt) { return dt == DTYPE_I4 ? 4 : dt == DTYPE_I2 ? 2 : 8 * (int)(dt == DTYPE_F32 ? 4 : dt == DTYPE_BF16 ? 2 : 1); }

/* KIVI's asymmetric groups (Liu et al., 2024) over a block of PACK_ROWS rows of `width`
 * elements (width a multiple of 16): an element stands for code * scale + min, one fmaf,
 * codes in [0, 2^bits - 1], scale and min in bf16 (min rounded down, scale up, so every
 * code's range covers its group). Per channel (keys): a scale and a min a column over the
 * block's rows. Per token (values): a scale and a min a row for each PACK_VALUE_GROUP
 * columns. A group holding Inf or NaN gets NaN scale and min, so it reads back as NaN.
 * A group is [codes: row j's 16-column slice s at (j * width + 16 s) * bits / 8, 2 * bits
 * bytes, byte i's bits [k * bits, (k + 1) * bits) holding lane i + 2 * bits * k]
 * [scales][mins]: per channel scale[width], min[width]; per token scale[PACK_ROWS][groups],
 * min[PACK_ROWS][groups]. */
enum { PACK_ROWS = 16, PACK_VALUE_GROUP = 32 };
size_t packed_group_bytes(int width, DType dt, int per_channel);
/* rows: PACK_ROWS rows of width floats, `stride` floats apart */
void block_quantize(void *group, const float *rows, size_t stride, int width, DType dt, int per_channel);
/* Row j of a group as the floats it stands for: the plain reference of the kernels' loads. */
void block_dequantize_row(float *dst, const void *group, int j, int width, DType dt, int per_channel);

/* A weight matrix [rows][cols] in the checkpoint's dtype (a vector is rows = 1), held in
 * the packed layout that matmul streams through memory in order:
 *   rows in groups of MAT_GROUP_ROWS (the last group may be shorter, nr rows), each group
 *   contiguous; inside a group, columns in chunks of 64 bytes of a row (mat_chunk_cols:
 *   32 bf16 or 16 fp32 columns; the last chunk may be narrower, cw columns); a chunk holds
 *   its nr rows one after another, cw elements each.
 * So element (r, c) sits near g*cols + c0*nr + (r - g)*cw + (c - c0), with g = r rounded
 * down to a group and c0 = c rounded down to a chunk. In a full bf16 chunk of a matrix
 * (rows > 1), a row's 32 columns are stored in pairs, (c0 + l, c0 + 16 + l) for l < 16:
 * one 64-byte load then gives columns c0..c0+15 as the low halves of its 16 words and
 * c0+16..c0+31 as the high halves, each widened to fp32 by one shift or mask, in the lane
 * order of simd.h (no cross-lane widening instruction). A narrower last chunk, an fp32
 * chunk and a vector (rows = 1, plain row-major) hold no pairs.
 * The file is row-major (docs/FORMAT.md); the loader packs with mat_pack: the hardware
 * prefetchers follow one ascending stream far better than MAT_GROUP_ROWS rows read side
 * by side. */
typedef struct {
    const void *data;
    int rows, cols;
    DType dtype;
} Mat;

/* Rows per group: the row block of matmul's tile (kernels.c), 8 where simd.h uses AVX-512's
 * 32 registers, 4 otherwise. The file's layout does not depend on it (the loader packs). */
#if ISA_AVX512
enum { MAT_GROUP_ROWS = 8 };
#else
enum { MAT_GROUP_ROWS = 4 };
#endif
enum { MAT_CHUNK_BYTES = 64 };

/* Row n floats of src into dst in dtype: bf16 rounded to nearest even; int8 as
 * round-to-nearest-even(x / scale) with scale = max|x| / 127 per part, parts [0, split) and
 * [split, n) with their scales in scales[0] and scales[1] (split = n: one part). A zero
 * part gets scale 0; a part holding Inf or NaN gets a NaN scale, so it reads back as NaN.
 * fp8 (e4m3: 4 exponent bits, bias 7, 3 mantissa bits, largest 448) the same way with
 * scale = max|x| / 448, x / scale rounded to the nearest e4m3, ties to even. */
void row_quantize(void *dst, float *scales, const float *src, int n, int split, DType dtype);
/* The floats a stored row stands for (row_quantize's inverse, as the kernels read it). */
void row_dequantize(float *dst, const void *row, const float *scales, int n, int split, DType dtype);

/* columns in a full chunk of a packed matrix */
int mat_chunk_cols(DType dt);

/* Offset, in elements, of element (r, c) of a packed rows x cols matrix. */
size_t mat_packed_offset(int rows, int cols, DType dt, int r, int c);
/* Packs a row-major rows x cols matrix src into dst (the same size; not in place). */
void mat_pack(void *dst, const void *src, int rows, int cols, DType dt);
/* Packs rows [r0, r1) of a rows x cols matrix, given row-major in src_rows ((r1 - r0) x
 * cols), into their places in dst, the whole packed matrix: mat_pack is all its rows at
 * once, and threads may pack disjoint row ranges of one matrix side by side. */
void mat_pack_rows(void *dst, const void *src_rows, int rows, int cols, DType dt, int r0, int r1);

size_t dtype_size(DType dt);
const char *kernels_simd_name(void); /* "avx512", "avx2" or "portable" */

/* Index of the first NaN or infinity among n values of type dt (fp32 or bf16), or -1. */
long first_nonfinite(const void *data, size_t n, DType dt);

/* Block i of a stack of matrices of n rows each, every block packed on its own
 * (rows [i*n, (i+1)*n) of a matrix built with mat_pack_blocks). */
Mat mat_block(Mat stack, int i, int n);
/* Packs a row-major (blocks*n) x cols matrix as blocks of n rows, each packed on its own. */
void mat_pack_blocks(void *dst, const void *src, int blocks, int n, int cols, DType dt);
/* Element (r, c), widened to fp32. */
float mat_get(Mat w, int r, int c);

/* out[t*ldo + i] = sum_k w[i][k] * x[t*ldx + k] for t < T, i < w.rows, k < w.cols.
 * A blocked matrix-matrix kernel (T = 1 is the matrix-vector case). Every thread of wk's
 * team calls it with the same arguments and computes its share (threads.h); it returns
 * when the product is whole (a barrier), or, run alone, on thread 0 when it is done. */
void matmul(Worker *wk, float *out, int ldo, const float *x, int ldx, Mat w, int T);
/* Independent products as one operation (one barrier instead of n). For one or two token
 * blocks (decode, the prompt) the threads split the row tiles of all of them; for more,
 * each thread computes every row for its share of the tokens. Each output is computed
 * exactly as matmul computes it, by one thread. */
typedef struct {
    float *out;
    int ldo;
    const float *x;
    int ldx;
    Mat w;
    int T;
} MatmulJob;
void matmul_jobs(Worker *wk, const MatmulJob *jobs, int n_jobs);
/* The FFN's up projections: h1 = silu(W1 x) * (W3 x), h3 = W3 x, both (T, w1.rows). A
 * thread computes the same rows of both products (split by rows for every T) and applies
 * SwiGLU to them, so no barrier separates the three. */
void matmul_swiglu(Worker *wk, float *h1, float *h3, const float *x, int ldx, Mat w1, Mat w3, int T);
/* Whether products of more than two token blocks take AVX-512's wide tiles (kernels.c):
 * at startup, unless the processor is AMD's. Both tiles give the same bits; the tests and
 * build/matmul_bench set it to take each. Always 0 without AVX-512. */
void matmul_set_wide_tiles(int on);
int matmul_wide_tiles(void);
/* The tile of the products past 6 tokens, rows x tokens: "4x6" (wide), "8x3" or "4x3". */
const char *matmul_tiles_name(void);

/* sum_i a[i] b[i] in the canonical order. */
float dot(const float *a, const float *b, int n);
/* dot of the concatenations [a1; a2] . [b1; b2]: part 2 continues in the same 16 lanes,
 * starting again at lane 0 (equal to dot() on the concatenation when n1 % 16 == 0). */
float dot_cat(const float *a1, const float *b1, int n1, const float *a2, const float *b2, int n2);
/* out[j] = dot(q, rows + j*stride, width) * scale for j < n, bit for bit (attention
 * scores: 16 rows at a time share one transposed final reduction). */
void dot_rows(float *out, const float *q, const float *rows, size_t stride, int n, int width, float scale);
/* out[j] = dot_cat(q1, rows1 + j*stride1, width1, q2, rows2 + j*stride2, width2) * scale for
 * j < n, bit for bit: keys stored in two parts (MLA's expanded [k_C ; k_R]). */
void dot_rows_cat(float *out, int n, float scale, const float *q1, const float *rows1, size_t stride1, int width1,
                  const float *q2, const float *rows2, size_t stride2, int width2);
/* out[d] = sum_j p[j] * rows[j*stride + d] for d < width, in a fixed order: the even j and
 * the odd j each in ascending j (fmaf(p[j], row, sum) from sum = 0), then even + odd. Two
 * chains per column: one alone waits on the FMA latency at every key. */
void weighted_sum_rows(float *out, const float *p, const float *rows, size_t stride, int n, int width);

/* n rows kept in blocks of block_rows rows (the paged KV cache): row j starts at element
 * (j % block_rows) * stride of block[j / block_rows], in dtype. An int8 (fp8) row stands for
 * the floats scale * int8 (scale * e4m3; one IEEE product each), with n_scales scales a row: element c
 * uses the row's first scale for c < split, its second from split on; block b's rows'
 * scales are scales[b][r * n_scales + part]. block_rows is even. An int4 (int2) block is one
 * group of block_rows = PACK_ROWS rows of stride elements. */
typedef struct {
    const void *const *block;
    const float *const *scales; /* DTYPE_I8 and DTYPE_F8 only */
    int block_rows;
    size_t stride;
    DType dtype;
    int n_scales, split; /* DTYPE_I8 and DTYPE_F8 only */
    int per_channel;     /* DTYPE_I4 and DTYPE_I2: block[b] is a group (block_quantize), keys' or values' */
    int last_f32;        /* the last block (of the n rows) is fp32 rows, `stride` floats apart (KIVI's residual) */
    int groups;          /* row groups read side by side, >= 1: group g's block b is block[g * nb + b],
                          * nb the n rows' blocks; heads [g * n_heads / groups, ...) read group g */
    int streamed;        /* no other query of the pass reads these rows: they come from memory */
} RowBlocks;
/* dot_rows and weighted_sum_rows over such rows for n_heads heads that read the same rows
 * (a GQA group, MQA's or MLA's heads), or each group of them its own rows: head h's query
 * (or probabilities) at q + h*ld_q (p + h*ld_p), its output at out + h*ld_out. Bit for bit
 * what dot_rows and weighted_sum_rows give each head on the same rows stored contiguously as
 * the floats they stand for; the heads take each part of the rows in turn while it is in L1,
 * and the groups take a block in turn, as the pool keeps a block's row groups together. */
void dot_row_blocks(float *out, size_t ld_out, const float *q, size_t ld_q, int n_heads, RowBlocks rows, int n,
                    int width, float scale);
void weighted_sum_row_blocks(float *out, size_t ld_out, const float *p, size_t ld_p, int n_heads, RowBlocks rows, int n,
                             int width);

/* out = w * x / sqrt(mean(x^2) + eps); w is a vector of n (out may be x). */
void rmsnorm(float *out, const float *x, Mat w, int n, float eps);
/* In place: e^(x - max) by simd.h's polynomial exp (the same bits on every path), divided
 * by their sum in the canonical 16-lane order. */
void softmax(float *x, int n);
/* softmax, also giving the max it subtracted and the sum it divided by: what merging the
 * softmaxes of a long context's chunks needs (softmax_merge). */
void softmax_stats(float *x, int n, float *max, float *sum);
/* Folds one chunk of keys into the attention over the chunks before it, in chunk order:
 * out (width) and its (*max, *sum) were the earlier chunks' weighted sum, normalized, and
 * their softmax's statistics; out_c, max_c, sum_c this chunk's. With M the larger max,
 * a = sum e^(max - M), b = sum_c e^(max_c - M): out = a/(a+b) out + b/(a+b) out_c, each
 * element alone (the same bits on every path). */
void softmax_merge(float *out, float *max, float *sum, const float *out_c, float max_c, float sum_c, int width);
/* h1[i] = silu(h1[i]) * h3[i], with simd.h's exp (the same bits on every path) */
void swiglu(float *h1, const float *h3, int n);
/* out[i] = row r of w, widened to fp32 */
void mat_row_f32(float *out, Mat w, int r);

/* splitmix64's finalizer: a counter in, 64 well-mixed bits out; the generator of every
 * generated value (--shape's weights, --fill's cache entries), so each depends only on
 * its seed and its place. */
static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* n zeroed floats, 64-byte aligned (on huge pages from 2 MB: alloc_huge), every page
 * already written. Aligned: malloc puts a large block 16 bytes past a page start, so every
 * 16-float load of an activation row would straddle two cache lines.
 * Written: a fresh allocation is only mapped on first write, and its page faults would
 * otherwise land in the first timed step. NULL when out of memory. */
float *alloc_floats_touched(size_t n);
/* The same for bytes (the KV pool). */
void *alloc_touched(size_t bytes);
/* bytes, 2 MB-aligned and advised as transparent huge pages when that large, else 64-byte
 * aligned; not written. For what a step streams (the weights, the KV pool, the scratch):
 * through one TLB entry per 2 MB instead of one per 4 KB page. NULL when out of memory; free() frees it. */
void *alloc_huge(size_t bytes);

/* The canonical dot in plain scalar C (fmaf, the same lane split and tree): the
 * reference the SIMD kernels must equal bit for bit. */
float dot_canonical_scalar(const float *a, const float *b, int n);

#endif /* KERNELS_H */
