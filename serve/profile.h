/* profile.h: --profile, what a step does inside (docs/PROFILE.md).
 *
 * The model and the scheduler charge each stage of a step to a StageClock (kernels/timer.h:
 * thread 0's clock, read at the barrier that ends each stage); after every step
 * profile_step takes the clock's reading and adds the bytes and FLOPs the step's shapes
 * and positions imply. The run's figures go into the summary, its JSON and the --log CSV. */
#ifndef PROFILE_H
#define PROFILE_H

#include <stdio.h>

#include "kvcache.h"
#include "model.h"
#include "serve/cli.h"
#include "serve/scheduler.h"

/* The parts a step's time is split into, as the summary names them. */
enum { PART_ATTENTION, PART_PROJECTIONS, PART_FFN, PART_HEAD, PART_SAMPLING, PART_EMBEDDING, PARTS };

/* One step's figures, or a phase's sums over its steps. */
typedef struct {
    int steps;
    double step_ms;
    double part_ms[PARTS];
    double part_wait_ms[PARTS]; /* of each part, the team's waits at its barriers (team_waited_ms) */
    double *layer_ms; /* (n_layers, STAGES_PER_LAYER) */
    double weight_bytes, kv_bytes, flops;
} ProfileFigures;

typedef struct {
    const Model *model;
    const KVPool *pool;
    MlaForm form;
    int per_layer;
    StageClock clock; /* the scheduler's: stage_slots(cfg) slots */
    /* what one pass reads of the weights, and the multiply-adds a token and a key cost */
    double pass_weight_bytes, token_macs, key_macs, sequence_key_macs;
    /* the machine's peaks (0: none) and where they came from */
    double peak_GBps, peak_GFLOPs;
    int peak_threads;
    const char *peaks_path;
    ProfileFigures step;      /* the last step's */
    ProfileFigures phases[2]; /* sums: the first step (prefill), every later one (decode) */
} Profile;

/* Sets p up for the run (dies with one line when the peaks file cannot be read). */
void profile_open(Profile *p, const Model *m, const KVPool *pool, const Options *o);
/* After a step: its figures from the clock and st, added to its phase; the clock reset. */
void profile_step(Profile *p, const StepResult *st);
/* The summary's lines (text), the "profile" member of the summary's JSON, and the --log
 * CSV's columns (header, then the last step's row), each starting with a comma. */
void profile_print(FILE *out, const Profile *p);
void profile_json(const Profile *p);
void profile_csv_header(FILE *csv);
void profile_csv_row(FILE *csv, const Profile *p);
void profile_close(Profile *p);

#endif /* PROFILE_H */
