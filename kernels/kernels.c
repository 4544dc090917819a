/* kernels.c: matmul, dot products, norms, softmax, in the canonical order of simd.h. */
#define _DEFAULT_SOURCE /* madvise, MADV_HUGEPAGE */
#include "kernels/kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kernels/threads.h"
#include "kernels/simd.h"

/* int4, int2: 1 here; their packed bytes are packed_group_bytes' */
size_t dtype_size(DType dt) { return dt == DTYPE_F32 ? 4 : dt == DTYPE_BF16 ? 2 : 1; }

const char *kernels_simd_name(void) { return SIMD_NAME; }

int mat_chunk_cols(DType dt) { return MAT_CHUNK_BYTES / (int)dtype_size(dt); }

/* Whether the full chunks of a rows-row matrix hold pairs (kernels.h); a vector is plain. */
static inline int chunks_paired(DType dt, int rows) { return dt == DTYPE_BF16 && rows > 1; }

/* Where column c0 + i of a row goes in that row's run of a chunk cw wide. */
static inline int chunk_position(DType dt, int rows, int cw, int i) {
    if (!chunks_paired(dt, rows) || cw < 32) return i; /* plain */
    return i < 16 ? 2 * i : 2 * (i - 16) + 1;          /* pairs (c0 + l, c0 + 16 + l) */
}

/* Offset of element (r, c0) of a packed matrix, c0 the first column of a chunk: the start
 * of the row's run in that chunk. */
static size_t run_offset(int rows, int cols, int r, int c0, int cw) {
    int g = r / MAT_GROUP_ROWS * MAT_GROUP_ROWS;
    int nr = rows - g < MAT_GROUP_ROWS ? rows - g : MAT_GROUP_ROWS;
    return (size_t)g * (size_t)cols + (size_t)c0 * (size_t)nr + (size_t)(r - g) * (size_t)cw;
}

static inline int chunk_width(int cols, int c0, int cc) { return cols - c0 < cc ? cols - c0 : cc; }

size_t mat_packed_offset(int rows, int cols, DType dt, int r, int c) {
    int cc = mat_chunk_cols(dt), c0 = c / cc * cc, cw = chunk_width(cols, c0, cc);
    return run_offset(rows, cols, r, c0, cw) + (size_t)chunk_position(dt, rows, cw, c - c0);
}

void mat_pack_rows(void *dst, const void *src_rows, int rows, int cols, DType dt, int r0, int r1) {
    const size_t es = dtype_size(dt);
    const int cc = mat_chunk_cols(dt), paired = chunks_paired(dt, rows);
    for (int r = r0; r < r1; r++) {
        const char *row = (const char *)src_rows + (size_t)(r - r0) * (size_t)cols * es;
        for (int c0 = 0; c0 < cols; c0 += cc) {
            const int cw = chunk_width(cols, c0, cc);
            char *run = (char *)dst + run_offset(rows, cols, r, c0, cw) * es;
            if (paired && cw == 32) { /* chunk_position's pairs (c0 + l, c0 + 16 + l) */
                const bf16 *from = (const bf16 *)(row + (size_t)c0 * es);
                bf16 *to = (bf16 *)run;
                for (int l = 0; l < 16; l++) to[2 * l] = from[l], to[2 * l + 1] = from[16 + l];
            } else { /* plain: chunk_position(i) == i */
                memcpy(run, row + (size_t)c0 * es, (size_t)cw * es);
            }
        }
    }
}

void mat_pack(void *dst, const void *src, int rows, int cols, DType dt) {
    mat_pack_rows(dst, src, rows, cols, dt, 0, rows);
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
    return mat_elem(w,
                    w.rows == 1 ? (size_t)c : mat_packed_offset(w.rows, w.cols, w.dtype, r, c)); /* a vector is plain */
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

/* acc[i] += q[k] * (row i of block)[k] for k < width, 16 rows, ascending k in every row */
static inline __attribute__((always_inline)) void rows_accumulate(v16 acc[16], const float *q, const float *block,
                                                                  size_t stride, int width) {
    for (int k = 0; k < width; k += 16) {
        const int len = width - k < 16 ? width - k : 16;
        const v16 qk = v16_load_f32(q + k, len);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) acc[i] = v16_fma(qk, v16_load_f32(block + (size_t)i * stride + k, len), acc[i]);
    }
}

/* dot_rows_cat for widths known at compile time (the dispatch below passes constants): q1
 * and q2 stay in registers, and each part's rows are walked by one pointer that steps by
 * its stride (the asm hides the pointer's value, or GCC keeps 16 row addresses and spills
 * them). Same order in every row: part 1, then part 2 from lane 0 again. */
static inline __attribute__((always_inline)) void dot_rows_fixed(float *out, int n, float scale, const float *q1,
                                                                 const float *rows1, size_t stride1, const int width1,
                                                                 const float *q2, const float *rows2, size_t stride2,
                                                                 const int width2) {
    enum { MAX_CHUNKS = 9 }; /* widths up to 144 */
    const int c1 = (width1 + 15) / 16, c2 = (width2 + 15) / 16;
    v16 q1c[MAX_CHUNKS], q2c[MAX_CHUNKS];
    for (int c = 0; c < c1; c++) q1c[c] = v16_load_f32(q1 + 16 * c, width1 - 16 * c);
    for (int c = 0; c < c2; c++) q2c[c] = v16_load_f32(q2 + 16 * c, width2 - 16 * c);
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        const float *row1 = rows1 + (size_t)j * stride1, *row2 = rows2 + (size_t)j * stride2;
        v16 acc[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            v16 a = v16_zero();
            for (int c = 0; c < c1; c++) a = v16_fma(q1c[c], v16_load_f32(row1 + 16 * c, width1 - 16 * c), a);
            for (int c = 0; c < c2; c++) a = v16_fma(q2c[c], v16_load_f32(row2 + 16 * c, width2 - 16 * c), a);
            acc[i] = a;
            row1 += stride1;
            row2 += stride2;
            __asm__("" : "+r"(row1), "+r"(row2));
        }
        v16_store(out + j, v16_mul(v16_reduce16(acc), v16_set1(scale)), 16);
    }
    for (; j < n; j++)
        out[j] = dot_cat(q1, rows1 + (size_t)j * stride1, width1, q2, rows2 + (size_t)j * stride2, width2) * scale;
}

/* The general case: any widths. */
static void dot_rows_any(float *out, int n, float scale, const float *q1, const float *rows1, size_t stride1,
                         int width1, const float *q2, const float *rows2, size_t stride2, int width2) {
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        v16 acc[16]; /* one per row, in registers: the row loops are unrolled */
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) acc[i] = v16_zero();
        rows_accumulate(acc, q1, rows1 + (size_t)j * stride1, stride1, width1);
        rows_accumulate(acc, q2, rows2 + (size_t)j * stride2, stride2, width2); /* from lane 0 again, as dot_cat */
        v16_store(out + j, v16_mul(v16_reduce16(acc), v16_set1(scale)), 16);
    }
    for (; j < n; j++)
        out[j] = dot_cat(q1, rows1 + (size_t)j * stride1, width1, q2, rows2 + (size_t)j * stride2, width2) * scale;
}

/* The key widths of the shipped checkpoints get a copy of the loop with their widths as
 * constants: 32 (MHA, GQA, MQA), 32 + 16 (MLA expanded [k_C ; k_R]), 80 and 144 (MLA
 * absorbed [c ; k_R]). */
void dot_rows_cat(float *out, int n, float scale, const float *q1, const float *rows1, size_t stride1, int width1,
                  const float *q2, const float *rows2, size_t stride2, int width2) {
    const int widths = width1 * 1000 + width2;
    switch (widths) {
    case 32000: dot_rows_fixed(out, n, scale, q1, rows1, stride1, 32, q2, rows2, stride2, 0); break;
    case 32016: dot_rows_fixed(out, n, scale, q1, rows1, stride1, 32, q2, rows2, stride2, 16); break;
    case 80000: dot_rows_fixed(out, n, scale, q1, rows1, stride1, 80, q2, rows2, stride2, 0); break;
    case 144000: dot_rows_fixed(out, n, scale, q1, rows1, stride1, 144, q2, rows2, stride2, 0); break;
    default: dot_rows_any(out, n, scale, q1, rows1, stride1, width1, q2, rows2, stride2, width2); break;
    }
}

