/* run.c: the command line. Generation with or without a KV cache, per-step
 * latency, --check-kv, --ppl, --info and --dump-logits.
 *
 *   ./run weights/gqa.bin -p "Once upon a time" --kv
 */
#include <errno.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <signal.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "serve/cli.h"
#include "kernels/errmsg.h"
#include "loader.h"
#include "model.h"
#include "serve/output.h"
#include "kernels/parallel.h"
#include "serve/json.h"
#include "serve/sampler.h"
#include "serve/scheduler.h"
#include "tokenizer/spm_c.h"
#include "serve/textfile.h"
#include "kernels/timer.h"
#include "tokenizer/utf8.h"
#include "serve/version.h"

#define EXIT_USAGE 2

_Static_assert(CLI_MAX_THREADS == PARALLEL_MAX_THREADS, "--threads and OMP_NUM_THREADS have one bound");

static void die(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("run: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(code);
}

/* Dies with one line when f could not be written (a full disk, a closed descriptor, a
 * broken pipe with SIGPIPE ignored): a run whose output is lost must not exit 0. */
static void check_written(FILE *f, const char *name) {
    if (fflush(f) != 0 || ferror(f)) die(1, "cannot write %s: %s", msg_path(name).s, strerror(errno ? errno : EIO));
}

static void close_written(FILE *f, const char *name) {
    check_written(f, name);
    if (fclose(f) != 0) die(1, "cannot write %s: %s", msg_path(name).s, strerror(errno));
}

/* ---- generation ---- */

typedef struct {
    Model *model;
    RunState *state;
    KVCache *cache;
    int kv;               /* keep the cache between steps */
    MlaForm form;
} Engine;

/* Ends the run when a forward pass (or scheduler_run) returned an error code. */
static void check_forward(int rc) {
    if (rc == MODEL_ERR_NONFINITE)
        die(1, "the model computes logits that are not finite numbers (NaN or infinity): its weights overflow "
               "float arithmetic");
    if (rc != 0) die(1, "out of memory");
}

/* The logits after tokens[0..n): with the cache, the forward pass runs the tokens the
 * cache does not hold yet; without it, the whole sequence on an emptied cache. A window
 * takes at most what it holds without sliding in one pass, then one token a pass, as
 * the scheduler feeds it. */
static void engine_step(Engine *e, const int *tokens, int n, float *logits) {
    if (!e->kv) kv_reset(e->cache);
    while (e->cache->len < n) {
        const int from = e->cache->len, count = kv_tokens_per_pass(e->cache, n - from);
        const int rc = model_forward(e->model, e->state, e->cache, tokens + from, count, e->form, logits, 0);
        if (rc == MODEL_ERR_BATCH) die(1, "internal error: a forward pass of %d tokens at position %d does not fit", count, from);
        check_forward(rc);
    }
}

/* What a negative spm_encode result means, after "the prompt" or "story N". */
static const char *encode_error(int code) {
    static char too_long[96];
    snprintf(too_long, sizeof too_long, "is over %d bytes, more than the tokenizer encodes at once", SPM_MAX_TEXT_BYTES);
    return code == SPM_ERR_TEXT ? "is not valid UTF-8 text" : code == SPM_ERR_NOMEM ? "cannot be encoded: out of memory"
         : code == SPM_ERR_TOO_LONG ? too_long : "cannot be encoded by the tokenizer";
}

/* BOS and the prompt's tokens; `where` ("" or "FILE:LINE: ") starts any error message. */
static int encode_prompt(const Model *m, const char *prompt, int *tokens, int max_tokens, const char *where) {
    int n = spm_encode(m->tokenizer, prompt, strlen(prompt), 1, tokens, max_tokens);
    if (n < 0) die(1, "%sthe prompt %s", where, encode_error(n));
    if (n > m->cfg.max_seq_len)
        die(1, "%sthe prompt is %d tokens, longer than the context (%d tokens)", where, n, m->cfg.max_seq_len);
    if (n >= m->cfg.max_seq_len)
        die(1, "%sthe prompt is %d tokens and fills the whole context (%d): no room to generate", where, n,
            m->cfg.max_seq_len);
    return n;
}

/* ---- --json: one object a line ---- */

/* Opens an output's JSON object with what every one carries: what it is, the program's
 * version and commit, the checkpoint, variant and cache settings, the threads and the
 * seed. The caller adds its figures (json_field) and closes it (json_end). */
static void json_begin(const char *type, const Model *m, const Options *o, const char *mode) {
    printf("{\"type\": \"%s\", \"version\": \"%s\", \"commit\": ", type, RUN_VERSION);
    json_text(stdout, build_commit());
    fputs(", \"checkpoint\": ", stdout);
    json_text(stdout, o->checkpoint);
    printf(", \"variant\": \"%s\", \"mode\": \"%s\", \"kv_dtype\": \"%s\", \"mla_form\": ", variant_name(&m->cfg), mode,
           kv_dtype_name(o->kv_dtype));
    if (m->cfg.variant == VARIANT_MLA && strcmp(type, "check-kv") != 0) printf("\"%s\"", mla_form_name(o->mla_form));
    else fputs("null", stdout);  /* --check-kv names the form of each run it compares */
    printf(", \"window\": %d, \"window_sinks\": %d, \"threads\": %d, \"seed\": %llu", o->window,
           o->window ? o->window_sinks : 0, parallel_threads(), (unsigned long long)o->seed);
}

static void json_field(const char *key, double value) {
    printf(", \"%s\": ", key);
    json_number(stdout, value);
}

static void json_end(void) { fputs("}\n", stdout); }

/* ---- generation: one sequence or many (scheduler.h) ---- */

static const char *stop_name(StopReason r) {
    return r == STOP_EOS ? "eos" : r == STOP_CONTEXT ? "context full" : r == STOP_STEPS ? "steps" : "interrupted";
}

typedef struct {
    const Options *o;
    const Model *model;
    Scheduler *sch;
    const char *const *prompts;  /* each request's prompt text, by index */
    int serving;                 /* --prompts */
    FILE *log_csv, *dump;
    SpmStream *stream;       /* one sequence's text, printed as it comes */
    int interrupted;         /* a signal ended the run: what is left prints as it is */
    int next_to_print;       /* many sequences print whole, in order */
    double *step_ms;         /* (steps so far) */
    int n_steps, cap_steps;
    int first_step_tokens;
    int step_lines;          /* the warm-up and each step on stderr */
    int one_terminal;        /* stdout and stderr are the same terminal */
    int mid_line;            /* the text on stdout does not end with a newline */
} Generation;

/* 1 when stdout and stderr are one terminal, where step lines would cut the story up. */
static int one_terminal(void) {
    struct stat out, err;
    return isatty(STDOUT_FILENO) && isatty(STDERR_FILENO) && fstat(STDOUT_FILENO, &out) == 0 &&
           fstat(STDERR_FILENO, &err) == 0 && out.st_rdev == err.st_rdev;
}

/* Story text on stdout, at once (sanitized for the terminal). */
static void print_text(Generation *g, const char *text) {
    utf8_fputs_sanitized(text, stdout);
    check_written(stdout, "standard output");
    if (*text) g->mid_line = text[strlen(text) - 1] != '\n';
}

/* Before a line on stderr: on the story's terminal it starts a line of its own. */
static void start_stderr_line(Generation *g) {
    if (g->one_terminal && g->mid_line) fputc('\n', stderr), g->mid_line = 0;
}

/* The text of tokens[1 ..) (after BOS) as stdout shows it: sanitized, in a new buffer. */
static char *sequence_text(const Model *m, const Request *r, size_t *len) {
    const size_t n = spm_decode(m->tokenizer, r->tokens + 1, r->n_tokens - 1, NULL, 0);
    char *raw = malloc(n + 1), *text = NULL;
    if (raw) {
        spm_decode(m->tokenizer, r->tokens + 1, r->n_tokens - 1, raw, n + 1);
        *len = utf8_sanitize(NULL, 0, raw, n);
        if ((text = malloc(*len + 1))) utf8_sanitize(text, *len + 1, raw, n);
    }
    free(raw);
    if (!text) die(1, "out of memory");
    return text;
}

/* A whole sequence: a JSON line, or its text under a header line. */
static void print_sequence(const Generation *g, const Request *r) {
    size_t len;
    char *text = sequence_text(g->model, r, &len);
    if (g->o->json) {
        const char *prompt = g->prompts[r->index];
        printf("{\"type\": \"sequence\", \"index\": %d, \"prompt\": ", r->index);
        json_string(stdout, prompt, strlen(prompt));
        printf(", \"seed\": %llu, \"text\": ", (unsigned long long)r->seed);
        json_string(stdout, text, len);
        printf(", \"prompt_tokens\": %d, \"tokens\": [", r->n_prompt);
        for (int i = r->n_prompt; i < r->n_tokens; i++) printf(i > r->n_prompt ? ", %d" : "%d", r->tokens[i]);
        printf("], \"generated\": %d, \"stop\": \"%s\", \"first_token_ms\": %.3f, \"prefill_ms\": %.3f, "
               "\"decode_ms_per_token\": %.4f, \"preemptions\": %d}\n",
               r->generated, stop_name(r->stop), r->first_token_ms, r->prefill_ms,
               r->decode_steps ? r->decode_ms / r->decode_steps : 0.0, r->preemptions);
    } else {
        printf("[sequence %d seed %llu stop %s]\n%s\n\n", r->index, (unsigned long long)r->seed, stop_name(r->stop), text);
    }
    check_written(stdout, "standard output");
    free(text);
}

static int streams_text(const Generation *g) { return g->sch->n_requests == 1 && !g->o->json && !g->serving; }

static void on_logits(void *ctx, Request *r, const float *logits) {
    Generation *g = ctx;
    (void)r;
    if (g->dump && fwrite(logits, sizeof(float), (size_t)g->model->cfg.vocab_size, g->dump) != (size_t)g->model->cfg.vocab_size)
        die(1, "cannot write %s: %s", msg_path(g->o->dump_path).s, strerror(errno));
}

static void on_token(void *ctx, Request *r, int token) {
    Generation *g = ctx;
    (void)r;
    if (streams_text(g)) print_text(g, spm_stream_put(g->stream, token));
}

static void on_done(void *ctx, Request *r) {
    Generation *g = ctx;
    if (streams_text(g)) {
        print_text(g, spm_stream_flush(g->stream));
        if (g->mid_line || !g->one_terminal) print_text(g, "\n");  /* after a step line the terminal is at a line start */
        (void)r;
        return;
    }
    while (g->next_to_print < g->sch->n_requests &&
           (g->sch->requests[g->next_to_print].stop != STOP_NONE || g->interrupted))
        print_sequence(g, &g->sch->requests[g->next_to_print++]);
}

/* Steps that ran only prompt tokens are prefill, only new tokens decode, both mixed. */
static const char *step_phase(const StepInfo *st) {
    return st->prefill_tokens == st->n_tokens ? "prefill" : st->prefill_tokens == 0 ? "decode" : "mixed";
}

static void on_step(void *ctx, const StepInfo *st) {
    Generation *g = ctx;
    if (g->n_steps == g->cap_steps) {
        g->cap_steps = g->cap_steps ? 2 * g->cap_steps : 512;
        if (!(g->step_ms = realloc(g->step_ms, (size_t)g->cap_steps * sizeof *g->step_ms))) die(1, "out of memory");
    }
    g->step_ms[g->n_steps++] = st->ms;
    if (st->step == 0) g->first_step_tokens = st->n_tokens;
    if (g->step_lines) {
        start_stderr_line(g);
        if (st->only && st->step == 0) fprintf(stderr, "[prefill] tokens %d next %d ms %.3f\n", st->n_tokens, st->next_token, st->ms);
        else if (st->only) fprintf(stderr, "[step %d] pos %d token %d ms %.3f\n", st->step, st->pos, st->next_token, st->ms);
        else fprintf(stderr, "[step %d] sequences %d tokens %d ms %.3f\n", st->step, st->sequences, st->n_tokens, st->ms);
    }
    if (g->log_csv) {
        fprintf(g->log_csv, "%d,%s,%d,%d,", st->step, step_phase(st), st->sequences, st->n_tokens);
        if (st->only) fprintf(g->log_csv, "%d,%d,", st->pos, st->next_token);
        else fputs("-1,-1,", g->log_csv);
        fprintf(g->log_csv, "%.4f\n", st->ms);
        check_written(g->log_csv, g->o->log_path);  /* a line at a time: a stopped run leaves whole lines */
    }
}

static int compare_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double percentile(double *v, int n, double q) {
    if (n == 0) return 0.0;
    qsort(v, (size_t)n, sizeof *v, compare_double);
    const double rank = q * (n - 1);
    const int lo = (int)rank;
    return lo + 1 < n ? v[lo] + (rank - lo) * (v[lo + 1] - v[lo]) : v[lo];
}

/* A run's figures, for the summary and its JSON form. The first step is the prefill,
 * every later step decodes; with --prompts, latencies are per request. */
typedef struct {
    int sequences, prefill_tokens, decode_steps, decode_tokens, stops[4];  /* stops by StopReason; NONE: interrupted */
    double prefill_ms, decode_ms, step_median_ms, step_mean_ms, ms_per_token, tokens_per_s, per_sequence_ms_per_token;
    long served_tokens;                      /* every token sampled, the first included */
    double ttft50, ttft95, token50, token95; /* --prompts: time to first token, per-token latency */
    size_t kv_bytes;
} Figures;

static Figures figures_of(const Generation *g) {
    const Scheduler *sch = g->sch;
    const int n = sch->n_requests;
    Figures f = {.sequences = n, .prefill_tokens = g->first_step_tokens, .decode_steps = g->n_steps > 0 ? g->n_steps - 1 : 0,
                 .prefill_ms = g->n_steps ? g->step_ms[0] : 0.0,
                 .kv_bytes = sch->kv ? kv_block_bytes(sch->pool) * (size_t)sch->pool->n_blocks : 0};
    double *ttft = malloc((size_t)n * sizeof *ttft), *per_token = malloc((size_t)n * sizeof *per_token);
    double *steps = malloc((size_t)(f.decode_steps + 1) * sizeof *steps);
    if (!ttft || !per_token || !steps) die(1, "out of memory");
    int n_per_token = 0;
    for (int i = 0; i < n; i++) {
        const Request *r = &sch->requests[i];
        f.decode_tokens += r->generated > 0 ? r->generated - 1 : 0;
        f.served_tokens += r->generated;
        f.stops[r->stop]++;
        f.per_sequence_ms_per_token += r->decode_steps ? r->decode_ms / r->decode_steps / n : 0.0;
        ttft[i] = r->first_token_ms;
        if (r->decode_steps) per_token[n_per_token++] = r->decode_ms / r->decode_steps;
    }
    for (int i = 0; i < f.decode_steps; i++) f.decode_ms += steps[i] = g->step_ms[i + 1];
    f.step_median_ms = percentile(steps, f.decode_steps, 0.5);
    f.step_mean_ms = f.decode_steps ? f.decode_ms / f.decode_steps : 0.0;
    f.ms_per_token = f.decode_tokens ? f.decode_ms / f.decode_tokens : 0.0;
    f.tokens_per_s = g->serving ? (sch->total_ms > 0 ? 1000.0 * f.served_tokens / sch->total_ms : 0.0)
                                : (f.decode_ms > 0 ? 1000.0 * f.decode_tokens / f.decode_ms : 0.0);
    f.ttft50 = percentile(ttft, n, 0.5), f.ttft95 = percentile(ttft, n, 0.95);
    f.token50 = percentile(per_token, n_per_token, 0.5), f.token95 = percentile(per_token, n_per_token, 0.95);
    free(ttft);
    free(per_token);
    free(steps);
    return f;
}

static void print_stops(FILE *out, const int *stops) {
    fprintf(out, "stops: eos %d, steps %d, context full %d", stops[STOP_EOS], stops[STOP_STEPS], stops[STOP_CONTEXT]);
    if (stops[STOP_NONE]) fprintf(out, ", interrupted %d", stops[STOP_NONE]);
}

/* The summary line, and with the cache for more than one sequence (or -v) the pool's line.
 * --prompts: requests served, throughput, time to first token and per-token latency
 * (each request's decode time over its decode steps), median and 95th percentile. */
static void write_summary(FILE *out, const Generation *g, const Figures *f) {
    const Scheduler *sch = g->sch;
    fprintf(out, "summary: %s %s", variant_name(&g->model->cfg), sch->kv ? "kv" : "no-kv");
    if (g->serving) {
        fprintf(out, " | %d requests served through %d slots in %d steps | %ld tokens in %.1f ms, %.1f tokens/s | time to "
                "first token median %.3f ms, p95 %.3f ms | per token median %.3f ms, p95 %.3f ms",
                f->sequences, sch->max_batch, sch->steps, f->served_tokens, sch->total_ms, f->tokens_per_s, f->ttft50,
                f->ttft95, f->token50, f->token95);
    } else {
        if (f->sequences > 1) fprintf(out, " | %d sequences", f->sequences);
        fprintf(out, " | prefill %d tokens %.3f ms | decode %d steps, %.3f ms/token, %.1f tokens/s, median step %.3f ms, "
                "mean step %.3f ms", f->prefill_tokens, f->prefill_ms, f->decode_steps, f->ms_per_token, f->tokens_per_s,
                f->step_median_ms, f->step_mean_ms);
        if (f->sequences > 1) fprintf(out, " | per sequence %.3f ms/token", f->per_sequence_ms_per_token);
    }
    fprintf(out, " | KV cache %zu bytes%s | ", f->kv_bytes, sch->kv || g->serving ? "" : " (recomputed every step)");
    if (f->sequences == 1 && !g->serving) fprintf(out, "stop: %s\n", stop_name(sch->requests[0].stop));
    else print_stops(out, f->stops), fputc('\n', out);
    if (!sch->kv || (f->sequences == 1 && !g->o->verbose)) return;
    const KVPool *pool = sch->pool;
    const size_t contiguous = kv_bytes_per_token(pool) * (size_t)g->model->cfg.max_seq_len * (size_t)sch->max_batch;
    fprintf(out, "kv pool: %d-token blocks of %zu bytes | peak %d of %d blocks in use, %zu bytes | contiguous "
            "full contexts for %d sequences: %zu bytes | preemptions %d\n",
            KV_BLOCK_TOKENS, kv_block_bytes(pool), pool->peak_in_use, pool->n_blocks,
            kv_block_bytes(pool) * (size_t)pool->peak_in_use, sch->max_batch, contiguous, sch->preemptions);
}

/* The summary on stderr: one line a part in a file or pipe; on a terminal each " | "
 * starts an indented line, so that nothing wraps in the middle of a figure. */
static void print_summary(const Generation *g, const Figures *f) {
    char *text = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&text, &len);
    if (!mem) die(1, "out of memory");
    write_summary(mem, g, f);
    if (fclose(mem) != 0) die(1, "out of memory");
    if (!isatty(STDERR_FILENO)) fputs(text, stderr);
    else
        for (const char *s = text; *s;) {
            const char *bar = strstr(s, " | ");
            if (!bar) { fputs(s, stderr); break; }
            fprintf(stderr, "%.*s\n  ", (int)(bar - s), s);
            s = bar + 3;
        }
    free(text);
}

