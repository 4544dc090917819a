/* test_threads.c: the team of a step (kernels/threads.h): every item of a shared operation
 * is done once, by one thread, in every mode and for every team size; a barrier makes every
 * thread's writes visible to all; work done alone by thread 0 is seen by the next shared
 * operation; a late member makes the team shrink, and it grows back when calm, its
 * left-out members asleep; OMP_NUM_THREADS and OMP_THREAD_LIMIT set the count, and
 * OMP_PROC_BIND binds thread i to the i-th CPU. */
#define _GNU_SOURCE /* syscall(SYS_gettid), the affinity calls */
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <cmocka.h>

#include "kernels/threads.h"
#include "kernels/timer.h"
#include "testutil.h"

enum { MAX_ITEMS = 1000, ROUNDS = 50 };

typedef struct {
    atomic_int visits[MAX_ITEMS]; /* per item, over all threads */
    atomic_int by_thread[8];      /* items each thread did */
    ParallelMode mode;
    ShareKind kind;
    long n;
    int alone_value;      /* written by thread 0 alone, read by every thread after */
    atomic_int saw_alone; /* runs of items that read this round's alone_value */
    atomic_int runs;      /* runs of items share_next gave, in shared rounds */
} Count;

/* Every thread: a shared operation over n items, ROUNDS times, each round after thread 0
 * alone writes the round's number, which every thread must then read. */
static void count_items(void *arg, Worker *w) {
    Count *c = arg;
    for (int round = 0; round < ROUNDS; round++) {
        if (team_alone(w)) c->alone_value = round;
        Share sh = share_begin(w, c->n, c->kind, c->mode);
        for (long lo, hi; share_next(&sh, &lo, &hi);) {
            if (c->mode != PARALLEL_ALONE) {
                atomic_fetch_add(&c->runs, 1);
                if (c->alone_value == round) atomic_fetch_add(&c->saw_alone, 1);
            }
            for (long i = lo; i < hi; i++) {
                atomic_fetch_add(&c->visits[i], 1);
                atomic_fetch_add(&c->by_thread[w->thread], 1);
            }
        }
        share_end(&sh);
        team_barrier(w);
    }
}

static void check_counts(int threads, ParallelMode mode, ShareKind kind, long n) {
    Count *c = calloc(1, sizeof *c);
    c->mode = mode, c->kind = kind, c->n = n;
    run_on_team(threads, count_items, c);
    /* SHARE_EACH: every part holds all n items, so each item is done once a part */
    const int parts = mode == PARALLEL_ALONE || threads == 1 ? 1 : threads;
    const int want = ROUNDS * (kind == SHARE_EACH ? parts : 1);
    for (long i = 0; i < n; i++)
        if (atomic_load(&c->visits[i]) != want)
            fail_msg("threads %d mode %d kind %d n %ld: item %ld done %d times, not %d", threads, (int)mode, (int)kind,
                     n, i, atomic_load(&c->visits[i]), want);
    if (mode == PARALLEL_ALONE)
        for (int t = 1; t < threads; t++) assert_int_equal(atomic_load(&c->by_thread[t]), 0);
    if (mode == PARALLEL_STATIC && kind == SHARE_SPLIT) /* thread p did exactly part p */
        for (int t = 0; t < threads; t++) {
            long lo, hi;
            parallel_share(n, t, parts, &lo, &hi);
            assert_int_equal(atomic_load(&c->by_thread[t]), ROUNDS * (hi - lo));
        }
    free(c);
}

static void test_each_item_once(void **state) {
    (void)state;
    const long sizes[] = {0, 1, 2, 3, 7, 64, 999};
    const ParallelMode modes[] = {PARALLEL_ALONE, PARALLEL_STATIC, PARALLEL_TAKE_OVER};
    for (int threads = 1; threads <= 5; threads++)
        for (size_t m = 0; m < 3; m++)
            for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
                check_counts(threads, modes[m], SHARE_SPLIT, sizes[k]);
                check_counts(threads, modes[m], SHARE_EACH, sizes[k]);
            }
}