void dot_rows(float *out, const float *q, const float *rows, size_t stride, int n, int width, float scale) {
    dot_rows_cat(out, n, scale, q, rows, stride, width, q, rows, stride, 0);
}

/* A run of rows to request: its start and bytes (none: NULL, 0). */
typedef struct {
    const char *at;
    size_t bytes;
} Run;

/* Requests bytes [lo, hi) of a run into L1, from the line lo falls in: a sequence's blocks
 * lie anywhere in the pool, so the hardware prefetchers lose the stream at every run's
 * start. The prefetch helpers are always inlined: GCC takes a call that only prefetches for
 * one without effect, and drops it. */
static inline __attribute__((always_inline)) void prefetch_lines(Run run, size_t lo, size_t hi) {
    for (size_t i = lo / 64 * 64; i < hi; i += 64) __builtin_prefetch(run.at + i, 0, 3);
}

/* the columns of a 16-wide slice that lie in [c, width): 0 to 16 */
static inline int slice_len(int width, int c) { return width - c < 0 ? 0 : width - c < 16 ? width - c : 16; }

/* Elements [col, col + n) of a stored row (n <= 16), as the floats they stand for: lane l
 * is element col + l. For int8 each lane takes its part's scale (the parts may meet inside
 * the n); the second scale is read only when they do, as a row of one part has none. */
static inline __attribute__((always_inline)) v16 row_load(const void *row, const float *scales, int col, int n,
                                                          DType dt, int split) {
    if (dt == DTYPE_F32) return v16_load_f32((const float *)row + col, n);
    if (dt == DTYPE_BF16) return v16_load_bf16((const bf16 *)row + col, n);
    const v16 x =
        dt == DTYPE_F8 ? v16_load_f8((const uint8_t *)row + col, n) : v16_load_i8((const int8_t *)row + col, n);
    /* col + n, not col + 16: an empty tail past a one-part row (n = 0) must not read a second scale */
    if (split >= col + n || !scales) return v16_mul(x, v16_set1(scales ? scales[0] : 0.0f));
    if (split <= col) return v16_mul(x, v16_set1(scales[1]));
    const v16 s0 = v16_set1(scales[0]), s1 = v16_set1(scales[1]); /* lanes below split - col take s0 */
    return v16_mul(x, v16_add(v16_first(s0, split - col), v16_sub(s1, v16_first(s1, split - col))));
}

static inline const float *row_scales(const RowBlocks *r, int b, int i) {
    return dtype_scaled(r->dtype) ? r->scales[b] + (size_t)i * r->n_scales : NULL;
}

/* Elements [col, col + 16) of row j of a packed group (kernels.h), as the floats they stand
 * for: the codes shifted into their lanes (simd.h), widened, then code * scale + min in
 * one fma. n is 16, or 0 past the row's end. */
static inline __attribute__((always_inline)) v16 packed_load(const unsigned char *g, int j, int col, int n, DType dt,
                                                             int width, int per_channel) {
    if (n <= 0) return v16_zero();
    const int bits = dt == DTYPE_I4 ? 4 : 2;
    const unsigned char *codes = g + ((size_t)j * width + (size_t)col) * bits / 8;
    v16 x;
    if (bits == 4) {
        uint64_t w;
        memcpy(&w, codes, 8);
        x = v16_from_4bit(w);
    } else {
        uint32_t w;
        memcpy(&w, codes, 4);
        x = v16_from_2bit(w);
    }
    const bf16 *params = (const bf16 *)(g + (size_t)PACK_ROWS * width * bits / 8);
    if (per_channel) return v16_fma(x, v16_load_bf16(params + col, 16), v16_load_bf16(params + width + col, 16));
    const int groups = (width + PACK_VALUE_GROUP - 1) / PACK_VALUE_GROUP, k = j * groups + col / PACK_VALUE_GROUP;
    return v16_fma(x, v16_set1(bf16_to_f32(params[k])), v16_set1(bf16_to_f32(params[PACK_ROWS * groups + k])));
}

/* Elements [col, col + n) of row j of block b (at base), as floats, whatever the dtype. */
static inline __attribute__((always_inline)) v16 block_load(const RowBlocks *r, const char *base, int b, int j, int col,
                                                            int n, DType dt) {
    if (dtype_packed(dt))
        return packed_load((const unsigned char *)base, j, col, n, dt, (int)r->stride, r->per_channel);
    return row_load(base + (size_t)j * r->stride * dtype_size(dt), row_scales(r, b, j), col, n, dt, r->split);
}

/* out[j] = dot(q, row j as floats, width) * scale for rows j of block b, j0 <= j < m, one
 * by one: a block's last rows short of 16. */
static inline __attribute__((always_inline)) void dot_block_tail(float *out, const float *q, const RowBlocks *r, int b,
                                                                 int j0, int m, int width, float scale, DType dt) {
    const char *base = r->block[b];
    for (int j = j0; j < m; j++) {
        v16 acc = v16_zero();
        for (int k = 0; k < width; k += 16) {
            const int len = width - k < 16 ? width - k : 16;
            acc = v16_fma(v16_load_f32(q + k, len), block_load(r, base, b, j, k, len, dt), acc);
        }
        out[j] = v16_reduce(acc) * scale;
    }
}

/* out[j] = dot(q, row j as floats, width) * scale for the rows of block b, j < m: 16 rows at
 * a time reduced side by side, the rest one by one, as dot_rows does. */
static inline __attribute__((always_inline)) void dot_block_rows(float *out, const float *q, const RowBlocks *r, int b,
                                                                 int m, int width, float scale, DType dt) {
    const char *base = r->block[b];
    int j = 0;
    for (; j + 16 <= m; j += 16) {
        v16 acc[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) acc[i] = v16_zero();
        for (int k = 0; k < width; k += 16) {
            const int len = width - k < 16 ? width - k : 16;
            const v16 qk = v16_load_f32(q + k, len);
            for (int i = 0; i < 16; i++) acc[i] = v16_fma(qk, block_load(r, base, b, j + i, k, len, dt), acc[i]);
        }
        v16_store(out + j, v16_mul(v16_reduce16(acc), v16_set1(scale)), 16);
    }
    dot_block_tail(out, q, r, b, j, m, width, scale, dt);
}

/* Columns a slab of dot_block_rows_shared widens at a time, and heads it carries at once: a
 * slab holds a whole row of every shape short of DeepSeek-V2-Lite's latent, so only such
 * rows spill a head's chains between slabs. */
enum { WIDE_COLS = 320, WIDE_HEADS = 16 };

/* dot_block_rows for the nh heads that read block b, each head's scores at out + h*ld_out:
 * every 16 rows' columns are widened to floats once, a slab of WIDE_COLS at a time, and
 * every head reads them from L1, where widening them anew for each head would bound the
 * loop. A 16-column slice holds its rows in pairs, the first 8 columns of both rows, then
 * the last 8 (v16_low_halves), so each head's chains for columns c and c + 8 lie in two
 * vectors at the same lanes and v16_reduce16's first level is one add, not two shuffles and
 * an add. A head's 16 chains wait in `spill` between slabs: each lane's chain is the one
 * dot_block_rows computes, in the same order, so the bits are its bits. */
