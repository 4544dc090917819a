/* roofline.c: this machine's two roofline numbers, for bench/bench.py.
 *
 *   build/roofline [--threads N] [--mib M] [--reps R] [--flop-seconds S] [--no-peak]
 *
 * Memory bandwidth: a streaming read (a vectorized sum) over an M MiB buffer (default
 * 1024, far larger than any cache), the buffer split evenly over N OpenMP threads, each
 * thread's part first touched by that thread. Best of R passes (default 7), after one
 * untimed pass.
 *
 * Peak fp32 FLOP rate: every thread runs 16 independent fused-multiply-add chains held in
 * registers (AVX-512: 16 floats per FMA, AVX2: 8), enough to cover the FMA latency on
 * every current x86 core; 2 FLOPs per lane per FMA. Best of R timed blocks of about S
 * seconds each (default 0.2), after one untimed block. --no-peak skips it (bench.py uses
 * that for a second bandwidth figure at the size of a decode step's working set).
 *
 * Output: one "key value" line per number, for machines; bench.py reads
 *   roofline_simd, roofline_threads, bandwidth_bytes, bandwidth_reps,
 *   bandwidth_best_GBps, bandwidth_median_GBps, peak_fma_chains,
 *   peak_best_GFLOPs, peak_median_GFLOPs, machine_balance_flop_per_byte
 * (GB = 1e9 bytes, GFLOP = 1e9 FLOPs). */
#define _POSIX_C_SOURCE 200809L
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"

#if defined(__AVX512F__)
#define SIMD_NAME "avx512"
#define LANES 16
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VSET(x) _mm512_set1_ps(x)
#define VLOAD(p) _mm512_load_ps(p)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
static float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define SIMD_NAME "avx2"
#define LANES 8
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VSET(x) _mm256_set1_ps(x)
#define VLOAD(p) _mm256_load_ps(p)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static float vsum(vec v) {
    float t[8];
    _mm256_storeu_ps(t, v);
    return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
#else
#error "roofline.c needs AVX-512F or AVX2+FMA (build with -march=native on x86-64)"
#endif

#define CHAINS 16
#define UNROLL 8 /* vectors per iteration of the streaming loop: 4 accumulators, 2 loads each */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static double best(const double *v, int n) {
    double b = v[0];
    for (int i = 1; i < n; i++) b = v[i] > b ? v[i] : b;
    return b;
}

static long arg_long(int argc, char **argv, const char *flag, long dflt, long lo, long hi) {
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], flag)) {
            char *end;
            long v = strtol(argv[i + 1], &end, 10);
            if (*end || v < lo || v > hi) {
                fprintf(stderr, "roofline: %s takes an integer in %ld..%ld\n", flag, lo, hi);
                exit(2);
            }
            return v;
        }
    return dflt;
}

static double arg_double(int argc, char **argv, const char *flag, double dflt) {
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], flag)) {
            char *end;
            double v = strtod(argv[i + 1], &end);
            if (*end || !(v > 0.0 && v < 100.0)) {
                fprintf(stderr, "roofline: %s takes a number of seconds in (0, 100)\n", flag);
                exit(2);
            }
            return v;
        }
    return dflt;
}

/* One streaming pass: every thread sums its own contiguous part. Returns the sum (so the
 * loads cannot be optimized away). */
static double stream_pass(const float *buf, size_t n_vec_per_thread) {
    double total = 0.0;
#pragma omp parallel reduction(+ : total)
    {
        const float *p = buf + (size_t)omp_get_thread_num() * n_vec_per_thread * LANES;
        vec a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
        for (size_t i = 0; i < n_vec_per_thread; i += UNROLL) {
            const float *q = p + i * LANES;
            a0 = VADD(a0, VADD(VLOAD(q + 0 * LANES), VLOAD(q + 1 * LANES)));
            a1 = VADD(a1, VADD(VLOAD(q + 2 * LANES), VLOAD(q + 3 * LANES)));
            a2 = VADD(a2, VADD(VLOAD(q + 4 * LANES), VLOAD(q + 5 * LANES)));
            a3 = VADD(a3, VADD(VLOAD(q + 6 * LANES), VLOAD(q + 7 * LANES)));
        }
        total += vsum(VADD(VADD(a0, a1), VADD(a2, a3)));
    }
    return total;
}

/* iters x CHAINS FMAs per thread on independent register chains. Returns a value that
 * depends on every chain. */
