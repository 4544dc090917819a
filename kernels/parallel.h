/* parallel.h: how the kernels share their work among the OpenMP threads.
 *
 * A forward pass runs inside one OpenMP parallel region, its team (parallel_team; run.c
 * opens one team for a whole generation, and the passes inside it use that one):
 * thread 0 runs the pass top to bottom, and the other threads wait, spinning on one
 * cache line, for the work it hands them (parallel_run). Opening an OpenMP region costs
 * several times more than such a hand-off (docs/PERFORMANCE.md). Outside a team (a unit
 * test or bench/matmul.c calling a kernel), parallel_run opens an OpenMP region of its
 * own. Either way fn gets the same thread numbers and counts, so a kernel splits its
 * work the same way and every output comes out the same.
 *
 * This file is the only one that talks to OpenMP, and parallel_mode is the one policy
 * that decides when work is worth the other threads. */
#ifndef PARALLEL_H
#define PARALLEL_H

#include <stddef.h>

/* Work for each thread: this is thread `thread` of `threads`. */
typedef void (*ParallelFn)(const void *ctx, int thread, int threads);

/* How a piece of work is shared among a team's threads. */
typedef enum {
    PARALLEL_ALONE,     /* on the calling thread only */
    PARALLEL_STATIC,    /* thread p does part p */
    PARALLEL_TAKE_OVER, /* thread p does part p, then helps with the others' remaining items */
} ParallelMode;

/* The policy. work: multiply-adds (or comparable element operations) of the whole job;
 * tokens: how many tokens the pass carries. Below PARALLEL_MIN_WORK the hand-off costs
 * more than it saves, so the work runs alone; from PARALLEL_MIN_TOKENS_TAKE_OVER tokens
 * the items are many and long enough for take-overs to pay for their claims. */
enum { PARALLEL_MIN_WORK = 8192, PARALLEL_MIN_TOKENS_TAKE_OVER = 16 };
ParallelMode parallel_mode(long work, int tokens);

/* Runs body(arg) on the calling thread while the other OpenMP threads serve its
 * parallel_run calls. Inside a team already, just runs body(arg). */
void parallel_team(void (*body)(void *arg), void *arg);

/* fn(ctx, i, n) for every thread i < n, and returns when all have returned: on the
 * calling thread alone (n = 1) when mode is PARALLEL_ALONE or when called from inside an
 * fn, on the team's threads inside a team, otherwise in a new OpenMP region. */
void parallel_run(ParallelFn fn, const void *ctx, ParallelMode mode);

/* item(ctx, i) for every i < n_items, each thread a contiguous share (parallel_share). */
void parallel_for(long n_items, void (*item)(const void *ctx, long i), const void *ctx, ParallelMode mode);

/* Work in parts, one per thread: part p of `parts` has count(p) items, and items does
 * items [lo, hi) of a part on thread `thread` (< parts; no two threads that run items of
 * one parallel_run_parts at the same time have the same number, so it can index scratch
 * of each thread's own). Thread p does part p; with PARALLEL_TAKE_OVER, a thread that
 * has done its own part then helps with the others' remaining items, claiming them from
 * the part's counter (one cache line each), a quarter of what is left at a time, so
 * claims are few while a part is long. Every item is done once, by one thread, so the
 * outputs are the static split's bit for bit; when one vCPU runs slower for a while, the
 * other takes over the end of its share instead of waiting. */
typedef struct {
    long (*count)(const void *ctx, int part, int parts);
    void (*items)(const void *ctx, int part, int parts, long lo, long hi, int thread);
    const void *ctx;
} ParallelParts;
void parallel_run_parts(const ParallelParts *w, ParallelMode mode);

/* The most threads a team has, whatever OMP_NUM_THREADS or parallel_set_threads ask for:
 * a thread's scratch is sized for this many (attention.h), and parallel_run_parts keeps
 * one claim a thread on the stack. */
enum { PARALLEL_MAX_THREADS = 256 };

/* The thread count for the runs to come (1 <= n <= PARALLEL_MAX_THREADS), and starting the
 * thread pool now rather than inside the first timed step. */
void parallel_set_threads(int n);
void parallel_warm_up(void);

/* The n that parallel_run(.., 1) would pass. */
int parallel_threads(void);

/* OMP_NUM_THREADS as the process was started with it: 0 when unset or a list of thread
 * counts 1..PARALLEL_MAX_THREADS (OpenMP's syntax: one count a nesting level), else -1
 * and one sentence in err. A bad value is taken out of the environment before the OpenMP
 * runtime reads it (which would print a warning of its own and carry on), so that the
 * caller can refuse it with this sentence alone. */
int parallel_check_env(char *err, size_t errlen);

/* Thread i's share [*lo, *hi) of n items split among n_threads, in order. */
static inline void parallel_share(long n, int i, int n_threads, long *lo, long *hi) {
    *lo = n * i / n_threads;
    *hi = n * (i + 1) / n_threads;
}

#endif /* PARALLEL_H */
