/* threads.c: the team of a step (threads.h). */
#define _GNU_SOURCE /* sched_getaffinity */
#include "kernels/threads.h"

#include <errno.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "kernels/errmsg.h"

/* A part's first unclaimed item in the operation that started after barrier `epoch` (the
 * epoch in the high 32 bits): an older epoch means none is claimed yet, so no barrier has
 * to reset the claims, and no cache line moves between threads but in take-overs. On a
 * cache line of its own. */
typedef struct {
    _Alignas(64) atomic_ullong next;
} Claim;

struct Team {
    int threads;
    int spin_ns;        /* how long a wait spins before it yields its core */
    atomic_int closing; /* read by the members after a post, or while left out of one */
    /* the threads that take part in this step, 1..threads, and the leader's barrier count
     * when it posted the step: both set by team_post, read by the members after it */
    atomic_int active;
    unsigned barriers_at_post;
    /* the leader's policy (team_post): late_step says a barrier of the last step waited past
     * the spin */
    TeamSize size;
    int cpus;              /* team_adapt's: CPUs the team may use; 0, no limit */
    int adaptive;          /* team_adapt: the size follows the machine's load */
    long short_steps;      /* steps posted with fewer threads than the team's */
    atomic_uint join_post; /* the post a member let back in takes first */
    _Alignas(64) atomic_int late_step;
    _Alignas(64) atomic_uint roster; /* changes when the team grows or closes: left-out members sleep on it */
    void (*member)(void *arg, Worker *w);
    void *arg;
    _Alignas(64) atomic_uint posted;  /* steps posted so far */
    _Alignas(64) atomic_uint arrived; /* threads at the barrier now */
    _Alignas(64) atomic_uint passed;  /* barriers passed so far */
    /* team_time_barriers: each thread's arrival at the barrier (its own slot, read by the
     * last to arrive), and the sum of the barriers' first-to-last spreads (ns) */
    int timed;
    _Alignas(64) atomic_long waited_ns;
    long arrival_ns[TEAM_MAX_THREADS];
    Claim claims[TEAM_MAX_THREADS]; /* one per part (share_next) */
    pthread_t ids[TEAM_MAX_THREADS];
    Worker workers[TEAM_MAX_THREADS];
};

/* ---- waiting: a spin, then giving the core away ---- */

/* A spin longer than a step's waits on an idle machine; none when the team has more threads
 * than the machine has CPUs for it, where the thread waited for may not be running at all. */
enum { SPIN_NS = 1000000 };

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Returns once *word differs from seen; 1 when it waited past the spin. Spins for up to
 * t->spin_ns, longer than the waits of a step on an idle machine; past that a team member
 * is late (descheduled on a busy machine), and this thread yields its core at every turn,
 * so the late one (or whatever else wants the core) runs. It stays runnable: beside
 * niced background work a futex sleep here was slower (docs/PERFORMANCE.md). */
static int wait_for_change(Team *t, atomic_uint *word, unsigned seen) {
    const long t0 = now_ns();
    for (unsigned spins = 1;; spins++) {
        if (atomic_load_explicit(word, memory_order_acquire) != seen) return 0;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        if (spins % 64 == 0 && now_ns() - t0 >= t->spin_ns) break;
    }
    while (atomic_load_explicit(word, memory_order_acquire) == seen) sched_yield();
    return now_ns() - t0 >= SPIN_NS;
}

/* A member the team left out sleeps in the kernel until the roster changes: it must not
 * compete for a core with the threads that run. */
