/* session.h: what every mode of ./run shares (serve/modes.h): ending the run with one line,
 * writing outputs whose loss is never silent, a prompt's tokens, the requests of a run,
 * a scheduler set up from the options, and the fields every --json object starts with. */
#ifndef SESSION_H
#define SESSION_H

#include <stdio.h>

#include "model.h"
#include "serve/cli.h"
#include "serve/scheduler.h"

enum { EXIT_USAGE = 2 };

/* "run: <message>" on stderr, and exit(code). */
_Noreturn void die(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Dies with one line when f could not be written (a full disk, a closed descriptor, a
 * broken pipe with SIGPIPE ignored): a run whose output is lost must not exit 0. */
void check_written(FILE *f, const char *name);
void close_written(FILE *f, const char *name);
/* Dies with the line a scheduler or forward-pass error code deserves (none for 0). */
void check_model(int rc);

/* What a negative spm_encode result means, after "the prompt" or "story N". */
const char *encode_error(int code);
/* BOS and the prompt's tokens into tokens (max_tokens); `where` ("" or "FILE:LINE: ")
 * starts any error message. Dies when the prompt does not leave room to generate, or
 * runs past the context after the `fill` positions --fill puts before it (the last of
 * its logits then give the one token there is room for). A model without a tokenizer (--shape) reads
 * the prompt as token ids, separated by spaces or commas, each below the vocabulary size. */
int encode_prompt(const Model *m, const char *prompt, int fill, int *tokens, int max_tokens, const char *where);

/* The run's requests: B copies of the prompt (request i with seed + i), or a line each of
 * the --prompts file, every line encoded (and refused with its number) before anything
 * runs. A request holds its prompt's tokens only; its array grows as it generates. */
typedef struct {
    Request *requests;
    int n;
    const char **texts; /* (n) each request's prompt text */
    void *file;         /* the --prompts file they point into */
} RequestList;
RequestList requests_of(const Model *m, const Options *o);
void requests_free(RequestList *l);

/* A scheduler for the options' cache, form, sampling, -n and speculation (draft: the
 * model of --draft CKPT, or NULL), with max_batch slots, initialized (dies when it cannot be). */
void scheduler_open(Scheduler *sch, const Model *m, KVPool *pool, const Drafter *draft, const Options *o,
                    int max_batch);

/* Opens a --json object with what every one carries: what it is, the program's version
 * and commit, the checkpoint, variant and cache settings, the threads and the seed. The
 * caller adds its figures (json_field, or its own printf) and closes it (json_end). */
void json_begin(const char *type, const Model *m, const Options *o, const char *mode);
/* About the bytes of the scheduler's scratch: the logits and activations of a pass's
 * tokens (scheduler_max_tokens). */
size_t scheduler_scratch_bytes(const Config *c, int max_batch);
/* Whether a sequence the pool cannot hold streams its oldest blocks from the tier
 * (kvtier.h's KVStream): a generation at --batch 1 with --kv-offload, no window. */
int run_streams(const Options *o);
/* The staging area a stream reads the tier's blocks into, part of --kv-mem: two layers of
 * a full context's blocks; 0 when the run does not stream. */
size_t stream_stage_bytes(const Config *c, const Options *o);
/* The memory this machine has for a new allocation (MemAvailable) and in all (MemTotal),
 * in bytes, from /proc/meminfo, or sysconf's pages where it cannot be read. 0 or -1. */
int machine_memory(double *available, double *total);
void json_field(const char *key, double value);
void json_end(void);

#endif /* SESSION_H */
