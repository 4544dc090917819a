/* The team of parallel.h: every thread runs each job once, with its own number; every
 * item of a loop, and of parallel_run_parts' parts, is done once; a job's writes are all
 * visible when parallel_run returns; inside a team and outside one, the same numbers and
 * shares. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <stdatomic.h>
#include <string.h>
#include <omp.h>

#include "kernels/parallel.h"
#include "testutil.h"

enum { MAX_THREADS = 8, MAX_ITEMS = 1001 };

/* What the threads saw; only the caller asserts (cmocka's checks belong to one thread). */
typedef struct {
    atomic_int calls[MAX_THREADS];  /* parallel_run: calls per thread number */
    atomic_int seen_threads;        /* the n they were given (all equal) */
    atomic_int bad_numbers;         /* calls with thread or n out of range */
    atomic_int visits[MAX_ITEMS];   /* parallel_for: visits per item */
    int use_threads;
} Record;

static void record_thread(const void *ctx, int thread, int threads) {
    Record *r = (Record *)ctx;
    if (thread < 0 || thread >= threads || threads > MAX_THREADS) {
        atomic_fetch_add(&r->bad_numbers, 1);
        return;
    }
    atomic_fetch_add(&r->calls[thread], 1);
    atomic_store(&r->seen_threads, threads);
}

static void record_item(const void *ctx, long i) { atomic_fetch_add(&((Record *)ctx)->visits[i], 1); }

/* the checks, run on the calling thread: inside a team (as its body) or outside one */
static void check_run_and_for(void *arg) {
    Record *r = arg;
    const int want_threads = r->use_threads ? omp_get_max_threads() : 1;
    assert_int_equal(r->use_threads ? parallel_threads() : 1, want_threads);
    for (int round = 0; round < 50; round++) {
        for (int t = 0; t < MAX_THREADS; t++) atomic_store(&r->calls[t], 0);
        parallel_run(record_thread, r, r->use_threads ? PARALLEL_STATIC : PARALLEL_ALONE);
        assert_int_equal(atomic_load(&r->bad_numbers), 0);
        assert_int_equal(atomic_load(&r->seen_threads), want_threads);
        for (int t = 0; t < MAX_THREADS; t++) assert_int_equal(atomic_load(&r->calls[t]), t < want_threads ? 1 : 0);
    }
    const long sizes[] = {0, 1, 2, 5, 100, MAX_ITEMS};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        for (int i = 0; i < MAX_ITEMS; i++) atomic_store(&r->visits[i], 0);
        parallel_for(sizes[k], record_item, r, r->use_threads ? PARALLEL_STATIC : PARALLEL_ALONE);
        for (long i = 0; i < MAX_ITEMS; i++) assert_int_equal(atomic_load(&r->visits[i]), i < sizes[k] ? 1 : 0);
    }
}

static void test_each_thread_and_item_once(void **state) {
    (void)state;
    int saved = omp_get_max_threads();
    for (int threads = 1; threads <= 4; threads++)
        for (int use_threads = 0; use_threads <= 1; use_threads++) {
            omp_set_num_threads(threads);
            Record r = {.use_threads = use_threads};
            check_run_and_for(&r);               /* outside a team */
            parallel_team(check_run_and_for, &r);  /* inside one */
        }
    omp_set_num_threads(saved);
}

/* Each thread writes its slot late (after a delay that varies by round); the caller
 * reads every slot right after parallel_run returns. */
typedef struct {
    int round;
    volatile int slot[MAX_THREADS];
} Join;

static void write_slot_late(const void *ctx, int thread, int threads) {
    (void)threads;
    Join *j = (Join *)ctx;
    for (volatile int spin = 0; spin < (j->round % 7) * 300 * thread; spin++) {
    }
    j->slot[thread] = j->round;
}

static void check_join(void *arg) {
    Join *j = arg;
    const int threads = parallel_threads();
    for (j->round = 1; j->round <= 3000; j->round++) {
        parallel_run(write_slot_late, j, PARALLEL_STATIC);
        for (int t = 0; t < threads; t++) assert_int_equal(j->slot[t], j->round);
    }
}

static void test_run_returns_after_every_thread(void **state) {
    (void)state;
    int saved = omp_get_max_threads();
    omp_set_num_threads(2);
    Join j;
    memset(&j, 0, sizeof j);
    parallel_team(check_join, &j);
    omp_set_num_threads(saved);
}

/* A job that calls parallel_run, parallel_for or parallel_team runs that work alone, with
 * thread 0 of 1, on whichever thread it is: nothing deadlocks, nothing is skipped, and
 * thread 0 does not post a job over the one the others are running. */
typedef struct {
    Record inner[2];           /* what each thread's own parallel_run and parallel_for did */
    atomic_int threads_of[2];  /* parallel_threads() on each thread, inside the job */
} Nested;

static void nested_run(const void *ctx, int thread, int threads) {
    (void)threads;
    Nested *n = (Nested *)ctx;
    atomic_store(&n->threads_of[thread], parallel_threads());
    n->inner[thread].use_threads = 1;
    parallel_run(record_thread, &n->inner[thread], PARALLEL_STATIC);
    parallel_for(10, record_item, &n->inner[thread], PARALLEL_STATIC);
}