static void sleep_while_unchanged(atomic_uint *word, unsigned seen) {
    while (atomic_load_explicit(word, memory_order_acquire) == seen)
        syscall(SYS_futex, (unsigned *)word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
}

static void wake_all(atomic_uint *word) {
    atomic_fetch_add_explicit(word, 1, memory_order_seq_cst);
    syscall(SYS_futex, (unsigned *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* Whether a task's /proc stat line shows it runnable at a nice value of at most `nice`.
 * A task niced further takes little of a core from this one, as CFS weighs them. */
static int runnable_at(const char *path, int nice) {
    char buf[512];
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    const ssize_t got = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (got <= 0) return 0;
    buf[got] = '\0';
    const char *p = strrchr(buf, ')'); /* the name may hold spaces and parentheses */
    if (!p || p[1] != ' ' || p[2] != 'R') return 0;
    /* fields after the state: ppid pgrp session tty_nr tpgid flags minflt cminflt majflt
     * cmajflt utime stime cutime cstime priority nice */
    p += 3;
    for (int field = 0; field < 15 && p; field++) p = strchr(p + 1, ' ');
    return p && strtol(p + 1, NULL, 10) <= nice;
}

/* Threads of other processes running or waiting for a CPU now at this process's nice
 * value or below. It reads every task's stat file, so it runs only at the start and once a
 * calm spell, never in a step (its cost: docs/PERFORMANCE.md). */
static int others_runnable(void) {
    DIR *proc = opendir("/proc");
    if (!proc) return 0;
    const int nice = getpriority(PRIO_PROCESS, 0), self = (int)getpid();
    int count = 0;
    char path[64];
    for (struct dirent *e; (e = readdir(proc));) {
        const int pid = atoi(e->d_name);
        if (pid <= 0 || pid == self) continue;
        snprintf(path, sizeof path, "/proc/%d/task", pid);
        DIR *tasks = opendir(path);
        if (!tasks) continue;
        for (struct dirent *t; (t = readdir(tasks));) {
            if (t->d_name[0] < '0' || t->d_name[0] > '9') continue;
            snprintf(path, sizeof path, "/proc/%d/task/%.16s/stat", pid, t->d_name);
            count += runnable_at(path, nice);
        }
        closedir(tasks);
    }
    closedir(proc);
    return count;
}

/* Whether a team of `size` threads finds a CPU each beside what else runs now. */
static int room_for(const Team *t, int size) { return t->cpus <= 0 || others_runnable() + size <= t->cpus; }

/* ---- the team ---- */

static void *member_main(void *arg) {
    Worker *w = arg;
    w->team->member(w->team->arg, w);
    return NULL;
}

/* The CPUs the process may run on, as it started: binding the leader narrows the main
 * thread's own mask, which later teams and threads_count must not take for the process's. */
static cpu_set_t process_cpus;
static int process_cpus_known;

static int allowed_cpus(cpu_set_t *out) {
    if (!process_cpus_known) {
        if (sched_getaffinity(0, sizeof process_cpus, &process_cpus) != 0) return -1;
        process_cpus_known = 1;
    }
    *out = process_cpus;
    return 0;
}

/* OMP_PROC_BIND=true|close|spread (libgomp's variable): thread i of the team on the i-th CPU
 * the process may use, so the scheduler never stacks a woken member on its waker's CPU while
 * another CPU idles, which can cost a step milliseconds until it balances the load. */
static void bind_threads(Team *t) {
    const char *bind = getenv("OMP_PROC_BIND");
    if (!bind || !(strcmp(bind, "true") == 0 || strcmp(bind, "close") == 0 || strcmp(bind, "spread") == 0)) return;
    cpu_set_t allowed;
    if (allowed_cpus(&allowed) != 0 || CPU_COUNT(&allowed) < 2) return;
    int cpus[CPU_SETSIZE], n = 0;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &allowed)) cpus[n++] = c;
    for (int i = 0; i < t->threads; i++) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpus[i % n], &one);
        pthread_setaffinity_np(i ? t->ids[i] : pthread_self(), sizeof one, &one);
    }
}

Team *team_open(int n, void (*member)(void *arg, Worker *w), void *arg) {
    if (n < 1 || n > TEAM_MAX_THREADS) return NULL;
    Team *t = NULL;
    if (posix_memalign((void **)&t, 64, sizeof *t) != 0) return NULL;
    memset(t, 0, sizeof *t);
    t->threads = n;
    t->member = member;
    t->arg = arg;
    atomic_init(&t->active, n);
    t->size = (TeamSize){.size = n, .max = n, .calm_ns = TEAM_CALM_NS_FIRST};
    const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    t->spin_ns = cpus > 0 && n > cpus ? 0 : SPIN_NS;
    for (int i = 0; i < n; i++) t->workers[i] = (Worker){.team = t, .thread = i, .threads = n};
    for (int i = 1; i < n; i++)
        if (pthread_create(&t->ids[i], NULL, member_main, &t->workers[i]) != 0) {
            t->threads = i; /* close the ones started */
            team_close(t);
            return NULL;
        }
    bind_threads(t);
    return t;
}

Worker *team_leader(Team *t) { return &t->workers[0]; }

void team_close(Team *t) {
    if (!t) return;
    atomic_store_explicit(&t->closing, 1, memory_order_relaxed); /* posted's release orders it */
    atomic_fetch_add_explicit(&t->posted, 1, memory_order_release);
    wake_all(&t->roster);
    for (int i = 1; i < t->threads; i++) pthread_join(t->ids[i], NULL);
    free(t);
}