static inline __attribute__((always_inline)) void dot_block_rows_shared(float *out, size_t ld_out, const float *q,
                                                                        size_t ld_q, int nh, const RowBlocks *r, int b,
                                                                        int m, int width, float scale, DType dt,
                                                                        Run next) {
    const char *base = r->block[b];
    float wide[16 * WIDE_COLS] __attribute__((aligned(64))); /* (WIDE_COLS / 16 slices, 8 pairs, 2 halves, 16) */
    v16 spill[WIDE_HEADS][16];
    const int batch = width <= WIDE_COLS ? nh : WIDE_HEADS; /* one slab: no chains wait, so no bound */
    if (m < 16) prefetch_lines(next, 0, next.bytes);        /* no head loop below to spread them over */
    int j = 0;
    for (; j + 16 <= m; j += 16)
        for (int h0 = 0; h0 < nh; h0 += batch) {
            const int hn = nh - h0 < batch ? nh - h0 : batch;
            for (int c0 = 0; c0 < width; c0 += WIDE_COLS) {
                const int cw = width - c0 < WIDE_COLS ? width - c0 : WIDE_COLS;
                for (int k = 0; k < cw; k += 16)
                    for (int i = 0; i < 16; i += 2) {
                        const int len = cw - k < 16 ? cw - k : 16;
                        const v16 first = block_load(r, base, b, j + i, c0 + k, len, dt),
                                  second = block_load(r, base, b, j + i + 1, c0 + k, len, dt);
                        v16_store(wide + 16 * (k + i), v16_low_halves(first, second), 16);
                        v16_store(wide + 16 * (k + i + 1), v16_high_halves(first, second), 16);
                    }
                for (int h = 0; h < hn; h++) {
                    if (j == 0 && h0 == 0 && c0 == 0)
                        prefetch_lines(next, next.bytes * h / hn, next.bytes * (h + 1) / hn);
                    const float *qh = q + (size_t)(h0 + h) * ld_q + c0;
                    v16 acc[16]; /* pair i/2 of rows: columns 0-7 of each 16 (i even), 8-15 (i odd) */
#pragma GCC unroll 16
                    for (int i = 0; i < 16; i++) acc[i] = c0 == 0 ? v16_zero() : spill[h][i];
                    for (int k = 0; k < cw; k += 16) {
                        const int len = cw - k < 16 ? cw - k : 16;
                        const v16 q_low = v16_load_f32_twice8(qh + k, len < 8 ? len : 8),
                                  q_high = v16_load_f32_twice8(qh + k + 8, len - 8);
#pragma GCC unroll 8
                        for (int i = 0; i < 16; i += 2) {
                            acc[i] = v16_fma(q_low, v16_load_f32(wide + 16 * (k + i), 16), acc[i]);
                            acc[i + 1] = v16_fma(q_high, v16_load_f32(wide + 16 * (k + i + 1), 16), acc[i + 1]);
                        }
                    }
                    if (c0 + cw < width) {
#pragma GCC unroll 16
                        for (int i = 0; i < 16; i++) spill[h][i] = acc[i];
                    } else {
                        v16 folded[8];
#pragma GCC unroll 8
                        for (int i = 0; i < 8; i++) folded[i] = v16_add(acc[2 * i], acc[2 * i + 1]);
                        v16_store(out + (size_t)(h0 + h) * ld_out + j,
                                  v16_mul(v16_reduce16_folded(folded), v16_set1(scale)), 16);
                    }
                }
            }
        }
    for (int h = 0; h < nh; h++)
        dot_block_tail(out + (size_t)h * ld_out, q + (size_t)h * ld_q, r, b, j, m, width, scale, dt);
}

/* Block b's scores for n_heads heads, dt a constant: one head widens the rows in registers as
 * it reads them; several share one widening. */
static inline __attribute__((always_inline)) void dot_block_heads(float *out, size_t ld_out, const float *q,
                                                                  size_t ld_q, int n_heads, const RowBlocks *r, int b,
                                                                  int m, int width, float scale, DType dt, Run next) {
    if (n_heads == 1)
        dot_block_rows(out, q, r, b, m, width, scale, dt);
    else
        dot_block_rows_shared(out, ld_out, q, ld_q, n_heads, r, b, m, width, scale, dt, next);
}

/* The blocks the n rows span. */
static int blocks_of(const RowBlocks *r, int n) { return (n + r->block_rows - 1) / r->block_rows; }

/* Bytes of a run of m rows (a packed group whole). */
static inline size_t run_bytes(const RowBlocks *r, int m) {
    return dtype_packed(r->dtype) ? packed_group_bytes((int)r->stride, r->dtype, r->per_channel)
                                  : (size_t)m * r->stride * dtype_size(r->dtype);
}

/* The rows of block b of the n. */
static inline int rows_in_block(const RowBlocks *r, int b, int n) {
    const int j0 = b * r->block_rows;
    return n - j0 < r->block_rows ? n - j0 : r->block_rows;
}

/* Requests the run at table index `at`, of m rows, into L2 (prefetch_lines: into L1). */
static inline __attribute__((always_inline)) void prefetch_run_l2(const RowBlocks *r, int at, int m) {
    const char *base = r->block[at];
    const size_t bytes = run_bytes(r, m);
    for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch(base + i, 0, 2);
}

/* Streamed runs of up to a page are read too fast for a request one run ahead to arrive in
 * time: such a run is also requested PREFETCH_FAR runs ahead, into L2, and the page of the
 * one after that is touched. Its page is one the TLB has not seen (a block holds a
 * sequence's rows of every layer, so a row group's next run is a block's size away), and a
 * prefetch that misses the TLB is lost: the load starts the page walk in time for it. */
enum { PREFETCH_FAR = 3, PREFETCH_FAR_BYTES = 4096 };

/* While group g's block b is read, in the order prefetch_next describes: the run
 * PREFETCH_FAR on into L2, and the page of the one after it touched. */
static inline __attribute__((always_inline)) void prefetch_far(const RowBlocks *r, int g, int b, int nb, int n,
                                                               int block_major) {
    const int across = block_major ? r->groups : 1; /* runs read a block */
    for (int ahead = PREFETCH_FAR; ahead <= PREFETCH_FAR + 1; ahead++) {
        const int k = (block_major ? g : 0) + ahead, to_group = block_major ? k % across : g, to_block = b + k / across;
        if (to_block >= nb) return;
        if (ahead == PREFETCH_FAR)
            prefetch_run_l2(r, to_group * nb + to_block, rows_in_block(r, to_block, n));
        else
            (void)*(const volatile char *)r->block[to_group * nb + to_block];
    }
}

/* The run read after group g's block b (of the nb blocks of the n rows): taking a block's
 * groups in turn, the next group's in the same block, which the pool keeps next to it,
 * then the first group's in the next block; taking a group's blocks in turn, its next
 * block. None when there is none, or the rows are not streamed (rows other queries read
 * are in cache, where requests only cost time). */
static inline Run next_run(const RowBlocks *r, int g, int b, int nb, int n, int block_major) {
    int at = -1;
    if (block_major && g + 1 < r->groups)
        at = (g + 1) * nb + b;
    else if (b + 1 < nb)
        at = (block_major ? 0 : g) * nb + b + 1;
    if (!r->streamed || at < 0) return (Run){NULL, 0};
    return (Run){r->block[at], run_bytes(r, rows_in_block(r, at % nb, n))};
}

/* Requests what is read after group g's block b: the next run (next_run) into L1 unless
 * the caller spreads those requests itself (`near` 0), and small runs' far ones. */
static inline __attribute__((always_inline)) void prefetch_next(const RowBlocks *r, int g, int b, int nb, int n,
                                                                int block_major, int near) {
    if (near) {
        const Run run = next_run(r, g, b, nb, n, block_major);
        prefetch_lines(run, 0, run.bytes);
    }
    if (r->streamed && run_bytes(r, r->block_rows) <= PREFETCH_FAR_BYTES) prefetch_far(r, g, b, nb, n, block_major);
}

void dot_row_blocks(float *out, size_t ld_out, const float *q, size_t ld_q, int n_heads, RowBlocks rows, int n,
                    int width, float scale) {
    const int groups = rows.groups, gh = n_heads / groups, nb = blocks_of(&rows, n);
    for (int j0 = 0, b = 0; j0 < n; j0 += rows.block_rows, b++) {
        const int m = rows_in_block(&rows, b, n);
        const DType dt = rows.last_f32 && j0 + m == n ? DTYPE_F32 : rows.dtype;
        for (int g = 0; g < groups; g++) {
            const int at = g * nb + b; /* group g's block b in the tables */
            /* heads that share the rows request the next run a slice a head: a burst of
             * requests for a whole run at once stalls the core while they are sent */
            const int spread = gh > 1 && dt != DTYPE_F32;
            const Run next = spread ? next_run(&rows, g, b, nb, n, 1) : (Run){NULL, 0};
            prefetch_next(&rows, g, b, nb, n, 1, !spread);
            float *o = out + (size_t)g * gh * ld_out + j0;
            const float *qg = q + (size_t)g * gh * ld_q;
            switch (dt) {
            case DTYPE_F32: /* fp32 rows take dot_rows' loops with constant widths */
                for (int h = 0; h < gh; h++)
                    dot_rows(o + (size_t)h * ld_out, qg + (size_t)h * ld_q, rows.block[at], rows.stride, m, width,
                             scale);
                break;
            case DTYPE_BF16:
                dot_block_heads(o, ld_out, qg, ld_q, gh, &rows, at, m, width, scale, DTYPE_BF16, next);
                break;
            case DTYPE_I8: dot_block_heads(o, ld_out, qg, ld_q, gh, &rows, at, m, width, scale, DTYPE_I8, next); break;
            case DTYPE_F8: dot_block_heads(o, ld_out, qg, ld_q, gh, &rows, at, m, width, scale, DTYPE_F8, next); break;
            case DTYPE_I4: dot_block_heads(o, ld_out, qg, ld_q, gh, &rows, at, m, width, scale, DTYPE_I4, next); break;
            case DTYPE_I2: dot_block_heads(o, ld_out, qg, ld_q, gh, &rows, at, m, width, scale, DTYPE_I2, next); break;
            }
        }
    }
}

