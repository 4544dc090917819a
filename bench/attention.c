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
 * roofline's bandwidth at one thread. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/kernels.h"

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
 * decode step's MHA items take them). Prints the cache's read rate. */
enum { MAX_GROUPS = 32 };
static void run_dram(const char *name, int nh, int kv_heads, int groups, int layers, int width, int reps) {
    /* kv_heads 0: MLA's latent rows, read by the scores (width) and the weighted sum (width - 32) */
    const int rows_a_layer = kv_heads ? 2 * kv_heads : 1, value_width = kv_heads ? width : width - 32;
    const size_t run = (size_t)BLOCK_ROWS * width * sizeof(bf16), block = (size_t)layers * rows_a_layer * run;
    const int chunks = (int)((1u << 30) / (block * (KEYS / BLOCK_ROWS)));
    char *pool = alloc_huge((size_t)chunks * (KEYS / BLOCK_ROWS) * block);
    float *q = aligned_alloc(64, (size_t)groups * nh * width * sizeof(float));
    float *att = aligned_alloc(64, (size_t)groups * nh * KEYS * sizeof(float));
    float *out = aligned_alloc(64, (size_t)groups * nh * width * sizeof(float));
    if (!pool || !q || !att || !out) {
        fprintf(stderr, "attention_bench: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < (size_t)chunks * (KEYS / BLOCK_ROWS) * block / 2; i++)
        ((bf16 *)pool)[i] = (bf16)(0x3c00 + i % 512);
    for (int i = 0; i < groups * nh * width; i++) q[i] = 0.01f * (float)(i % 13);
    const void *keys[MAX_GROUPS * KEYS / BLOCK_ROWS], *values[MAX_GROUPS * KEYS / BLOCK_ROWS];
    double best = 1e30, t_scores = 0, t_mix = 0;
    for (int r = 0; r < reps; r++) {
        double ts = 0, tm = 0;
        const double t0 = now_s();
        for (int l = 0; l < layers; l++)
            for (int g0 = 0; g0 < (kv_heads ? kv_heads : 1); g0 += groups)
                for (int c = 0; c < chunks; c++) {
                    for (int g = 0; g < groups; g++)
                        for (int b = 0; b < KEYS / BLOCK_ROWS; b++) {
                            const char *base =
                                pool + ((size_t)c * (KEYS / BLOCK_ROWS) + b) * block + (size_t)l * rows_a_layer * run;
                            keys[g * KEYS / BLOCK_ROWS + b] = base + (size_t)(g0 + g) * run;
                            values[g * KEYS / BLOCK_ROWS + b] = base + (size_t)(kv_heads + g0 + g) * run;
                        }
                    const RowBlocks kb = {keys, NULL, BLOCK_ROWS, (size_t)width, DTYPE_BF16, 0, 0, 0, 0, groups, 1};
                    const RowBlocks vb = {values, NULL, BLOCK_ROWS, (size_t)width, DTYPE_BF16, 0, 0, 0, 0, groups, 1};
                    const double a = now_s();
                    dot_row_blocks(att, KEYS, q, (size_t)width, groups * nh, kb, KEYS, width, 0.125f);
                    for (int h = 0; h < groups * nh; h++) {
                        float m, s;
                        softmax_stats(att + (size_t)h * KEYS, KEYS, &m, &s);
                    }
                    const double b2 = now_s();
                    weighted_sum_row_blocks(out, (size_t)width, att, KEYS, groups * nh, vb, KEYS, value_width);
                    ts += b2 - a, tm += now_s() - b2;
                }
        const double t = now_s() - t0;
        if (t < best) best = t, t_scores = ts, t_mix = tm;
    }
    const double bytes = (double)chunks * (KEYS / BLOCK_ROWS) * block;
    printf("%-22s heads %2d from DRAM: %.1f ms a sweep of %.0f MB, %.1f GB/s (scores+softmax %.1f ms, weighted sum "
           "%.1f ms)  (check %g)\n",
           name, nh, best * 1e3, bytes * 1e-6, bytes / best * 1e-9, t_scores * 1e3, t_mix * 1e3, (double)out[0]);
    free(pool), free(q), free(att), free(out);
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
