/* attn_dump.h: --dump-attn FILE, the attention weights of chosen layers, heads, steps and
 * sequences, in the binary format of docs/PROFILE.md. */
#ifndef ATTN_DUMP_H
#define ATTN_DUMP_H

#include <stdio.h>

#include "attention.h"
#include "model.h"
#include "serve/cli.h"

typedef struct {
    FILE *f;
    const char *path;
    const Options *o;
    const Config *cfg;
    AttnRecord record; /* the scheduler's: what each step recorded */
    unsigned char *layers, *heads;
    long records;
} AttnDump;

/* Takes the chosen layers and heads; dies with one line (exit 2) when one is not in the
 * model, or a chosen sequence not among the run's n_sequences. Called before any output is
 * opened, so a refused run leaves every file as it was. */
void attn_dump_open(AttnDump *d, const Model *m, const Options *o, int n_sequences);

/* Writes the header to f (opened by the caller, refused when it is an input). */
void attn_dump_begin(AttnDump *d, FILE *f);
/* Whether step `step` is recorded. */
int attn_dump_wants_step(const AttnDump *d, int step);
/* After step `step`: its records of the chosen sequences into the file. */
void attn_dump_step(AttnDump *d, int step);
void attn_dump_close(AttnDump *d);

#endif /* ATTN_DUMP_H */
