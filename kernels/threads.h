/* threads.h: a team of threads that runs a step together, the way ggml does it.
 *
 * Every thread of the team runs the whole step top to bottom (the forward pass, then the
 * sampling). Each kernel does its own share of the rows, chosen by the thread's index
 * (share_begin / share_next below), and team_barrier separates one operation from the
 * next. Nothing is handed from thread to thread through function pointers: the loops
 * live in the kernels, and each kernel's caller is the next line of the step.
 *
 * Thread 0 is the caller's own thread. It posts a step (team_post) to the others, which
 * wait for it in team_wait, runs its share, and leaves the last barrier with every
 * thread's writes visible. A waiting thread spins for a while, then yields its core at
 * every turn, so that on a busy machine a late team member gets a core instead of a
 * spinning one (docs/PERFORMANCE.md).
 *
 * An adaptive team (team_adapt) follows the machine's load: it starts with as many threads
 * as find a free CPU, and a step whose barrier waited past the spin was late, so the next
 * step runs with one thread fewer (the highest left out, asleep in the kernel); after a
 * calm spell it grows back by one where a CPU is free, the spell doubling each time a
 * grown team is late again at once, from TEAM_CALM_NS_FIRST up to TEAM_CALM_NS_MAX.
 * Worker.threads is the step's team size. The outputs do not depend on it.
 *
 * Whether work is worth the other threads is one policy, parallel_mode. A Worker of one
 * thread (worker_alone) runs every share itself and its barriers return at once: the
 * unit tests and bench/matmul.c call the kernels that way. */
#ifndef THREADS_H
#define THREADS_H

#include <stdatomic.h>
#include <stddef.h>

/* The most threads a team has: a thread's scratch is sized for this many (attention.h). */
enum { TEAM_MAX_THREADS = 256 };
/* The first calm spell after a late step, and the longest: a probe of the grown team costs
 * at most one late step, so on a machine that stays busy probes take little of the time. */
enum { TEAM_CALM_NS_FIRST = 20000000, TEAM_CALM_NS_MAX = 1000000000 };

typedef struct Team Team;

/* One thread's view of its team: thread `thread` of `threads` (team NULL: alone).
 * pending: work that thread 0 did alone since the last barrier, which the others have not
 * seen yet; the next shared operation starts with a barrier. Every thread runs the same
 * operations in the same modes, so they agree on it. */
typedef struct {
    Team *team;
    int thread, threads;
    int pending;
    unsigned barriers; /* passed so far: the same count on every thread */
} Worker;

static inline Worker worker_alone(void) { return (Worker){.team = NULL, .thread = 0, .threads = 1}; }

/* A team of n threads (1 <= n <= TEAM_MAX_THREADS): thread 0 is the caller; threads
 * 1..n-1 are started here and run member(arg, worker) until the team closes. member is
 * called once per thread, at its start, not per step. Returns NULL when out of memory or
 * when a thread cannot be started. */
Team *team_open(int n, void (*member)(void *arg, Worker *w), void *arg);
/* The adaptive team's size, 1..max: a late step shrinks it by one, and a calm spell of
 * calm_ns since calm_since_ns grows it back by one where room says a CPU is free; calm_ns
 * doubles each time a grown team is late again at once (grown). */
typedef struct {
    int size, max, grown;
    long calm_ns, calm_since_ns;
} TeamSize;
/* Whether the spell is over and the team may grow at `now` (ns): then room is asked. */
int team_size_may_grow(const TeamSize *z, long now);
/* The size after a step: late, whether its barrier waited past the spin; room, whether a
 * CPU is free for one more thread (read only when team_size_may_grow). */
void team_size_next(TeamSize *z, int late, long now, int room);
/* Makes the team's size follow the load of a machine of `cpus` CPUs (above): it starts
 * with the CPUs other processes leave free and grows where one is. cpus 0: no limit, the
 * team starts whole and grows back whenever calm. */
void team_adapt(Team *t, int cpus);
/* Steps posted so far with fewer threads than the team's. */
long team_short_steps(const Team *t);
/* Wakes the members with `closing` set, waits for them to return, frees the team. */
void team_close(Team *t);
/* Thread 0's worker. */
Worker *team_leader(Team *t);

/* --profile: from now on each barrier of the team adds the time from its first thread's
 * arrival to its last's to a sum, what the team's threads waited for one another there
 * (the slowest thread's lead, or a thread another process held off its core). It costs a
 * clock read per thread and barrier. */
