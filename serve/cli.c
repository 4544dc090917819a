/* cli.c: the flag parser of ./run (see cli.h). */
#include "serve/cli.h"

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/errmsg.h"

void cli_usage(FILE *f) {
    fputs("Usage: run CHECKPOINT [options]\n"
          "       run --shape SPEC [options]\n"
          "Generates a TinyStories continuation of a prompt, logging the latency of every step.\n"
          "Values follow a flag as the next argument or after '=' (--top-k=40); -- ends the flags.\n"
          "\n"
          "      --shape SPEC      no checkpoint: a model of weights generated from the seed, of a preset\n"
          "                        shape, key=value,... or both (llama2-7b,kv_heads=1; docs/SHAPES.md); its\n"
          "                        prompt is token ids (-p \"1 2 3\") and its output ids that mean nothing\n"
          "  -c, --ctx-size N      the context: a checkpoint's trained one or less; --shape's up to 131072\n"
          "  -p, --prompt PROMPT   prompt text; - reads it from standard input (default: empty, BOS only)\n"
          "  -f, --file FILE       read the prompt from a UTF-8 text file (CRLF read as LF; trailing line\n"
          "                        breaks dropped)\n"
          "  -n, --n-predict N     tokens to generate, 1..context (default: until EOS or the context is full)\n"
          "  -k, --top-k K         keep the K most likely tokens, 1..vocab; 1 is greedy (default 40, or vocab)\n"
          "      --top-p P         then the fewest whose probability reaches P, 0..1; 1 is off (default 1)\n"
          "  -t, --temp T          then divide the logits by T, 0..100; 0 is greedy (default 1.0)\n"
          "  -s, --seed S          random seed, a non-negative integer (default: from the clock; printed)\n"
          "      --kv              decode with a KV cache (default: recompute the whole sequence every step)\n"
          "      --mla absorb|expand  MLA form (default: absorb with --kv, expand without it and for --ppl)\n"
          "      --batch B         decode B sequences of the prompt together, sequence i with seed s+i, 1..256\n"
          "      --kv-mem MB       the KV cache's pool in MiB, fractions allowed (default: B full contexts)\n"
          "      --kv-offload PATH  with --kv: a tier file on disk behind the pool, created anew (an\n"
          "                        existing PATH is refused) and removed at once, so never left behind;\n"
          "                        at --batch 1 a cache larger than --kv-mem streams its oldest blocks from it\n"
          "      --preempt swap|recompute  a preempted sequence's cache goes to the tier and comes back,\n"
          "                        or is recomputed (default with --kv-offload: whichever the tier's measured\n"
          "                        speed says is faster for that sequence; without: recompute)\n"
          "      --prompts FILE    serve a file of prompts, one a line, through the --batch slots, sequence i\n"
          "                        with seed s+i (continuous batching)\n"
          "      --kv-dtype fp32|bf16|int8|fp8|int4|int2  precision of the cached keys and values\n"
          "                        (default fp32; int4 and int2 after KIVI: docs/KVCACHE.md)\n"
          "      --kv-budget N, --window N  with --kv: keep N positions a sequence, so -n may exceed the\n"
          "                        context\n"
          "      --fill N          with --kv: start every sequence at position N, over a cache of generated\n"
          "                        entries that no pass computed (the step time at a long context); past\n"
          "                        --shape's context without -c, the context is N plus the shape's own\n"
          "      --evict ring|sinks|h2o|block, --window-policy  what a full budget gives up: the oldest\n"
          "                        position (ring, default), the oldest after the first 4 (sinks), the\n"
          "                        least attended older than the recent half (h2o), or the least attended\n"
          "                        block of 16 older than it (block; a budget of 32, 48, ...)\n"
          "      --threads N       threads, 1..256 (default: OMP_NUM_THREADS, else all cores)\n"
          "      --log FILE.csv    write the per-step latencies as CSV\n"
          "      --dump-logits FILE  write the logits of every step as raw float32 (steps x vocab)\n"
          "      --json            JSON on stdout: one object a sequence and one for the summary, or one\n"
          "                        for --info, --ppl and each check (--check-kv, --check-batch, --check-spec)\n"
          "      --profile[=layers]  per step: time in attention, projections, FFN, head and sampling (and\n"
          "                        per layer), bytes read, FLOPs, GB/s and GFLOP/s (docs/PROFILE.md)\n"
          "      --profile-peaks FILE  the machine's peaks for --profile: build/roofline's output\n"
          "      --dump-attn FILE  write attention weights (docs/PROFILE.md's format) of the chosen\n"
          "      --dump-attn-layers L, --dump-attn-heads H, --dump-attn-steps S, --dump-attn-seqs Q\n"
          "                        each all (default) or indices like 0,3,5-7\n"
          "  -v, --verbose         step lines on stderr also in a file, a pipe or stdout's terminal\n"
          "  -q, --quiet           no step lines on stderr (the summary stays)\n"
          "      --ignore-eos      keep generating after EOS\n"
          "\n"
          "Other modes, one a run:\n"
          "      --check-kv        greedy runs with and without the cache: the same tokens, bitwise the same\n"
          "                        logits? Exit 1 when not\n"
          "      --check-batch     with --batch: is every sequence bitwise what it is when run alone?\n"
          "      --check-spec      with --draft: greedy with and without speculation, bitwise the same?\n"
          "      --draft ngram|CKPT|TABLE  with --kv: speculative decoding, drafts by prompt lookup,\n"
          "                        by a small model of the same tokenizer (a checkpoint) or by a\n"
          "                        corpus n-gram table (train/ngram.py)\n"
          "      --draft-k K       draft tokens verified a pass, 1..16 (default 4)\n"
          "      --ppl FILE        mean NLL (nats/token) and perplexity of a text file (stories separated\n"
          "                        by <|endoftext|> lines), each story scored in windows of the context\n"
          "      --info            configuration, parameters and KV cache sizes\n"
          "  -h, --help            this help\n"
          "      --version         the version and the git commit it was built from\n",
          f);
}