/* One block's m rows (block b at j0) into the chains of heads 0 .. nh-1 over columns
 * [c, c + 32): the even and odd rows in two chains a slice. */
static inline __attribute__((always_inline)) void weighted_sum_block(v16 *even0, v16 *odd0, v16 *even1, v16 *odd1,
                                                                     const float *p, size_t ld_p, const int nh,
                                                                     const RowBlocks *rows, int b, int j0, int m, int c,
                                                                     int len0, int len1, DType dt) {
    const char *base = rows->block[b];
    int j = 0;
    for (; j + 2 <= m; j += 2) {
        const v16 e0 = block_load(rows, base, b, j, c, len0, dt), o0 = block_load(rows, base, b, j + 1, c, len0, dt);
        const v16 e1 = block_load(rows, base, b, j, c + 16, len1, dt);
        const v16 o1 = block_load(rows, base, b, j + 1, c + 16, len1, dt);
        for (int h = 0; h < nh; h++) {
            const float *pb = p + (size_t)h * ld_p + j0;
            const v16 p_even = v16_set1(pb[j]), p_odd = v16_set1(pb[j + 1]);
            even0[h] = v16_fma(p_even, e0, even0[h]);
            odd0[h] = v16_fma(p_odd, o0, odd0[h]);
            even1[h] = v16_fma(p_even, e1, even1[h]);
            odd1[h] = v16_fma(p_odd, o1, odd1[h]);
        }
    }
    if (j < m) { /* an odd last row: only in the last block */
        const v16 e0 = block_load(rows, base, b, j, c, len0, dt), e1 = block_load(rows, base, b, j, c + 16, len1, dt);
        for (int h = 0; h < nh; h++) {
            const v16 p_last = v16_set1(p[(size_t)h * ld_p + j0 + j]);
            even0[h] = v16_fma(p_last, e0, even0[h]);
            even1[h] = v16_fma(p_last, e1, even1[h]);
        }
    }
}

/* Heads h0 .. h0+nh-1 over columns [c, c + 32) (two slices, each with two chains) of group
 * g's blocks [b0, b1): each row's columns are loaded once for the nh heads (nh a constant,
 * 1, 2 or 4). The chains start from zero at the first block, else from `carry`, and go back
 * to it (head h's four at carry + 4h), or after the last block into out. */
static inline __attribute__((always_inline)) void weighted_sum_pass(float *out, size_t ld_out, const float *p,
                                                                    size_t ld_p, const int nh, const RowBlocks *rows,
                                                                    int g, int b0, int b1, int n, int c, int width,
                                                                    DType dt, int prefetch, v16 *carry) {
    const int len0 = slice_len(width, c), len1 = slice_len(width, c + 16); /* len1 may be 0 */
    const int nb = blocks_of(rows, n);
    v16 even0[4], odd0[4], even1[4], odd1[4];
    for (int h = 0; h < nh; h++) {
        const v16 *from = carry + 4 * h;
        const int fresh = b0 == 0;
        even0[h] = fresh ? v16_zero() : from[0], odd0[h] = fresh ? v16_zero() : from[1];
        even1[h] = fresh ? v16_zero() : from[2], odd1[h] = fresh ? v16_zero() : from[3];
    }
    for (int b = b0; b < b1; b++) { /* blocks start at even j */
        const int j0 = b * rows->block_rows, m = rows_in_block(rows, b, n);
        if (prefetch) prefetch_next(rows, g, b, nb, n, b1 - b0 == 1, 1);
        if (dt != DTYPE_F32 && rows->last_f32 && j0 + m == n)
            weighted_sum_block(even0, odd0, even1, odd1, p, ld_p, nh, rows, g * nb + b, j0, m, c, len0, len1,
                               DTYPE_F32);
        else
            weighted_sum_block(even0, odd0, even1, odd1, p, ld_p, nh, rows, g * nb + b, j0, m, c, len0, len1, dt);
    }
    for (int h = 0; h < nh; h++) {
        if (b1 < nb) {
            v16 *to = carry + 4 * h;
            to[0] = even0[h], to[1] = odd0[h], to[2] = even1[h], to[3] = odd1[h];
            continue;
        }
        float *o = out + (size_t)h * ld_out;
        v16_store(o + c, v16_add(even0[h], odd0[h]), len0);
        if (len1) v16_store(o + c + 16, v16_add(even1[h], odd1[h]), len1);
    }
}

/* Chains of the heads of several groups (4 a head and column pass) weighted_sum_typed keeps
 * between blocks. */
enum { CARRY_CHAINS = 512 };

/* Heads four (then two) at a time where 32 registers hold their 16 chains and the rows' 4
 * vectors (AVX-512), so each row is loaded once for all of them; every head reads a column
 * pass's rows while they are in L1. Several groups take each block in turn, their chains
 * carried between blocks (the same chains, so the same bits), unless too many to carry:
 * then each group takes all its blocks in turn. */
static inline __attribute__((always_inline)) void weighted_sum_typed(float *out, size_t ld_out, const float *p,
                                                                     size_t ld_p, int n_heads, const RowBlocks *rows,
                                                                     int n, int width, DType dt) {
    const int groups = rows->groups, gh = n_heads / groups, nb = blocks_of(rows, n), passes = (width + 31) / 32;
    const int by_block = groups > 1 && n_heads * passes * 4 <= CARRY_CHAINS;
    v16 carry[CARRY_CHAINS];
    for (int b0 = 0; b0 < (by_block ? nb : 1); b0++) {
        const int b1 = by_block ? b0 + 1 : nb;
        for (int g = 0; g < groups; g++)
            for (int c = 0; c < width; c += 32) {
                float *o = out + (size_t)g * gh * ld_out;
                const float *pg = p + (size_t)g * gh * ld_p;
                v16 *cg = carry + (size_t)(g * passes + c / 32) * gh * 4;
                int h = 0;
#if ISA_AVX512
                for (; h + 4 <= gh; h += 4)
                    weighted_sum_pass(o + (size_t)h * ld_out, ld_out, pg + (size_t)h * ld_p, ld_p, 4, rows, g, b0, b1,
                                      n, c, width, dt, c == 0 && h == 0, cg + 4 * h);
                for (; h + 2 <= gh; h += 2)
                    weighted_sum_pass(o + (size_t)h * ld_out, ld_out, pg + (size_t)h * ld_p, ld_p, 2, rows, g, b0, b1,
                                      n, c, width, dt, c == 0 && h == 0, cg + 4 * h);
#endif
                for (; h < gh; h++)
                    weighted_sum_pass(o + (size_t)h * ld_out, ld_out, pg + (size_t)h * ld_p, ld_p, 1, rows, g, b0, b1,
                                      n, c, width, dt, c == 0 && h == 0, cg + 4 * h);
            }
    }
}

void weighted_sum_row_blocks(float *out, size_t ld_out, const float *p, size_t ld_p, int n_heads, RowBlocks rows, int n,
                             int width) {
    switch (rows.dtype) {
    case DTYPE_F32: weighted_sum_typed(out, ld_out, p, ld_p, n_heads, &rows, n, width, DTYPE_F32); break;
    case DTYPE_BF16: weighted_sum_typed(out, ld_out, p, ld_p, n_heads, &rows, n, width, DTYPE_BF16); break;
    case DTYPE_I8: weighted_sum_typed(out, ld_out, p, ld_p, n_heads, &rows, n, width, DTYPE_I8); break;
    case DTYPE_F8: weighted_sum_typed(out, ld_out, p, ld_p, n_heads, &rows, n, width, DTYPE_F8); break;
    case DTYPE_I4: weighted_sum_typed(out, ld_out, p, ld_p, n_heads, &rows, n, width, DTYPE_I4); break;
    case DTYPE_I2: weighted_sum_typed(out, ld_out, p, ld_p, n_heads, &rows, n, width, DTYPE_I2); break;
    }
}

