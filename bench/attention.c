/* attention.c: the attention kernels alone (dot_row_blocks, weighted_sum_row_blocks), on
 * one item of a long-context decode step, in GFLOP/s, one thread.
 *
 *   build/attention_bench [--reps R] [--dram]
 *
 * An item is nh heads that read the same cache rows (a GQA group, MQA's or MLA's heads)
 * over one chunk of ATTN_CHUNK_KEYS = 256 keys kept in blocks of 16 bf16 rows, as the
 * paged pool keeps them: the scores (2 * nh * 256 * width FLOPs) and the weighted sum (the
 * same). The rows are in cache, as every head after an item's first reads them, so this is
 * the kernels' arithmetic rate; compare with roofline's peak_best_GFLOPs / threads. Best
 * and median of R timed calls (default 2000) after 100 untimed. --dram: the items of a
 * whole layer over about 1 GB of rows laid out as the pool lays them out, so they come
 * from DRAM (streamed, as a decode step's); the read rate, best of R sweeps; compare with
 * roofline's bandwidth at one thread. Beside it the same sweep's two bounds: the kernels
 * on one chunk's rows every time (in cache), and the rows read alone. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/kernels.h"
#include "kernels/simd.h"

enum { KEYS = 256, BLOCK_ROWS = 16 };

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One shape: nh heads of rows `width` wide. Prints best and median GFLOP/s of each kernel. */
static void run_shape(const char *name, int nh, int width, int reps) {
    const size_t block_elems = (size_t)BLOCK_ROWS * width;
    /* 64-byte aligned, as the pool's rows and the engine's scratch are */
    bf16 *rows = aligned_alloc(64, KEYS * (size_t)width * sizeof(bf16));
    float *q = aligned_alloc(64, (size_t)nh * width * sizeof(float));
    float *att = aligned_alloc(64, (size_t)nh * KEYS * sizeof(float));
    float *out = aligned_alloc(64, (size_t)nh * width * sizeof(float));
    double *t_dot = malloc((size_t)reps * sizeof(double)), *t_mix = malloc((size_t)reps * sizeof(double));
    const void *blocks[KEYS / BLOCK_ROWS];
    if (!rows || !q || !att || !out || !t_dot || !t_mix) {
        fprintf(stderr, "attention_bench: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < KEYS * (size_t)width; i++) rows[i] = (bf16)(0x3c00 + i % 512); /* small positive values */
    for (int i = 0; i < nh * width; i++) q[i] = 0.01f * (float)(i % 13);
    for (int b = 0; b < KEYS / BLOCK_ROWS; b++) blocks[b] = rows + (size_t)b * block_elems;
    const RowBlocks rb = {blocks, NULL, BLOCK_ROWS, (size_t)width, DTYPE_BF16, 0, 0, 0, 0, 1, 0};
    for (int r = -100; r < reps; r++) {
        const double t0 = now_s();
        dot_row_blocks(att, KEYS, q, (size_t)width, nh, rb, KEYS, width, 0.125f);
        const double t1 = now_s();
        for (int i = 0; i < nh * KEYS; i++) att[i] = 1.0f / KEYS; /* the probabilities' values do not matter */
        const double t2 = now_s();
        weighted_sum_row_blocks(out, (size_t)width, att, KEYS, nh, rb, KEYS, width);
        const double t3 = now_s();
        if (r >= 0) t_dot[r] = t1 - t0, t_mix[r] = t3 - t2;
    }
    qsort(t_dot, (size_t)reps, sizeof(double), by_value);
    qsort(t_mix, (size_t)reps, sizeof(double), by_value);
    const double flops = 2.0 * nh * KEYS * width;
    printf("%-22s heads %2d width %3d  scores %6.1f best %6.1f median GFLOP/s   weighted sum %6.1f best %6.1f median "
           "GFLOP/s  (check %g)\n",
           name, nh, width, flops / t_dot[0] * 1e-9, flops / t_dot[reps / 2] * 1e-9, flops / t_mix[0] * 1e-9,
           flops / t_mix[reps / 2] * 1e-9, (double)out[0]);
    free(rows), free(q), free(att), free(out), free(t_dot), free(t_mix);
}

/* The same kernels on rows that come from DRAM: the pool's layout for the twins' shapes (a
 * block holds 16 positions of every layer, each layer its KV heads' keys then values as
 * 2 KB runs), one layer's items over a pool of about 1 GB, then the next layer's, as a
 * decode step at a long context reads them, `groups` KV heads an item side by side (as a
 * decode step's MHA items take them). Prints the cache's read rate, and two bounds of the
 * same sweep: the kernels on one chunk's rows every time (in cache: their arithmetic) and
 * the rows read alone with plain loads (the read rate this layout allows one thread). A
 * sweep slower than the larger of the two does not overlap its reads with its arithmetic. */
enum { MAX_GROUPS = 32 };
typedef enum { SWEEP_KERNELS, SWEEP_IN_CACHE, SWEEP_READS } SweepKind;

typedef struct {
    int nh, kv_heads, groups, layers, width, value_width, rows_a_layer, chunks;
    size_t run, block; /* bytes of one row group's 16 rows, of a block */
    const char *pool;
    float *q, *att, *out;
} DramSweep;

/* Sum of every float of a run of `bytes`, in vector loads, the next run requested as it is read. */
static __attribute__((noinline)) float read_run(const char *run, const char *next, size_t bytes) {
    v16 acc = v16_zero();
    for (size_t i = 0; i < bytes; i += 64) {
        if (next) __builtin_prefetch(next + i, 0, 3);
        acc = v16_add(acc, v16_load_f32((const float *)(run + i), 16));
    }
    return v16_reduce(acc);
}

/* One sweep of every layer's items; the seconds of the scores with their softmax and of the
 * weighted sums into *scores_s and *mix_s. */
static double sweep(const DramSweep *d, SweepKind kind, double *scores_s, double *mix_s, float *check) {
    const int nb = KEYS / BLOCK_ROWS;
    const void *keys[MAX_GROUPS * KEYS / BLOCK_ROWS], *values[MAX_GROUPS * KEYS / BLOCK_ROWS];
    double ts = 0, tm = 0;
    float sum = 0;
    const double t0 = now_s();
    for (int l = 0; l < d->layers; l++)
        for (int g0 = 0; g0 < (d->kv_heads ? d->kv_heads : 1); g0 += d->groups)
            for (int c = 0; c < d->chunks; c++) {
                const int from = kind == SWEEP_IN_CACHE ? 0 : c;
                for (int g = 0; g < d->groups; g++)
                    for (int b = 0; b < nb; b++) {
                        const char *base =
                            d->pool + ((size_t)from * nb + b) * d->block + (size_t)l * d->rows_a_layer * d->run;
                        keys[g * nb + b] = base + (size_t)(g0 + g) * d->run;
                        values[g * nb + b] = base + (size_t)(d->kv_heads + g0 + g) * d->run;
                    }
                const double a = now_s();
                if (kind == SWEEP_READS) {
                    const int n = d->groups * nb;
                    for (int i = 0; i < n; i++) sum += read_run(keys[i], i + 1 < n ? keys[i + 1] : values[0], d->run);
                    if (d->kv_heads)
                        for (int i = 0; i < n; i++)
                            sum += read_run(values[i], i + 1 < n ? values[i + 1] : NULL, d->run);
                    ts += now_s() - a;
                    continue;
                }
                const RowBlocks kb = {keys, NULL, BLOCK_ROWS, (size_t)d->width, DTYPE_BF16, 0, 0, 0, 0, d->groups, 1};
                const RowBlocks vb = {values, NULL, BLOCK_ROWS, (size_t)d->width, DTYPE_BF16, 0, 0, 0, 0, d->groups, 1};
                dot_row_blocks(d->att, KEYS, d->q, (size_t)d->width, d->groups * d->nh, kb, KEYS, d->width, 0.125f);
                for (int h = 0; h < d->groups * d->nh; h++) {
                    float m, s;
                    softmax_stats(d->att + (size_t)h * KEYS, KEYS, &m, &s);
                }
                const double b2 = now_s();
                weighted_sum_row_blocks(d->out, (size_t)d->width, d->att, KEYS, d->groups * d->nh, vb, KEYS,
                                        d->value_width);
                ts += b2 - a, tm += now_s() - b2;
            }
    *scores_s = ts, *mix_s = tm;
    *check = kind == SWEEP_READS ? sum : d->out[0];
    return now_s() - t0;
}

static void run_dram(const char *name, int nh, int kv_heads, int groups, int layers, int width, int reps) {
    /* kv_heads 0: MLA's latent rows, read by the scores (width) and the weighted sum (width - 32) */
    DramSweep d = {.nh = nh,
                   .kv_heads = kv_heads,
                   .groups = groups,
                   .layers = layers,
                   .width = width,
                   .value_width = kv_heads ? width : width - 32,
                   .rows_a_layer = kv_heads ? 2 * kv_heads : 1};
    d.run = (size_t)BLOCK_ROWS * width * sizeof(bf16), d.block = (size_t)layers * d.rows_a_layer * d.run;
    d.chunks = (int)((1u << 30) / (d.block * (KEYS / BLOCK_ROWS)));
    const size_t pool_bytes = (size_t)d.chunks * (KEYS / BLOCK_ROWS) * d.block;
    char *pool = alloc_huge(pool_bytes);
    d.pool = pool;
    d.q = aligned_alloc(64, (size_t)groups * nh * width * sizeof(float));
    d.att = aligned_alloc(64, (size_t)groups * nh * KEYS * sizeof(float));
    d.out = aligned_alloc(64, (size_t)groups * nh * width * sizeof(float));
    if (!pool || !d.q || !d.att || !d.out) {
        fprintf(stderr, "attention_bench: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < pool_bytes / 2; i++) ((bf16 *)pool)[i] = (bf16)(0x3c00 + i % 512);
    for (int i = 0; i < groups * nh * width; i++) d.q[i] = 0.01f * (float)(i % 13);
    /* best of reps for each kind, the kinds taken in turn in every round */
    double best[3] = {1e30, 1e30, 1e30}, scores[3] = {0}, mix[3] = {0};
    float check[3] = {0};
    for (int r = 0; r < reps; r++)
        for (int k = 0; k < 3; k++) {
            double ts, tm;
            const double t = sweep(&d, (SweepKind)k, &ts, &tm, &check[k]);
            if (t < best[k]) best[k] = t, scores[k] = ts, mix[k] = tm;
        }
    const double bytes = (double)pool_bytes;
    printf("%-22s heads %2d from DRAM: %.1f ms a sweep of %.0f MB, %.1f GB/s (scores+softmax %.1f ms, weighted sum "
           "%.1f ms)  (check %g)\n",
           name, nh, best[0] * 1e3, bytes * 1e-6, bytes / best[0] * 1e-9, scores[0] * 1e3, mix[0] * 1e3,
           (double)check[0]);
    printf("%-22s   in cache (one chunk's rows): %.1f ms (%.1f, %.1f); reads alone: %.1f ms, %.1f GB/s  (check %g)\n",
           "", best[1] * 1e3, scores[1] * 1e3, mix[1] * 1e3, best[2] * 1e3, bytes / best[2] * 1e-9, (double)check[2]);
    free(pool), free(d.q), free(d.att), free(d.out);
}

int main(int argc, char **argv) {
    int reps = 2000, dram = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc && atoi(argv[i + 1]) > 0) {
            reps = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--dram") == 0) {
            dram = 1;
        } else {
            fprintf(stderr, "usage: build/attention_bench [--reps R] [--dram]\n");
            return 2;
        }
    }
    if (dram) {
        run_dram("MHA twin (1 head)", 1, 32, 1, 22, 64, reps);
        run_dram("MHA twin (32 KV heads)", 1, 32, 32, 22, 64, reps);
        run_dram("GQA twin (group of 8)", 8, 4, 1, 22, 64, reps);
        run_dram("GQA twin (4 groups)", 8, 4, 4, 22, 64, reps);
        run_dram("MQA twin (32 heads)", 32, 1, 1, 22, 64, reps);
        run_dram("MLA twin (32 heads)", 32, 0, 1, 22, 288, reps);
        return 0;
    }
    /* the ~1B twins of bench/scale.py at batch 1 (head_dim 64; MLA's latent 256 + RoPE key 32),
     * each item as a decode step takes it: a GQA group, or MQA's and MLA's 32 heads */
    run_shape("MHA twin (1 head)", 1, 64, reps);
    run_shape("GQA twin (group of 8)", 8, 64, reps);
    run_shape("MQA twin (32 heads)", 32, 64, reps);
    run_shape("MLA twin, scores", 32, 288, reps);
    run_shape("MLA twin, latent", 32, 256, reps);
    return 0;
}