const char *mla_form_name(MlaForm form) { return form == MLA_ABSORBED ? "absorb" : "expand"; }

const char *evict_name(const Options *o) {
    return o->evict == KV_EVICT_H2O ? "h2o" : o->evict == KV_EVICT_BLOCK ? "block" : o->window_sinks ? "sinks" : "ring";
}

const char *kv_dtype_name(DType dtype) {
    static const char *const names[] = {"fp32", "bf16", "int8", "fp8", "int4", "int2"};
    return names[dtype];
}

/* 0 with *out set, or 2 with the message in err. */
static int parse_long(const char *flag, const char *s, long lo, long hi, long *out, char *err, size_t errlen) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end) return errmsg(err, errlen, 2, "%s needs an integer, got '%s'", flag, s);
    if (errno == ERANGE) /* an integer all the same, past what a long holds */
        return errmsg(err, errlen, 2, "%s %s is out of range (%ld..%ld)", flag, s, lo, hi);
    if (v < lo || v > hi) return errmsg(err, errlen, 2, "%s %ld is out of range (%ld..%ld)", flag, v, lo, hi);
    *out = v;
    return 0;
}

static int parse_float(const char *flag, const char *s, float lo, float hi, float *out, char *err, size_t errlen) {
    char *end;
    float v = strtof(s, &end); /* ERANGE needs no check: an overflow is inf, an underflow rounds */
    if (end == s || *end || isnan(v)) return errmsg(err, errlen, 2, "%s needs a number, got '%s'", flag, s);
    if (isinf(v)) /* 1e39 overflows a float (ERANGE) as inf does: a number, out of range */
        return errmsg(err, errlen, 2, "%s %s is out of range (%.10g..%.10g)", flag, s, lo, hi);
    if (v < lo || v > hi) return errmsg(err, errlen, 2, "%s %s is out of range (%.10g..%.10g)", flag, s, lo, hi);
    *out = v;
    return 0;
}

