/* test_threads.c: the team of a step (kernels/threads.h): every item of a shared operation
 * is done once, by one thread, in every mode and for every team size; a barrier makes every
 * thread's writes visible to all; work done alone by thread 0 is seen by the next shared
 * operation; OMP_NUM_THREADS and OMP_THREAD_LIMIT set the count. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "kernels/threads.h"
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

static void test_mode_policy(void **state) {
    (void)state;
    assert_int_equal(parallel_mode(PARALLEL_MIN_WORK - 1, 256), PARALLEL_ALONE);
    assert_int_equal(parallel_mode(PARALLEL_MIN_WORK, 1), PARALLEL_STATIC);
    assert_int_equal(parallel_mode(PARALLEL_MIN_WORK, PARALLEL_MIN_TOKENS_TAKE_OVER - 1), PARALLEL_STATIC);
    assert_int_equal(parallel_mode(PARALLEL_MIN_WORK, PARALLEL_MIN_TOKENS_TAKE_OVER), PARALLEL_TAKE_OVER);
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

int main(int argc, char **argv) {
    g_tokenizer_path = argc > 1 ? argv[1] : NULL;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_each_item_once),
        cmocka_unit_test(test_alone_work_seen_by_the_next_shared_operation),
        cmocka_unit_test(test_barrier_makes_writes_visible),
        cmocka_unit_test(test_mode_policy),
        cmocka_unit_test(test_thread_count_from_the_environment),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