/* The team's size for the next step. A late member means another process holds its core:
 * the team shrinks by one, so the step no longer waits for a thread that is not running;
 * after a calm spell it grows back by one, and if that step is late at once the machine is
 * still busy and the next spell is twice as long. The arithmetic does not depend on the
 * threads (threads.h), so neither do the outputs. */
void team_adapt(Team *t, int cpus) {
    t->adaptive = 1;
    t->cpus = cpus;
    /* as many threads as find a CPU now (at least one): on a busy machine the first steps
     * would otherwise wait for a member that has none */
    int size = t->threads;
    while (size > 1 && !room_for(t, size)) size--;
    t->size.size = size;
    t->size.calm_since_ns = now_ns();
    atomic_store(&t->active, t->size.size);
}

long team_short_steps(const Team *t) { return t->short_steps; }

int team_size_may_grow(const TeamSize *z, long now) { return z->size < z->max && now - z->calm_since_ns >= z->calm_ns; }

void team_size_next(TeamSize *z, int late, long now, int room) {
    if (late && z->size > 1) {
        z->calm_ns =
            z->grown ? (z->calm_ns * 2 < TEAM_CALM_NS_MAX ? z->calm_ns * 2 : TEAM_CALM_NS_MAX) : TEAM_CALM_NS_FIRST;
        z->size--;
        z->grown = 0;
        z->calm_since_ns = now;
    } else if (late) {
        z->calm_since_ns = now;
    } else if (team_size_may_grow(z, now)) {
        if (z->grown) z->calm_ns = TEAM_CALM_NS_FIRST; /* the last growth held a whole spell */
        if (!room)                                     /* no CPU free for one more: look again after a longer spell */
            z->calm_ns = z->calm_ns * 2 < TEAM_CALM_NS_MAX ? z->calm_ns * 2 : TEAM_CALM_NS_MAX;
        z->size += room;
        z->grown = room;
        z->calm_since_ns = now;
    } else if (z->grown && now - z->calm_since_ns >= z->calm_ns) {
        z->grown = 0; /* the grown team stayed calm: the machine is idle again */
        z->calm_ns = TEAM_CALM_NS_FIRST;
    }
}

static void choose_active(Team *t) {
    if (!t->adaptive) return;
    const int late = atomic_exchange_explicit(&t->late_step, 0, memory_order_relaxed);
    const long now = now_ns();
    const int size = t->size.size;
    /* /proc/loadavg is read only when the policy would grow the team */
    const int room = !late && team_size_may_grow(&t->size, now) && room_for(t, size + 1);
    team_size_next(&t->size, late, now, room);
    if (t->size.size > size) {
        atomic_store_explicit(&t->join_post, atomic_load_explicit(&t->posted, memory_order_relaxed) + 1,
                              memory_order_relaxed);
        atomic_store_explicit(&t->active, t->size.size, memory_order_release); /* after join_post */
        wake_all(&t->roster);
    } else {
        atomic_store_explicit(&t->active, t->size.size, memory_order_relaxed);
    }
}

void team_post(Team *t) {
    Worker *lead = &t->workers[0];
    lead->pending = 0;
    choose_active(t);
    lead->threads = atomic_load_explicit(&t->active, memory_order_relaxed);
    t->short_steps += lead->threads < t->threads;
    t->barriers_at_post = lead->barriers;
    atomic_fetch_add_explicit(&t->posted, 1, memory_order_release);
}

int team_wait(Worker *w) {
    Team *t = w->team;
    static _Thread_local unsigned seen; /* the posts this thread has taken */
    for (;;) {
        wait_for_change(t, &t->posted, seen);
        /* the newest post: one this thread did not see ran without it (thread 0 cannot end
         * a step of the team's without it), and taking them one by one would start a step
         * that was never posted, on the last one's state */
        seen = atomic_load_explicit(&t->posted, memory_order_acquire);
        if (atomic_load_explicit(&t->closing, memory_order_relaxed)) return 0;
        /* in the team, unless it was let back in for a post still to come */
        if (w->thread < atomic_load_explicit(&t->active, memory_order_acquire) &&
            (int)(atomic_load_explicit(&t->join_post, memory_order_relaxed) - seen) <= 0)
            break;
        /* left out: asleep until the team lets this thread back in, at post join_post */
        for (;;) {
            const unsigned roster = atomic_load_explicit(&t->roster, memory_order_acquire);
            if (atomic_load_explicit(&t->closing, memory_order_relaxed)) return 0;
            if (w->thread < atomic_load_explicit(&t->active, memory_order_acquire)) break;
            sleep_while_unchanged(&t->roster, roster);
        }
        seen = atomic_load_explicit(&t->join_post, memory_order_relaxed) - 1;
    }
    w->pending = 0;
    w->threads = atomic_load_explicit(&t->active, memory_order_relaxed);
    w->barriers = t->barriers_at_post; /* the claims' epochs count barriers the step's threads all passed */
    return 1;
}

