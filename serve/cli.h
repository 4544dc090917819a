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
#include "kernels/threads.h"
#include "kvcache.h"
#include "serve/indexlist.h"

#define CLI_MAX_BATCH 256

typedef struct {
    const char *checkpoint;
    const char *shape; /* --shape SPEC (shape.h): a model of generated weights instead of a checkpoint */
    int ctx_size;      /* -c: the context, at most a checkpoint's trained one; 0 = the model's */
    const char *prompt;
    const char *prompt_path; /* -f FILE, or "-" for -p - (standard input): run.c reads it into prompt */
    int steps;               /* 0 = until EOS or the context is full */
    int top_k;
    int top_k_given; /* -k given: else 40, or the whole vocabulary when that is smaller */
    float top_p;     /* 1 = off */
    float temperature;
    uint64_t seed;
    int kv;
    int threads; /* 0 = threads.h's default */
    const char *log_path;
    int quiet;   /* no step lines on stderr */
    int verbose; /* step lines on stderr even when it shares a terminal with stdout */
    int ignore_eos;
    MlaForm mla_form; /* --mla; by default absorbed with --kv, expanded without it (and for --ppl) */
    int check_kv;
    const char *ppl_path;
    int info;
    const char *dump_path;
    int batch;       /* sequences decoded together (1 = one) */
    int batch_given; /* --batch was on the command line */
    float kv_mem_mb; /* the KV pool's size in MiB; 0 = enough for `batch` full contexts */
    const char *kv_offload; /* --kv-offload: the tier file behind the pool (kvtier.h); NULL: none */
    int preempt_swap;       /* --preempt: 1 swap to the tier, 0 recompute; -1 not given, with a tier: the
                             * measured rule (scheduler.h's preempt_rule) */
    int json;        /* one JSON object per line and sequence on stdout */
    int check_batch;
    int check_spec; /* --check-spec: greedy with and without speculation, compared */
    int draft;      /* --draft ngram|CKPT|TABLE: speculative decoding */
    const char *draft_path; /* --draft CKPT|TABLE: the draft checkpoint or the corpus table; NULL: ngram */
    int draft_k; /* --draft-k: draft tokens a pass, 1..16 */
    const char *prompts_path; /* --prompts: one prompt a line, served through `batch` slots */
    DType kv_dtype;           /* of the cached elements: fp32, bf16, int8 or fp8 (e4m3) */
    int window;               /* positions each sequence's cache keeps; 0 = the whole context */
    int window_from_model;    /* window is the model's own (Config's window), no --window given */
    const char *window_flag;  /* "--window" or "--kv-budget", as given: the messages name it */
    int window_sinks;         /* of them, the first positions kept for good (--evict sinks) */
    KVEvict evict;            /* what a full window gives up (--evict) */
    int fill;                 /* --fill: positions of generated cache entries every sequence starts after */
    int fill_grew_ctx;        /* --shape's own context, when --fill past it (no -c) set the context */
    int prompt_given;         /* -p or -f was on the command line */
    int mla_given;        /* --mla was on the command line (refused for a model without MLA) */
    int threads_note;         /* -t above 2: say that -t is the temperature here and threads are --threads */
    int usage_on_error;       /* with return 2: print the usage text to stderr before the message */
    /* what the step does inside (docs/PROFILE.md): */
    int profile;                /* --profile: 1 the parts of each step, 2 (--profile=layers) also per layer */
    const char *profile_peaks;  /* --profile-peaks FILE: build/roofline's output, the machine's peaks */
    const char *dump_attn_path; /* --dump-attn FILE: attention weights */
    IndexList dump_attn_layers, dump_attn_heads, dump_attn_steps, dump_attn_sequences; /* what it records */
} Options;

enum { CLI_RUN = 0, CLI_HELP = 1, CLI_USAGE_ERROR = 2, CLI_VERSION = 3 };

/* Parses argv[1..argc) into o with getopt_long (the strings are not copied: o points
 * into argv, which is not reordered). Every flag has a long name; values may follow as
 * the next argument or after '='; "--" ends the flags. Returns CLI_RUN when o is ready
 * to run; CLI_HELP or CLI_VERSION when -h or --version was asked for (the caller prints
 * and exits 0); CLI_USAGE_ERROR with one sentence in err (errlen bytes, always
 * NUL-terminated when errlen > 0; cut when longer), which ./run prints as
 * "run: <message>" before exiting 2 (after cli_usage(stderr) when o->usage_on_error).
 * Limits that depend on the model (-k, -n) are checked by run.c. Not reentrant: getopt
 * keeps its state in globals. */
int cli_parse(Options *o, int argc, char **argv, char *err, size_t errlen);

/* The help text. */
void cli_usage(FILE *f);

/* The sink positions --evict sinks keeps, as StreamingLLM's default. */
enum { CLI_WINDOW_SINKS = 4 };

/* "fp32", "bf16", "int8" or "fp8" */
const char *kv_dtype_name(DType dtype);
/* --evict's name for the policy o chose: ring, sinks, h2o or block. */
const char *evict_name(const Options *o);

/* "absorb" or "expand", as --mla spells them */
const char *mla_form_name(MlaForm form);

#endif /* CLI_H */