/* Every run of items of a shared operation reads what thread 0 wrote alone just before it
 * (an operation that skipped the barrier after the lone write would read the old round). */
static void test_alone_work_seen_by_the_next_shared_operation(void **state) {
    (void)state;
    for (int threads = 2; threads <= 4; threads++) {
        Count *c = calloc(1, sizeof *c);
        c->mode = PARALLEL_TAKE_OVER, c->kind = SHARE_SPLIT, c->n = 500;
        run_on_team(threads, count_items, c);
        assert_true(atomic_load(&c->runs) >= ROUNDS);
        assert_int_equal(atomic_load(&c->saw_alone), atomic_load(&c->runs));
        long runs_total = 0;
        for (int t = 0; t < threads; t++) runs_total += atomic_load(&c->by_thread[t]);
        assert_int_equal(runs_total, ROUNDS * 500);
        free(c);
    }
}

/* Thread t writes slot t, then after a barrier every thread reads every slot. */
typedef struct {
    int slots[8];
    atomic_int wrong;
} Visible;

static void write_then_read(void *arg, Worker *w) {
    Visible *v = arg;
    for (int round = 1; round <= 2000; round++) {
        v->slots[w->thread] = round;
        team_barrier(w);
        for (int t = 0; t < w->threads; t++)
            if (v->slots[t] != round) atomic_fetch_add(&v->wrong, 1);
        team_barrier(w);
    }
}

static void test_barrier_makes_writes_visible(void **state) {
    (void)state;
    for (int threads = 2; threads <= 5; threads++) {
        Visible v = {0};
        run_on_team(threads, write_then_read, &v);
        assert_int_equal(atomic_load(&v.wrong), 0);
    }
}

/* ---- a team that shrinks when a member is late ---- */

enum { LATE_TEAM = 2, LATE_ITEMS = 600 }; /* a team the smallest machine runs without a wait */
/* How long the late member sleeps: several times the team's spin (threads.c's SPIN_NS), so
 * the others' wait at the barrier counts as late however the test machine is loaded. */
enum { LATE_SLEEP_MS = 4 };

typedef struct {
    int step, late_thread; /* this step, thread late_thread sleeps before its share */
    atomic_int visits[LATE_ITEMS];
    int tids[LATE_TEAM]; /* the kernel's thread ids */
} Late;

static void sleep_ms(double ms) {
    struct timespec d = {(time_t)(ms / 1000), (long)((ms - 1000 * (int)(ms / 1000)) * 1e6)};
    while (nanosleep(&d, &d) != 0) {}
}

/* A step: a shared operation with take-overs (so the claims' epochs must agree after a
 * member comes back), every item counted. */
static void late_step(Late *l, Worker *w) {
    l->tids[w->thread] = (int)syscall(SYS_gettid);
    if (w->thread == l->late_thread) sleep_ms(LATE_SLEEP_MS);
    Share sh = share_begin(w, LATE_ITEMS, SHARE_SPLIT, PARALLEL_TAKE_OVER);
    for (long lo, hi; share_next(&sh, &lo, &hi);)
        for (long i = lo; i < hi; i++) atomic_fetch_add(&l->visits[i], 1);
    share_end(&sh);
}

static void late_member(void *arg, Worker *w) {
    while (team_wait(w)) late_step(arg, w);
}

/* Posts one step; checks every item was done once more; returns the step's team size. */
static int post_step(Team *t, Late *l, int late_thread) {
    l->late_thread = late_thread;
    team_post(t);
    Worker *lead = team_leader(t);
    const int size = lead->threads;
    late_step(l, lead);
    l->step++;
    for (int i = 0; i < LATE_ITEMS; i++)
        if (atomic_load(&l->visits[i]) != l->step) fail_msg("step %d: item %d done %d times", l->step, i, atomic_load(&l->visits[i]));
    return size;
}

