/* parallel.h: how the kernels share their work among the OpenMP threads.
 *
 * A forward pass runs inside one OpenMP parallel region, its team (parallel_team; run.c
 * opens one team for a whole generation, and the passes inside it use that one):
 * thread 0 runs the pass top to bottom, and the other threads wait, spinning on one
 * cache line, for the work it hands them (parallel_run). On this VM an OpenMP region
 * costs ~3.3 us to open and close (libgomp wakes its threads with futex calls) and a
 * decode step needs ~21 of them; a hand-off through a cache line and back costs ~0.5 us.
 * Outside a team (a unit test or bench/matmul.c calling a kernel), parallel_run opens an
 * OpenMP region of its own. Either way fn gets the same thread numbers and counts, so a
 * kernel splits its work the same way and every output comes out the same. */
#ifndef PARALLEL_H
#define PARALLEL_H

/* Work for each thread: this is thread `thread` of `threads`. */
typedef void (*ParallelFn)(const void *ctx, int thread, int threads);

/* Runs body(arg) on the calling thread while the other OpenMP threads serve its
 * parallel_run calls. Inside a team already, just runs body(arg). */
void parallel_team(void (*body)(void *arg), void *arg);

/* fn(ctx, i, n) for every thread i < n, and returns when all have returned: on the
 * calling thread alone (n = 1) unless use_threads or when called from inside an fn, on the
 * team's threads inside a team, otherwise in a new OpenMP region. */
void parallel_run(ParallelFn fn, const void *ctx, int use_threads);

/* item(ctx, i) for every i < n_items, each thread a contiguous share (parallel_share). */
void parallel_for(long n_items, void (*item)(const void *ctx, long i), const void *ctx, int use_threads);

/* Work in parts, one per thread: part p of `parts` has count(p) items, and items does
 * items [lo, hi) of a part. parallel_run_parts runs thread p's part on thread p; with
 * take_over, a thread that has done its own part then helps with the others' remaining
 * items, claiming them from the part's counter (one cache line each), a quarter of what
 * is left at a time (claiming single items cost 0.9% of an MHA no-KV run's samples; in
 * quarters 0.3%). Every item is done once, by one thread, so the outputs are the static
 * split's bit for bit; when one vCPU runs slower for a while (a neighbour on this VM:
 * measured alone, 156 against 181 GFLOP/s at one moment), the other takes over the end
 * of its share instead of waiting. MHA no-KV step, 7 alternated runs in a noisy hour:
 * 14.14 ms with static shares, 12.85 with take-overs. */
typedef struct {
    long (*count)(const void *ctx, int part, int parts);
    void (*items)(const void *ctx, int part, int parts, long lo, long hi);
    const void *ctx;
} ParallelParts;
void parallel_run_parts(const ParallelParts *w, int take_over, int use_threads);

/* The n that parallel_run(.., 1) would pass. */
int parallel_threads(void);

/* Thread i's share [*lo, *hi) of n items split among n_threads, in order. */
static inline void parallel_share(long n, int i, int n_threads, long *lo, long *hi) {
    *lo = n * i / n_threads;
    *hi = n * (i + 1) / n_threads;
}

#endif /* PARALLEL_H */
