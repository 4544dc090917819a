/* modes.h: the modes of ./run, one a run, each driving the model through the scheduler's
 * steps (scheduler.h). Each returns the run's exit status (die()s on bad data). */
#ifndef MODES_H
#define MODES_H

#include "kvcache.h"
#include "model.h"
#include "serve/cli.h"
#include "serve/scheduler.h"

/* Generation: one sequence, --batch B of the prompt, or --prompts through B slots. The text
 * on stdout, step lines and the summary on stderr, --json, --log, --dump-logits. */
int mode_generate(const Model *m, KVPool *pool, const Drafter *draft, const Options *o);
/* --check-batch: every sequence of the batch against itself run alone. Exit 1 when any differs. */
int mode_check_batch(const Model *m, KVPool *pool, const Options *o);
/* --check-kv: greedy with the cache against greedy without it. Exit 1 when they differ. */
int mode_check_kv(const Model *m, KVPool *pool, const Options *o);
/* --check-spec: greedy with speculation (--draft) against without it, every sequence of
 * the batch or --prompts: the same tokens and bitwise the same logits at every emitted
 * position. Exit 1 when any differs. */
int mode_check_spec(const Model *m, KVPool *pool, const Drafter *draft, const Options *o);
/* --ppl FILE: mean NLL and perplexity of a text file of stories. */
int mode_ppl(const Model *m, KVPool *pool, const Options *o);
/* --info: the configuration, parameters, weight and KV cache bytes for the options' context,
 * batch, dtype and a pool of pool_blocks blocks, and whether they fit in this machine's
 * memory; from the shape alone, allocating nothing big (no weights, no pool). */
int mode_info(const Config *c, const Options *o, int pool_blocks);

#endif /* MODES_H */
