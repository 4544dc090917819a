/* cli.c: the flag parser of ./run (see cli.h). */
#include "cli.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "errmsg.h"

void cli_usage(FILE *f) {
    fputs("Usage: run CHECKPOINT [options]\n"
          "Generates a TinyStories continuation of a prompt, logging the latency of every step.\n"
          "\n"
          "  -p PROMPT         prompt text (default: empty, the story starts from BOS)\n"
          "  -n STEPS          tokens to generate, 1..context (default: until EOS or the context is full)\n"
          "  -k TOPK           top-k sampling, 1..vocab; 1 is greedy (default 40)\n"
          "  -t TEMP           temperature, 0..100; 0 is greedy (default 1.0)\n"
          "  -s SEED           random seed, a non-negative integer (default: from the clock; printed)\n"
          "  --kv              decode with a KV cache (default: recompute the whole sequence every step)\n"
          "  --mla absorb|expand  MLA form (default: absorb with --kv, expand without)\n"
          "  --batch B         decode B sequences of the prompt together, sequence i with seed s+i, 1..256\n"
          "  --kv-mem MB       the KV cache pool's size in MiB, fractions allowed (default: B full contexts)\n"
          "  --json            one JSON object per line and sequence on stdout instead of the text\n"
          "  --check-batch     with --batch: is every sequence bitwise what it is when run alone?\n"
          "  --prompts FILE    serve a file of prompts, one a line, through the --batch slots, sequence i\n"
          "                    with seed s+i (continuous batching)\n"
          "  --kv-dtype fp32|bf16|int8  precision of the cached keys and values (default fp32)\n"
          "  --window W        with --kv: keep W positions a sequence, so -n may exceed the context\n"
          "  --window-policy ring|sinks  overwrite the oldest position (ring, default), or keep the\n"
          "                    first 4 for good and slide the rest (sinks)\n"
          "  --threads N       OpenMP threads, 1..256 (default: all cores)\n"
          "  --log FILE.csv    write the per-step latencies as CSV\n"
          "  -q                no per-step lines on stderr (the summary stays)\n"
          "  --ignore-eos      keep generating after EOS\n"
          "  --check-kv        greedy runs with and without the cache: are the logits bitwise identical?\n"
          "  --ppl FILE        mean NLL (nats/token) and perplexity of a text file (stories separated\n"
          "                    by <|endoftext|> lines), each story scored in windows of the context\n"
          "  --info            configuration, parameters and KV cache sizes, then exit\n"
          "  --dump-logits FILE  write the logits of every step as raw float32 (steps x vocab)\n"
          "  -h, --help        this help\n",
          f);
}

const char *mla_form_name(MlaForm form) { return form == MLA_ABSORBED ? "absorb" : "expand"; }

const char *kv_dtype_name(DType dtype) { return dtype == DTYPE_F32 ? "fp32" : dtype == DTYPE_BF16 ? "bf16" : "int8"; }

/* 0 with *out set, or 2 with the message in err. */
static int parse_long(const char *flag, const char *s, long lo, long hi, long *out, char *err, size_t errlen) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end) return errmsg(err, errlen, 2, "%s needs an integer, got '%s'", flag, s);
    if (v < lo || v > hi) return errmsg(err, errlen, 2, "%s %ld is out of range (%ld..%ld)", flag, v, lo, hi);
    *out = v;
    return 0;
}

static int parse_float(const char *flag, const char *s, float lo, float hi, float *out, char *err, size_t errlen) {
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end || !isfinite(v)) return errmsg(err, errlen, 2, "%s needs a number, got '%s'", flag, s);
    if (v < lo || v > hi) return errmsg(err, errlen, 2, "%s %g is out of range (%g..%g)", flag, v, lo, hi);
    *out = v;
    return 0;
}