/* The summary as one JSON object on stdout, after the sequences' lines. */
static void print_summary_json(const Generation *g, const Figures *f) {
    const Scheduler *sch = g->sch;
    const Options *o = g->o;
    json_begin("summary", g->model, o, sch->kv ? "kv" : "no-kv");
    printf(", \"serving\": %s", g->serving ? "true" : "false");
    const struct {
        const char *key;
        double value;
    } figures[] = {
        {"sequences", f->sequences}, {"slots", sch->max_batch}, {"top_k", o->top_k}, {"top_p", o->top_p},
        {"temperature", o->temperature}, {"steps", sch->steps}, {"prefill_tokens", f->prefill_tokens},
        {"prefill_ms", f->prefill_ms}, {"decode_steps", f->decode_steps}, {"decode_tokens", f->decode_tokens},
        {"decode_ms", f->decode_ms}, {"ms_per_token_mean", f->ms_per_token}, {"step_ms_median", f->step_median_ms},
        {"step_ms_mean", f->step_mean_ms}, {"tokens_per_s", f->tokens_per_s},
        {"per_sequence_ms_per_token", f->per_sequence_ms_per_token}, {"tokens_generated", (double)f->served_tokens},
        {"total_ms", sch->total_ms}, {"first_token_ms_median", f->ttft50}, {"first_token_ms_p95", f->ttft95},
        {"token_ms_median", f->token50}, {"token_ms_p95", f->token95},
    };
    for (size_t i = 0; i < sizeof figures / sizeof figures[0]; i++) json_field(figures[i].key, figures[i].value);
    printf(", \"kv_cache_bytes\": %zu, \"preemptions\": %d, \"stops\": {\"eos\": %d, \"steps\": %d, "
           "\"context_full\": %d, \"interrupted\": %d}",
           f->kv_bytes, sch->preemptions, f->stops[STOP_EOS], f->stops[STOP_STEPS], f->stops[STOP_CONTEXT],
           f->stops[STOP_NONE]);
    json_end();
}