/* Codes of the flags that have no short form. */
enum {
    OPT_KV = 256,
    OPT_MLA,
    OPT_BATCH,
    OPT_KV_MEM,
    OPT_KV_OFFLOAD,
    OPT_PREEMPT,
    OPT_PROMPTS,
    OPT_KV_DTYPE,
    OPT_WINDOW,
    OPT_WINDOW_POLICY,
    OPT_THREADS,
    OPT_LOG,
    OPT_DUMP_LOGITS,
    OPT_JSON,
    OPT_IGNORE_EOS,
    OPT_CHECK_KV,
    OPT_CHECK_BATCH,
    OPT_CHECK_SPEC,
    OPT_DRAFT,
    OPT_DRAFT_K,
    OPT_PPL,
    OPT_INFO,
    OPT_VERSION,
    OPT_TOP_P,
    OPT_FILL,
    OPT_SHAPE,
    OPT_PROFILE,
    OPT_PROFILE_PEAKS,
    OPT_DUMP_ATTN,
    OPT_DUMP_ATTN_LAYERS,
    OPT_DUMP_ATTN_HEADS,
    OPT_DUMP_ATTN_STEPS,
    OPT_DUMP_ATTN_SEQS
};

static const struct option LONG_OPTIONS[] = {
    {"shape", required_argument, NULL, OPT_SHAPE},
    {"ctx-size", required_argument, NULL, 'c'},
    {"prompt", required_argument, NULL, 'p'},
    {"file", required_argument, NULL, 'f'},
    {"n-predict", required_argument, NULL, 'n'},
    {"top-k", required_argument, NULL, 'k'},
    {"top-p", required_argument, NULL, OPT_TOP_P},
    {"temp", required_argument, NULL, 't'},
    {"seed", required_argument, NULL, 's'},
    {"kv", no_argument, NULL, OPT_KV},
    {"mla", required_argument, NULL, OPT_MLA},
    {"batch", required_argument, NULL, OPT_BATCH},
    {"kv-mem", required_argument, NULL, OPT_KV_MEM},
    {"kv-offload", required_argument, NULL, OPT_KV_OFFLOAD},
    {"preempt", required_argument, NULL, OPT_PREEMPT},
    {"prompts", required_argument, NULL, OPT_PROMPTS},
    {"kv-dtype", required_argument, NULL, OPT_KV_DTYPE},
    {"window", required_argument, NULL, OPT_WINDOW},
    {"kv-budget", required_argument, NULL, OPT_WINDOW},
    {"window-policy", required_argument, NULL, OPT_WINDOW_POLICY},
    {"evict", required_argument, NULL, OPT_WINDOW_POLICY},
    {"fill", required_argument, NULL, OPT_FILL},
    {"threads", required_argument, NULL, OPT_THREADS},
    {"log", required_argument, NULL, OPT_LOG},
    {"dump-logits", required_argument, NULL, OPT_DUMP_LOGITS},
    {"json", no_argument, NULL, OPT_JSON},
    {"verbose", no_argument, NULL, 'v'},
    {"quiet", no_argument, NULL, 'q'},
    {"ignore-eos", no_argument, NULL, OPT_IGNORE_EOS},
    {"check-kv", no_argument, NULL, OPT_CHECK_KV},
    {"check-batch", no_argument, NULL, OPT_CHECK_BATCH},
    {"check-spec", no_argument, NULL, OPT_CHECK_SPEC},
    {"draft", required_argument, NULL, OPT_DRAFT},
    {"draft-k", required_argument, NULL, OPT_DRAFT_K},
    {"ppl", required_argument, NULL, OPT_PPL},
    {"info", no_argument, NULL, OPT_INFO},
    {"help", no_argument, NULL, 'h'},
    {"version", no_argument, NULL, OPT_VERSION},
    {"profile", optional_argument, NULL, OPT_PROFILE},
    {"profile-peaks", required_argument, NULL, OPT_PROFILE_PEAKS},
    {"dump-attn", required_argument, NULL, OPT_DUMP_ATTN},
    {"dump-attn-layers", required_argument, NULL, OPT_DUMP_ATTN_LAYERS},
    {"dump-attn-heads", required_argument, NULL, OPT_DUMP_ATTN_HEADS},
    {"dump-attn-steps", required_argument, NULL, OPT_DUMP_ATTN_STEPS},
    {"dump-attn-seqs", required_argument, NULL, OPT_DUMP_ATTN_SEQS},
    {NULL, 0, NULL, 0},
};

/* "-": non-options come back in order (code 1), so argv is never reordered; ":": a
 * missing value is reported as ':', and getopt prints nothing. */
static const char SHORT_OPTIONS[] = "-:p:f:n:k:t:s:c:vqh";

