/* parallel.c: the team of a forward pass (parallel.h). */
#include "kernels/parallel.h"

#include <sched.h>
#include <stdatomic.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels/errmsg.h"

/* The threads a team gets: what OpenMP would start (OMP_THREAD_LIMIT caps it below
 * omp_get_max_threads), at most PARALLEL_MAX_THREADS. */
static int team_size(void) {
#ifdef _OPENMP
    int n = omp_get_max_threads();
    if (n > omp_get_thread_limit()) n = omp_get_thread_limit();
    return n < PARALLEL_MAX_THREADS ? n : PARALLEL_MAX_THREADS;
#else
    return 1;
#endif
}

/* The team's mailbox. Thread 0 writes fn and ctx, then bumps `posted`; each other
 * thread, having seen the bump, runs fn and bumps `finished`. Thread 0 writes the next
 * job only once every thread has finished this one, so a job is never overwritten while
 * it is read. The two counters live on cache lines of their own. */
typedef struct {
    _Alignas(64) atomic_uint posted;   /* jobs posted so far */
    ParallelFn fn;
    const void *ctx;
    int threads;
    unsigned spins_before_yielding;    /* see wait_turn */
    int closing;                       /* the last post: leave */
    int in_job;                        /* thread 0 is inside a job (its own share of it) */
    _Alignas(64) atomic_uint finished; /* jobs finished so far, summed over threads 1.. */
} Team;

/* the team whose thread 0 is this thread, if any */
static _Thread_local Team *my_team;

/* One turn of a wait: a pause, and after a while it gives the core away at every turn; at
 * once when the team has more threads than there are cores (--threads 3 on 2 cores),
 * where the thread waited for may not be running and spinning only delays it. */
enum { SPINS_BEFORE_YIELDING = 1 << 14 };
static inline void wait_turn(const Team *t, unsigned *spins) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if (*spins < t->spins_before_yielding) ++*spins;
    else sched_yield();
}

#ifdef _OPENMP
/* the life of threads 1.. of a team: run each posted job, until the team closes */
static void serve(Team *t, int thread) {
    for (unsigned seen = 0;; ) {
        unsigned spins = 0;
        while (atomic_load_explicit(&t->posted, memory_order_acquire) == seen) wait_turn(t, &spins);
        seen++;
        if (t->closing) return;
        t->fn(t->ctx, thread, t->threads);
        atomic_fetch_add_explicit(&t->finished, 1, memory_order_release);
    }
}
#endif

static void post(Team *t) {
    atomic_store_explicit(&t->posted, atomic_load_explicit(&t->posted, memory_order_relaxed) + 1, memory_order_release);
}

void parallel_team(void (*body)(void *arg), void *arg) {
#ifdef _OPENMP
    if (my_team || omp_in_parallel()) {
        body(arg);
        return;
    }
    Team team = {.threads = 1};
#pragma omp parallel num_threads(team_size())
    {
        if (omp_get_thread_num() == 0) {
            team.threads = omp_get_num_threads();  /* read by the others after a post */
            team.spins_before_yielding = team.threads > omp_get_num_procs() ? 0 : SPINS_BEFORE_YIELDING;
            my_team = &team;
            body(arg);
            my_team = NULL;
            team.closing = 1;
            post(&team);
        } else {
            serve(&team, omp_get_thread_num());
        }
    }
#else
    body(arg);
#endif
}

ParallelMode parallel_mode(long work, int tokens) {
    if (work < PARALLEL_MIN_WORK) return PARALLEL_ALONE;
    return tokens >= PARALLEL_MIN_TOKENS_TAKE_OVER ? PARALLEL_TAKE_OVER : PARALLEL_STATIC;
}