/* The kernel's state letter of one of this process's threads: R running or runnable, S asleep. */
static char thread_state(int tid) {
    char path[64], line[512];
    snprintf(path, sizeof path, "/proc/self/task/%d/stat", tid);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    assert_non_null(fgets(line, sizeof line, f));
    fclose(f);
    const char *close = strrchr(line, ')'); /* the name may hold spaces */
    assert_non_null(close);
    return close[2];
}

static void test_late_member_shrinks_the_team(void **state) {
    (void)state;
    Late *l = calloc(1, sizeof *l);
    Team *t = team_open(LATE_TEAM, late_member, l);
    assert_non_null(t);
    team_adapt(t, 0); /* no CPU limit: the test decides when the team is late */
    assert_int_equal(post_step(t, l, -1), LATE_TEAM);
    post_step(t, l, 1); /* thread 1 is late: thread 0 waits past its spin at the barrier */
    assert_true(post_step(t, l, -1) < LATE_TEAM);
    /* the left-out thread sleeps in the kernel, not competing for a core, while steps run
     * without it (asked before the calm spell ends) */
    if (team_leader(t)->threads == LATE_TEAM - 1) {
        sleep_ms(2);
        char letter = thread_state(l->tids[LATE_TEAM - 1]);
        for (int i = 0; i < 50 && letter != 'S'; i++) sleep_ms(0.1), letter = thread_state(l->tids[LATE_TEAM - 1]);
        assert_int_equal(letter, 'S');
    }
    /* calm steps: the team grows back to its whole size, the left-out thread rejoining with
     * the others' barrier count (every item still done once) */
    int grown = 0;
    for (int i = 0; i < 400 && !grown; i++) {
        sleep_ms(TEAM_CALM_NS_FIRST / 1e6 / 2);
        grown = post_step(t, l, -1) == LATE_TEAM;
    }
    assert_true(grown);
    for (int i = 0; i < 5; i++) post_step(t, l, -1);
    /* late again at once after growing: shrinks, and the next calm spell is longer */
    post_step(t, l, 1);
    assert_true(post_step(t, l, -1) < LATE_TEAM);
    team_close(t);
    free(l);
}

/* ---- the barriers' waits (--profile) ---- */

enum { WAIT_SLEEP_MS = 20 };

typedef struct {
    atomic_int leader_there; /* thread 0 is about to enter the barrier */
    int sleep;               /* thread 1 sleeps WAIT_SLEEP_MS after that, then enters it */
} Waits;

static void waits_step(Waits *x, Worker *w) {
    if (w->thread == 0) {
        atomic_store(&x->leader_there, 1);
    } else if (x->sleep) {
        while (!atomic_load(&x->leader_there)) {}
        sleep_ms(WAIT_SLEEP_MS);
    }
    team_barrier(w);
}

static void waits_member(void *arg, Worker *w) {
    while (team_wait(w)) waits_step(arg, w);
}

/* Posts one step of the waits test; its wall time on thread 0. */
static double waits_post(Team *t, Waits *x, int sleep) {
    x->sleep = sleep;
    atomic_store(&x->leader_there, 0);
    const double t0 = now_ms();
    team_post(t);
    waits_step(x, team_leader(t));
    return now_ms() - t0;
}

static void test_barrier_waits_when_timed(void **state) {
    (void)state;
    Worker alone = worker_alone();
    assert_true(team_waited_ms(&alone) == 0.0);
    Waits x = {0};
    Team *t = team_open(2, waits_member, &x);
    assert_non_null(t);
    Worker *lead = team_leader(t);
    waits_post(t, &x, 1); /* untimed: nothing is summed */
    assert_true(team_waited_ms(lead) == 0.0);
    team_time_barriers(t);
    /* thread 1 enters the barrier WAIT_SLEEP_MS after thread 0: that is the spread, within
     * the step's wall time */
    const double wall = waits_post(t, &x, 1), waited = team_waited_ms(lead);
    if (!(waited >= 0.75 * WAIT_SLEEP_MS && waited <= wall))
        fail_msg("waited %.3f ms at a barrier thread 1 entered %d ms late, in a step of %.3f ms", waited, WAIT_SLEEP_MS,
                 wall);
    waits_post(t, &x, 0); /* the sum goes on */
    assert_true(team_waited_ms(lead) >= waited);
    team_close(t);
}

