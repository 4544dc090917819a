/* matmul.c: the engine's matmul alone, on the model's weight shapes, in GFLOP/s.
 *
 *   build/matmul_bench [--threads N] [--reps R] [--tiles 8x3|wide]
 *
 * For each shape (rows x cols of a bf16 weight, packed as the loader packs it) and token
 * count T: best and median of R timed calls (default 30) after one untimed call, with the
 * weights and activations already in cache, as they are inside a no-KV step. T = 1 is a
 * cached decode step's product; T = 3 one token block; 4 and 6 two (a verifying pass of
 * speculative decoding, a small batch); 64 to 256 the products of a step without the
 * cache. 2 * rows * cols * T FLOPs per call. Compare with roofline's
 * peak_best_GFLOPs (`build/roofline`): the kernel's share of the peak, without attention,
 * norms or thread waits. --threads 1 gives one core's figure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/kernels.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The product every thread of the team runs when thread 0 posts it, as in a forward pass. */
static struct {
    float *out;
    const float *x;
    Mat w;
    int T;
} job;

static void product(Worker *wk) { matmul(wk, job.out, job.w.rows, job.x, job.w.cols, job.w, job.T); }

static void member(void *arg, Worker *wk) {
    (void)arg;
    while (team_wait(wk)) product(wk);
}

static void timed_product(Team *team) {
    Worker alone = worker_alone(), *lead = team ? team_leader(team) : &alone;
    if (team) team_post(team);
    product(lead);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int reps = 30;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            const int threads = atoi(argv[++i]);
            if (threads < 1 || threads > TEAM_MAX_THREADS) {
                fprintf(stderr, "matmul_bench: --threads must be 1 to %d\n", TEAM_MAX_THREADS);
                return 2;
            }
            threads_set(threads);
        } else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tiles") && i + 1 < argc &&
                 (!strcmp(argv[i + 1], "8x3") || !strcmp(argv[i + 1], "wide")))
            matmul_set_wide_tiles(!strcmp(argv[++i], "wide"));
        else {
            fprintf(stderr, "usage: matmul_bench [--threads N] [--reps R] [--tiles 8x3|wide]\n");
            return 2;
        }
    }
    if (reps < 1 || reps > 100000) {
        fprintf(stderr, "matmul_bench: --reps must be 1 to 100000\n");
        return 2;
    }
    static const struct {
        const char *name;
        int rows, cols;
    } shapes[] = {
        {"wq 512x512", 512, 512},
        {"w1 1344x512", 1344, 512},
        {"w2 512x1344", 512, 1344},
        {"head 4096x512", 4096, 512},
    };
    static const int token_counts[] = {1, 3, 4, 6, 64, 128, 256};
    double *times = malloc((size_t)reps * sizeof *times);
    const int threads = threads_count();
    Team *team = threads > 1 ? team_open(threads, member, NULL) : NULL;
    if (threads > 1 && !team) {
        fprintf(stderr, "matmul_bench: cannot start %d threads\n", threads);
        return 1;
    }
    printf("kernels %s, tiles of %s past 6 tokens, %d threads, %d reps\n", kernels_simd_name(), matmul_tiles_name(),
           threads, reps);
    printf("%-14s %4s %10s %12s %14s\n", "shape", "T", "best ms", "best GFLOP/s", "median GFLOP/s");
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int rows = shapes[s].rows, cols = shapes[s].cols;
        bf16 *raw = malloc((size_t)rows * cols * sizeof(bf16)), *packed = malloc((size_t)rows * cols * sizeof(bf16));
        if (!times || !raw || !packed) {
            fprintf(stderr, "matmul_bench: out of memory\n");
            return 1;
        }
        for (size_t i = 0; i < (size_t)rows * cols; i++) raw[i] = (bf16)(0x3C00 + i % 97); /* 0.0078 to 0.0137 */
        mat_pack(packed, raw, rows, cols, DTYPE_BF16);
        Mat w = {packed, rows, cols, DTYPE_BF16};
        for (size_t k = 0; k < sizeof token_counts / sizeof token_counts[0]; k++) {
            const int T = token_counts[k];
            float *x = alloc_floats_touched((size_t)T * cols), *out = alloc_floats_touched((size_t)T * rows);
            if (!x || !out) {
                fprintf(stderr, "matmul_bench: out of memory\n");
                return 1;
            }
            for (size_t i = 0; i < (size_t)T * cols; i++) x[i] = 1e-3f * (float)(i % 113);
            job.out = out, job.x = x, job.w = w, job.T = T;
            timed_product(team); /* untimed */
            for (int r = 0; r < reps; r++) {
                double t0 = now_s();
                timed_product(team);
                times[r] = now_s() - t0;
            }
            qsort(times, (size_t)reps, sizeof *times, cmp_double);
            double flop = 2.0 * rows * cols * T;
            printf("%-14s %4d %10.4f %12.1f %14.1f\n", shapes[s].name, T, 1e3 * times[0], flop / times[0] * 1e-9,
                   flop / times[reps / 2] * 1e-9);
            free(x);
            free(out);
        }
        free(raw);
        free(packed);
    }
    free(times);
    team_close(team);
    return 0;
}