/* ---- KIVI's packed groups (kernels.h) ---- */

/* The bf16 nearest x from above (up) or below: truncation moves toward zero, so one more
 * step of magnitude where that went the wrong way; never past the largest finite bf16. */
static bf16 bf16_toward(float x, int up) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    bf16 t = (bf16)(u >> 16);
    if ((u & 0xFFFFu) && up != (int)(u >> 31)) t++;
    return (t & 0x7FFFu) == 0x7F80u ? (bf16)(t - 1) : t;
}

size_t packed_group_bytes(int width, DType dt, int per_channel) {
    const size_t codes = (size_t)PACK_ROWS * width * dtype_bits(dt) / 8;
    const int groups = (width + PACK_VALUE_GROUP - 1) / PACK_VALUE_GROUP;
    return codes + (per_channel ? 2 * (size_t)width : 2 * (size_t)PACK_ROWS * groups) * sizeof(bf16);
}

/* One group's n values (x[i * step]) into codes (code i at code_at(i)), its scale and min. */
static void quantize_group(unsigned char *codes, const size_t *at, int shift_of[], bf16 *scale, bf16 *min,
                           const float *x, size_t step, int n, int levels) {
    float lo = INFINITY, hi = -INFINITY;
    int finite = 1;
    for (int i = 0; i < n; i++) {
        const float v = x[(size_t)i * step];
        if (!isfinite(v)) finite = 0;
        lo = fminf(lo, v), hi = fmaxf(hi, v);
    }
    if (!finite) {
        *scale = *min = 0x7FC0; /* NaN: the group reads back as NaN */
        for (int i = 0; i < n; i++) codes[at[i]] &= (unsigned char)~(levels << shift_of[i]);
        return;
    }
    *min = bf16_toward(lo, 0);
    const float m = bf16_to_f32(*min);
    bf16 s = bf16_toward(hi / (float)levels - m / (float)levels, 1); /* (hi - m) / levels, without overflow */
    while (s < 0x7F7Fu && fmaf((float)levels, bf16_to_f32(s), m) < hi) s++;
    *scale = s;
    const float sf = bf16_to_f32(s);
    for (int i = 0; i < n; i++) {
        const float v =
            sf > 0.0f ? fminf((float)levels, fmaxf(0.0f, nearbyintf((x[(size_t)i * step] - m) / sf))) : 0.0f;
        codes[at[i]] = (unsigned char)((codes[at[i]] & ~(levels << shift_of[i])) | ((unsigned)v << shift_of[i]));
    }
}

/* Where element (j, c)'s code lives: its byte and its shift (kernels.h's layout). */
static void code_place(int j, int c, int width, int bits, size_t *byte, int *shift) {
    const int per_slice = 2 * bits, lane = c % 16;
    *byte = ((size_t)j * width + (size_t)(c - lane)) * bits / 8 + (size_t)(lane % per_slice);
    *shift = lane / per_slice * bits;
}

void block_quantize(void *group, const float *rows, size_t stride, int width, DType dt, int per_channel) {
    const int bits = dtype_bits(dt), levels = (1 << bits) - 1;
    unsigned char *codes = group;
    bf16 *params = (bf16 *)(codes + (size_t)PACK_ROWS * width * bits / 8);
    size_t at[PACK_VALUE_GROUP > PACK_ROWS ? PACK_VALUE_GROUP : PACK_ROWS];
    int shift[PACK_VALUE_GROUP > PACK_ROWS ? PACK_VALUE_GROUP : PACK_ROWS];
    if (per_channel) {
        for (int c = 0; c < width; c++) {
            for (int j = 0; j < PACK_ROWS; j++) code_place(j, c, width, bits, &at[j], &shift[j]);
            quantize_group(codes, at, shift, &params[c], &params[width + c], rows + c, stride, PACK_ROWS, levels);
        }
        return;
    }
    const int groups = (width + PACK_VALUE_GROUP - 1) / PACK_VALUE_GROUP;
    for (int j = 0; j < PACK_ROWS; j++)
        for (int g = 0; g < groups; g++) {
            const int c0 = g * PACK_VALUE_GROUP, n = width - c0 < PACK_VALUE_GROUP ? width - c0 : PACK_VALUE_GROUP;
            for (int i = 0; i < n; i++) code_place(j, c0 + i, width, bits, &at[i], &shift[i]);
            quantize_group(codes, at, shift, &params[j * groups + g], &params[PACK_ROWS * groups + j * groups + g],
                           rows + (size_t)j * stride + c0, 1, n, levels);
        }
}

void block_dequantize_row(float *dst, const void *group, int j, int width, DType dt, int per_channel) {
    const int bits = dtype_bits(dt), levels = (1 << bits) - 1;
    const unsigned char *codes = group;
    const bf16 *params = (const bf16 *)(codes + (size_t)PACK_ROWS * width * bits / 8);
    const int groups = (width + PACK_VALUE_GROUP - 1) / PACK_VALUE_GROUP;
    for (int c = 0; c < width; c++) {
        size_t byte;
        int shift;
        code_place(j, c, width, bits, &byte, &shift);
        const float code = (float)((codes[byte] >> shift) & levels);
        const int k = j * groups + c / PACK_VALUE_GROUP;
        const bf16 scale = per_channel ? params[c] : params[k],
                   min = per_channel ? params[width + c] : params[PACK_ROWS * groups + k];
        dst[c] = fmaf(code, bf16_to_f32(scale), bf16_to_f32(min));
    }
}

