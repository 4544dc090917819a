/* timer.h: a monotonic clock in milliseconds, for the latency logs, and a clock of stages
 * for --profile. */
#ifndef TIMER_H
#define TIMER_H

#include <time.h>

#include "kernels/threads.h"

static inline double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Where a step's time goes: stage_begin marks the start of a run of stages, stage_end
 * charges the time since the last mark to slot `slot` of ms, and the team's waits at the
 * barriers since then (team_waited_ms) to the same slot of wait_ms, and marks again. Only
 * thread 0 reads the clock: every shared stage ends in a barrier, so thread 0 leaves it
 * last and its clock covers the whole team. A NULL clock (profiling off) costs one branch
 * and no clock call. */
typedef struct {
    double *ms;      /* (slots) milliseconds charged to each slot so far */
    double *wait_ms; /* (slots) of which the team's threads waited for one another */
    double mark, wait_mark;
} StageClock;

static inline void stage_begin(StageClock *c, const Worker *w) {
    if (c && w->thread == 0) c->mark = now_ms(), c->wait_mark = team_waited_ms(w);
}

static inline void stage_end(StageClock *c, const Worker *w, int slot) {
    if (c && w->thread == 0) {
        const double t = now_ms(), waited = team_waited_ms(w), spread = waited - c->wait_mark;
        c->ms[slot] += t - c->mark;
        /* a member may reach the stage's first barrier before thread 0 has marked its start */
        c->wait_ms[slot] += spread < t - c->mark ? spread : t - c->mark;
        c->mark = t, c->wait_mark = waited;
    }
}

#endif /* TIMER_H */
