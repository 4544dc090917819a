/* timer.h: a monotonic clock in milliseconds, for the latency logs. */
#ifndef TIMER_H
#define TIMER_H

#include <time.h>

static inline double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

#endif /* TIMER_H */