/* The policy alone, on a clock the test sets. */
static void test_team_size_policy(void **state) {
    (void)state;
    const long ms = 1000000;
    TeamSize z = {.size = 4, .max = 4, .calm_ns = TEAM_CALM_NS_FIRST};
    team_size_next(&z, 0, 1 * ms, 1);
    assert_int_equal(z.size, 4);
    team_size_next(&z, 1, 2 * ms, 1); /* late: one fewer */
    assert_int_equal(z.size, 3);
    team_size_next(&z, 1, 3 * ms, 1); /* late again: one fewer again, the spell restarts */
    assert_int_equal(z.size, 2);
    team_size_next(&z, 0, 3 * ms + TEAM_CALM_NS_FIRST - 1, 1); /* not calm long enough */
    assert_int_equal(z.size, 2);
    assert_false(team_size_may_grow(&z, 3 * ms + TEAM_CALM_NS_FIRST - 1));
    assert_true(team_size_may_grow(&z, 3 * ms + TEAM_CALM_NS_FIRST));
    team_size_next(&z, 0, 3 * ms + TEAM_CALM_NS_FIRST, 0); /* calm, but no CPU free: a longer spell */
    assert_int_equal(z.size, 2);
    assert_int_equal(z.calm_ns, 2 * TEAM_CALM_NS_FIRST);
    long now = 3 * ms + 3 * TEAM_CALM_NS_FIRST;
    team_size_next(&z, 0, now, 1); /* calm and a CPU free: one more */
    assert_int_equal(z.size, 3);
    team_size_next(&z, 1, now + ms, 1); /* late at once after growing: the spell doubles */
    assert_int_equal(z.size, 2);
    assert_int_equal(z.calm_ns, 4 * TEAM_CALM_NS_FIRST);
    assert_false(team_size_may_grow(&z, now + ms + 2 * TEAM_CALM_NS_FIRST));
    for (int i = 0; i < 20; i++) { /* a machine that stays busy: the spell stops at its longest */
        now = z.calm_since_ns + z.calm_ns;
        team_size_next(&z, 0, now, 1);
        assert_int_equal(z.size, 3);
        team_size_next(&z, 1, now + 1, 1);
        assert_int_equal(z.size, 2);
    }
    assert_int_equal(z.calm_ns, TEAM_CALM_NS_MAX);
    now = z.calm_since_ns + z.calm_ns;
    team_size_next(&z, 0, now, 1); /* grown, then calm for a whole spell: idle again */
    assert_int_equal(z.size, 3);
    team_size_next(&z, 0, now + z.calm_ns, 1);
    assert_int_equal(z.size, 4);
    assert_int_equal(z.calm_ns, TEAM_CALM_NS_FIRST);
    z.size = 1;
    team_size_next(&z, 1, now + 2 * z.calm_ns, 1); /* never below one */
    assert_int_equal(z.size, 1);
}

/* A team not made adaptive keeps its size through late steps: the thread counts the tests
 * and --threads ask for are the ones that run. */
static void test_fixed_team_keeps_its_size(void **state) {
    (void)state;
    Late *l = calloc(1, sizeof *l);
    Team *t = team_open(LATE_TEAM, late_member, l);
    assert_non_null(t);
    for (int i = 0; i < 4; i++) assert_int_equal(post_step(t, l, i % 2 ? 1 : -1), LATE_TEAM);
    assert_int_equal(team_short_steps(t), 0);
    team_close(t);
    free(l);
}

static void test_mode_policy(void **state) {
    (void)state;
    assert_int_equal(parallel_mode(PARALLEL_MIN_WORK - 1), PARALLEL_ALONE);
    assert_int_equal(parallel_mode(PARALLEL_MIN_WORK), PARALLEL_STATIC);
    assert_int_equal(parallel_mode(PARALLEL_MIN_WORK_TAKE_OVER - 1), PARALLEL_STATIC);
    assert_int_equal(parallel_mode(PARALLEL_MIN_WORK_TAKE_OVER), PARALLEL_TAKE_OVER);
}