void team_barrier(Worker *w) {
    Team *t = w->team;
    w->pending = 0;
    if (!t || w->threads == 1) return;
    w->barriers++;
    if (t->timed) t->arrival_ns[w->thread] = now_ns();
    const unsigned passed = atomic_load_explicit(&t->passed, memory_order_acquire);
    if (atomic_fetch_add_explicit(&t->arrived, 1, memory_order_acq_rel) + 1 == (unsigned)w->threads) {
        if (t->timed) { /* the others' arrivals came before their increments of `arrived` */
            long first = t->arrival_ns[0], last = first;
            for (int i = 1; i < w->threads; i++) {
                first = t->arrival_ns[i] < first ? t->arrival_ns[i] : first;
                last = t->arrival_ns[i] > last ? t->arrival_ns[i] : last;
            }
            atomic_fetch_add_explicit(&t->waited_ns, last - first, memory_order_relaxed);
        }
        atomic_store_explicit(&t->arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&t->passed, 1, memory_order_release);
        return;
    }
    if (wait_for_change(t, &t->passed, passed)) atomic_store_explicit(&t->late_step, 1, memory_order_relaxed);
}

void team_time_barriers(Team *t) { t->timed = 1; }

double team_waited_ms(const Worker *w) {
    return w->team ? (double)atomic_load_explicit(&w->team->waited_ns, memory_order_relaxed) / 1e6 : 0.0;
}

/* ---- sharing an operation's items ---- */

ParallelMode parallel_mode(long work) {
    if (work < PARALLEL_MIN_WORK) return PARALLEL_ALONE;
    return work >= PARALLEL_MIN_WORK_TAKE_OVER ? PARALLEL_TAKE_OVER : PARALLEL_STATIC;
}

Share share_begin(Worker *w, long n, ShareKind kind, ParallelMode mode) {
    const int shared = mode != PARALLEL_ALONE && w->threads > 1;
    if (shared && w->pending) team_barrier(w);
    if (!shared) w->pending = 1;
    return (Share){.w = w,
                   .n = n,
                   .kind = kind,
                   .take_over = shared && mode == PARALLEL_TAKE_OVER,
                   .parts = shared ? w->threads : 1};
}

/* Selects part p: its items [first, first + count). */
static void share_part(Share *s, int p) {
    s->part = p;
    if (s->kind == SHARE_EACH) {
        s->first = 0;
        s->count = s->n;
    } else {
        long lo, hi;
        parallel_share(s->n, p, s->parts, &lo, &hi);
        s->first = lo;
        s->count = hi - lo;
    }
}

int share_next(Share *s, long *lo, long *hi) {
    const Worker *w = s->w;
    const int visits = s->take_over ? s->parts : 1; /* parts this thread looks at */
    for (;;) {
        if (!s->in_part) {
            if (s->visited == visits || (s->parts == 1 && w->thread != 0)) return 0;
            share_part(s, (w->thread + s->visited) % s->parts); /* its own part first */
            s->visited++;
            if (!s->take_over) { /* the whole part at once */
                if (s->count == 0) continue;
                *lo = s->first;
                *hi = s->first + s->count;
                return 1;
            }
            s->in_part = 1;
        }
        /* a claim takes a quarter of what looked left (at least one item): few claims while
         * the part is long, single items at its end */
        atomic_ullong *next = &w->team->claims[s->part].next;
        const unsigned long long epoch = (unsigned long long)w->barriers << 32;
        unsigned long long seen = atomic_load_explicit(next, memory_order_relaxed);
        for (;;) {
            const long i = (seen & ~0xFFFFFFFFull) == epoch ? (long)(seen & 0xFFFFFFFFull) : 0;
            if (i >= s->count) break;
            const long take = (s->count - i) / 4 > 1 ? (s->count - i) / 4 : 1;
            if (atomic_compare_exchange_weak_explicit(next, &seen, epoch | (unsigned long long)(i + take),
                                                      memory_order_relaxed, memory_order_relaxed)) {
                *lo = s->first + i;
                *hi = s->first + i + take;
                return 1;
            }
        }
        s->in_part = 0;
    }
}