/* scheduler_run inside one team (parallel.h), so that every forward pass of the run uses
 * it instead of opening an OpenMP region of its own: the other threads stay awake,
 * spinning, while tokens are sampled and printed. */
static void run_in_team(void *arg) {
    Scheduler *sch = arg;
    check_forward(scheduler_run(sch));
}

/* B requests of one prompt, request i with seed + i. */
/* Room for a sequence's tokens: the context and one, or prompt and -n when that is more
 * (with a window); the scheduler grows it past that when it has to. */
static int token_room(const Model *m, int n_prompt, int steps) {
    const int need = n_prompt + steps + 1;
    return need > m->cfg.max_seq_len + 1 ? need : m->cfg.max_seq_len + 1;
}

static Request *prompt_requests(const int *prompt, int n_prompt, int B, uint64_t seed, int room) {
    Request *requests = calloc((size_t)B, sizeof *requests);
    if (!requests) die(1, "out of memory");
    for (int i = 0; i < B; i++) {
        Request *r = &requests[i];
        r->cap_tokens = room;
        if (!(r->tokens = malloc((size_t)room * sizeof(int)))) die(1, "out of memory");
        memcpy(r->tokens, prompt, (size_t)n_prompt * sizeof(int));
        r->n_prompt = n_prompt;
        r->index = i;
        r->seed = seed + (uint64_t)i;
    }
    return requests;
}

static void free_requests(Scheduler *sch) {
    scheduler_free_requests(sch);
    for (int i = 0; i < sch->n_requests; i++) free(sch->requests[i].tokens);
    free(sch->requests);
}

/* Warm-up, as llama.cpp does after loading: one untimed forward of the prompt, then an
 * empty cache. A process's first forward runs cold (its weights come from DRAM); that is
 * a cost of loading, so the timed prefill runs warm, like every decode step. The
 * arithmetic is batch-invariant, so the prefill's logits are the same bits either way. */
static void warm_up(const Scheduler *sch, Generation *g) {
    const Request *r = &sch->requests[0];
    KVCache scratch;
    const double t0 = now_ms();
    const int n = sch->pool->window && r->n_prompt > sch->pool->window ? sch->pool->window : r->n_prompt;  /* one pass */
    if (kv_init(&scratch, sch->pool, sch->model->cfg.max_seq_len) != 0) die(1, "out of memory");
    check_forward(model_forward(sch->model, sch->state, &scratch, r->tokens, n, sch->form, sch->logits, 0));
    kv_free(&scratch);
    if (g->step_lines) {
        start_stderr_line(g);
        fprintf(stderr, "[warm-up] tokens %d ms %.3f (untimed; cache emptied)\n", n, now_ms() - t0);
    }
}