void team_time_barriers(Team *t);
/* That sum so far, in ms: 0 alone or untimed. Thread 0 reads it between barriers. */
double team_waited_ms(const Worker *w);

/* Thread 0: starts a step on the threads the step runs with (each returns from team_wait
 * with 1); the team's size for the step is then team_leader(t)->threads. */
void team_post(Team *t);
/* Threads 1..: waits for the next step; 0 when the team is closing. */
int team_wait(Worker *w);
/* Every thread of the team reaches it before any leaves it; each thread's writes before it
 * are visible to every thread after it. Alone: returns at once. */
void team_barrier(Worker *w);
/* Work for thread 0 alone, as `if (team_alone(w)) { ... }`: the others go on, and the next
 * shared operation waits for it. */
static inline int team_alone(Worker *w) {
    w->pending = 1;
    return w->thread == 0;
}

/* Waits for the others where thread 0 did work alone since the last barrier (pending): they
 * may still be deciding how to run those operations, from data thread 0 is about to change. */
static inline void team_settle(Worker *w) {
    if (w->pending) team_barrier(w);
}

/* How a piece of work is shared among a team's threads. */
typedef enum {
    PARALLEL_ALONE,     /* thread 0 does it all */
    PARALLEL_STATIC,    /* thread p does part p */
    PARALLEL_TAKE_OVER, /* thread p does part p, then helps with the others' remaining items */
} ParallelMode;

/* The policy. work: multiply-adds (or comparable element operations) of the whole job.
 * Below PARALLEL_MIN_WORK the other threads cost more than they save, so the work runs
 * alone; from PARALLEL_MIN_WORK_TAKE_OVER each thread's share is long enough for
 * take-overs to pay for their claims, and a thread slowed by its core or its memory no
 * longer holds the others at the barrier. */
enum { PARALLEL_MIN_WORK = 8192, PARALLEL_MIN_WORK_TAKE_OVER = 1 << 22 };
ParallelMode parallel_mode(long work);

/* Thread i's share [*lo, *hi) of n items split among n_threads, in order. */
static inline void parallel_share(long n, int i, int n_threads, long *lo, long *hi) {
    *lo = n * i / n_threads;
    *hi = n * (i + 1) / n_threads;
}

/* One operation's items, in parts: `parts` parts (1 when alone, else the team's threads),
 * part p holding items [first, first + count) (SHARE_SPLIT: p's share of n) or, with
 * SHARE_EACH, all n items of its own (the kernel gives each part its own slice of another
 * dimension, as matmul does with tokens). Thread p does part p; with PARALLEL_TAKE_OVER,
 * a thread done with its own part helps with the others' remaining items, claiming them
 * from the part's counter, a quarter of what is left at a time, so claims are few while a
 * part is long. Every item is done once, by one thread, so the outputs are the static
 * split's bit for bit:
 *
 *     Share sh = share_begin(w, n, SHARE_SPLIT, mode);
 *     for (long lo, hi; share_next(&sh, &lo, &hi);) ... items [lo, hi) of part sh.part ...
 *     share_end(&sh);
 *
 * A shared operation starts with a barrier when thread 0 did work alone before it
 * (pending), and ends with one; an operation run alone ends with none. */
typedef enum { SHARE_SPLIT, SHARE_EACH } ShareKind;
typedef struct {
    Worker *w;
    long n;
    ShareKind kind;
    int take_over;
    int parts;   /* 1 or w->threads */
    int part;    /* the part of the last run share_next gave */
    int visited; /* parts looked at so far */
    int in_part; /* claiming from part `part` */
    long first, count;
} Share;

Share share_begin(Worker *w, long n, ShareKind kind, ParallelMode mode);
int share_next(Share *s, long *lo, long *hi);
/* After the last share_next: the operation is over for every thread (a barrier), or, run
 * alone, will be before the next shared one. */
void share_end(Share *s);

/* The thread count for teams opened from now on (1 <= n <= TEAM_MAX_THREADS), and the
 * count itself: --threads, else OMP_NUM_THREADS (its first count, as OpenMP reads it),
 * else the CPUs this process may run on. */
void threads_set(int n);
int threads_count(void);
/* Whether the count was chosen (--threads or OMP_NUM_THREADS), which a team then keeps. */
int threads_chosen(void);

/* OMP_NUM_THREADS: 0 when unset or a list of thread counts 1..TEAM_MAX_THREADS (OpenMP's
 * syntax: one count a nesting level), and OMP_THREAD_LIMIT unset or a positive count; else
 * -1 and one sentence in err. */
int threads_check_env(char *err, size_t errlen);

#endif /* THREADS_H */