void share_end(Share *s) {
    if (s->parts > 1) team_barrier(s->w);
}

/* ---- how many threads ---- */

static int chosen_threads; /* --threads; 0: not given */

void threads_set(int n) { chosen_threads = n < 1 ? 1 : n < TEAM_MAX_THREADS ? n : TEAM_MAX_THREADS; }

/* OpenMP's syntax: counts separated by commas, white space around each; a count of more
 * digits than any count in range is out of range, not a parse failure. *first gets the
 * first count. */
enum { ENV_THREADS_FINE, ENV_THREADS_OUT_OF_RANGE, ENV_THREADS_NOT_A_COUNT };
static int env_threads_verdict(const char *v, int *first) {
    int out_of_range = 0;
    for (int k = 0;; k++) {
        while (*v == ' ' || *v == '\t') v++;
        long n = 0;
        int digits = 0;
        for (; *v >= '0' && *v <= '9'; v++, digits++)
            if (n <= TEAM_MAX_THREADS) n = 10 * n + (*v - '0');
        if (digits == 0) return ENV_THREADS_NOT_A_COUNT;
        out_of_range |= n < 1 || n > TEAM_MAX_THREADS;
        if (k == 0) *first = (int)n;
        while (*v == ' ' || *v == '\t') v++;
        if (*v == '\0') return out_of_range ? ENV_THREADS_OUT_OF_RANGE : ENV_THREADS_FINE;
        if (*v++ != ',') return ENV_THREADS_NOT_A_COUNT;
    }
}

int threads_chosen(void) {
    int first;
    const char *env = getenv("OMP_NUM_THREADS");
    return chosen_threads > 0 || (env && env_threads_verdict(env, &first) == ENV_THREADS_FINE);
}

/* --threads, else OMP_NUM_THREADS, else the CPUs this process may run on; at most
 * OMP_THREAD_LIMIT when that is a count, as OpenMP caps its teams. */
int threads_count(void) {
    const char *env = getenv("OMP_NUM_THREADS"), *limit = getenv("OMP_THREAD_LIMIT");
    int n = chosen_threads, cap = 0;
    if (!n && env && env_threads_verdict(env, &n) != ENV_THREADS_FINE) n = 0;
    if (!n) {
        cpu_set_t cpus;
        n = allowed_cpus(&cpus) == 0 ? CPU_COUNT(&cpus) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    }
    if (limit && env_threads_verdict(limit, &cap) == ENV_THREADS_FINE && cap < n) n = cap;
    return n < 1 ? 1 : n < TEAM_MAX_THREADS ? n : TEAM_MAX_THREADS;
}

int threads_check_env(char *err, size_t errlen) {
    const char *env = getenv("OMP_NUM_THREADS"), *limit = getenv("OMP_THREAD_LIMIT");
    char shown[64]; /* cut to fit; no control sequence reaches the terminal */
    int first;
    if (env) {
        snprintf(shown, sizeof shown, "%s", env);
        utf8_mask_controls(shown);
        switch (env_threads_verdict(env, &first)) {
        case ENV_THREADS_OUT_OF_RANGE:
            return errmsg(err, errlen, -1, "OMP_NUM_THREADS=%s is out of range (1..%d)", shown, TEAM_MAX_THREADS);
        case ENV_THREADS_NOT_A_COUNT:
            return errmsg(err, errlen, -1, "OMP_NUM_THREADS needs a thread count (1..%d), got '%s'", TEAM_MAX_THREADS,
                          shown);
        default: break;
        }
    }
    if (limit) { /* a limit past the team's most is no limit; one below 1 or not a count is refused */
        snprintf(shown, sizeof shown, "%s", limit);
        utf8_mask_controls(shown);
        const int verdict = env_threads_verdict(limit, &first);
        if (verdict == ENV_THREADS_NOT_A_COUNT || (verdict == ENV_THREADS_OUT_OF_RANGE && first < 1))
            return errmsg(err, errlen, -1, "OMP_THREAD_LIMIT needs a positive thread count, got '%s'", shown);
    }
    return 0;
}