static void test_thread_count_from_the_environment(void **state) {
    (void)state;
    char err[128];
    setenv("OMP_NUM_THREADS", "3,2", 1);
    unsetenv("OMP_THREAD_LIMIT");
    assert_int_equal(threads_check_env(err, sizeof err), 0);
    assert_int_equal(threads_count(), 3);
    setenv("OMP_THREAD_LIMIT", "2", 1);
    assert_int_equal(threads_count(), 2);
    unsetenv("OMP_THREAD_LIMIT");
    setenv("OMP_NUM_THREADS", "0", 1);
    assert_int_equal(threads_check_env(err, sizeof err), -1);
    assert_string_equal(err, "OMP_NUM_THREADS=0 is out of range (1..256)");
    setenv("OMP_NUM_THREADS", "4\x1b[2J", 1);
    assert_int_equal(threads_check_env(err, sizeof err), -1);
    assert_string_equal(err, "OMP_NUM_THREADS needs a thread count (1..256), got '4?[2J'");
    unsetenv("OMP_NUM_THREADS");
    threads_set(7);
    assert_int_equal(threads_count(), 7);
}

/* Each thread's CPUs, recorded in the team's one step. */
typedef struct {
    cpu_set_t mask[4];
} Masks;

static void record_mask(void *arg, Worker *w) {
    Masks *m = arg;
    assert_int_equal(pthread_getaffinity_np(pthread_self(), sizeof m->mask[0], &m->mask[w->thread]), 0);
    team_barrier(w);
}

/* OMP_PROC_BIND=true puts thread i on the i-th CPU the process may use (wrapping around);
 * unset, every thread may run anywhere. A later team binds the same way, though the
 * leader's own mask is one CPU by then. */
static void test_proc_bind_pins_thread_i_to_cpu_i(void **state) {
    (void)state;
    cpu_set_t all;
    assert_int_equal(sched_getaffinity(0, sizeof all, &all), 0);
    int cpus[CPU_SETSIZE], n = 0;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &all)) cpus[n++] = c;
    Masks *m = calloc(1, sizeof *m);
    unsetenv("OMP_PROC_BIND");
    run_on_team(3, record_mask, m);
    for (int i = 0; i < 3; i++) assert_true(CPU_EQUAL(&m->mask[i], &all));
    setenv("OMP_PROC_BIND", "true", 1);
    for (int team = 0; team < 2; team++) { /* the second team opens with the leader bound already */
        memset(m, 0, sizeof *m);
        run_on_team(3, record_mask, m);
        for (int i = 0; i < 3; i++)
            if (n >= 2) {
                assert_int_equal(CPU_COUNT(&m->mask[i]), 1);
                assert_true(CPU_ISSET(cpus[i % n], &m->mask[i]));
            } else { /* one CPU: nothing to choose */
                assert_true(CPU_EQUAL(&m->mask[i], &all));
            }
    }
    unsetenv("OMP_PROC_BIND");
    assert_int_equal(sched_setaffinity(0, sizeof all, &all), 0);
    free(m);
}

int main(int argc, char **argv) {
    g_tokenizer_path = argc > 1 ? argv[1] : NULL;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_each_item_once),
        cmocka_unit_test(test_alone_work_seen_by_the_next_shared_operation),
        cmocka_unit_test(test_barrier_makes_writes_visible),
        cmocka_unit_test(test_mode_policy),
        cmocka_unit_test(test_late_member_shrinks_the_team),
        cmocka_unit_test(test_fixed_team_keeps_its_size),
        cmocka_unit_test(test_barrier_waits_when_timed),
        cmocka_unit_test(test_team_size_policy),
        cmocka_unit_test(test_thread_count_from_the_environment),
        cmocka_unit_test(test_proc_bind_pins_thread_i_to_cpu_i),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