void parallel_run(ParallelFn fn, const void *ctx, ParallelMode mode) {
    Team *t = my_team;
    /* alone: when asked, in a team of one, or from inside a job (the team is busy with it) */
    if (mode == PARALLEL_ALONE || (t && (t->threads == 1 || t->in_job))) {
        fn(ctx, 0, 1);
        return;
    }
    if (t) {
        t->fn = fn;
        t->ctx = ctx;
        post(t);
        t->in_job = 1;
        fn(ctx, 0, t->threads);
        t->in_job = 0;
        const unsigned all = atomic_load_explicit(&t->posted, memory_order_relaxed) * (unsigned)(t->threads - 1);
        unsigned spins = 0;
        while (atomic_load_explicit(&t->finished, memory_order_acquire) != all) wait_turn(t, &spins);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(team_size())
    fn(ctx, omp_get_thread_num(), omp_get_num_threads());
#else
    fn(ctx, 0, 1);
#endif
}

int parallel_threads(void) {
    if (my_team) return my_team->in_job ? 1 : my_team->threads;
#ifdef _OPENMP
    return omp_in_parallel() ? 1 : team_size();
#else
    return 1;
#endif
}

typedef struct {
    long n_items;
    void (*item)(const void *ctx, long i);
    const void *ctx;
} ForLoop;

static void for_share(const void *ctx, int thread, int threads) {
    const ForLoop *f = ctx;
    long lo, hi;
    parallel_share(f->n_items, thread, threads, &lo, &hi);
    for (long i = lo; i < hi; i++) f->item(f->ctx, i);
}

void parallel_for(long n_items, void (*item)(const void *ctx, long i), const void *ctx, ParallelMode mode) {
    const ForLoop f = {n_items, item, ctx};
    parallel_run(for_share, &f, mode);
}

typedef struct {
    _Alignas(64) atomic_long next;  /* the part's first unclaimed item */
} Claim;

typedef struct {
    const ParallelParts *w;
    Claim *claims;  /* one per thread */
    int take_over;
} PartsRun;

static void parts_thread(const void *ctx, int thread, int threads) {
    const PartsRun *r = ctx;
    const ParallelParts *w = r->w;
    if (!r->take_over) {
        const long n = w->count(w->ctx, thread, threads);
        if (n > 0) w->items(w->ctx, thread, threads, 0, n, thread);
        return;
    }
    for (int k = 0; k < threads; k++) {
        const int p = (thread + k) % threads;  /* its own part first */
        const long n = w->count(w->ctx, p, threads);
        for (;;) {
            /* a claim takes a quarter of what looked left (at least one item): few claims
             * while the part is long, single items at its end */
            const long seen = atomic_load_explicit(&r->claims[p].next, memory_order_relaxed);
            const long take = (n - seen) / 4 > 1 ? (n - seen) / 4 : 1;
            const long i = atomic_fetch_add_explicit(&r->claims[p].next, take, memory_order_relaxed);
            if (i >= n) break;
            w->items(w->ctx, p, threads, i, i + take < n ? i + take : n, thread);
        }
    }
}

void parallel_run_parts(const ParallelParts *w, ParallelMode mode) {
    const int n = parallel_threads();
    Claim claims[n];
    for (int i = 0; i < n; i++) atomic_init(&claims[i].next, 0);
    const PartsRun r = {w, claims, mode == PARALLEL_TAKE_OVER};
    parallel_run(parts_thread, &r, mode);
}

void parallel_set_threads(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n < 1 ? 1 : n < PARALLEL_MAX_THREADS ? n : PARALLEL_MAX_THREADS);
#else
    (void)n;
#endif
}

void parallel_warm_up(void) {
#pragma omp parallel num_threads(team_size())
    {
    }
}

/* ---- OMP_NUM_THREADS ---- */

/* What check_env_threads found: the value it took out of the environment (cut to fit), and
 * whether it was a number out of range or no list of numbers at all. */
static char bad_env_threads[64];
static enum { ENV_THREADS_FINE, ENV_THREADS_OUT_OF_RANGE, ENV_THREADS_NOT_A_COUNT } env_threads_state;

/* OpenMP's syntax: counts separated by commas, white space around each; a count of more
 * digits than any count in range is out of range, not a parse failure. */
static int env_threads_verdict(const char *v) {
    int out_of_range = 0;
    for (;;) {
        while (*v == ' ' || *v == '\t') v++;
        long n = 0;
        int digits = 0;
        for (; *v >= '0' && *v <= '9'; v++, digits++)
            if (n <= PARALLEL_MAX_THREADS) n = 10 * n + (*v - '0');
        if (digits == 0) return ENV_THREADS_NOT_A_COUNT;
        out_of_range |= n < 1 || n > PARALLEL_MAX_THREADS;
        while (*v == ' ' || *v == '\t') v++;
        if (*v == '\0') return out_of_range ? ENV_THREADS_OUT_OF_RANGE : ENV_THREADS_FINE;
        if (*v++ != ',') return ENV_THREADS_NOT_A_COUNT;
    }
}

/* Runs from .preinit_array, before any library's constructor, so before the OpenMP runtime
 * reads the variable: a bad value is kept for parallel_check_env and its entry removed from
 * the environment. Plain loops only: no library is initialized yet. */
static void check_env_threads(int argc, char **argv, char **envp) {
    static const char name[] = "OMP_NUM_THREADS=";
    (void)argc;
    (void)argv;
    for (char **e = envp; e && *e;) {
        size_t k = 0;
        while (name[k] && (*e)[k] == name[k]) k++;
        const int verdict = name[k] == '\0' ? env_threads_verdict(*e + k) : ENV_THREADS_FINE;
        if (verdict == ENV_THREADS_FINE) {
            e++;
            continue;
        }
        if (env_threads_state == ENV_THREADS_FINE) {
            env_threads_state = verdict;
            size_t i = 0;
            for (; (*e)[k + i] && i + 1 < sizeof bad_env_threads; i++) {
                const unsigned char ch = (unsigned char)(*e)[k + i];
                bad_env_threads[i] = ch < 0x20 || ch == 0x7F ? '?' : (char)ch;  /* no control sequence reaches the terminal */
            }
            bad_env_threads[i] = '\0';
        }
        for (char **f = e; *f; f++) f[0] = f[1];  /* as unsetenv does */
    }
}

#ifdef __ELF__
__attribute__((section(".preinit_array"), used)) static void (*check_env_threads_first)(int, char **, char **) =
    check_env_threads;
#endif

int parallel_check_env(char *err, size_t errlen) {
    if (env_threads_state == ENV_THREADS_OUT_OF_RANGE)
        return errmsg(err, errlen, -1, "OMP_NUM_THREADS=%s is out of range (1..%d)", bad_env_threads, PARALLEL_MAX_THREADS);
    if (env_threads_state == ENV_THREADS_NOT_A_COUNT)
        return errmsg(err, errlen, -1, "OMP_NUM_THREADS needs a thread count (1..%d), got '%s'", PARALLEL_MAX_THREADS,
                      bad_env_threads);
    return 0;
}