/* The signal that asked the run to stop, or 0. */
static volatile sig_atomic_t interrupted_by;

static void on_interrupt(int sig) { interrupted_by = sig; }

/* SIGINT and SIGTERM end a generation at the next step boundary, so the outputs are whole;
 * a second one acts at once (SA_RESETHAND). */
static void catch_interrupts(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_interrupt;
    sa.sa_flags = SA_RESETHAND | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

/* --log and --dump-logits, refused when they name one of the run's inputs or each other. */
static FILE *open_output(const char *path, const Options *o, const char *log_path) {
    const NamedPath inputs[] = {{"the checkpoint", o->checkpoint}, {"the prompt file", o->prompt_path},
                                {"the --prompts file", o->prompts_path}, {"the --log file", log_path}};
    FILE *f;
    char err[512];
    const int rc = output_open(&f, path, inputs, (int)(sizeof inputs / sizeof inputs[0]), err, sizeof err);
    if (rc) die(rc, "%s", err);
    return f;
}

/* The settings line on stderr, before the story: with the seed, any run can be repeated. */
static void print_settings(const Scheduler *sch, const Options *o) {
    const Config *c = &sch->model->cfg;
    fprintf(stderr, "seed %llu | %s | %s %s | mla form %s | threads %d | top-k %d | top-p %g | temperature %g",
            (unsigned long long)o->seed, variant_name(c), o->kv ? "kv" : "no-kv", kv_dtype_name(o->kv_dtype),
            c->variant == VARIANT_MLA ? mla_form_name(o->mla_form) : "n/a", parallel_threads(), o->top_k, o->top_p,
            o->temperature);
    if (sch->n_requests > 1 || sch->max_batch > 1)
        fprintf(stderr, " | %d sequences in %d slots, seeds %llu..%llu", sch->n_requests, sch->max_batch,
                (unsigned long long)o->seed, (unsigned long long)(o->seed + (uint64_t)sch->n_requests - 1));
    if (o->window) fprintf(stderr, " | window %d, %d sinks", o->window, o->window_sinks);
    fputc('\n', stderr);
}

/* Generates, prints the summary and closes the outputs. Returns the signal that cut the run
 * short, or 0. */
static int generate(Scheduler *sch, const Options *o, const char *const *prompts) {
    Generation g = {.o = o, .model = sch->model, .sch = sch, .prompts = prompts, .serving = o->prompts_path != NULL,
                    .one_terminal = one_terminal()};
    if (o->log_path) {
        g.log_csv = open_output(o->log_path, o, NULL);
        fprintf(g.log_csv, "step,phase,sequences,n_tokens,pos,token,ms\n");
        check_written(g.log_csv, o->log_path);
    }
    if (o->dump_path) g.dump = open_output(o->dump_path, o, o->log_path);
    print_settings(sch, o);
    /* Step lines go to stderr when asked for, or when it is not the terminal the story is
     * on (a file, a pipe, a terminal of its own): there they do not cut the story up. */
    g.step_lines = !o->quiet && (o->verbose || !g.one_terminal);
    if (!(g.stream = spm_stream_new(sch->model->tokenizer))) die(1, "out of memory");
    sch->on_logits = on_logits;
    sch->on_token = on_token;
    sch->on_done = on_done;
    sch->on_step = on_step;
    sch->ctx = &g;
    sch->stop = &interrupted_by;
    catch_interrupts();
    if (streams_text(&g)) {
        const Request *r = &sch->requests[0];
        for (int i = 1; i < r->n_prompt; i++) print_text(&g, spm_stream_put(g.stream, r->tokens[i]));
    }
    warm_up(sch, &g);
    parallel_team(run_in_team, sch);
    if ((g.interrupted = interrupted_by != 0)) on_done(&g, NULL);  /* the text so far, as it is */
    if (g.one_terminal && streams_text(&g)) fputc('\n', stderr);  /* a blank line between the story and the summary */
    const Figures f = figures_of(&g);
    print_summary(&g, &f);
    if (o->json) print_summary_json(&g, &f);
    if (g.log_csv) close_written(g.log_csv, o->log_path);
    if (g.dump) close_written(g.dump, o->dump_path);
    spm_stream_free(g.stream);
    free(g.step_ms);
    return interrupted_by;
}

/* ---- --check-batch ---- */

/* What one sequence produced: its tokens, and a hash of every step's logits. */
typedef struct {
    uint64_t *hashes;  /* (requests, max_seq_len + 1) */
    int stride;
} LogitHashes;

static void hash_logits(void *ctx, Request *r, const float *logits) {
    LogitHashes *h = ctx;
    const unsigned char *bytes = (const unsigned char *)logits;
    uint64_t x = 0xcbf29ce484222325ull;  /* FNV-1a */
    for (size_t i = 0; i < (size_t)r->sampler.vocab_size * sizeof(float); i++) x = (x ^ bytes[i]) * 0x100000001b3ull;
    h->hashes[(size_t)r->index * h->stride + r->generated] = x;
}

static void run_hashed(Scheduler *sch, LogitHashes *h) {
    sch->on_logits = hash_logits;
    sch->on_token = NULL;
    sch->on_done = NULL;
    sch->on_step = NULL;
    sch->ctx = h;
    parallel_team(run_in_team, sch);
}

/* One sequence of --check-batch: its steps, the tokens it generated alike, its verdict, and
 * the first step whose logits differ (-1: none). */
typedef struct {
    int steps, same_tokens, identical, first_difference;
} BatchVerdict;

/* Every sequence of the batch against the same prompt and seed run alone: the same
 * tokens, and logits of the same bits at every step. Returns 1 when any differs. */
static int check_batch(Scheduler *batch, const Options *o, const char *what) {
    const Model *m = batch->model;
    if (batch->pool->window && !o->steps) die(EXIT_USAGE, "--check-batch with --window needs -n: a window has no end");
    const int B = batch->n_requests, stride = (o->steps > m->cfg.max_seq_len ? o->steps : m->cfg.max_seq_len) + 1;
    LogitHashes in_batch = {calloc((size_t)B * stride, sizeof(uint64_t)), stride};
    LogitHashes alone = {calloc((size_t)B * stride, sizeof(uint64_t)), stride};
    if (!in_batch.hashes || !alone.hashes) die(1, "out of memory");
    run_hashed(batch, &in_batch);
    int differ = 0;
    BatchVerdict *verdicts = malloc((size_t)B * sizeof *verdicts);
    if (!verdicts) die(1, "out of memory");
    for (int i = 0; i < B; i++) {
        const Request *a = &batch->requests[i];
        Scheduler solo = *batch;
        solo.requests = prompt_requests(a->tokens, a->n_prompt, 1, a->seed, a->cap_tokens);
        solo.requests[0].index = i;
        solo.n_requests = 1;
        solo.max_batch = 1;
        run_hashed(&solo, &alone);
        const Request *b = &solo.requests[0];
        int same_tokens = 0;
        while (same_tokens < a->n_tokens && same_tokens < b->n_tokens && a->tokens[same_tokens] == b->tokens[same_tokens])
            same_tokens++;
        int first_difference = -1;
        const int steps = a->generated < b->generated ? a->generated : b->generated;
        for (int s = 0; s < steps && first_difference < 0; s++)
            if (in_batch.hashes[(size_t)i * stride + s] != alone.hashes[(size_t)i * stride + s]) first_difference = s;
        if (first_difference < 0 && a->generated != b->generated) first_difference = steps;
        const int identical = first_difference < 0 && a->n_tokens == b->n_tokens && same_tokens == a->n_tokens;
        differ |= !identical;
        verdicts[i] = (BatchVerdict){a->generated, same_tokens - a->n_prompt, identical, first_difference};
        free_requests(&solo);
    }
    int n_identical = 0;
    for (int i = 0; i < B; i++) n_identical += verdicts[i].identical;
    if (o->json) {
        json_begin("check-batch", m, o, batch->kv ? "kv" : "no-kv");
        printf(", \"batch\": %d, \"slots\": %d, \"identical\": %s, \"sequences_identical\": %d, \"sequences\": [", B,
               batch->max_batch, differ ? "false" : "true", n_identical);
        for (int i = 0; i < B; i++)
            printf("%s{\"index\": %d, \"seed\": %llu, \"steps\": %d, \"identical_tokens\": %d, \"bitwise_identical\": %s, "
                   "\"first_difference\": %d}", i ? ", " : "", i, (unsigned long long)batch->requests[i].seed,
                   verdicts[i].steps, verdicts[i].same_tokens, verdicts[i].identical ? "true" : "false",
                   verdicts[i].first_difference);
        putchar(']');
        json_end();
    } else {
        printf("%s %s, %d sequences of %s\"%s\" in %d slots: %d of %d give the same tokens and bitwise the same logits as "
               "run alone\n",
               variant_name(&m->cfg), batch->kv ? "kv" : "no-kv", B, o->prompts_path ? "the prompts of " : "", what,
               batch->max_batch, n_identical, B);
        for (int i = 0; i < B; i++)
            printf("check-batch variant=%s mode=%s batch=%d index=%d seed=%llu steps=%d identical_tokens=%d "
                   "bitwise_identical=%d first_difference=%d\n",
                   variant_name(&m->cfg), batch->kv ? "kv" : "no-kv", B, i, (unsigned long long)batch->requests[i].seed,
                   verdicts[i].steps, verdicts[i].same_tokens, verdicts[i].identical, verdicts[i].first_difference);
    }
    free(verdicts);
    free(in_batch.hashes);
    free(alone.hashes);
    return differ;
}

/* ---- --check-kv ---- */

typedef struct {
    int *tokens;
    float *logits;   /* (steps, vocab) */
    int steps;
} GreedyRun;

static GreedyRun greedy_run(Engine *e, const int *prompt, int n_prompt, int steps, int ignore_eos) {
    const Model *m = e->model;
    const int max_seq = m->cfg.max_seq_len, V = m->cfg.vocab_size;
    GreedyRun r = {malloc((size_t)(max_seq + 1) * sizeof(int)), malloc((size_t)(max_seq + 1) * V * sizeof(float)), 0};
    if (!r.tokens || !r.logits) die(1, "out of memory");
    memcpy(r.tokens, prompt, (size_t)n_prompt * sizeof(int));
    int n = n_prompt;
    kv_reset(e->cache);
    engine_step(e, r.tokens, n, r.logits);
    for (;;) {
        int next = sampler_argmax(r.logits + (size_t)r.steps * V, V);
        r.steps++;
        if ((next == m->cfg.eos_id && !ignore_eos) || r.steps >= steps || n >= max_seq) break;
        r.tokens[n++] = next;
        engine_step(e, r.tokens, n, r.logits + (size_t)r.steps * V);
    }
    return r;
}

/* Greedy with the cache against greedy without it, step by step while both runs have seen
 * the same tokens. */
typedef struct {
    char a[32], b[32];     /* the runs' names: kv[-form], no-kv[-form] */
    int same_form;         /* the same arithmetic: the logits should be the same bits */
    int steps;             /* compared */
    int identical_tokens, divergent_step, token_a, token_b;  /* -1: none */
    int first_bitwise_difference;                             /* -1: none */
    double max_abs_logit_diff;
} KvComparison;

/* The comparison fails on different tokens, and for the same form on different logits. */
static int comparison_fails(const KvComparison *c) {
    return c->divergent_step >= 0 || (c->same_form && c->first_bitwise_difference >= 0);
}

/* e->cache is used with the cache; uncached (a cache without a window) without it. */
static KvComparison check_kv_pair(Engine *e, KVCache *uncached, const Options *o, const int *prompt, int n_prompt,
                                  int steps, MlaForm form_cached, MlaForm form_uncached) {
    const Model *m = e->model;
    const int V = m->cfg.vocab_size;
    const int is_mla = m->cfg.variant == VARIANT_MLA;
    KvComparison c = {.same_form = !is_mla || form_cached == form_uncached, .divergent_step = -1, .token_a = -1, .token_b = -1,
                      .first_bitwise_difference = -1};
    snprintf(c.a, sizeof c.a, is_mla ? "kv-%s" : "kv", mla_form_name(form_cached));
    snprintf(c.b, sizeof c.b, is_mla ? "no-kv-%s" : "no-kv", mla_form_name(form_uncached));

    KVCache *cached = e->cache;
    e->kv = 1;
    e->form = form_cached;
    GreedyRun a = greedy_run(e, prompt, n_prompt, steps, o->ignore_eos);
    e->kv = 0;
    e->form = form_uncached;
    e->cache = uncached;
    GreedyRun b = greedy_run(e, prompt, n_prompt, steps, o->ignore_eos);
    e->cache = cached;

    c.steps = a.steps < b.steps ? a.steps : b.steps;
    for (int s = 0; s < c.steps; s++) {
        const float *la = a.logits + (size_t)s * V, *lb = b.logits + (size_t)s * V;
        if (c.first_bitwise_difference < 0 && memcmp(la, lb, (size_t)V * sizeof(float)) != 0) c.first_bitwise_difference = s;
        for (int i = 0; i < V; i++) {
            double d = fabs((double)la[i] - (double)lb[i]);
            if (d > c.max_abs_logit_diff) c.max_abs_logit_diff = d;
        }
        if (sampler_argmax(la, V) != sampler_argmax(lb, V)) { c.divergent_step = s; break; }
    }
    if (c.divergent_step < 0 && a.steps != b.steps) c.divergent_step = c.steps;  /* one stopped at EOS, the other not */
    const int d = c.divergent_step;
    c.identical_tokens = d < 0 ? c.steps : d;
    if (d >= 0 && d < a.steps) c.token_a = sampler_argmax(a.logits + (size_t)d * V, V);
    if (d >= 0 && d < b.steps) c.token_b = sampler_argmax(b.logits + (size_t)d * V, V);
    free(a.tokens);
    free(a.logits);
    free(b.tokens);
    free(b.logits);
    return c;
}

/* One line for people, then the machine-readable key=value lines (or one JSON object).
 * For MLA two comparisons: absorbed with the cache against expanded without it (the
 * KV-cache post's setup), and against absorbed without it (the same arithmetic). With a
 * window the cached run keeps only the window and the uncached one recomputes the whole
 * sequence: they agree until the window is full. Returns 1 when a comparison fails. */
static int check_kv(Engine *e, const Options *o) {
    const Model *m = e->model;
    const KVPool *pool = e->cache->pool;
    int *prompt = malloc((size_t)(m->cfg.max_seq_len + 1) * sizeof(int));
    if (!prompt) die(1, "out of memory");
    const int n = encode_prompt(m, o->prompt, prompt, m->cfg.max_seq_len + 1, "");
    const int steps = o->steps ? o->steps : m->cfg.max_seq_len;
    KVPool whole;  /* without the window */
    KVCache uncached;
    if (kv_pool_init(&whole, &m->cfg, pool->dtype, kv_blocks_for(m->cfg.max_seq_len)) != 0 ||
        kv_init(&uncached, &whole, m->cfg.max_seq_len) != 0)
        die(1, "out of memory");
    const MlaForm uncached_forms[2] = {MLA_EXPANDED, MLA_ABSORBED};
    const int n_pairs = m->cfg.variant == VARIANT_MLA ? 2 : 1;
    KvComparison c[2];
    int fails = 0;
    for (int i = 0; i < n_pairs; i++) {
        c[i] = check_kv_pair(e, &uncached, o, prompt, n, steps, MLA_ABSORBED, uncached_forms[i]);
        fails |= comparison_fails(&c[i]);
    }
    char window[32] = "";
    if (pool->window) snprintf(window, sizeof window, " (window %d)", pool->window);
    for (int i = 0; i < n_pairs && !o->json; i++) {
        printf("%s: %s%s vs %s: identical for %d tokens", variant_name(&m->cfg), c[i].a, window, c[i].b,
               c[i].identical_tokens);
        if (c[i].divergent_step >= 0)
            printf(", then step %d diverges: %s gives token %d, %s gives token %d", c[i].divergent_step, c[i].a,
                   c[i].token_a, c[i].b, c[i].token_b);
        printf("; logits %s; max |logit difference| %.3g\n",
               c[i].first_bitwise_difference < 0 ? "bitwise identical" : "not bitwise identical", c[i].max_abs_logit_diff);
    }
    if (o->json) {
        json_begin("check-kv", m, o, "kv-vs-no-kv");
        printf(", \"steps_requested\": %d, \"identical\": %s, \"comparisons\": [", steps, fails ? "false" : "true");
        for (int i = 0; i < n_pairs; i++) {
            printf("%s{\"a\": \"%s\", \"b\": \"%s\", \"same_form\": %s, \"steps\": %d, \"identical_tokens\": %d, "
                   "\"first_divergent_step\": ", i ? ", " : "", c[i].a, c[i].b, c[i].same_form ? "true" : "false",
                   c[i].steps, c[i].identical_tokens);
            json_number(stdout, c[i].divergent_step < 0 ? NAN : c[i].divergent_step);
            fputs(", \"token_a\": ", stdout);
            json_number(stdout, c[i].token_a < 0 ? NAN : c[i].token_a);
            fputs(", \"token_b\": ", stdout);
            json_number(stdout, c[i].token_b < 0 ? NAN : c[i].token_b);
            printf(", \"bitwise_identical\": %s, \"first_bitwise_difference\": ",
                   c[i].first_bitwise_difference < 0 ? "true" : "false");
            json_number(stdout, c[i].first_bitwise_difference < 0 ? NAN : c[i].first_bitwise_difference);
            json_field("max_abs_logit_diff", c[i].max_abs_logit_diff);
            putchar('}');
        }
        putchar(']');
        json_end();
    }
    for (int i = 0; i < n_pairs && !o->json; i++)
        printf("check-kv variant=%s a=%s b=%s window=%d steps=%d identical_tokens=%d first_divergent_step=%d token_a=%d "
               "token_b=%d bitwise_identical=%d first_bitwise_difference=%d max_abs_logit_diff=%.6g\n",
               variant_name(&m->cfg), c[i].a, c[i].b, pool->window, c[i].steps, c[i].identical_tokens,
               c[i].divergent_step, c[i].token_a, c[i].token_b, c[i].first_bitwise_difference < 0,
               c[i].first_bitwise_difference, c[i].max_abs_logit_diff);
    kv_free(&uncached);
    kv_pool_free(&whole);
    free(prompt);
    return fails;
}

/* ---- --ppl ---- */

/* -log softmax(l)[target] in double */
static double token_nll(const float *l, int V, int target) {
    float max = l[0];
    for (int i = 1; i < V; i++) max = l[i] > max ? l[i] : max;
    double sum = 0.0;
    for (int i = 0; i < V; i++) sum += exp((double)l[i] - max);
    return log(sum) + max - l[target];
}

typedef struct {
    double nll, nll_past;  /* all targets; targets at positions past the context */
    long count, count_past;
    int stories;
    double story_s2, story_sn, story_n2;  /* sums of s_i^2, s_i n_i, n_i^2: story i's NLL s_i over n_i tokens */
} NllSum;

/* The mean NLL over all tokens is a ratio, and the stories are the units sampled (tokens of
 * one story are not independent), so its standard error is the ratio estimator's:
 * sqrt(k/(k-1) * sum_i (s_i - mean n_i)^2) / N over k stories of N tokens. NAN for one story. */
static double nll_standard_error(const NllSum *t) {
    if (t->stories < 2) return NAN;
    const double mean = t->nll / t->count;
    const double spread = t->story_s2 - 2.0 * mean * t->story_sn + mean * mean * t->story_n2;
    return sqrt((double)t->stories / (t->stories - 1) * (spread > 0.0 ? spread : 0.0)) / (double)t->count;
}

static void add_nll(NllSum *sum, double nll, int target_pos, int ctx) {
    sum->nll += nll;
    sum->count++;
    if (target_pos >= ctx) sum->nll_past += nll, sum->count_past++;
}

/* A story scored in windows of the context, each from an empty cache, as train/model.py
 * story_windows() does (the baseline past the context: restart). */
static void score_in_windows(Engine *e, const int *ids, int n, float *logits, NllSum *sum) {
    const Model *m = e->model;
    const int ctx = m->cfg.max_seq_len, V = m->cfg.vocab_size;
    for (int start = 0; start < n - 1; start += ctx) {
        const int len = n - start < ctx + 1 ? n - start : ctx + 1;  /* inputs len-1, targets len-1 */
        kv_reset(e->cache);
        check_forward(model_forward(m, e->state, e->cache, ids + start, len - 1, e->form, logits, 1));
        for (int t = 0; t < len - 1; t++) add_nll(sum, token_nll(logits + (size_t)t * V, V, ids[start + t + 1]), start + t + 1, ctx);
    }
}

/* A story scored through a windowed cache: the first window's tokens in one pass, then one
 * token a pass, each seeing what the window keeps. */
static void score_through_window(Engine *e, const int *ids, int n, float *logits, NllSum *sum) {
    const Model *m = e->model;
    const int V = m->cfg.vocab_size, first = n - 1 < e->cache->pool->window ? n - 1 : e->cache->pool->window;
    kv_reset(e->cache);
    check_forward(model_forward(m, e->state, e->cache, ids, first, e->form, logits, 1));
    for (int t = 0; t < first; t++) add_nll(sum, token_nll(logits + (size_t)t * V, V, ids[t + 1]), t + 1, m->cfg.max_seq_len);
    for (int t = first; t < n - 1; t++) {
        check_forward(model_forward(m, e->state, e->cache, ids + t, 1, e->form, logits, 0));
        add_nll(sum, token_nll(logits, V, ids[t + 1]), t + 1, m->cfg.max_seq_len);
    }
}

/* --ppl: every story scored, with running estimates on stderr when it is a terminal, then
 * one line (or one JSON object) on stdout. */
static void perplexity(Engine *e, const Options *o) {
    const Model *m = e->model;
    const char *path = o->ppl_path;
    const int ctx = m->cfg.max_seq_len, V = m->cfg.vocab_size;
    char err[256];
    StoryFile sf;
    if (storyfile_read(&sf, path, err, sizeof err) != 0) die(1, "%s", err);
    int cap = 1 << 16;
    int *ids = malloc((size_t)cap * sizeof(int));
    float *logits = malloc((size_t)ctx * V * sizeof(float));
    if (!ids || !logits) die(1, "out of memory");
    const int progress = !o->quiet && isatty(STDERR_FILENO);
    NllSum sum = {0};
    for (int s = 0; s < sf.n_stories; s++) {
        const char *text = sf.stories[s];
        int n = spm_encode(m->tokenizer, text, strlen(text), 1, ids, cap - 1);
        if (n < 0 || n >= cap) {
            free(ids);
            free(logits);
            storyfile_free(&sf);
            if (progress) fputs("\r\033[K", stderr);
            die(1, "%s: story %d %s", input_name(path).s, s + 1, n < 0 ? encode_error(n) : "is longer than 65535 tokens");
        }
        ids[n++] = m->cfg.eos_id;
        const double nll_before = sum.nll;
        const long count_before = sum.count;
        if (e->cache->pool->window) score_through_window(e, ids, n, logits, &sum);
        else score_in_windows(e, ids, n, logits, &sum);
        const double story_nll = sum.nll - nll_before, story_count = (double)(sum.count - count_before);
        sum.stories++;
        sum.story_s2 += story_nll * story_nll, sum.story_sn += story_nll * story_count;
        sum.story_n2 += story_count * story_count;
        if (progress) {
            const double mean = sum.nll / sum.count, se = nll_standard_error(&sum);
            fprintf(stderr, "\rppl: story %d of %d, %ld tokens, PPL = %.3f", s + 1, sf.n_stories, sum.count, exp(mean));
            if (!isnan(se)) fprintf(stderr, " +/- %.3f", exp(mean) * se);
            fputs("\033[K", stderr);
        }
    }
    if (progress) fputs("\r\033[K", stderr);
    const double mean = sum.nll / sum.count, se = nll_standard_error(&sum), ppl = exp(mean);
    if (o->json) {
        json_begin("ppl", m, o, e->kv ? "kv" : "no-kv");
        fputs(", \"path\": ", stdout);
        json_text(stdout, path);
        printf(", \"stories\": %d, \"tokens\": %ld", sf.n_stories, sum.count);
        json_field("mean_nll", mean);
        json_field("mean_nll_stderr", se);
        json_field("perplexity", ppl);
        json_field("perplexity_stderr", ppl * se);
        printf(", \"past_context\": ");
        if (sum.count_past) {
            printf("{\"from_position\": %d, \"tokens\": %ld, \"mean_nll\": ", ctx, sum.count_past);
            json_number(stdout, sum.nll_past / sum.count_past);
            putchar('}');
        } else {
            fputs("null", stdout);
        }
        json_end();
    } else {
    printf("ppl: %s | %d stories, %ld tokens | mean NLL %.4f nats/token | perplexity %.3f", path, sf.n_stories,
           sum.count, mean, ppl);
    if (sum.count_past)
        printf(" | past the context (position %d on): %ld tokens, mean NLL %.4f", ctx, sum.count_past,
               sum.nll_past / sum.count_past);
    if (isnan(se)) printf(" | PPL = %.3f (one story: no standard error)\n", ppl);
    else printf(" | PPL = %.3f +/- %.3f, mean NLL %.4f +/- %.4f (standard errors over %d stories)\n", ppl, ppl * se, mean,
                se, sum.stories);
    }
    storyfile_free(&sf);
    free(ids);
    free(logits);
}

/* ---- --info ---- */

/* --info as one JSON object: the configuration, the parameters, the KV cache's bytes per
 * token by the formula and as allocated, the pool. */
static void info_json(const Model *m, const KVPool *pool, const Options *o, size_t per_token, int kept) {
    const Config *c = &m->cfg;
    json_begin("info", m, o, o->kv ? "kv" : "no-kv");
    printf(", \"dtype\": \"%s\", \"dim\": %d, \"layers\": %d, \"heads\": %d, \"head_dim\": %d, \"kv_heads\": %d, "
           "\"kv_latent\": %d, \"rope_dim\": %d, \"hidden\": %d, \"vocab\": %d, \"context\": %d, \"parameters\": %zu, "
           "\"weight_bytes\": %zu, \"kv_bytes_per_token\": %zu, \"kv_bytes_full\": %zu, "
           "\"kv_bytes_per_token_allocated\": %zu, \"kv_pool_blocks\": %d, \"kv_block_tokens\": %d, "
           "\"kv_block_bytes\": %zu, \"kv_pool_bytes\": %zu, \"kernels\": \"%s\"",
           c->dtype == DTYPE_BF16 ? "bf16" : "fp32", c->dim, c->n_layers, c->n_heads, c->head_dim, c->n_kv_heads,
           c->kv_latent, config_rope_width(c), c->hidden_dim, c->vocab_size, c->max_seq_len, model_param_count(c),
           model_param_count(c) * dtype_size(c->dtype), per_token, per_token * (size_t)kept, kv_bytes_per_token(pool),
           pool->n_blocks, KV_BLOCK_TOKENS, kv_block_bytes(pool), kv_block_bytes(pool) * (size_t)pool->n_blocks,
           kernels_simd_name());
    json_end();
}

static void info(const Model *m, const KVPool *pool, const Options *o) {
    const Config *c = &m->cfg;
    const DType dt = pool->dtype;
    const int batch = o->batch;
    const size_t es = dtype_size(dt), per_token = c->variant == VARIANT_MLA
        ? (size_t)c->n_layers * ((c->kv_latent + c->rope_dim) * es + (dt == DTYPE_I8 ? 8 : 0))
        : 2 * (size_t)c->n_layers * c->n_kv_heads * (c->head_dim * es + (dt == DTYPE_I8 ? 4 : 0));
    const int kept = pool->window ? pool->window : c->max_seq_len;
    if (o->json) {
        info_json(m, pool, o, per_token, kept);
        return;
    }
    printf("variant        %s\n", variant_name(c));
    printf("dtype          %s\n", c->dtype == DTYPE_BF16 ? "bf16" : "fp32");
    printf("dim %d, layers %d, heads %d x %d, kv heads %d, latent %d, rope dim %d, hidden %d, vocab %d, context %d\n",
           c->dim, c->n_layers, c->n_heads, c->head_dim, c->n_kv_heads, c->kv_latent,
           config_rope_width(c), c->hidden_dim, c->vocab_size, c->max_seq_len);
    printf("parameters     %zu (%.2f M), %zu bytes of weights\n", model_param_count(c), model_param_count(c) / 1e6,
           model_param_count(c) * dtype_size(c->dtype));
    if (c->variant == VARIANT_MLA) {
        if (dt == DTYPE_I8) printf("KV cache       L*(d_c+d_R+8) = %d*(%d+%d+8)", c->n_layers, c->kv_latent, c->rope_dim);
        else printf("KV cache       L*(d_c+d_R)*%zu = %d*(%d+%d)*%zu", es, c->n_layers, c->kv_latent, c->rope_dim, es);
    } else {
        if (dt == DTYPE_I8) printf("KV cache       2*L*H_kv*(d_h+4) = 2*%d*%d*(%d+4)", c->n_layers, c->n_kv_heads, c->head_dim);
        else printf("KV cache       2*L*H_kv*d_h*%zu = 2*%d*%d*%d*%zu", es, c->n_layers, c->n_kv_heads, c->head_dim, es);
    }
    printf(" = %zu bytes/token; %zu bytes at full %s (%s%s)\n", per_token, per_token * kept,
           pool->window ? "window" : "context", kv_dtype_name(dt), dt == DTYPE_I8 ? ", a 4-byte scale a vector" : "");
    if (pool->window)
        printf("window         %d positions a sequence, %d of them sinks kept for good; the rest a ring\n", pool->window,
               pool->sinks);
    printf("allocated      %zu bytes/token; %zu bytes (%s)\n", kv_bytes_per_token(pool),
           kv_block_bytes(pool) * (size_t)pool->n_blocks, kv_dtype_name(dt));
    printf("KV pool        %d blocks of %d tokens, %zu bytes each (%zu bytes); a contiguous cache of the full %s "
           "for %d sequence%s would take %zu bytes\n",
           pool->n_blocks, KV_BLOCK_TOKENS, kv_block_bytes(pool), kv_block_bytes(pool) * (size_t)pool->n_blocks,
           pool->window ? "window" : "context", batch, batch > 1 ? "s" : "", kv_bytes_per_token(pool) * (size_t)kept * (size_t)batch);
    printf("kernels        %s\n", kernels_simd_name());
}

/* ---- the standard streams and the prompt ---- */

/* A closed standard descriptor would be handed to the next file opened (the checkpoint, a
 * log), and the story or a message would land in that file: a closed stdout is refused,
 * a closed stdin or stderr gets /dev/null. */
static void check_standard_streams(const Options *o) {
    if (fcntl(STDOUT_FILENO, F_GETFD) < 0) die(1, "cannot write standard output: it is closed");
    if (fcntl(STDIN_FILENO, F_GETFD) < 0) {
        if (o->prompt_path && !strcmp(o->prompt_path, "-")) die(1, "cannot read the prompt: standard input is closed");
        if (open("/dev/null", O_RDONLY) != STDIN_FILENO) die(1, "cannot open /dev/null: %s", strerror(errno));
    }
    if (fcntl(STDERR_FILENO, F_GETFD) < 0 && open("/dev/null", O_WRONLY) != STDERR_FILENO) exit(1);
}

/* The prompt of -f FILE or -p - (standard input), without its trailing line breaks. */
static char *read_prompt(const char *path) {
    char err[512], *text;
    if (textfile_read_text(path, &text, err, sizeof err) != 0) die(1, "%s", err);
    size_t n = strlen(text);
    while (n > 0 && (text[n - 1] == '\n' || text[n - 1] == '\r')) text[--n] = '\0';
    return text;
}

/* The least stack limit (ulimit -s) this program runs under, refused below rather than met by
 * SIGSEGV: its large scratch is on the heap, but the libraries' own frames take several KB. */
enum { MIN_STACK_BYTES = 32 << 10 };

int main(int argc, char **argv) {
    struct rlimit stack;
    if (getrlimit(RLIMIT_STACK, &stack) == 0 && stack.rlim_cur != RLIM_INFINITY && stack.rlim_cur < MIN_STACK_BYTES) {
        /* a string and _exit: printf to the unbuffered stderr and exit's handlers need more stack */
        char line[128];
        snprintf(line, sizeof line, "run: the stack limit (ulimit -s) is %llu KB, below the %d KB this program needs\n",
                 (unsigned long long)stack.rlim_cur >> 10, MIN_STACK_BYTES >> 10);
        fputs(line, stderr);
        _exit(EXIT_USAGE);
    }
    Options o;
    size_t errlen = 256;  /* room for the longest message with every argument in it */
    for (int i = 0; i < argc; i++) errlen += strlen(argv[i]);
    char *usage_err = malloc(errlen);
    if (!usage_err) die(1, "out of memory");
    int rc = cli_parse(&o, argc, argv, usage_err, errlen);
    if (rc == CLI_HELP || rc == CLI_VERSION) {
        if (rc == CLI_HELP) cli_usage(stdout);
        else printf("run %s (commit %s)\n", RUN_VERSION, build_commit());
        exit(0);
    }
    if (rc != CLI_RUN) {
        if (o.usage_on_error) cli_usage(stderr);
        die(EXIT_USAGE, "%s", usage_err);
    }
    check_standard_streams(&o);
    char *prompt_text = o.prompt_path ? read_prompt(o.prompt_path) : NULL;
    if (prompt_text) o.prompt = prompt_text;
    if (o.threads > 0) parallel_set_threads(o.threads);
    else if (parallel_check_env(usage_err, errlen) != 0) die(EXIT_USAGE, "%s", usage_err);
    free(usage_err);

    Model m;
    char err[512];
    if (model_load(&m, o.checkpoint, err, sizeof err) != 0) die(1, "%s", err);
    if (o.top_k > m.cfg.vocab_size) die(EXIT_USAGE, "-k %d is out of range (1..%d, the vocabulary)", o.top_k, m.cfg.vocab_size);
    if (o.steps > m.cfg.max_seq_len && (!o.window || o.check_kv))
        die(EXIT_USAGE, "-n %d is out of range (1..%d, the context%s)", o.steps, m.cfg.max_seq_len,
            o.check_kv ? "" : "; more with --window");
    if (o.window > m.cfg.max_seq_len)
        die(EXIT_USAGE, "--window %d is out of range (1..%d, the context)", o.window, m.cfg.max_seq_len);
    if (o.window && o.window <= o.window_sinks)
        die(EXIT_USAGE, "--window %d leaves no room beside the %d sink positions", o.window, o.window_sinks);

    const int B = o.batch;
    if (o.dump_path && (B > 1 || o.prompts_path))
        die(EXIT_USAGE, "--dump-logits writes one sequence's logits: it takes no --batch or --prompts");
    const size_t block_bytes = kv_block_bytes_for(&m.cfg, o.kv_dtype);
    const int one_sequence = kv_blocks_for(o.window ? o.window : m.cfg.max_seq_len);
    const double pool_blocks = o.kv_mem_mb > 0.0f ? floor((double)o.kv_mem_mb * 1048576.0 / (double)block_bytes)
                                                  : (double)(o.kv ? B : 1) * one_sequence;
    if (pool_blocks < one_sequence)
        die(EXIT_USAGE, "--kv-mem %g MB holds %.0f blocks of %zu bytes; one sequence of the full %s (%d tokens) needs %d",
            (double)o.kv_mem_mb, pool_blocks, block_bytes, o.window ? "window" : "context",
            o.window ? o.window : m.cfg.max_seq_len, one_sequence);
    if (pool_blocks > INT_MAX) die(EXIT_USAGE, "--kv-mem %g MB is more blocks than this program counts", (double)o.kv_mem_mb);
    const long n_blocks = (long)pool_blocks;

    RunState state;
    KVPool pool;
    KVCache cache;
    int *tokens = malloc((size_t)(m.cfg.max_seq_len + 1) * sizeof(int));  /* the prompt */
    float *logits = malloc((size_t)B * (size_t)m.cfg.vocab_size * sizeof(float));
    if (!tokens || !logits || runstate_init(&state, &m.cfg, scheduler_max_tokens(&m.cfg, B)) != 0 ||
        kv_pool_init(&pool, &m.cfg, o.kv_dtype, (int)n_blocks) != 0)
        die(1, "out of memory: the KV cache pool of %ld blocks takes %zu bytes", n_blocks, (size_t)n_blocks * block_bytes);
    if (o.window) kv_pool_set_window(&pool, o.window, o.window_sinks);
    if (kv_init(&cache, &pool, m.cfg.max_seq_len) != 0) die(1, "out of memory");
    Engine e = {&m, &state, &cache, o.kv, o.mla_form};

    int status = 0;
    if (o.info) {
        info(&m, &pool, &o);
    } else if (o.check_kv) {
        status = check_kv(&e, &o);
    } else if (o.ppl_path) {
        perplexity(&e, &o);
    } else {
        Scheduler sch = {.model = &m, .state = &state, .pool = &pool, .kv = o.kv, .form = o.mla_form, .max_batch = B,
                         .max_new = o.steps, .ignore_eos = o.ignore_eos, .top_k = o.top_k, .top_p = o.top_p,
                         .temperature = o.temperature,
                         .logits = logits};
        PromptFile file = {0};
        const char **prompts;  /* each request's text */
        if (o.prompts_path) {
            if (promptfile_read(&file, o.prompts_path, err, sizeof err) != 0) die(1, "%s", err);
            sch.n_requests = file.n_prompts;
            if (!(sch.requests = calloc((size_t)file.n_prompts, sizeof *sch.requests))) die(1, "out of memory");
            for (int i = 0; i < file.n_prompts; i++) {  /* every line is checked before anything runs */
                Request *r = &sch.requests[i];
                char where[320];
                snprintf(where, sizeof where, "%s:%d: ", input_name(o.prompts_path).s, file.line_numbers[i]);
                r->cap_tokens = m.cfg.max_seq_len + 1;
                if (!(r->tokens = malloc((size_t)r->cap_tokens * sizeof(int)))) die(1, "out of memory");
                r->n_prompt = encode_prompt(&m, file.prompts[i], r->tokens, m.cfg.max_seq_len + 1, where);
                r->index = i;
                r->seed = o.seed + (uint64_t)i;
            }
            prompts = (const char **)file.prompts;
        } else {
            const int n_prompt = encode_prompt(&m, o.prompt, tokens, m.cfg.max_seq_len + 1, "");
            sch.n_requests = B;
            sch.requests = prompt_requests(tokens, n_prompt, B, o.seed, token_room(&m, n_prompt, o.steps));
            if (!(prompts = malloc((size_t)B * sizeof *prompts))) die(1, "out of memory");
            for (int i = 0; i < B; i++) prompts[i] = o.prompt;
        }
        if (o.check_batch) {
            status = check_batch(&sch, &o, o.prompts_path ? o.prompts_path : o.prompt);
        } else {
            const int sig = generate(&sch, &o, prompts);
            if (sig) status = 128 + sig;  /* as a shell reports a run a signal ended */
        }
        free_requests(&sch);
        if (!o.prompts_path) free(prompts);
        promptfile_free(&file);
    }
    kv_free(&cache);
    kv_pool_free(&pool);
    runstate_free(&state);
    free(tokens);
    free(logits);
    model_free(&m);
    free(prompt_text);
    close_written(stdout, "standard output");  /* --info, --ppl and --check-kv print only at the end */
    return status;
}
