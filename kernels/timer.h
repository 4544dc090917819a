/* timer.h: a monotonic clock in milliseconds, for the latency logs, and a clock of stages
 * for --profile. */
#ifndef TIMER_H
#define TIMER_H

#include <time.h>

static inline double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Where a step's time goes: stage_begin marks the start of a run of stages, stage_end
 * charges the time since the last mark to slot `slot` of ms and marks again. Only thread 0
 * reads the clock: every shared stage ends in a barrier, so thread 0 leaves it last and its
 * clock covers the whole team. A NULL clock (profiling off) costs one branch and no clock
 * call. */
typedef struct {
    double *ms; /* (slots) milliseconds charged to each slot so far */
    double mark;
} StageClock;

static inline void stage_begin(StageClock *c, int thread) {
    if (c && thread == 0) c->mark = now_ms();
}

static inline void stage_end(StageClock *c, int thread, int slot) {
    if (c && thread == 0) {
        const double t = now_ms();
        c->ms[slot] += t - c->mark;
        c->mark = t;
    }
}

#endif /* TIMER_H */
