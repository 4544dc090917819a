/* cli.h: the command line of ./run, parsed without side effects.
 *
 * cli_parse never exits and never prints: run.c prints what it returns. It is a
 * module of its own so that fuzz/fuzz_cli.c can feed it arbitrary argument vectors. */
#ifndef CLI_H
#define CLI_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "config.h"

#define CLI_MAX_THREADS 256
#define CLI_MAX_BATCH 256

typedef struct {
    const char *checkpoint;
    const char *prompt;
    int steps;            /* 0 = until EOS or the context is full */
    int top_k;
    float temperature;
    uint64_t seed;
    int kv;
    int threads;          /* 0 = OpenMP's default */
    const char *log_path;
    int quiet;
    int ignore_eos;
    MlaForm mla_form;     /* --mla; by default absorbed with --kv, expanded without it (and for --ppl) */
    int check_kv;
    const char *ppl_path;
    int info;
    const char *dump_path;
    int batch;            /* sequences decoded together (1 = one) */
    int batch_given;      /* --batch was on the command line */
    float kv_mem_mb;      /* the KV pool's size in MiB; 0 = enough for `batch` full contexts */
    int json;             /* one JSON object per line and sequence on stdout */
    int check_batch;
    const char *prompts_path;  /* --prompts: one prompt a line, served through `batch` slots */
    DType kv_dtype;       /* of the cached elements: fp32, bf16 or int8 */
    int window;           /* positions each sequence's cache keeps; 0 = the whole context */
    int window_sinks;     /* of them, the first positions kept for good (--window-policy sinks) */
    int prompt_given;     /* -p was on the command line */
    int usage_on_error;   /* with return 2: print the usage text to stderr before the message */
} Options;

/* Parses argv[1..argc) into o (the strings are not copied: o points into argv).
 * Returns 0 when o is ready to run, 1 when help was asked for (the caller prints
 * cli_usage(stdout) and exits 0), 2 on a usage error: one sentence in err (errlen
 * bytes, always NUL-terminated when errlen > 0; cut when longer), which ./run prints
 * as "run: <message>" before exiting 2 (after cli_usage(stderr) when
 * o->usage_on_error). Limits that depend on the model (-k, -n) are checked by run.c. */
int cli_parse(Options *o, int argc, char **argv, char *err, size_t errlen);

/* The help text. */
void cli_usage(FILE *f);

/* The sink positions --window-policy sinks keeps, as StreamingLLM's default. */
enum { CLI_WINDOW_SINKS = 4 };

/* "fp32", "bf16" or "int8" */
const char *kv_dtype_name(DType dtype);

/* "absorb" or "expand", as --mla spells them */
const char *mla_form_name(MlaForm form);

#endif /* CLI_H */