/* The long options whose names start with arg's name ("--name" or "--name=value"). */
static int long_matches(const char *arg, const struct option **first) {
    const char *name = arg + 2;
    const size_t len = strcspn(name, "=");
    int n = 0;
    for (const struct option *opt = LONG_OPTIONS; opt->name; opt++) {
        if (strncmp(opt->name, name, len) != 0) continue;
        if (strlen(opt->name) == len) { /* an exact match wins over longer names */
            *first = opt;
            return 1;
        }
        if (n++ == 0) *first = opt;
    }
    return n;
}

/* What getopt_long's '?' or ':' means, as one sentence in err. */
static int getopt_error(int code, const char *arg, char *err, size_t errlen) {
    const struct option *opt = NULL;
    const int is_long = arg && arg[0] == '-' && arg[1] == '-';
    const int n = is_long ? long_matches(arg, &opt) : 0;
    const int name_len = is_long ? (int)strcspn(arg, "=") : 0;
    if (code == ':') {
        if (is_long) return errmsg(err, errlen, 2, "%.*s needs a value (see -h)", name_len, arg);
        return errmsg(err, errlen, 2, "-%c needs a value (see -h)", optopt);
    }
    if (is_long && n == 1 && optopt == opt->val && strchr(arg, '='))
        return errmsg(err, errlen, 2, "--%s takes no value, got '%s'", opt->name, arg);
    if (is_long && n > 1) return errmsg(err, errlen, 2, "%.*s is ambiguous (see -h)", name_len, arg);
    if (!is_long && optopt) return errmsg(err, errlen, 2, "unknown flag -%c (see -h)", optopt);
    return errmsg(err, errlen, 2, "unknown flag %.*s (see -h)", is_long ? name_len : (int)strlen(arg), arg);
}

/* Refuses what one run cannot do at once, rather than silently doing one of it: two
 * modes, and flags only a generation (or only one sequence) uses beside another mode. */
static int one_mode(const Options *o, char *err, size_t errlen) {
    const char *given[5];
    int n = 0;
    if (o->info) given[n++] = "--info";
    if (o->check_kv) given[n++] = "--check-kv";
    if (o->ppl_path) given[n++] = "--ppl";
    if (o->check_batch) given[n++] = "--check-batch";
    if (o->check_spec) given[n++] = "--check-spec";
    if (n > 1) return errmsg(err, errlen, 2, "%s and %s cannot be combined: one mode a run", given[0], given[1]);
    const char *output = o->log_path         ? "--log"
                         : o->dump_path      ? "--dump-logits"
                         : o->profile        ? "--profile"
                         : o->dump_attn_path ? "--dump-attn"
                                             : NULL;
    if (output && n) return errmsg(err, errlen, 2, "%s records a generation: it takes no %s", output, given[0]);
    if (o->prompts_path && n && !o->check_batch && !o->check_spec)
        return errmsg(err, errlen, 2, "--prompts serves a generation: it takes no %s", given[0]);
    if (o->batch_given && o->check_kv)
        return errmsg(err, errlen, 2, "--check-kv compares one sequence; --check-batch compares a batch");
    if (o->batch_given && o->ppl_path)
        return errmsg(err, errlen, 2, "--ppl scores one sequence at a time: it takes no --batch");
    if (o->ppl_path && (o->prompt_given || o->steps))
        return errmsg(err, errlen, 2, "--ppl scores the text of its file whole: it takes no %s",
                      o->prompt_given ? "-p or -f" : "-n");
    return 0;
}