static float fma_block(long iters) {
    float total = 0.0f;
#pragma omp parallel reduction(+ : total)
    {
        const vec m = VSET(0.999999f), a = VSET(1e-7f);
        vec c[CHAINS];
        for (int k = 0; k < CHAINS; k++) c[k] = VSET(1.0f + 0.01f * (float)(k + omp_get_thread_num()));
        for (long i = 0; i < iters; i++) {
#pragma GCC unroll 16
            for (int k = 0; k < CHAINS; k++) c[k] = VFMA(c[k], m, a);
        }
        vec s = VZERO();
        for (int k = 0; k < CHAINS; k++) s = VADD(s, c[k]);
        total += vsum(s);
    }
    return total;
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            puts("Usage: roofline [--threads N] [--mib M] [--reps R] [--flop-seconds S] [--no-peak]\n"
                 "Streaming-read bandwidth and peak fp32 FMA rate of this machine (see the source).");
            return 0;
        }
    int threads = (int)arg_long(argc, argv, "--threads", omp_get_max_threads(), 1, 1024);
    long mib = arg_long(argc, argv, "--mib", 1024, 1, 1L << 20);
    int reps = (int)arg_long(argc, argv, "--reps", 7, 1, 1000);
    double flop_seconds = arg_double(argc, argv, "--flop-seconds", 0.2);
    int peak = 1;
    for (int i = 1; i < argc; i++) peak &= strcmp(argv[i], "--no-peak") != 0;
    omp_set_num_threads(threads);
    omp_set_dynamic(0);

    /* ---- bandwidth ---- */
    size_t chunk = (size_t)UNROLL * LANES; /* floats per loop iteration */
    size_t n = (size_t)mib * 1024 * 1024 / sizeof(float);
    size_t per_thread = n / threads / chunk * chunk; /* floats, a multiple of chunk */
    if (per_thread == 0) {
        fprintf(stderr, "roofline: --mib %ld is too small for %d threads\n", mib, threads);
        return 2;
    }
    n = per_thread * threads;
    /* the engine's allocator, so that the probe reads huge pages where the weights and the
     * cache pool do: a floor measured on 4 KB pages would be a slower machine's */
    float *buf = alloc_huge(n * sizeof(float));
    if (!buf) {
        fprintf(stderr, "roofline: cannot allocate %zu bytes\n", n * sizeof(float));
        return 1;
    }
#pragma omp parallel
    {
        float *p = buf + (size_t)omp_get_thread_num() * per_thread;
        for (size_t i = 0; i < per_thread; i++) p[i] = (float)(i & 1023) * 1e-3f; /* first touch */
    }
    double *gbps = malloc((size_t)reps * sizeof(double)), *gflops = malloc((size_t)reps * sizeof(double));
    if (!gbps || !gflops) return 1;
    double sink = stream_pass(buf, per_thread / LANES); /* untimed */
    for (int r = 0; r < reps; r++) {
        double t0 = omp_get_wtime();
        sink += stream_pass(buf, per_thread / LANES);
        double dt = omp_get_wtime() - t0;
        gbps[r] = (double)(n * sizeof(float)) / dt / 1e9;
    }
    free(buf);

    /* ---- peak FMA rate: calibrate the block length to about flop_seconds ---- */
    long iters = 1L << 16;
    for (; peak;) {
        double t0 = omp_get_wtime();
        sink += fma_block(iters);
        double dt = omp_get_wtime() - t0;
        if (dt >= flop_seconds / 4 || iters > (1L << 40)) {
            iters = (long)((double)iters * flop_seconds / (dt > 1e-9 ? dt : 1e-9));
            if (iters < 1) iters = 1;
            break;
        }
        iters *= 4;
    }
    for (int r = 0; peak && r < reps; r++) {
        double t0 = omp_get_wtime();
        sink += fma_block(iters);
        double dt = omp_get_wtime() - t0;
        gflops[r] = 2.0 * LANES * CHAINS * (double)iters * threads / dt / 1e9;
    }

    double bw_best = best(gbps, reps);
    printf("roofline_simd %s\n", SIMD_NAME);
    printf("roofline_threads %d\n", threads);
    printf("bandwidth_bytes %zu\n", n * sizeof(float));
    printf("bandwidth_reps %d\n", reps);
    printf("bandwidth_best_GBps %.3f\n", bw_best);
    printf("bandwidth_median_GBps %.3f\n", median(gbps, reps));
    if (peak) {
        double fl_best = best(gflops, reps);
        printf("peak_fma_chains %d\n", CHAINS);
        printf("peak_best_GFLOPs %.3f\n", fl_best);
        printf("peak_median_GFLOPs %.3f\n", median(gflops, reps));
        printf("machine_balance_flop_per_byte %.3f\n", fl_best / bw_best);
    }
    fprintf(stderr, "roofline: checksum %g\n", sink); /* keeps every pass alive */
    free(gbps);
    free(gflops);
    return 0;
}
