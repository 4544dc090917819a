/* generate.c: generation, the default mode (modes.h): one sequence streamed to stdout as it
 * comes, or many printed whole in order; a line a step on stderr; the summary. */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/errmsg.h"
#include "kernels/timer.h"
#include "loader.h"
#include "serve/json.h"
#include "serve/modes.h"
#include "serve/output.h"
#include "serve/attn_dump.h"
#include "serve/profile.h"
#include "serve/session.h"
#include "tokenizer/spm_c.h"
#include "kernels/utf8.h"

/* A generation's outputs and figures, as the step loop fills them. */
typedef struct {
    const Options *o;
    const Model *model;
    const Scheduler *sch;
    const RequestList *list;
    int serving; /* --prompts */
    FILE *log_csv, *dump;
    SpmStream *stream; /* one sequence's text, printed as it comes (NULL: no tokenizer) */
    char id_text[16];  /* without a tokenizer, a token's text is its id */
    int interrupted;   /* a signal ended the run: what is left prints as it is */
    int next_to_print; /* many sequences print whole, in order */
    double *step_ms;   /* (steps so far) */
    int *step_tokens;  /* (steps so far): the tokens each step sampled */
    int n_steps, cap_steps;
    int prefill_steps, prefill_tokens; /* the steps up to the first that samples, and their tokens */
    int step_lines;   /* the warm-up and each step on stderr */
    int one_terminal; /* stdout and stderr are the same terminal */
    int mid_line;     /* the text on stdout does not end with a newline */
    Profile *profile; /* --profile, or NULL */
    AttnDump *attn;   /* --dump-attn, or NULL */
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

static const char *stop_name(StopReason r) {
    return r == STOP_EOS ? "eos" : r == STOP_CONTEXT ? "context full" : r == STOP_STEPS ? "steps" : "interrupted";
}

/* The text a token adds to the streamed sequence: the tokenizer's, or without one its id. */
static const char *token_text(Generation *g, int token) {
    if (g->stream) return spm_stream_put(g->stream, token);
    snprintf(g->id_text, sizeof g->id_text, "%d ", token);
    return g->id_text;
}
static const char *stream_end(Generation *g) { return g->stream ? spm_stream_flush(g->stream) : ""; }

/* Token ids, separated by spaces: the text of a model without a tokenizer. */
static char *ids_text(const int *tokens, int n, size_t *len) {
    char *text = malloc((size_t)n * 12 + 1);
    if (!text) die(1, "out of memory");
    *len = 0;
    text[0] = '\0';
    for (int i = 0; i < n; i++) *len += (size_t)sprintf(text + *len, i ? " %d" : "%d", tokens[i]);
    return text;
}

/* The text of tokens[1 ..) (after BOS) as stdout shows it: sanitized, in a new buffer. */
static char *sequence_text(const Model *m, const Request *r, int fill, size_t *len) {
    const int *tokens = r->tokens + fill + 1, count = r->n_tokens - fill - 1; /* after the fill and BOS */
    if (!m->tokenizer) return ids_text(tokens, count, len);
    const size_t n = spm_decode(m->tokenizer, tokens, count, NULL, 0);
    char *raw = malloc(n + 1), *text = NULL;
    if (raw) {
        spm_decode(m->tokenizer, tokens, count, raw, n + 1);
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
    char *text = sequence_text(g->model, r, g->o->fill, &len);
    if (g->o->json) {
        const char *prompt = g->list->texts[r->index];
        printf("{\"type\": \"sequence\", \"index\": %d, \"prompt\": ", r->index);
        json_string(stdout, prompt, strlen(prompt));
        printf(", \"seed\": %llu, \"text\": ", (unsigned long long)r->seed);
        json_string(stdout, text, len);
        printf(", \"prompt_tokens\": %d, \"fill\": %d, \"tokens\": [", r->n_prompt - g->o->fill, g->o->fill);
        for (int i = r->n_prompt; i < r->n_tokens; i++) printf(i > r->n_prompt ? ", %d" : "%d", r->tokens[i]);
        printf("], \"generated\": %d, \"stop\": \"%s\", \"first_token_ms\": ", r->generated, stop_name(r->stop));
        if (r->generated > 0) /* no token, no time to it */
            printf("%.3f", r->first_token_ms);
        else
            printf("null");
        printf(", \"prefill_ms\": %.3f, \"decode_ms_per_token_mean\": %.4f, \"preemptions\": %d}\n", r->prefill_ms,
               r->decode_steps ? r->decode_ms / r->decode_steps : 0.0, r->preemptions);
    } else {
        printf("[sequence %d seed %llu stop %s]\n%s\n\n", r->index, (unsigned long long)r->seed, stop_name(r->stop),
               text);
    }
    check_written(stdout, "standard output");
    free(text);
}

static int streams_text(const Generation *g) { return g->list->n == 1 && !g->o->json && !g->serving; }

/* The sequences that can print now: many print whole, in order, each once every sequence
 * before it has; after an interruption, all that are left, as they are. */
static void print_finished(Generation *g) {
    while (g->next_to_print < g->list->n && (g->list->requests[g->next_to_print].stop != STOP_NONE || g->interrupted))
        print_sequence(g, &g->list->requests[g->next_to_print++]);
}

/* Steps that ran only prompt tokens are prefill, only new tokens decode, both mixed. */
static const char *step_phase(const StepResult *st) {
    return st->prefill_tokens == st->n_tokens ? "prefill" : st->prefill_tokens == 0 ? "decode" : "mixed";
}

/* A step's token(s) out: the logits dumped, the text streamed, the step's line and CSV row. */
static void report_step(Generation *g, const StepResult *st) {
    const int V = g->model->cfg.vocab_size;
    if (g->profile) profile_step(g->profile, st);
    if (g->attn) attn_dump_step(g->attn, st->step);
    for (int k = 0; k < st->n_rows; k++) {
        const StepRow *row = &st->rows[k];
        if (g->dump && fwrite(st->logits + (size_t)k * V, sizeof(float), (size_t)V, g->dump) != (size_t)V)
            die(1, "cannot write %s: %s", msg_path(g->o->dump_path).s, strerror(errno));
        const int kept = row->token != g->model->cfg.eos_id || g->o->ignore_eos;
        if (streams_text(g) && kept) print_text(g, token_text(g, row->token));
    }
    if (g->n_steps == g->cap_steps) {
        g->cap_steps = g->cap_steps ? 2 * g->cap_steps : 512;
        if (!(g->step_ms = realloc(g->step_ms, (size_t)g->cap_steps * sizeof *g->step_ms)) ||
            !(g->step_tokens = realloc(g->step_tokens, (size_t)g->cap_steps * sizeof *g->step_tokens)))
            die(1, "out of memory");
    }
    g->step_tokens[g->n_steps] = st->n_rows;
    g->step_ms[g->n_steps++] = st->ms;
    /* a prompt past one pass, or with the cache past a window, takes several steps */
    if (g->prefill_steps == 0 || g->step_tokens[g->prefill_steps - 1] == 0)
        g->prefill_steps++, g->prefill_tokens += st->n_tokens;
    /* a lone sequence's line names its position and token */
    const StepRow *only = st->running == 1 && st->n_rows == 1 ? &st->rows[0] : NULL;
    if (g->step_lines) {
        start_stderr_line(g);
        if (only && st->step == 0)
            fprintf(stderr, "[prefill] tokens %d next %d ms %.3f\n", st->n_tokens, only->token, st->ms);
        else if (only)
            fprintf(stderr, "[step %d] pos %d token %d ms %.3f\n", st->step, only->pos, only->token, st->ms);
        else
            fprintf(stderr, "[step %d] sequences %d tokens %d ms %.3f\n", st->step, st->sequences, st->n_tokens,
                    st->ms);
    }
    if (g->log_csv) {
        fprintf(g->log_csv, "%d,%s,%d,%d,", st->step, step_phase(st), st->sequences, st->n_tokens);
        if (only)
            fprintf(g->log_csv, "%d,%d,", only->pos, only->token);
        else
            fputs("-1,-1,", g->log_csv);
        fprintf(g->log_csv, "%.4f", st->ms);
        if (g->profile) { /* and the pool after the step: its blocks in use, and those held by several sequences */
            profile_csv_row(g->log_csv, g->profile);
            const KVPool *pool = g->sch->pool;
            fprintf(g->log_csv, ",%d,%d", g->sch->kv ? kv_blocks_in_use(pool) : 0, g->sch->kv ? pool->shared_blocks : 0);
        }
        fputc('\n', g->log_csv);
        check_written(g->log_csv, g->o->log_path); /* a line at a time: a stopped run leaves whole lines */
    }
    if (st->n_finished == 0) return;
    if (streams_text(g)) {
        print_text(g, stream_end(g));
        if (g->mid_line || !g->one_terminal)
            print_text(g, "\n"); /* after a step line the terminal is at a line start */
    } else {
        print_finished(g);
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

/* A run's figures, for the summary and its JSON form. The prefill is the steps up to the
 * first that samples, every later step decodes; with --prompts, latencies are per request,
 * over the requests that got a token. After an interruption, requests are served (ended),
 * cut (begun) or not started. tokens/s: the mean is the tokens over their time (decode
 * steps; with --prompts every step, over the run's time); the median is that of each such
 * step's tokens over its time, as bench reports steps. */
typedef struct {
    int sequences, served, cut, not_started;
    int prefill_tokens, decode_steps, decode_tokens, stops[4]; /* stops by StopReason; NONE: interrupted */
    double steps_ms; /* every step's time, summed */
    double prefill_ms, decode_ms, step_median_ms, step_mean_ms, ms_per_token;
    double tokens_per_s_mean, tokens_per_s_median, per_sequence_ms_per_token_mean;
    long served_tokens;                      /* every token sampled, the first included */
    double ttft50, ttft95, token50, token95; /* --prompts: time to first token, per-token latency */
    int slow_steps;                          /* decode steps over 3x the median: waits on other processes */
    size_t kv_bytes;
} Figures;

/* A run is disturbed when over 2% of its decode steps take 3x the median: on an idle machine
 * a step is within a small factor of the median, and a busy one deschedules a thread of the
 * team for milliseconds now and then. */
static int disturbed(const Figures *f) { return f->decode_steps >= 20 && f->slow_steps * 50 > f->decode_steps; }

/* The median over steps [first, n_steps) of each step's sampled tokens a second. */
static double median_step_tokens_per_s(const Generation *g, int first) {
    const int n = g->n_steps > first ? g->n_steps - first : 0;
    double *rates = malloc((size_t)(n + 1) * sizeof *rates);
    if (!rates) die(1, "out of memory");
    for (int i = 0; i < n; i++) {
        const double ms = g->step_ms[first + i];
        rates[i] = ms > 0 ? 1000.0 * g->step_tokens[first + i] / ms : 0.0;
    }
    const double median = percentile(rates, n, 0.5);
    free(rates);
    return median;
}

static Figures figures_of(const Generation *g) {
    const Scheduler *sch = g->sch;
    const int n = g->list->n;
    const int P = g->prefill_steps;
    Figures f = {.sequences = n,
                 .prefill_tokens = g->prefill_tokens,
                 .decode_steps = g->n_steps - P,
                 .kv_bytes = sch->kv ? kv_block_bytes(sch->pool) * (size_t)sch->pool->n_blocks : 0};
    double *ttft = malloc((size_t)n * sizeof *ttft), *per_token = malloc((size_t)n * sizeof *per_token);
    double *steps = malloc((size_t)(f.decode_steps + 1) * sizeof *steps);
    if (!ttft || !per_token || !steps) die(1, "out of memory");
    int n_ttft = 0, n_per_token = 0, n_decoding = 0;
    for (int i = 0; i < n; i++) {
        const Request *r = &g->list->requests[i];
        f.decode_tokens += r->generated > 0 ? r->generated - 1 : 0;
        f.served_tokens += r->generated;
        f.stops[r->stop]++;
        if (r->stop != STOP_NONE)
            f.served++;
        else if (r->generated > 0)
            f.cut++;
        else
            f.not_started++;
        if (r->generated > 0) ttft[n_ttft++] = r->first_token_ms;
        if (r->decode_steps) {
            per_token[n_per_token++] = r->decode_ms / r->decode_steps;
            f.per_sequence_ms_per_token_mean += r->decode_ms / r->decode_steps;
            n_decoding++;
        }
    }
    f.stops[STOP_NONE] = f.cut; /* interrupted: begun and cut short */
    f.per_sequence_ms_per_token_mean = n_decoding ? f.per_sequence_ms_per_token_mean / n_decoding : 0.0;
    for (int i = 0; i < P; i++) f.prefill_ms += g->step_ms[i];
    for (int i = 0; i < f.decode_steps; i++) f.decode_ms += steps[i] = g->step_ms[P + i];
    f.steps_ms = f.prefill_ms + f.decode_ms;
    f.step_median_ms = percentile(steps, f.decode_steps, 0.5);
    for (int i = 0; i < f.decode_steps; i++) f.slow_steps += steps[i] > 3.0 * f.step_median_ms;
    f.step_mean_ms = f.decode_steps ? f.decode_ms / f.decode_steps : 0.0;
    f.ms_per_token = f.decode_tokens ? f.decode_ms / f.decode_tokens : 0.0;
    f.tokens_per_s_mean = g->serving ? (sch->total_ms > 0 ? 1000.0 * f.served_tokens / sch->total_ms : 0.0)
                                     : (f.decode_ms > 0 ? 1000.0 * f.decode_tokens / f.decode_ms : 0.0);
    f.tokens_per_s_median = median_step_tokens_per_s(g, g->serving ? 0 : P);
    f.ttft50 = percentile(ttft, n_ttft, 0.5), f.ttft95 = percentile(ttft, n_ttft, 0.95);
    f.token50 = percentile(per_token, n_per_token, 0.5), f.token95 = percentile(per_token, n_per_token, 0.95);
    free(ttft);
    free(per_token);
    free(steps);
    return f;
}

static void print_stops(FILE *out, const Figures *f) {
    fprintf(out, "stops: eos %d, steps %d, context full %d", f->stops[STOP_EOS], f->stops[STOP_STEPS],
            f->stops[STOP_CONTEXT]);
    if (f->cut || f->not_started) fprintf(out, ", interrupted %d, not started %d", f->cut, f->not_started);
}

/* The summary line, and with the cache for more than one sequence (or -v) the pool's line.
 * --prompts: requests served, throughput, time to first token and per-token latency
 * (each request's decode time over its decode steps), median and 95th percentile. */
static void write_summary(FILE *out, const Generation *g, const Figures *f) {
    const Scheduler *sch = g->sch;
    fprintf(out, "summary: %s %s", variant_name(&g->model->cfg), sch->kv ? "kv" : "no-kv");
    if (g->serving) {
        fprintf(out, " | %d requests served through %d slots in %d steps", f->served, sch->max_batch, sch->steps);
        if (f->cut || f->not_started)
            fprintf(out, " (interrupted: %d cut short, %d not started)", f->cut, f->not_started);
        fprintf(out,
                " | %ld tokens in %.1f ms, %.1f tokens/s | time to first token median %.3f ms, p95 %.3f ms | per "
                "token median %.3f ms, p95 %.3f ms",
                f->served_tokens, sch->total_ms, f->tokens_per_s_mean, f->ttft50, f->ttft95, f->token50, f->token95);
    } else {
        if (f->sequences > 1) fprintf(out, " | %d sequences", f->sequences);
        fprintf(out,
                " | prefill %d tokens %.3f ms | decode %d steps, %.3f ms/token, %.1f tokens/s, median step %.3f ms, "
                "mean step %.3f ms",
                f->prefill_tokens, f->prefill_ms, f->decode_steps, f->ms_per_token, f->tokens_per_s_mean, f->step_median_ms,
                f->step_mean_ms);
        if (f->sequences > 1) fprintf(out, " | per sequence %.3f ms/token", f->per_sequence_ms_per_token_mean);
    }
    fprintf(out, " | KV cache %zu bytes%s | ", f->kv_bytes, sch->kv || g->serving ? "" : " (recomputed every step)");
    if (f->sequences == 1 && !g->serving)
        fprintf(out, "stop: %s\n", stop_name(g->list->requests[0].stop));
    else
        print_stops(out, f), fputc('\n', out);
    if (sch->draft_k)
        fprintf(out,
                "speculation: %s, k %d | %ld draft tokens, %ld accepted (%.1f%%) | %.2f tokens a verifying pass | "
                "drafting %.3f ms, %.1f%% of the steps' time | %ld sequence steps without room to draft\n",
                g->o->draft_path ? msg_path(g->o->draft_path).s : "ngram", sch->draft_k, sch->drafted, sch->accepted,
                sch->drafted ? 100.0 * sch->accepted / sch->drafted : 0.0,
                sch->verify_passes ? (double)(sch->accepted + sch->verify_passes) / sch->verify_passes : 0.0,
                sch->draft_ms, f->steps_ms > 0 ? 100.0 * sch->draft_ms / f->steps_ms : 0.0, sch->drafts_without_room);
    if (disturbed(f))
        fprintf(out,
                "disturbed: %d of %d decode steps took over 3x the median step (another process wanted the "
                "cores?): the mean and the totals are not the engine's own\n",
                f->slow_steps, f->decode_steps);
    if (sch->short_team_steps)
        fprintf(out,
                "busy machine: %ld of %d steps ran on fewer threads than the %d asked for, after a thread came "
                "over 1 ms late to a barrier (its core taken by another process, the kernel or the host)\n",
                sch->short_team_steps, sch->steps, threads_count());
    const KVStream *st = sch->pool->stream;
    if (st && st->blocks_written)
        fprintf(out,
                "kv tier streaming: %ld blocks spilled, peak on disk %zu bytes | read %.0f bytes in %.1f ms | attention "
                "waited %.1f ms for the disk | staging %zu bytes\n",
                st->blocks_written, kv_block_bytes(sch->pool) * (size_t)st->peak_blocks,
                (double)st->layers_read * (double)st->layer_bytes, st->read_ms, st->wait_ms,
                kv_stream_stage_bytes(sch->pool, st->max_blocks));
    if (!sch->kv || (f->sequences == 1 && !g->o->verbose)) return;
    const KVPool *pool = sch->pool;
    const size_t contiguous = kv_bytes_per_token(pool) * (size_t)g->model->cfg.max_seq_len * (size_t)sch->max_batch;
    fprintf(out,
            "kv pool: %d-token blocks of %zu bytes | peak %d of %d blocks in use, %zu bytes | contiguous "
            "full contexts for %d sequences: %zu bytes | shared by prefixes: at most %d blocks, saving %d "
            "blocks, %zu bytes | preemptions %d\n",
            KV_BLOCK_TOKENS, kv_block_bytes(pool), pool->peak_in_use, pool->n_blocks,
            kv_block_bytes(pool) * (size_t)pool->peak_in_use, sch->max_batch, contiguous, pool->peak_shared_blocks,
            pool->peak_saved_blocks, kv_block_bytes(pool) * (size_t)pool->peak_saved_blocks, sch->preemptions);
    if (pool->tier)
        fprintf(out,
                "kv tier: %d preemptions swapped (%d fell back to recompute, %d recomputed by the rule) | blocks "
                "written %ld, read %ld, shared ones kept in the pool %ld | peak on disk %zu bytes | waiting for the disk %.1f ms\n",
                sch->swaps, sch->swap_failures, sch->rule_recomputes, pool->tier->blocks_written, pool->tier->blocks_read,
                pool->tier->blocks_kept,
                pool->tier->block_bytes * (size_t)pool->tier->peak_slots, pool->tier->wait_ms);
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
    if (!isatty(STDERR_FILENO))
        fputs(text, stderr);
    else
        for (const char *s = text; *s;) {
            const char *bar = strstr(s, " | ");
            if (!bar) {
                fputs(s, stderr);
                break;
            }
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
    printf(", \"serving\": %s, \"disturbed\": %s, \"short_team_steps\": %ld", g->serving ? "true" : "false",
           disturbed(f) ? "true" : "false", sch->short_team_steps);
    const struct {
        const char *key;
        double value;
    } figures[] = {
        {"sequences", f->sequences},
        {"requests_served", f->served},
        {"requests_cut", f->cut},
        {"requests_not_started", f->not_started},
        {"slots", sch->max_batch},
        {"top_k", o->top_k},
        {"top_p", o->top_p},
        {"temperature", o->temperature},
        {"steps", sch->steps},
        {"prefill_tokens", f->prefill_tokens},
        {"prefill_ms", f->prefill_ms},
        {"fill", o->fill},
        {"fill_ms_total", sch->fill_ms},
        {"decode_steps", f->decode_steps},
        {"decode_tokens", f->decode_tokens},
        {"decode_ms_total", f->decode_ms},
        {"ms_per_token_mean", f->ms_per_token},
        {"step_ms_median", f->step_median_ms},
        {"step_ms_mean", f->step_mean_ms},
        {"tokens_per_s_mean", f->tokens_per_s_mean},
        {"tokens_per_s_median", f->tokens_per_s_median},
        {"per_sequence_ms_per_token_mean", f->per_sequence_ms_per_token_mean},
        {"tokens_generated", (double)f->served_tokens},
        {"total_ms", sch->total_ms},
        {"first_token_ms_median", f->ttft50},
        {"first_token_ms_p95", f->ttft95},
        {"token_ms_median", f->token50},
        {"token_ms_p95", f->token95},
        {"steps_over_3x_median", f->slow_steps},
    };
    for (size_t i = 0; i < sizeof figures / sizeof figures[0]; i++) json_field(figures[i].key, figures[i].value);
    const KVPool *pool = sch->pool;
    printf(", \"kv_cache_bytes\": %zu, \"kv_block_tokens\": %d, \"kv_block_bytes\": %zu, \"kv_pool_blocks\": %d, "
           "\"kv_peak_blocks\": %d, \"kv_peak_bytes\": %zu",
           f->kv_bytes, KV_BLOCK_TOKENS, kv_block_bytes(pool), pool->n_blocks, pool->peak_in_use,
           kv_block_bytes(pool) * (size_t)pool->peak_in_use);
    printf(", \"kv_contiguous_bytes\": %zu, \"kv_shared_blocks_peak\": %d, \"kv_saved_blocks_peak\": %d, "
           "\"kv_saved_bytes_peak\": %zu",
           kv_bytes_per_token(pool) * (size_t)g->model->cfg.max_seq_len * (size_t)sch->max_batch,
           pool->peak_shared_blocks, pool->peak_saved_blocks, kv_block_bytes(pool) * (size_t)pool->peak_saved_blocks);
    printf(", \"preemptions\": %d, \"stops\": {\"eos\": %d, \"steps\": %d, "
           "\"context_full\": %d, \"interrupted\": %d}",
           sch->preemptions, f->stops[STOP_EOS], f->stops[STOP_STEPS], f->stops[STOP_CONTEXT], f->stops[STOP_NONE]);
    const KVTier none = {0}, *t = pool->tier ? pool->tier : &none; /* zeros without a tier */
    const KVStream no_stream = {0}, *st = pool->stream ? pool->stream : &no_stream;
    /* a stream and swaps never share a run (one slot has nothing to preempt): the peak is one or the other's */
    const size_t stream_peak = kv_block_bytes(pool) * (size_t)st->peak_blocks,
                 swap_peak = t->block_bytes * (size_t)t->peak_slots;
    printf(", \"tier_swaps\": %d, \"tier_swap_failures\": %d, \"tier_blocks_written\": %ld, "
           "\"tier_blocks_read\": %ld, \"tier_peak_bytes\": %zu, \"tier_wait_ms_total\": %.3f",
           sch->swaps, sch->swap_failures, t->blocks_written, t->blocks_read,
           stream_peak > swap_peak ? stream_peak : swap_peak, t->wait_ms + st->wait_ms);
    printf(", \"tier_stream_blocks\": %ld, \"tier_stream_peak_blocks\": %d, \"tier_stream_bytes_read\": %.0f, "
           "\"tier_stream_read_ms_total\": %.3f, \"tier_stream_wait_ms_total\": %.3f, \"tier_stage_bytes\": %zu",
           st->blocks_written, st->peak_blocks, (double)st->layers_read * (double)st->layer_bytes, st->read_ms,
           st->wait_ms, kv_stream_stage_bytes(pool, st->max_blocks));
    printf(", \"tier_rule_recomputes\": %d, \"tier_blocks_kept\": %ld", sch->rule_recomputes, t->blocks_kept);
    fputs(", \"draft\": ", stdout);
    if (!sch->draft_k)
        fputs("null", stdout);
    else
        json_text(stdout, g->o->draft_path ? g->o->draft_path : "ngram");
    printf(", \"draft_k\": %d, \"draft_tokens\": %ld, \"draft_accepted\": %ld, "
           "\"acceptance_rate\": %.4f, \"tokens_per_verify_pass\": %.4f, \"draft_ms_total\": %.3f, "
           "\"draft_time_share\": %.4f, \"drafts_without_room\": %ld",
           sch->draft_k, sch->drafted, sch->accepted, sch->drafted ? (double)sch->accepted / sch->drafted : 0.0,
           sch->verify_passes ? (double)(sch->accepted + sch->verify_passes) / sch->verify_passes : 0.0, sch->draft_ms,
           f->steps_ms > 0 ? sch->draft_ms / f->steps_ms : 0.0, sch->drafts_without_room);
    if (g->profile) profile_json(g->profile);
    json_end();
}

/* Ends the run in one line when a step failed: check_model's errors, or a streamed cache's
 * tier, whose blocks have no other copy. */
static void check_step(const Scheduler *sch, int rc) {
    if (rc == MODEL_ERR_TIER)
        die(1, "--kv-offload: the tier failed under a streamed cache (%s); its blocks have no other copy, so the run "
               "cannot go on", strerror(sch->tier_errno));
    if (rc == MODEL_ERR_NONFINITE && sch->failed_in_draft)
        die(1, "--draft: the draft model computes logits that are not finite numbers (NaN or infinity): its weights "
               "overflow float arithmetic");
    check_model(rc);
}

/* Warm-up, as llama.cpp does after loading: one untimed forward of the first prompt (what
 * a window or one pass takes), on a cache emptied after. A process's first forward runs
 * cold (its weights come from DRAM); that is a cost of loading, so the timed prefill runs
 * warm, like every decode step. It runs on the run's own scheduler, whose buffers are then
 * warm too, and which holds the only scratch --info counts. The arithmetic is
 * batch-invariant, so the prefill's logits are the same bits either way. */
static void warm_up(Scheduler *sch, const Request *first, Generation *g) {
    const double t0 = now_ms();
    const KVPool *pool = sch->pool;
    const int fill = sch->fill;
    sch->fill = 0; /* the generated entries are the timed run's: the warm-up computes the prompt */
    int n = pool->window && first->n_prompt > pool->window ? pool->window : first->n_prompt;
    if (n > SCHEDULER_PASS_TOKENS) n = SCHEDULER_PASS_TOKENS; /* a scored request's rows fit one pass */
    Request r = {.tokens = first->tokens, .n_prompt = n, .cap_tokens = first->cap_tokens, .score = 1};
    if (scheduler_add(sch, &r) != 0) die(1, "out of memory");
    StepResult st;
    int rc;
    while ((rc = scheduler_step(sch, &st)) > 0) {}
    check_step(sch, rc);
    sch->fill = fill;
    scheduler_restart_figures(sch);
    if (pool->stream) kv_stream_restart_figures(pool->stream);
    if (g->step_lines) {
        start_stderr_line(g);
        fprintf(stderr, "[warm-up] tokens %d ms %.3f (untimed; cache emptied)\n", n, now_ms() - t0);
    }
}

/* The signal that asked the run to stop, or 0. */
static volatile sig_atomic_t interrupted_by;

static void on_interrupt(int sig) { interrupted_by = sig; }

/* SIGINT and SIGTERM end a generation at the next step boundary, so the outputs are whole;
 * a second one acts at once (SA_RESETHAND). One the run was started with ignored stays
 * ignored, as a shell's background job is kept from the terminal's Ctrl-C. */
static void catch_interrupts(void) {
    struct sigaction sa, was;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_interrupt;
    sa.sa_flags = SA_RESETHAND | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    const int signals[] = {SIGINT, SIGTERM};
    for (int i = 0; i < 2; i++)
        if (sigaction(signals[i], NULL, &was) == 0 && was.sa_handler != SIG_IGN) sigaction(signals[i], &sa, NULL);
}

/* --log, --dump-logits and --dump-attn, refused when they name one of the run's inputs or
 * an output opened before them (earlier: those outputs' paths, NULL where none). */
static FILE *open_output(const char *path, const Options *o, const char *earlier_log, const char *earlier_dump) {
    const NamedPath inputs[] = {{"the checkpoint", o->checkpoint},
                                {"the prompt file", o->prompt_path},
                                {"the --prompts file", o->prompts_path},
                                {"the --draft file", o->draft_path},
                                {"the --profile-peaks file", o->profile_peaks},
                                {"the --log file", earlier_log},
                                {"the --dump-logits file", earlier_dump}};
    FILE *f;
    char err[512];
    const int rc = output_open(&f, path, inputs, (int)(sizeof inputs / sizeof inputs[0]), err, sizeof err);
    if (rc) die(rc, "%s", err);
    return f;
}

/* The settings line on stderr, before the story: with the seed, any run can be repeated. */
static void print_settings(const Model *m, const Options *o, int n_requests, int slots) {
    const Config *c = &m->cfg;
    fprintf(stderr, "seed %llu | %s | %s %s | mla form %s | threads %d | top-k %d | top-p %g | temperature %g",
            (unsigned long long)o->seed, variant_name(c), o->kv ? "kv" : "no-kv", kv_dtype_name(o->kv_dtype),
            c->variant == VARIANT_MLA ? mla_form_name(o->mla_form) : "n/a", threads_count(), o->top_k, o->top_p,
            o->temperature);
    if (n_requests > 1 || slots > 1)
        fprintf(stderr, " | %d sequences in %d slots, seeds %llu..%llu", n_requests, slots, (unsigned long long)o->seed,
                (unsigned long long)(o->seed + (uint64_t)n_requests - 1));
    if (o->window) fprintf(stderr, " | window %d, %d sinks, evicting %s", o->window, o->window_sinks, evict_name(o));
    fputc('\n', stderr);
}

int mode_generate(const Model *m, KVPool *pool, const Drafter *draft, const Options *o) {
    RequestList list = requests_of(m, o);
    Scheduler sch = {0};
    Generation g = {.o = o,
                    .model = m,
                    .sch = &sch,
                    .list = &list,
                    .serving = o->prompts_path != NULL,
                    .one_terminal = one_terminal()};
    Profile profile;
    AttnDump attn;
    /* what can refuse the run is read before any output is opened, so a refused run leaves
     * every file as it was */
    if (o->profile) profile_open(g.profile = &profile, m, pool, o);
    if (o->dump_attn_path) attn_dump_open(g.attn = &attn, m, o, list.n);
    if (o->log_path) {
        g.log_csv = open_output(o->log_path, o, NULL, NULL);
        fprintf(g.log_csv, "step,phase,sequences,n_tokens,pos,token,ms");
        if (o->profile) {
            profile_csv_header(g.log_csv);
            fputs(",kv_blocks,kv_shared_blocks", g.log_csv);
        }
        fputc('\n', g.log_csv);
        check_written(g.log_csv, o->log_path);
    }
    if (o->dump_path) g.dump = open_output(o->dump_path, o, o->log_path, NULL);
    if (o->dump_attn_path) attn_dump_begin(&attn, open_output(o->dump_attn_path, o, o->log_path, o->dump_path));
    /* notes once every input has been checked, so that an error stays the one line */
    if (o->threads_note)
        fprintf(stderr, "run: note: -t %g is the temperature (as in llama2.c); the thread count is --threads\n",
                (double)o->temperature);
    if ((o->batch > 1 || o->prompts_path) && !o->kv && !o->quiet)
        fprintf(stderr, "run: note: without --kv every step recomputes each sequence whole; --kv keeps a cache\n");
    if (o->shape)
        fprintf(stderr, "run: note: the weights are generated from the seed (--shape %s), not trained: the tokens "
                        "mean nothing, and print as their ids\n",
                o->shape);
    if (o->fill_grew_ctx)
        fprintf(stderr, "run: note: the context is %d positions, --fill %d plus the shape's own %d (-c sets it)\n",
                m->cfg.max_seq_len, o->fill, o->fill_grew_ctx);
    print_settings(m, o, list.n, o->batch);
    /* Step lines go to stderr when asked for, or when it is a terminal of its own: there
     * they do not cut the story up. In a file or pipe they would interleave with the story
     * whenever stdout goes to the same place (make demo > log 2>&1); --log records them. */
    g.step_lines = !o->quiet && (o->verbose || (isatty(STDERR_FILENO) && !g.one_terminal));
    if (m->tokenizer && !(g.stream = spm_stream_new(m->tokenizer))) die(1, "out of memory");
    catch_interrupts();
    if (streams_text(&g))
        for (int i = 1; i < list.requests[0].n_prompt; i++) print_text(&g, token_text(&g, list.requests[0].tokens[i]));
    scheduler_open(&sch, m, pool, draft, o, o->batch);
    warm_up(&sch, &list.requests[0], &g);
    sch.clock = g.profile ? &profile.clock : NULL;
    sch.record = g.attn ? &attn.record : NULL;
    for (int i = 0; i < list.n; i++)
        if (scheduler_add(&sch, &list.requests[i]) != 0) die(1, "out of memory");
    StepResult st;
    int rc = 0;
    while (!interrupted_by) {
        if (g.attn) sch.record_step = attn_dump_wants_step(g.attn, sch.steps);
        if ((rc = scheduler_step(&sch, &st)) <= 0) break;
        report_step(&g, &st);
    }
    if (!interrupted_by) check_step(&sch, rc < 0 ? rc : 0);
    if ((g.interrupted = interrupted_by != 0) && streams_text(&g)) { /* the text so far, as it is */
        print_text(&g, stream_end(&g));
        if (g.mid_line || !g.one_terminal) print_text(&g, "\n");
    } else if (g.interrupted) {
        print_finished(&g);
    }
    if (g.one_terminal && streams_text(&g)) fputc('\n', stderr); /* a blank line between the story and the summary */
    const Figures f = figures_of(&g);
    print_summary(&g, &f);
    if (g.profile) profile_print(stderr, g.profile);
    if (o->json) print_summary_json(&g, &f);
    if (g.log_csv) close_written(g.log_csv, o->log_path);
    if (g.dump) close_written(g.dump, o->dump_path);
    if (g.attn) close_written(attn.f, o->dump_attn_path), attn_dump_close(&attn);
    if (g.profile) profile_close(&profile);
    if (g.stream) spm_stream_free(g.stream);
    free(g.step_ms);
    free(g.step_tokens);
    scheduler_free(&sch);
    requests_free(&list);
    return interrupted_by ? 128 + interrupted_by : 0; /* as a shell reports a run a signal ended */
}