/* round to nearest even, as torch's bf16 conversion; NaN stays NaN */
static bf16 f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return (bf16)((u >> 16) | 0x40);
    return (bf16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* |y| <= 448 to the nearest e4m3 code, ties to even: codes are ordered like the values
 * they stand for, so a step past a mantissa's end carries into the exponent. */
static uint8_t f32_to_e4m3(float y) {
    const float a = fabsf(y);
    int e;
    frexpf(a, &e); /* a = f * 2^e, f in [0.5, 1) */
    unsigned code;
    if (a < 0x1p-6f) /* subnormal: steps of 2^-9 */
        code = (unsigned)nearbyintf(a * 0x1p9f);
    else /* 8 .. 16 steps of 2^(e - 4) in [2^(e-1), 2^e) */
        code = (unsigned)(e + 6) * 8 + (unsigned)nearbyintf(ldexpf(a, 4 - e)) - 8;
    if (code > 126) code = 126;
    return (uint8_t)(code | (y < 0 ? 0x80u : 0u));
}

static void quantize_part(void *dst, float *scale, const float *src, int n, DType dtype) {
    float max = 0.0f;
    int finite = 1;
    for (int i = 0; i < n; i++) {
        const float a = fabsf(src[i]);
        if (!isfinite(src[i]))
            finite = 0;
        else if (a > max)
            max = a;
    }
    const float top = dtype == DTYPE_F8 ? 448.0f : 127.0f;
    *scale = !finite ? NAN : max / top;
    for (int i = 0; i < n; i++) {
        const float y = *scale > 0.0f ? fmaxf(-top, fminf(top, src[i] / *scale)) : 0.0f;
        if (dtype == DTYPE_F8)
            ((uint8_t *)dst)[i] = f32_to_e4m3(y);
        else
            ((int8_t *)dst)[i] = (int8_t)nearbyintf(y);
    }
}

void row_quantize(void *dst, float *scales, const float *src, int n, int split, DType dtype) {
    if (dtype == DTYPE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == DTYPE_BF16) {
        for (int i = 0; i < n; i++) ((bf16 *)dst)[i] = f32_to_bf16(src[i]);
    } else {
        quantize_part(dst, &scales[0], src, split, dtype);
        if (split < n) quantize_part((int8_t *)dst + split, &scales[1], src + split, n - split, dtype);
    }
}

void row_dequantize(float *dst, const void *row, const float *scales, int n, int split, DType dtype) {
    for (int c = 0; c < n; c += 16) {
        const int len = n - c < 16 ? n - c : 16;
        v16_store(dst + c, row_load(row, scales, c, len, dtype, split), len);
    }
}

void weighted_sum_rows(float *out, const float *p, const float *rows, size_t stride, int n, int width) {
    const void *one[1] = {rows};
    const RowBlocks all = {one, NULL, n + n % 2, stride, DTYPE_F32, 0, 0, 0, 0, 1, 0}; /* one block holding every row */
    weighted_sum_typed(out, 0, p, 0, 1, &all, n, width, DTYPE_F32);
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
 * A tile is one row group (RB = MAT_GROUP_ROWS weight rows) x up to TB tokens, RB*TB
 * accumulators of 16 lanes. Each accumulator is one output's dot product in the
 * canonical order, whatever the tile shape: the blocking changes which outputs are
 * computed together, never the order inside one. The group's weights are read as one
 * ascending stream (the packed layout of kernels.h).
 * In a full bf16 chunk, each 16 columns of the TB tokens are loaded into registers once
 * and serve all RB rows, so every FMA is register to register. An accumulator is
 * SIMD_PARTS registers (simd.h). With 32 registers (AVX-512) an 8x3 tile holds 24
 * accumulators, 3 token registers and one weight register, and one pass computes
 * everything, and a token's 8 outputs are reduced side by side (v16_reduce8_store), since
 * reducing them one at a time costs a large share of the kernel. With 16 (AVX2: two parts per
 * accumulator) a tile's accumulators would not fit; there, a 4x3 tile computes one part
 * of its accumulators per pass over the group, which stays in L1 between the passes,
 * and a 4x1 tile (decode) both parts in one pass, for 8 independent chains.
 * Where many tokens pass over a group held in L1 (a batched step, a prompt), AVX-512
 * takes wide tiles of 4 to 6 tokens first (tile_wide) on Intel's processors
 * (wide_tiles): there the 8x3 tile spends one of its two vector ports' slots on
 * widening for every 3 FMAs, a wide tile one for every 6. */
#define RB MAT_GROUP_ROWS
#define TB 3
_Static_assert(TB == 3, "tile_any has one case per token count, 1 to TB");
_Static_assert(MAT_CHUNK_BYTES == 64, "a full bf16 chunk is 16 pairs, a full fp32 chunk 16 columns");

/* How far ahead of the chunk in use tile_pass prefetches the weights (the stream is one
 * matrix's packed groups, in order; a prefetch past its end never faults): where a matmul
 * streams its weights from L3 or DRAM (a cached decode step, the prompt), the hardware
 * prefetchers alone fall well short of a streaming read (docs/PERFORMANCE.md). */
enum { PREFETCH_BYTES = 8192 };

/* acc[t][slot] += w * x[t0 + t][col .. col + n) for the tile's tokens: one weight register
 * of one row, used nt times (n < VP_LANES: the rest of x loads as 0) */
static inline __attribute__((always_inline)) void row_fma(vp acc[TB][SIMD_PARTS], vp w, const float *x, int ldx, int t0,
                                                          int col, int n, const int nt, const int slot) {
    for (int t = 0; t < nt; t++)
        acc[t][slot] = vp_fma(w, vp_load_f32(x + (size_t)(t0 + t) * ldx + col, n), acc[t][slot]);
}

/* One pass over the group for parts p0 .. p0+np-1 of the tile's accumulators (acc[r][t][p - p0]).
 * One weight register is live at a time, so a 4x3 tile fits AVX2's 16 registers. */
static inline __attribute__((always_inline)) void tile_pass(vp acc[RB][TB][SIMD_PARTS], const Mat *w, int r0,
                                                            const float *x, int ldx, int t0, const int nr, const int nt,
                                                            const int p0, const int np) {
    const int n = w->cols;
    const DType dt = w->dtype;
    const size_t es = dtype_size(dt);
    const char *group = (const char *)w->data + (size_t)r0 * (size_t)n * es; /* this group: nr rows, packed */
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++)
            for (int p = 0; p < np; p++) acc[r][t][p] = vp_zero();
    int k = 0;
    if (chunks_paired(dt, w->rows))
        for (; k + 32 <= n; k += 32) { /* a full bf16 chunk: nr rows x 16 pairs (c, c + 16) */
            const bf16 *chunk = (const bf16 *)group + (size_t)k * (size_t)nr;
            if (p0 == 0) /* once per tile: AVX2 passes over the group once per part */
                for (int r = 0; r < nr; r++) __builtin_prefetch((const char *)(chunk + 32 * r) + PREFETCH_BYTES, 0, 3);
            for (int half = 0; half < 2; half++) /* columns c = k + 16*half + p*VP_LANES + l */
                for (int p = p0; p < p0 + np; p++) {
                    vp xv[TB]; /* these columns of the tile's tokens, for all nr rows */
                    for (int t = 0; t < nt; t++)
                        xv[t] = vp_load_f32(x + (size_t)(t0 + t) * ldx + k + 16 * half + p * VP_LANES, VP_LANES);
                    for (int r = 0; r < nr; r++) {
                        const vpairs pairs = vp_load_pairs(chunk + 32 * r + 2 * VP_LANES * p);
                        const vp wv = half ? vp_pairs_second(pairs) : vp_pairs_first(pairs);
                        for (int t = 0; t < nt; t++) acc[r][t][p - p0] = vp_fma(wv, xv[t], acc[r][t][p - p0]);
                    }
                }
        }
    for (const int cc = mat_chunk_cols(dt); k < n; k += cc) { /* plain chunks: nr rows x cw */
        const int cw = chunk_width(n, k, cc);
        const char *chunk = group + (size_t)k * (size_t)nr * es;
        for (int i = 0; i < cw; i += 16)
            for (int r = 0; r < nr; r++)
                for (int p = p0; p < p0 + np; p++) {
                    /* columns c = k + i + p*VP_LANES + l, l < left; missing ones load as 0 and add 0*0 */
                    const int col = i + p * VP_LANES, left = (cw - i < 16 ? cw - i : 16) - p * VP_LANES;
                    const char *run = chunk + ((size_t)r * (size_t)cw + (size_t)col) * es;
                    vp wv = dt == DTYPE_BF16 ? vp_load_bf16((const bf16 *)run, left)
                                             : vp_load_f32((const float *)run, left);
                    row_fma(acc[r], wv, x, ldx, t0, k + col, left, nt, p - p0);
                }
    }
}

static inline __attribute__((always_inline)) void tile(float *out, int ldo, const float *x, int ldx, const Mat *w,
                                                       int r0, int t0, const int nr, const int nt) {
    vp acc[RB][TB][SIMD_PARTS], parts[RB][TB][SIMD_PARTS];
    if (nt == 1 || SIMD_PARTS == 1) {
        tile_pass(parts, w, r0, x, ldx, t0, nr, nt, 0, SIMD_PARTS);
    } else {
        for (int p = 0; p < SIMD_PARTS; p++) {
            tile_pass(acc, w, r0, x, ldx, t0, nr, nt, p, 1);
            for (int r = 0; r < nr; r++)
                for (int t = 0; t < nt; t++) parts[r][t][p] = acc[r][t][0];
        }
    }
    if (nr == 8) { /* a full AVX-512 group: a token's 8 outputs are adjacent, reduced side by side */
        for (int t = 0; t < nt; t++) {
            v16 a[8];
            for (int r = 0; r < 8; r++) a[r] = v16_from_parts(parts[r][t]);
            v16_reduce8_store(out + (size_t)(t0 + t) * ldo + r0, a);
        }
        return;
    }
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++) out[(size_t)(t0 + t) * ldo + r0 + r] = v16_reduce(v16_from_parts(parts[r][t]));
}

#if ISA_AVX512
/* A wide tile (AVX-512): a full group of full bf16 chunks x TW tokens, in two passes of
 * RW rows. Each widened weight serves TW tokens rather than TB, so fewer of the two vector
 * ports' slots go to widening; each token's 16 columns are loaded once for RW rows, and
 * the TW tokens' x stays in L1 for the second pass. Each output's order is tile_pass's. */
enum { TW = 6, RW = 4 };
_Static_assert(RB == 2 * RW && TW == 6 && TB == 3,
               "two passes of a 4x6 tile cover a group; tile_wide_any: 4 to 6 tokens");