int cli_parse(Options *o, int argc, char **argv, char *err, size_t errlen) {
    memset(o, 0, sizeof *o);
    if (err && errlen > 0) err[0] = '\0';
    o->prompt = "";
    o->top_k = 40;
    o->top_p = 1.0f;
    o->temperature = 1.0f;
    o->seed = (uint64_t)time(NULL);
    int mla_given = 0, policy_given = 0, prompt_flags = 0; /* bit 0: -p, bit 1: -f */
    o->batch = 1;
    o->preempt_swap = -1;
    o->window_flag = "--window";
    o->dump_attn_layers.all = o->dump_attn_heads.all = o->dump_attn_steps.all = o->dump_attn_sequences.all = 1;
    optind = 0; /* 0, not 1: glibc then forgets every earlier scan */
    opterr = 0;
    for (;;) {
        int index = -1;
        const int c = getopt_long(argc, argv, SHORT_OPTIONS, LONG_OPTIONS, &index);
        if (c == -1) break;
        /* the flag as written, for messages: "-n", or the long name */
        char flag[32];
        if (index >= 0)
            snprintf(flag, sizeof flag, "--%s", LONG_OPTIONS[index].name);
        else
            snprintf(flag, sizeof flag, "-%c", c);
        const char *v = optarg;
        long n = 0;
        int rc = 0;
        switch (c) {
        case '?':
        case ':': return getopt_error(c, argv[optind - 1], err, errlen);
        case 'h': return CLI_HELP;
        case OPT_VERSION: return CLI_VERSION;
        case 1:
            if (!o->checkpoint)
                o->checkpoint = v;
            else
                rc = errmsg(err, errlen, 2, "unexpected argument '%s' (one checkpoint only; see -h)", v);
            break;
        case OPT_SHAPE: o->shape = v; break;
        case 'c':
            if (!(rc = parse_long(flag, v, 1, MAX_SEQ_LEN, &n, err, errlen))) o->ctx_size = (int)n;
            break;
        case 'p':
            prompt_flags |= 1;
            o->prompt_path = !strcmp(v, "-") ? v : NULL; /* - is standard input */
            o->prompt = o->prompt_path ? "" : v;
            break;
        case 'f':
            prompt_flags |= 2;
            o->prompt_path = v;
            break;
        case 'n':
            if (!(rc = parse_long(flag, v, 1, 1L << 20, &n, err, errlen))) o->steps = (int)n;
            break;
        case 'k':
            if (!(rc = parse_long(flag, v, 1, 1L << 20, &n, err, errlen))) o->top_k = (int)n, o->top_k_given = 1;
            break;
        case OPT_TOP_P: rc = parse_float(flag, v, 0.0f, 1.0f, &o->top_p, err, errlen); break;
        case 't':
            rc = parse_float(flag, v, 0.0f, 100.0f, &o->temperature, err, errlen);
            o->threads_note = !rc && !strcmp(flag, "-t") && o->temperature > 2.0f; /* llama.cpp's -t is threads */
            break;
        case 's':
            if (!(rc = parse_long(flag, v, 0, INT64_MAX, &n, err, errlen))) o->seed = (uint64_t)n;
            break;
        case 'v': o->verbose = 1; break;
        case 'q': o->quiet = 1; break;
        case OPT_KV: o->kv = 1; break;
        case OPT_MLA:
            mla_given = 1;
            if (!strcmp(v, "absorb"))
                o->mla_form = MLA_ABSORBED;
            else if (!strcmp(v, "expand"))
                o->mla_form = MLA_EXPANDED;
            else
                rc = errmsg(err, errlen, 2, "--mla takes absorb or expand, got '%s'", v);
            break;
        case OPT_BATCH:
            if (!(rc = parse_long(flag, v, 1, CLI_MAX_BATCH, &n, err, errlen))) o->batch = (int)n, o->batch_given = 1;
            break;
        case OPT_KV_MEM:
            if (!(rc = parse_float(flag, v, 0.0f, 1048576.0f, &o->kv_mem_mb, err, errlen)) && o->kv_mem_mb == 0.0f)
                rc = errmsg(err, errlen, 2, "--kv-mem needs a size above 0 MB");
            break;
        case OPT_KV_OFFLOAD: o->kv_offload = v; break;
        case OPT_PREEMPT:
            if (!strcmp(v, "swap"))
                o->preempt_swap = 1;
            else if (!strcmp(v, "recompute"))
                o->preempt_swap = 0;
            else
                rc = errmsg(err, errlen, 2, "--preempt takes swap or recompute, got '%s'", v);
            break;
        case OPT_PROMPTS: o->prompts_path = v; break;
        case OPT_KV_DTYPE:
            if (!strcmp(v, "fp32"))
                o->kv_dtype = DTYPE_F32;
            else if (!strcmp(v, "bf16"))
                o->kv_dtype = DTYPE_BF16;
            else if (!strcmp(v, "int8"))
                o->kv_dtype = DTYPE_I8;
            else if (!strcmp(v, "fp8"))
                o->kv_dtype = DTYPE_F8;
            else if (!strcmp(v, "int4"))
                o->kv_dtype = DTYPE_I4;
            else if (!strcmp(v, "int2"))
                o->kv_dtype = DTYPE_I2;
            else
                rc = errmsg(err, errlen, 2, "--kv-dtype takes fp32, bf16, int8, fp8, int4 or int2, got '%s'", v);
            break;
        case OPT_WINDOW:
            if (!(rc = parse_long(flag, v, 1, 1L << 20, &n, err, errlen))) o->window = (int)n;
            o->window_flag = strcmp(flag, "--kv-budget") ? "--window" : "--kv-budget";
            break;
        case OPT_FILL:
            if (!(rc = parse_long(flag, v, 1, 1L << 24, &n, err, errlen))) o->fill = (int)n;
            break;
        case OPT_WINDOW_POLICY:
            policy_given = 1;
            o->window_sinks = 0, o->evict = KV_EVICT_OLDEST;
            if (!strcmp(v, "sinks"))
                o->window_sinks = CLI_WINDOW_SINKS;
            else if (!strcmp(v, "h2o"))
                o->evict = KV_EVICT_H2O;
            else if (!strcmp(v, "block"))
                o->evict = KV_EVICT_BLOCK;
            else if (strcmp(v, "ring"))
                rc = errmsg(err, errlen, 2, "%s takes ring, sinks, h2o or block, got '%s'", flag, v);
            break;
        case OPT_THREADS:
            if (!(rc = parse_long(flag, v, 1, TEAM_MAX_THREADS, &n, err, errlen))) o->threads = (int)n;
            break;
        case OPT_LOG: o->log_path = v; break;
        case OPT_DUMP_LOGITS: o->dump_path = v; break;
        case OPT_JSON: o->json = 1; break;
        case OPT_IGNORE_EOS: o->ignore_eos = 1; break;
        case OPT_CHECK_KV: o->check_kv = 1; break;
        case OPT_CHECK_BATCH: o->check_batch = 1; break;
        case OPT_CHECK_SPEC: o->check_spec = 1; break;
        case OPT_DRAFT:
            o->draft = 1;
            o->draft_path = strcmp(v, "ngram") ? v : NULL;
            break;
        case OPT_DRAFT_K:
            if (!(rc = parse_long(flag, v, 1, 16, &n, err, errlen))) o->draft_k = (int)n;
            break;
        case OPT_PPL: o->ppl_path = v; break;
        case OPT_INFO: o->info = 1; break;
        case OPT_PROFILE:
            if (!v)
                o->profile = 1;
            else if (!strcmp(v, "layers"))
                o->profile = 2;
            else
                rc = errmsg(err, errlen, 2, "--profile takes no value or =layers, got '%s'", v);
            break;
        case OPT_PROFILE_PEAKS: o->profile_peaks = v; break;
        case OPT_DUMP_ATTN: o->dump_attn_path = v; break;
        case OPT_DUMP_ATTN_LAYERS: rc = index_list_parse(&o->dump_attn_layers, v, flag, err, errlen); break;
        case OPT_DUMP_ATTN_HEADS: rc = index_list_parse(&o->dump_attn_heads, v, flag, err, errlen); break;
        case OPT_DUMP_ATTN_STEPS: rc = index_list_parse(&o->dump_attn_steps, v, flag, err, errlen); break;
        case OPT_DUMP_ATTN_SEQS: rc = index_list_parse(&o->dump_attn_sequences, v, flag, err, errlen); break;
        }
        if (rc) return rc;
    }
    for (int i = optind; i < argc; i++) { /* after "--" */
        if (o->checkpoint)
            return errmsg(err, errlen, 2, "unexpected argument '%s' (one checkpoint only; see -h)", argv[i]);
        o->checkpoint = argv[i];
    }
    o->prompt_given = prompt_flags != 0;
    int rc = one_mode(o, err, errlen);
    if (rc) return rc;
    if (prompt_flags == 3) return errmsg(err, errlen, 2, "-p and -f cannot be combined");
    if (o->quiet && o->verbose) return errmsg(err, errlen, 2, "-q and -v cannot be combined");
    if (o->check_batch && !o->batch_given) return errmsg(err, errlen, 2, "--check-batch needs --batch B");
    if (o->draft_k && !o->draft) return errmsg(err, errlen, 2, "--draft-k needs --draft ngram|CKPT|TABLE");
    if (o->check_spec && !o->draft)
        return errmsg(err, errlen, 2, "--check-spec needs --draft ngram|CKPT|TABLE and --kv");
    if (o->draft && !o->draft_k) o->draft_k = 4;
    if (o->draft && (!o->kv || o->window || o->ppl_path || o->info || o->check_kv || o->check_batch))
        return errmsg(err, errlen, 2, "--draft speculates on the cache: it needs --kv and takes no %s%s",
                      !o->kv      ? "run without it"
                      : o->window ? o->window_flag
                                  : "other mode",
                      o->kv && o->window ? " (a ring cannot be rolled back)" : "");
    if (o->prompts_path && o->prompt_given)
        return errmsg(err, errlen, 2, "%s and --prompts cannot be combined", prompt_flags & 1 ? "-p" : "-f");
    if (policy_given && !o->window) return errmsg(err, errlen, 2, "--evict needs a budget: --kv-budget N");
    if (o->evict != KV_EVICT_OLDEST && (o->check_kv || o->dump_attn_path))
        return errmsg(err, errlen, 2, "--evict %s %s", evict_name(o),
                      o->check_kv ? "cannot agree with --check-kv: recomputing without the cache keeps every position"
                                  : "records the attention itself: it takes no --dump-attn");
    if (o->profile_peaks && !o->profile) return errmsg(err, errlen, 2, "--profile-peaks needs --profile");
    if (!o->dump_attn_path &&
        !(o->dump_attn_layers.all && o->dump_attn_heads.all && o->dump_attn_steps.all && o->dump_attn_sequences.all))
        return errmsg(err, errlen, 2,
                      "--dump-attn-layers, -heads, -steps and -seqs choose what --dump-attn FILE records");
    if (o->fill && (!o->kv || o->window || o->info || o->check_kv || o->check_batch || o->ppl_path))
        return errmsg(err, errlen, 2, "--fill starts a generation with --kv over generated entries: it takes no %s",
                      !o->kv           ? "run without --kv"
                      : o->window      ? o->window_flag
                      : o->info        ? "--info"
                      : o->check_kv    ? "--check-kv"
                      : o->check_batch ? "--check-batch"
                                       : "--ppl");
    if (dtype_packed(o->kv_dtype) && (o->window || o->kv_offload))
        return errmsg(err, errlen, 2, "--kv-dtype %s quantizes whole blocks: it takes no %s",
                      kv_dtype_name(o->kv_dtype), o->window ? o->window_flag : "--kv-offload");
    if (o->kv_offload && (!o->kv || o->window))
        return errmsg(err, errlen, 2, "--kv-offload swaps a sequence's cache: it needs --kv and takes no %s",
                      o->window_flag);
    if (o->preempt_swap == 1 && !o->kv_offload)
        return errmsg(err, errlen, 2, "--preempt swap needs a tier to swap to: give --kv-offload PATH");
    if (o->preempt_swap < 0 && !o->kv_offload) o->preempt_swap = 0; /* with a tier, -1: the measured rule */
    if (o->window && !o->kv && !o->ppl_path && !o->info && !o->check_kv)
        return errmsg(err, errlen, 2, "%s needs --kv: without the cache every step recomputes the whole sequence",
                      o->window_flag);
    /* the setup of the KV-cache post: the absorbed form decodes with the cache, the
     * expanded one recomputes without it */
    if (!mla_given) o->mla_form = o->kv && !o->ppl_path ? MLA_ABSORBED : MLA_EXPANDED;
    o->mla_given = mla_given;
    if (o->shape && o->checkpoint)
        return errmsg(err, errlen, 2,
                      "--shape generates a model's weights: it takes no checkpoint (got '%s'); give one or the other",
                      o->checkpoint);
    if (!o->checkpoint && !o->shape) {
        o->usage_on_error = 1;
        return errmsg(err, errlen, 2, "no checkpoint given");
    }
    return CLI_RUN;
}