static void run_nested(void *arg) { parallel_run(nested_run, arg, PARALLEL_STATIC); }

static void count_body(void *arg) { atomic_fetch_add((atomic_int *)arg, 1); }

static void team_in_team(void *arg) { parallel_team(count_body, arg); }

static void test_nested_calls_run_alone(void **state) {
    (void)state;
    int saved = omp_get_max_threads();
    omp_set_num_threads(2);
    static Nested n;
    memset(&n, 0, sizeof n);
    parallel_team(run_nested, &n);
    for (int t = 0; t < 2; t++) {
        const Record *r = &n.inner[t];
        assert_int_equal(atomic_load(&n.threads_of[t]), 1);
        assert_int_equal(atomic_load(&r->bad_numbers), 0);
        assert_int_equal(atomic_load(&r->calls[0]), 1);
        assert_int_equal(atomic_load(&r->calls[1]), 0);
        assert_int_equal(atomic_load(&r->seen_threads), 1);
        for (int i = 0; i < MAX_ITEMS; i++) assert_int_equal(atomic_load(&r->visits[i]), i < 10 ? 1 : 0);
    }
    atomic_int bodies = 0;
    parallel_team(team_in_team, &bodies);
    assert_int_equal(atomic_load(&bodies), 1);
    omp_set_num_threads(saved);
}

/* parallel_run_parts: every item of every part is done once, whatever the thread count,
 * with take-overs or without (then each part by its own thread), parts of 0 to 999 items. */
typedef struct {
    atomic_int visits[4][1000];  /* [part][item] */
    atomic_int bad_ranges;        /* calls with a range outside the part or the wrong thread number */
    atomic_int done_by[4][1000];  /* the OpenMP thread that did it */
} PartsRecord;

static long parts_count(const void *ctx, int part, int parts) {
    (void)ctx, (void)parts;
    return (long)part * 333;  /* 0, 333, 666, 999 */
}

static void parts_items(const void *ctx, int part, int parts, long lo, long hi, int thread) {
    PartsRecord *r = (PartsRecord *)ctx;
    if (lo < 0 || hi <= lo || hi > parts_count(ctx, part, parts)) atomic_fetch_add(&r->bad_ranges, 1);
    if (thread != omp_get_thread_num()) atomic_fetch_add(&r->bad_ranges, 1);  /* the thread it runs on */
    for (long i = lo; i < hi && i >= 0 && i < 1000; i++) {
        atomic_fetch_add(&r->visits[part][i], 1);
        atomic_store(&r->done_by[part][i], omp_get_thread_num());
    }
}

static void check_parts(void *arg) {
    PartsRecord *r = arg;
    const int parts = parallel_threads();
    for (int round = 0; round < 20; round++) {
        memset(r->visits, 0, sizeof r->visits);
        const ParallelParts w = {parts_count, parts_items, r};
        parallel_run_parts(&w, round % 2 ? PARALLEL_TAKE_OVER : PARALLEL_STATIC);
        assert_int_equal(atomic_load(&r->bad_ranges), 0);
        for (int p = 0; p < 4; p++)
            for (int i = 0; i < 1000; i++) {
                const int in_part = p < parts && i < parts_count(r, p, parts);
                assert_int_equal(atomic_load(&r->visits[p][i]), in_part);
                if (in_part && round % 2 == 0) assert_int_equal(atomic_load(&r->done_by[p][i]), p);  /* its own thread */
            }
    }
}

static void test_parts_each_item_once(void **state) {
    (void)state;
    int saved = omp_get_max_threads();
    static PartsRecord r;
    for (int threads = 1; threads <= 4; threads++) {
        omp_set_num_threads(threads);
        check_parts(&r);               /* outside a team */
        parallel_team(check_parts, &r);  /* inside one */
    }
    omp_set_num_threads(saved);
}

/* The one policy: small work alone, take-overs from PARALLEL_MIN_TOKENS_TAKE_OVER tokens. */
static void test_mode_policy(void **state) {
    (void)state;
    assert_int_equal(parallel_mode(PARALLEL_MIN_WORK - 1, 256), PARALLEL_ALONE);
    assert_int_equal(parallel_mode(PARALLEL_MIN_WORK, 1), PARALLEL_STATIC);
    assert_int_equal(parallel_mode(PARALLEL_MIN_WORK, PARALLEL_MIN_TOKENS_TAKE_OVER - 1), PARALLEL_STATIC);
    assert_int_equal(parallel_mode(PARALLEL_MIN_WORK, PARALLEL_MIN_TOKENS_TAKE_OVER), PARALLEL_TAKE_OVER);
}

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_each_thread_and_item_once),
        cmocka_unit_test(test_run_returns_after_every_thread),
        cmocka_unit_test(test_nested_calls_run_alone),
        cmocka_unit_test(test_parts_each_item_once),
        cmocka_unit_test(test_mode_policy),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