static inline __attribute__((always_inline)) void tile_wide(float *out, int ldo, const float *x, int ldx, const Mat *w,
                                                            int r0, int t0, const int nt) {
    const int n = w->cols;
    const bf16 *group = (const bf16 *)w->data + (size_t)r0 * (size_t)n; /* 8 rows, packed */
    const float *xt = x + (size_t)t0 * ldx;
    for (int rr = 0; rr < RB; rr += RW) {
        vp acc[RW][TW];
        for (int r = 0; r < RW; r++)
            for (int t = 0; t < nt; t++) acc[r][t] = vp_zero();
        for (int k = 0; k < n; k += 32) { /* a full bf16 chunk: RW rows x 16 pairs (c, c + 16) */
            const bf16 *chunk = group + (size_t)k * RB + 32 * rr;
            if (t0 == 0) /* the group's first tokens: as in tile_pass, ahead of the stream */
                for (int r = 0; r < RW; r++) __builtin_prefetch((const char *)(chunk + 32 * r) + PREFETCH_BYTES, 0, 3);
            for (int half = 0; half < 2; half++) { /* each half loads the pairs again: registers are short */
                vp wv[RW];
                for (int r = 0; r < RW; r++) {
                    const vpairs pairs = vp_load_pairs(chunk + 32 * r);
                    wv[r] = half ? vp_pairs_second(pairs) : vp_pairs_first(pairs);
                }
                for (int t = 0; t < nt; t++) {
                    const vp xv = vp_load_f32(xt + (size_t)t * ldx + k + 16 * half, VP_LANES);
                    for (int r = 0; r < RW; r++) acc[r][t] = vp_fma(wv[r], xv, acc[r][t]);
                }
            }
        }
        for (int t = 0; t < nt; t += 2) { /* two tokens' RW outputs reduced side by side */
            v16 a[8];
            for (int i = 0; i < 8; i++) a[i] = t + i / RW < nt ? acc[i % RW][t + i / RW] : v16_zero();
            float sums[8];
            v16_reduce8_store(sums, a);
            for (int i = 0; i < 2 && t + i < nt; i++)
                memcpy(out + (size_t)(t0 + t + i) * ldo + r0 + rr, sums + i * RW, RW * sizeof(float));
        }
    }
}

/* A wide tile of nt tokens, TB < nt <= TW (fewer take tile_any's 8x3); one function per
 * nt, since GCC allocates a 6-token tile's 24 accumulators without a spill only alone. */
#define TILE_WIDE_NT(nt) \
    static __attribute__((noinline)) void tile_wide_##nt(float *out, int ldo, const float *x, int ldx, const Mat *w, \
                                                         int r0, int t0) { \
        tile_wide(out, ldo, x, ldx, w, r0, t0, nt); \
    }
TILE_WIDE_NT(6)
TILE_WIDE_NT(5)
TILE_WIDE_NT(4)
static void tile_wide_any(float *out, int ldo, const float *x, int ldx, const Mat *w, int r0, int t0, int nt) {
    (nt == 6 ? tile_wide_6 : nt == 5 ? tile_wide_5 : tile_wide_4)(out, ldo, x, ldx, w, r0, t0);
}

/* Wide tiles measured faster on an Intel AVX-512 core (Ice Lake), where widening a weight
 * seems to take the FMAs' ports, and slower on AMD's Zen 5 (docs/PERFORMANCE.md). Set
 * before main, while one thread runs. */
static int wide_tiles_on;
__attribute__((constructor)) static void pick_tiles(void) {
    __builtin_cpu_init();
    wide_tiles_on = !__builtin_cpu_is("amd");
}

/* Whether tile tl of w takes wide tiles: where they are on, a full group of full bf16
 * chunks only. */
static int wide_tiles(const Mat *w, int tl) {
    return wide_tiles_on && chunks_paired(w->dtype, w->rows) && w->cols % 32 == 0 && (tl + 1) * RB <= w->rows;
}
void matmul_set_wide_tiles(int on) { wide_tiles_on = on != 0; }
int matmul_wide_tiles(void) { return wide_tiles_on; }
#else
void matmul_set_wide_tiles(int on) { (void)on; }
int matmul_wide_tiles(void) { return 0; }
#endif
const char *matmul_tiles_name(void) { return matmul_wide_tiles() ? "4x6" : RB == 8 ? "8x3" : "4x3"; }

/* Tile tl (rows tl*RB ..) for the token block at t0 of T tokens. */
static void tile_any(float *out, int ldo, const float *x, int ldx, const Mat *w, int tl, int t0, int T) {
    const int r0 = tl * RB, nr = w->rows - r0 < RB ? w->rows - r0 : RB, nt = T - t0 < TB ? T - t0 : TB;
    if (nr == RB) {
        switch (nt) { /* nt <= TB = 3 */
        case 3: tile(out, ldo, x, ldx, w, r0, t0, RB, 3); return;
        case 2: tile(out, ldo, x, ldx, w, r0, t0, RB, 2); return;
        default: tile(out, ldo, x, ldx, w, r0, t0, RB, 1); return;
        }
    }
    tile(out, ldo, x, ldx, w, r0, t0, nr, nt); /* the last, shorter group of a matrix */
}

/* Tiles [tile_lo, tile_hi) of RB rows, tiles outside: a tile's RB weight rows stay in L1
 * while every token block passes, so w is read from memory once (for one block, decode or
 * a short prompt, as one unbroken stream). */
static void matmul_rows(float *out, int ldo, const float *x, int ldx, const Mat *w, int T, int tile_lo, int tile_hi) {
    for (int tl = tile_lo; tl < tile_hi; tl++) {
        int t0 = 0;
#if ISA_AVX512
        if (T > 2 * TB && wide_tiles(w, tl)) /* from two blocks' worth on, they pay */
            for (int nt; (nt = T - t0 < TW ? T - t0 : TW) > TB; t0 += nt)
                tile_wide_any(out, ldo, x, ldx, w, tl * RB, t0, nt);
#endif
        for (; t0 < T; t0 += TB) tile_any(out, ldo, x, ldx, w, tl, t0, T);
    }
}

/* Tiles [lo, hi) of the concatenation of the jobs' tile lists, cut at the products' edges;
 * tokens [t0, t_hi) of each job (up to its own T). */
static void jobs_tiles(const MatmulJob *jobs, int n_jobs, long lo, long hi, int t0, int t_hi) {
    long base = 0;
    for (int j = 0; j < n_jobs; j++) {
        const MatmulJob *jb = &jobs[j];
        long n = (jb->w.rows + RB - 1) / RB, a = lo > base ? lo : base, b = hi < base + n ? hi : base + n;
        const int t1 = t_hi < jb->T ? t_hi : jb->T;
        if (a < b && t0 < t1)
            matmul_rows(jb->out + (size_t)t0 * jb->ldo, jb->ldo, jb->x + (size_t)t0 * jb->ldx, jb->ldx, &jb->w, t1 - t0,
                        (int)(a - base), (int)(b - base));
        base += n;
    }
}

/* How a product is split over the threads.
 * One or two token blocks (decode, the prompt): by rows, a contiguous share of the tiles
 * per thread, so each thread streams its part of w from memory once.
 * More (a no-KV step): by tokens, every row for a contiguous share of the token blocks,
 * so a thread's part of x is half of x and stays in its L2, and is mostly written on the
 * same thread (residual_rmsnorm splits rows alike). matmul_swiglu stays by rows: by
 * tokens each thread would stream all of W1 and W3. Whether threads take over each
 * other's remaining tiles is parallel_mode's call. */
static int split_by_tokens(int T) { return T > 2 * TB; }

void matmul_jobs(Worker *wk, const MatmulJob *jobs, int n_jobs) {
    long tiles = 0, work = 0;
    int max_T = 0;
    for (int j = 0; j < n_jobs; j++) {
        tiles += (jobs[j].w.rows + RB - 1) / RB;
        work += (long)jobs[j].T * jobs[j].w.rows * jobs[j].w.cols;
        max_T = jobs[j].T > max_T ? jobs[j].T : max_T;
    }
    const int by_tokens = split_by_tokens(max_T);
    Share sh = share_begin(wk, tiles, by_tokens ? SHARE_EACH : SHARE_SPLIT, parallel_mode(work));
    for (long lo, hi; share_next(&sh, &lo, &hi);) {
        if (!by_tokens) {
            jobs_tiles(jobs, n_jobs, lo, hi, 0, max_T);
            continue;
        }
        long b_lo, b_hi; /* the part's token blocks (of the longest job) */
        parallel_share((max_T + TB - 1) / TB, sh.part, sh.parts, &b_lo, &b_hi);
        jobs_tiles(jobs, n_jobs, lo, hi, (int)b_lo * TB, (int)b_hi * TB);
    }
    share_end(&sh);
}