int cli_parse(Options *o, int argc, char **argv, char *err, size_t errlen) {
    memset(o, 0, sizeof *o);
    if (err && errlen > 0) err[0] = '\0';
    o->prompt = "";
    o->top_k = 40;
    o->temperature = 1.0f;
    o->seed = (uint64_t)time(NULL);
    int mla_given = 0, policy_given = 0;
    o->batch = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) return 1;
        int takes_value = !strcmp(a, "-p") || !strcmp(a, "-n") || !strcmp(a, "-k") || !strcmp(a, "-t") ||
                          !strcmp(a, "-s") || !strcmp(a, "--threads") || !strcmp(a, "--log") ||
                          !strcmp(a, "--mla") || !strcmp(a, "--ppl") || !strcmp(a, "--dump-logits") ||
                          !strcmp(a, "--batch") || !strcmp(a, "--kv-mem") || !strcmp(a, "--prompts") ||
                          !strcmp(a, "--kv-dtype") || !strcmp(a, "--window") || !strcmp(a, "--window-policy");
        if (takes_value && i + 1 >= argc) return errmsg(err, errlen, 2, "%s needs a value (see -h)", a);
        const char *v = takes_value ? argv[++i] : NULL;
        long n = 0;
        int rc = 0;
        if (!strcmp(a, "-p")) o->prompt = v, o->prompt_given = 1;
        else if (!strcmp(a, "--prompts")) o->prompts_path = v;
        else if (!strcmp(a, "--kv-dtype")) {
            if (!strcmp(v, "fp32")) o->kv_dtype = DTYPE_F32;
            else if (!strcmp(v, "bf16")) o->kv_dtype = DTYPE_BF16;
            else if (!strcmp(v, "int8")) o->kv_dtype = DTYPE_I8;
            else rc = errmsg(err, errlen, 2, "--kv-dtype takes fp32, bf16 or int8, got '%s'", v);
        } else if (!strcmp(a, "--window")) {
            if (!(rc = parse_long(a, v, 1, 1L << 20, &n, err, errlen))) o->window = (int)n;
        } else if (!strcmp(a, "--window-policy")) {
            policy_given = 1;
            if (!strcmp(v, "ring")) o->window_sinks = 0;
            else if (!strcmp(v, "sinks")) o->window_sinks = CLI_WINDOW_SINKS;
            else rc = errmsg(err, errlen, 2, "--window-policy takes ring or sinks, got '%s'", v);
        }
        else if (!strcmp(a, "-n")) { if (!(rc = parse_long(a, v, 1, 1L << 20, &n, err, errlen))) o->steps = (int)n; }
        else if (!strcmp(a, "-k")) { if (!(rc = parse_long(a, v, 1, 1L << 20, &n, err, errlen))) o->top_k = (int)n; }
        else if (!strcmp(a, "-t")) rc = parse_float(a, v, 0.0f, 100.0f, &o->temperature, err, errlen);
        else if (!strcmp(a, "-s")) { if (!(rc = parse_long(a, v, 0, INT64_MAX, &n, err, errlen))) o->seed = (uint64_t)n; }
        else if (!strcmp(a, "--threads")) { if (!(rc = parse_long(a, v, 1, CLI_MAX_THREADS, &n, err, errlen))) o->threads = (int)n; }
        else if (!strcmp(a, "--log")) o->log_path = v;
        else if (!strcmp(a, "--batch")) {
            if (!(rc = parse_long(a, v, 1, CLI_MAX_BATCH, &n, err, errlen))) o->batch = (int)n, o->batch_given = 1;
        } else if (!strcmp(a, "--kv-mem")) {
            if (!(rc = parse_float(a, v, 0.0f, 1048576.0f, &o->kv_mem_mb, err, errlen)) && o->kv_mem_mb == 0.0f)
                rc = errmsg(err, errlen, 2, "--kv-mem needs a size above 0 MB");
        }
        else if (!strcmp(a, "--mla")) {
            mla_given = 1;
            if (!strcmp(v, "absorb")) o->mla_form = MLA_ABSORBED;
            else if (!strcmp(v, "expand")) o->mla_form = MLA_EXPANDED;
            else rc = errmsg(err, errlen, 2, "--mla takes absorb or expand, got '%s'", v);
        } else if (!strcmp(a, "--ppl")) o->ppl_path = v;
        else if (!strcmp(a, "--dump-logits")) o->dump_path = v;
        else if (!strcmp(a, "--kv")) o->kv = 1;
        else if (!strcmp(a, "-q")) o->quiet = 1;
        else if (!strcmp(a, "--ignore-eos")) o->ignore_eos = 1;
        else if (!strcmp(a, "--check-kv")) o->check_kv = 1;
        else if (!strcmp(a, "--check-batch")) o->check_batch = 1;
        else if (!strcmp(a, "--json")) o->json = 1;
        else if (!strcmp(a, "--info")) o->info = 1;
        else if (a[0] == '-' && a[1] != '\0') rc = errmsg(err, errlen, 2, "unknown flag %s (see -h)", a);
        else if (!o->checkpoint) o->checkpoint = a;
        else rc = errmsg(err, errlen, 2, "unexpected argument '%s' (one checkpoint only; see -h)", a);
        if (rc) return rc;
    }
    /* the setup of the KV-cache post: the absorbed form decodes with the cache, the
     * expanded one recomputes without it */
    if (o->check_batch && !o->batch_given) return errmsg(err, errlen, 2, "--check-batch needs --batch B");
    if (o->prompts_path && o->prompt_given) return errmsg(err, errlen, 2, "-p and --prompts cannot be combined");
    if (policy_given && !o->window) return errmsg(err, errlen, 2, "--window-policy needs --window W");
    if (o->window && !o->kv && !o->ppl_path && !o->info)
        return errmsg(err, errlen, 2, "--window needs --kv: without the cache every step recomputes the whole sequence");
    if (o->window && o->check_kv)
        return errmsg(err, errlen, 2, "--window cannot be checked with --check-kv: without the cache there is no window");
    if (!mla_given) o->mla_form = o->kv && !o->ppl_path ? MLA_ABSORBED : MLA_EXPANDED;
    if (!o->checkpoint) {
        o->usage_on_error = 1;
        return errmsg(err, errlen, 2, "no checkpoint given");
    }
    return 0;
}