void matmul(Worker *wk, float *out, int ldo, const float *x, int ldx, Mat w, int T) {
    const MatmulJob job = {out, ldo, x, ldx, w, T};
    matmul_jobs(wk, &job, 1);
}

/* Items of matmul_swiglu: 2 row tiles, 16 rows, one vector of SwiGLU per token. */
enum { SWIGLU_ITEM_TILES = 2 };

void matmul_swiglu(Worker *wk, float *h1, float *h3, const float *x, int ldx, Mat w1, Mat w3, int T) {
    const int F = w1.rows;
    const long tiles = (F + RB - 1) / RB, items = (tiles + SWIGLU_ITEM_TILES - 1) / SWIGLU_ITEM_TILES;
    /* by rows for every T (split_by_tokens): a thread computes the same rows of both products
     * and applies SwiGLU to them, so no barrier separates the three */
    Share sh = share_begin(wk, items, SHARE_SPLIT, parallel_mode((long)T * w1.rows * w1.cols));
    for (long lo, hi; share_next(&sh, &lo, &hi);) {
        const long a = lo * SWIGLU_ITEM_TILES, b = hi * SWIGLU_ITEM_TILES < tiles ? hi * SWIGLU_ITEM_TILES : tiles;
        matmul_rows(h1, F, x, ldx, &w1, T, (int)a, (int)b);
        matmul_rows(h3, F, x, ldx, &w3, T, (int)a, (int)b);
        const int r_lo = (int)a * RB, r_hi = (int)b * RB < F ? (int)b * RB : F;
        for (int t = 0; r_lo < r_hi && t < T; t++)
            swiglu(h1 + (size_t)t * F + r_lo, h3 + (size_t)t * F + r_lo, r_hi - r_lo);
    }
    share_end(&sh);
}

/* ---- elementwise ---- */

void rmsnorm(float *out, const float *x, Mat w, int n, float eps) {
    float ss = dot(x, x, n) / (float)n + eps;
    float s = 1.0f / sqrtf(ss);
    for (int i = 0; i < n; i++) out[i] = mat_get(w, 0, i) * (x[i] * s);
}

void softmax(float *x, int n) {
    float max, sum;
    softmax_stats(x, n, &max, &sum);
}

void softmax_stats(float *x, int n, float *max_out, float *sum_out) {
    int full = n / 16 * 16, tail = n - full;
    float max = x[0];
    if (n >= 16) { /* max is exact in any order: the last 16 elements overlap the blocks */
        v16 m = v16_load_f32(x + n - 16, 16);
        for (int i = 0; i < full; i += 16) m = v16_max(m, v16_load_f32(x + i, 16));
        float lanes[16];
        v16_store(lanes, m, 16);
        for (int l = 0; l < 16; l++) max = lanes[l] > max ? lanes[l] : max;
    } else {
        for (int i = 1; i < n; i++) max = x[i] > max ? x[i] : max;
    }
    const v16 shift = v16_set1(-max), zero = v16_zero();
    v16 sum = v16_zero(); /* element i in lane i % 16, as in every canonical sum */
    for (int i = 0; i < full; i += 16) {
        v16 e = v16_exp_nonpositive(v16_add(v16_load_f32(x + i, 16), shift));
        v16_store(x + i, e, 16);
        sum = v16_add(sum, e);
    }
    v16 e_tail = zero; /* the tail stays in a register until its final store: a masked load
                         * cannot take its data from a masked store and waits until the store
                         * reaches L1 */
    if (tail) {        /* lanes past the end: e^min(0, -max) (min keeps a NaN), zeroed before the sum */
        e_tail = v16_first(v16_exp_nonpositive(v16_min(zero, v16_add(v16_load_f32(x + full, tail), shift))), tail);
        sum = v16_add(sum, e_tail);
    }
    const float total = v16_reduce(sum);
    const v16 inv = v16_set1(1.0f / total);
    for (int i = 0; i < full; i += 16) v16_store(x + i, v16_mul(v16_load_f32(x + i, 16), inv), 16);
    if (tail) v16_store(x + full, v16_mul(e_tail, inv), tail);
    *max_out = max;
    *sum_out = total;
}

/* e^x for x <= 0 by simd.h's polynomial, one lane of it: softmax's exp */
static float exp_nonpositive(float x) {
    float lanes[16];
    v16_store(lanes, v16_exp_nonpositive(v16_set1(x)), 16);
    return lanes[0];
}

void softmax_merge(float *out, float *max, float *sum, const float *out_c, float max_c, float sum_c, int width) {
    const float m = max_c > *max ? max_c : *max;
    const float a = *sum * exp_nonpositive(*max - m), b = sum_c * exp_nonpositive(max_c - m);
    const float total = a + b, wa = a / total, wb = b / total;
    const v16 va = v16_set1(wa), vb = v16_set1(wb);
    int d = 0;
    for (; d + 16 <= width; d += 16)
        v16_store(out + d, v16_add(v16_mul(va, v16_load_f32(out + d, 16)), v16_mul(vb, v16_load_f32(out_c + d, 16))),
                  16);
    for (; d < width; d++) out[d] = wa * out[d] + wb * out_c[d];
    *max = m;
    *sum = total;
}

/* silu(a) = a sigmoid(a), sigmoid(a) = e^min(a,0) / (1 + e^-|a|): both exponents <= 0 */
static inline v16 silu_times(v16 a, v16 b) {
    const v16 zero = v16_zero();
    v16 abs_a = v16_max(a, v16_mul(a, v16_set1(-1.0f)));
    v16 sigmoid = v16_div(v16_exp_nonpositive(v16_min(a, zero)),
                          v16_add(v16_set1(1.0f), v16_exp_nonpositive(v16_mul(abs_a, v16_set1(-1.0f)))));
    return v16_mul(v16_mul(a, sigmoid), b);
}

void swiglu(float *h1, const float *h3, int n) {
    for (int i = 0; i < n; i += 16)
        v16_store(h1 + i, silu_times(v16_load_f32(h1 + i, n - i), v16_load_f32(h3 + i, n - i)), n - i);
}

void mat_row_f32(float *out, Mat w, int r) {
    int cc = mat_chunk_cols(w.dtype);
    for (int c0 = 0; c0 < w.cols; c0 += cc) { /* the row's run of each chunk is contiguous */
        int cw = chunk_width(w.cols, c0, cc);
        size_t run = run_offset(w.rows, w.cols, r, c0, cw);
        for (int i = 0; i < cw; i++) out[c0 + i] = mat_elem(w, run + (size_t)chunk_position(w.dtype, w.rows, cw, i));
    }
}

#define HUGE_PAGE ((size_t)2 << 20)
void *alloc_huge(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, bytes >= HUGE_PAGE ? HUGE_PAGE : 64, bytes ? bytes : 1) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    if (bytes >= HUGE_PAGE)
        madvise(p, bytes / HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE); /* a hint; 4 KB pages still work */
#endif
    return p;
}

void *alloc_touched(size_t bytes) {
    void *p = alloc_huge(bytes ? bytes : 1);
    if (p) memset(p, 0, bytes ? bytes : 1); /* writes every page */
    return p;
}

float *alloc_floats_touched(size_t n) { return alloc_touched(n * sizeof(float)); }

/* An exponent of all ones, looked for a chunk at a time so that the test of a chunk
 * vectorizes; the bits are read with memcpy, which is how C lets a float be seen as bits. */
static int nonfinite_at(const unsigned char *p, size_t i, DType dt) {
    if (dt == DTYPE_BF16) {
        uint16_t u;
        memcpy(&u, p + 2 * i, sizeof u);
        return (u & 0x7F80u) == 0x7F80u;
    }
    uint32_t u;
    memcpy(&u, p + 4 * i, sizeof u);
    return (u & 0x7F800000u) == 0x7F800000u;
}

long first_nonfinite(const void *data, size_t n, DType dt) {
    enum { CHUNK = 1024 };
    const unsigned char *p = data;
    for (size_t lo = 0; lo < n; lo += CHUNK) {
        const size_t hi = n - lo < CHUNK ? n : lo + CHUNK;
        int any = 0;
        for (size_t i = lo; i < hi; i++) any |= nonfinite_at(p, i, dt);
        if (any)
            for (size_t i = lo; i < hi; i++)
                if (nonfinite_at(p, i, dt)) return (long)i;
    }
    return -1;
}
