/* run.c: the command line. Generation with or without a KV cache, per-step
 * latency, --check-kv, --ppl, --info and --dump-logits.
 *
 *   ./run weights/gqa.bin -p "Once upon a time" --kv
 */
#include <errno.h>
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

#include "cli.h"
#include "errmsg.h"
#include "loader.h"
#include "model.h"
#include "parallel.h"
#include "json.h"
#include "sampler.h"
#include "scheduler.h"
#include "spm_c.h"
#include "textfile.h"
#include "timer.h"
#include "utf8.h"

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
 * cache does not hold yet; without it, the whole sequence on an emptied cache. */
static void engine_step(Engine *e, const int *tokens, int n, float *logits) {
    if (!e->kv) kv_reset(e->cache);
    const int from = e->cache->len;
    const int rc = model_forward(e->model, e->state, e->cache, tokens + from, n - from, e->form, logits, 0);
    if (rc == MODEL_ERR_BATCH) die(1, "internal error: a forward pass of %d tokens at position %d does not fit", n - from, from);
    check_forward(rc);
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

/* ---- generation: one sequence or many (scheduler.h) ---- */

static const char *stop_name(StopReason r) {
    return r == STOP_EOS ? "eos" : r == STOP_CONTEXT ? "context full" : r == STOP_STEPS ? "steps" : "running";
}

typedef struct {
    const Options *o;
    const Model *model;
    Scheduler *sch;
    const char *const *prompts;  /* each request's prompt text, by index */
    int serving;                 /* --prompts */
    FILE *log_csv, *dump;
    SpmStream *stream;       /* one sequence's text, printed as it comes */
    int next_to_print;       /* many sequences print whole, in order */
    double *step_ms;         /* (steps so far) */
    int n_steps, cap_steps;
    int first_step_tokens;
} Generation;

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
        printf("{\"index\": %d, \"prompt\": ", r->index);
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
    fflush(stdout);
    free(text);
}

static int streams_text(const Generation *g) { return g->sch->n_requests == 1 && !g->o->json && !g->serving; }

static void on_logits(void *ctx, Request *r, const float *logits) {
    Generation *g = ctx;
    (void)r;
    if (g->dump) fwrite(logits, sizeof(float), (size_t)g->model->cfg.vocab_size, g->dump);
}

static void on_token(void *ctx, Request *r, int token) {
    Generation *g = ctx;
    (void)r;
    if (!streams_text(g)) return;
    utf8_fputs_sanitized(spm_stream_put(g->stream, token), stdout);
    fflush(stdout);
}

static void on_done(void *ctx, Request *r) {
    Generation *g = ctx;
    if (streams_text(g)) {
        utf8_fputs_sanitized(spm_stream_flush(g->stream), stdout);
        fputc('\n', stdout);
        fflush(stdout);
        (void)r;
        return;
    }
    while (g->next_to_print < g->sch->n_requests && g->sch->requests[g->next_to_print].stop != STOP_NONE)
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
    if (!g->o->quiet) {
        if (st->only && st->step == 0) fprintf(stderr, "[prefill] tokens %d next %d ms %.3f\n", st->n_tokens, st->next_token, st->ms);
        else if (st->only) fprintf(stderr, "[step %d] pos %d token %d ms %.3f\n", st->step, st->pos, st->next_token, st->ms);
        else fprintf(stderr, "[step %d] sequences %d tokens %d ms %.3f\n", st->step, st->sequences, st->n_tokens, st->ms);
    }
    if (g->log_csv) {
        fprintf(g->log_csv, "%d,%s,%d,%d,", st->step, step_phase(st), st->sequences, st->n_tokens);
        if (st->only) fprintf(g->log_csv, "%d,%d,", st->pos, st->next_token);
        else fputs("-1,-1,", g->log_csv);
        fprintf(g->log_csv, "%.4f\n", st->ms);
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

static void print_pool(const Generation *g) {
    const Scheduler *sch = g->sch;
    const KVPool *pool = sch->pool;
    const size_t contiguous = kv_bytes_per_token(pool) * (size_t)g->model->cfg.max_seq_len * (size_t)sch->max_batch;
    fprintf(stderr, "kv pool: %d-token blocks of %zu bytes | peak %d of %d blocks in use, %zu bytes | contiguous "
            "full contexts for %d sequences: %zu bytes | preemptions %d\n",
            KV_BLOCK_TOKENS, kv_block_bytes(pool), pool->peak_in_use, pool->n_blocks,
            kv_block_bytes(pool) * (size_t)pool->peak_in_use, sch->max_batch, contiguous, sch->preemptions);
}

/* --prompts: requests served, throughput, time to first token and per-token latency
 * (each request's decode time over its decode steps), median and 95th percentile. */
static void print_serving_summary(const Generation *g) {
    const Scheduler *sch = g->sch;
    const int n = sch->n_requests;
    double *ttft = malloc((size_t)n * sizeof *ttft), *per_token = malloc((size_t)n * sizeof *per_token);
    if (!ttft || !per_token) die(1, "out of memory");
    long tokens = 0;
    int n_per_token = 0, stops[4] = {0};
    for (int i = 0; i < n; i++) {
        const Request *r = &sch->requests[i];
        tokens += r->generated;
        stops[r->stop]++;
        ttft[i] = r->first_token_ms;
        if (r->decode_steps) per_token[n_per_token++] = r->decode_ms / r->decode_steps;
    }
    const double ttft50 = percentile(ttft, n, 0.5), ttft95 = percentile(ttft, n, 0.95);
    const double tok50 = percentile(per_token, n_per_token, 0.5), tok95 = percentile(per_token, n_per_token, 0.95);
    fprintf(stderr, "summary: %s %s | %d requests served through %d slots in %d steps | %ld tokens in %.1f ms, "
            "%.1f tokens/s | time to first token median %.3f ms, p95 %.3f ms | per token median %.3f ms, p95 %.3f ms "
            "| KV cache %zu bytes | stops: eos %d, steps %d, context full %d\n",
            variant_name(&g->model->cfg), sch->kv ? "kv" : "no-kv", n, sch->max_batch, sch->steps, tokens,
            sch->total_ms, sch->total_ms > 0 ? 1000.0 * tokens / sch->total_ms : 0.0, ttft50, ttft95, tok50, tok95,
            sch->kv ? kv_block_bytes(sch->pool) * (size_t)sch->pool->n_blocks : (size_t)0, stops[STOP_EOS],
            stops[STOP_STEPS], stops[STOP_CONTEXT]);
    if (sch->kv) print_pool(g);
    free(ttft);
    free(per_token);
}

/* The summary line (and the pool's line with the cache): the first step is the prefill,
 * every later step decodes. */
static void print_summary(const Generation *g) {
    if (g->serving) {
        print_serving_summary(g);
        return;
    }
    const Scheduler *sch = g->sch;
    const KVPool *pool = sch->pool;
    const int B = sch->n_requests;
    int decode_tokens = 0, stops[4] = {0};
    double per_sequence = 0.0;
    for (int i = 0; i < B; i++) {
        const Request *r = &sch->requests[i];
        decode_tokens += r->generated - 1;
        stops[r->stop]++;
        per_sequence += r->decode_steps ? r->decode_ms / r->decode_steps / B : 0.0;
    }
    const int decode_steps = g->n_steps - 1;
    double decode_ms = 0.0;
    for (int i = 1; i < g->n_steps; i++) decode_ms += g->step_ms[i];
    double *sorted = malloc((size_t)(decode_steps > 0 ? decode_steps : 1) * sizeof *sorted);
    if (!sorted) die(1, "out of memory");
    memcpy(sorted, g->step_ms + 1, (size_t)(decode_steps > 0 ? decode_steps : 0) * sizeof *sorted);
    const double med = percentile(sorted, decode_steps > 0 ? decode_steps : 0, 0.5);
    free(sorted);
    const double per_token = decode_tokens ? decode_ms / decode_tokens : 0.0;
    fprintf(stderr, "summary: %s %s", variant_name(&g->model->cfg), sch->kv ? "kv" : "no-kv");
    if (B > 1) fprintf(stderr, " | %d sequences", B);
    fprintf(stderr, " | prefill %d tokens %.3f ms | decode %d steps, %.3f ms/token, %.1f tokens/s, median step %.3f ms, "
            "mean step %.3f ms",
            g->first_step_tokens, g->n_steps ? g->step_ms[0] : 0.0, decode_steps, per_token,
            decode_ms > 0 ? 1000.0 * decode_tokens / decode_ms : 0.0, med, decode_steps ? decode_ms / decode_steps : 0.0);
    if (B > 1) fprintf(stderr, " | per sequence %.3f ms/token", per_sequence);
    fprintf(stderr, " | KV cache %zu bytes%s", sch->kv ? kv_block_bytes(pool) * (size_t)pool->n_blocks : (size_t)0,
            sch->kv ? "" : " (recomputed every step)");
    if (B == 1) fprintf(stderr, " | stop: %s\n", stop_name(sch->requests[0].stop));
    else fprintf(stderr, " | stops: eos %d, steps %d, context full %d\n", stops[STOP_EOS], stops[STOP_STEPS], stops[STOP_CONTEXT]);
    if (sch->kv) print_pool(g);
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
static void warm_up(const Scheduler *sch, const Options *o) {
    const Request *r = &sch->requests[0];
    KVCache scratch;
    const double t0 = now_ms();
    const int n = sch->pool->window && r->n_prompt > sch->pool->window ? sch->pool->window : r->n_prompt;  /* one pass */
    if (kv_init(&scratch, sch->pool, sch->model->cfg.max_seq_len) != 0) die(1, "out of memory");
    check_forward(model_forward(sch->model, sch->state, &scratch, r->tokens, n, sch->form, sch->logits, 0));
    kv_free(&scratch);
    if (!o->quiet) fprintf(stderr, "[warm-up] tokens %d ms %.3f (untimed; cache emptied)\n", n, now_ms() - t0);
}

static void generate(Scheduler *sch, const Options *o, const char *const *prompts, FILE *log_csv, FILE *dump) {
    Generation g = {o, sch->model, sch, prompts, o->prompts_path != NULL, log_csv, dump, NULL, 0, NULL, 0, 0, 0};
    if (!(g.stream = spm_stream_new(sch->model->tokenizer))) die(1, "out of memory");
    sch->on_logits = on_logits;
    sch->on_token = on_token;
    sch->on_done = on_done;
    sch->on_step = on_step;
    sch->ctx = &g;
    if (streams_text(&g)) {
        const Request *r = &sch->requests[0];
        for (int i = 1; i < r->n_prompt; i++) utf8_fputs_sanitized(spm_stream_put(g.stream, r->tokens[i]), stdout);
        fflush(stdout);
    }
    warm_up(sch, o);
    parallel_team(run_in_team, sch);
    print_summary(&g);
    spm_stream_free(g.stream);
    free(g.step_ms);
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
    char (*lines)[320] = malloc((size_t)B * sizeof *lines);
    if (!lines) die(1, "out of memory");
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
        snprintf(lines[i], sizeof lines[i],
                 "check-batch variant=%s mode=%s batch=%d index=%d seed=%llu steps=%d identical_tokens=%d "
                 "bitwise_identical=%d first_difference=%d",
                 variant_name(&m->cfg), batch->kv ? "kv" : "no-kv", B, i, (unsigned long long)a->seed, a->generated,
                 same_tokens - a->n_prompt, identical, first_difference);
        free_requests(&solo);
    }
    int n_identical = 0;
    for (int i = 0; i < B; i++) n_identical += strstr(lines[i], "bitwise_identical=1") != NULL;
    printf("%s %s, %d sequences of %s\"%s\" in %d slots: %d of %d give the same tokens and bitwise the same logits as "
           "run alone\n",
           variant_name(&m->cfg), batch->kv ? "kv" : "no-kv", B, o->prompts_path ? "the prompts of " : "", what,
           batch->max_batch, n_identical, B);
    for (int i = 0; i < B; i++) puts(lines[i]);
    free(lines);
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

/* Greedy with the cache (form_cached) against greedy without it (form_uncached); prints one
 * line for people and returns the machine-readable one in line. Returns 1 when they differ. */
static int check_kv_pair(Engine *e, const Options *o, const int *prompt, int n_prompt, int steps, MlaForm form_cached,
                         MlaForm form_uncached, char *line, size_t linelen) {
    const Model *m = e->model;
    const int V = m->cfg.vocab_size;
    const int is_mla = m->cfg.variant == VARIANT_MLA;
    char name_a[32], name_b[32];
    snprintf(name_a, sizeof name_a, is_mla ? "kv-%s" : "kv", mla_form_name(form_cached));
    snprintf(name_b, sizeof name_b, is_mla ? "no-kv-%s" : "no-kv", mla_form_name(form_uncached));

    e->kv = 1;
    e->form = form_cached;
    GreedyRun a = greedy_run(e, prompt, n_prompt, steps, o->ignore_eos);
    e->kv = 0;
    e->form = form_uncached;
    GreedyRun b = greedy_run(e, prompt, n_prompt, steps, o->ignore_eos);

    /* compare step by step while both runs have seen the same tokens */
    int n = a.steps < b.steps ? a.steps : b.steps, diverge = -1, first_bit_diff = -1;
    double max_diff = 0.0;
    for (int s = 0; s < n; s++) {
        const float *la = a.logits + (size_t)s * V, *lb = b.logits + (size_t)s * V;
        if (first_bit_diff < 0 && memcmp(la, lb, (size_t)V * sizeof(float)) != 0) first_bit_diff = s;
        for (int i = 0; i < V; i++) {
            double d = fabs((double)la[i] - (double)lb[i]);
            if (d > max_diff) max_diff = d;
        }
        if (sampler_argmax(la, V) != sampler_argmax(lb, V)) { diverge = s; break; }
    }
    if (diverge < 0 && a.steps != b.steps) diverge = n;  /* one run stopped at EOS, the other did not */
    int same = diverge < 0 ? n : diverge;
    int ta = diverge >= 0 && diverge < a.steps ? sampler_argmax(a.logits + (size_t)diverge * V, V) : -1;
    int tb = diverge >= 0 && diverge < b.steps ? sampler_argmax(b.logits + (size_t)diverge * V, V) : -1;
    printf("%s: %s vs %s: ", variant_name(&m->cfg), name_a, name_b);
    if (diverge < 0) printf("identical for %d tokens", n);
    else printf("identical for %d tokens, then step %d diverges: %s gives token %d, %s gives token %d",
                same, diverge, name_a, ta, name_b, tb);
    printf("; logits %s; max |logit difference| %.3g\n", first_bit_diff < 0 ? "bitwise identical" : "not bitwise identical",
           max_diff);
    snprintf(line, linelen,
             "check-kv variant=%s a=%s b=%s steps=%d identical_tokens=%d first_divergent_step=%d token_a=%d token_b=%d "
             "bitwise_identical=%d first_bitwise_difference=%d max_abs_logit_diff=%.6g",
             variant_name(&m->cfg), name_a, name_b, n, same, diverge, ta, tb, first_bit_diff < 0, first_bit_diff, max_diff);
    free(a.tokens);
    free(a.logits);
    free(b.tokens);
    free(b.logits);
    return diverge >= 0 || first_bit_diff >= 0;
}

/* For MLA two comparisons: absorbed with the cache against expanded without it (the
 * KV-cache post's setup), and against absorbed without it (the same arithmetic). */
static void check_kv(Engine *e, const Options *o) {
    const Model *m = e->model;
    int *prompt = malloc((size_t)(m->cfg.max_seq_len + 1) * sizeof(int));
    if (!prompt) die(1, "out of memory");
    int n = encode_prompt(m, o->prompt, prompt, m->cfg.max_seq_len + 1, "");
    int steps = o->steps ? o->steps : m->cfg.max_seq_len;
    int is_mla = m->cfg.variant == VARIANT_MLA;
    const MlaForm uncached_forms[2] = {MLA_EXPANDED, MLA_ABSORBED};
    char lines[2][512];
    int n_pairs = is_mla ? 2 : 1;
    for (int i = 0; i < n_pairs; i++)
        check_kv_pair(e, o, prompt, n, steps, MLA_ABSORBED, uncached_forms[i], lines[i], sizeof lines[i]);
    for (int i = 0; i < n_pairs; i++) puts(lines[i]);
    free(prompt);
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
} NllSum;

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

static void perplexity(Engine *e, const char *path) {
    const Model *m = e->model;
    const int ctx = m->cfg.max_seq_len, V = m->cfg.vocab_size;
    char err[256];
    StoryFile sf;
    if (storyfile_read(&sf, path, err, sizeof err) != 0) die(1, "%s", err);
    int cap = 1 << 16;
    int *ids = malloc((size_t)cap * sizeof(int));
    float *logits = malloc((size_t)ctx * V * sizeof(float));
    if (!ids || !logits) die(1, "out of memory");
    NllSum sum = {0};
    for (int s = 0; s < sf.n_stories; s++) {
        const char *text = sf.stories[s];
        int n = spm_encode(m->tokenizer, text, strlen(text), 1, ids, cap - 1);
        if (n < 0 || n >= cap) {
            free(ids);
            free(logits);
            storyfile_free(&sf);
            die(1, "%s: story %d %s", path, s + 1, n < 0 ? encode_error(n) : "is longer than 65535 tokens");
        }
        ids[n++] = m->cfg.eos_id;
        if (e->cache->pool->window) score_through_window(e, ids, n, logits, &sum);
        else score_in_windows(e, ids, n, logits, &sum);
    }
    printf("ppl: %s | %d stories, %ld tokens | mean NLL %.4f nats/token | perplexity %.3f", path, sf.n_stories,
           sum.count, sum.nll / sum.count, exp(sum.nll / sum.count));
    if (sum.count_past)
        printf(" | past the context (position %d on): %ld tokens, mean NLL %.4f", ctx, sum.count_past,
               sum.nll_past / sum.count_past);
    putchar('\n');
    storyfile_free(&sf);
    free(ids);
    free(logits);
}

/* ---- --info ---- */

static void info(const Model *m, const KVPool *pool, int batch) {
    const Config *c = &m->cfg;
    const DType dt = pool->dtype;
    const size_t es = dtype_size(dt), per_token = c->variant == VARIANT_MLA
        ? (size_t)c->n_layers * ((c->kv_latent + c->rope_dim) * es + (dt == DTYPE_I8 ? 8 : 0))
        : 2 * (size_t)c->n_layers * c->n_kv_heads * (c->head_dim * es + (dt == DTYPE_I8 ? 4 : 0));
    const int kept = pool->window ? pool->window : c->max_seq_len;
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
    if (rc == 1) {
        cli_usage(stdout);
        exit(0);
    }
    if (rc != 0) {
        if (o.usage_on_error) cli_usage(stderr);
        die(EXIT_USAGE, "%s", usage_err);
    }
    if (o.threads > 0) parallel_set_threads(o.threads);
    else if (parallel_check_env(usage_err, errlen) != 0) die(EXIT_USAGE, "%s", usage_err);
    free(usage_err);

    Model m;
    char err[512];
    if (model_load(&m, o.checkpoint, err, sizeof err) != 0) die(1, "%s", err);
    if (o.top_k > m.cfg.vocab_size) die(EXIT_USAGE, "-k %d is out of range (1..%d, the vocabulary)", o.top_k, m.cfg.vocab_size);
    if (o.steps > m.cfg.max_seq_len && !o.window)
        die(EXIT_USAGE, "-n %d is out of range (1..%d, the context%s)", o.steps, m.cfg.max_seq_len,
            o.check_kv ? "" : "; more with --window");
    if (o.window > m.cfg.max_seq_len)
        die(EXIT_USAGE, "--window %d is out of range (1..%d, the context)", o.window, m.cfg.max_seq_len);
    if (o.window && o.window <= o.window_sinks)
        die(EXIT_USAGE, "--window %d leaves no room beside the %d sink positions", o.window, o.window_sinks);

    const int B = o.batch;
    if (o.dump_path && (B > 1 || o.prompts_path))
        die(EXIT_USAGE, "--dump-logits writes one sequence's logits: it takes no --batch or --prompts");
    if (o.check_kv && B > 1) die(EXIT_USAGE, "--check-kv compares one sequence; --check-batch compares a batch");
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
        info(&m, &pool, B);
    } else if (o.check_kv) {
        check_kv(&e, &o);
    } else if (o.ppl_path) {
        perplexity(&e, o.ppl_path);
    } else {
        Scheduler sch = {.model = &m, .state = &state, .pool = &pool, .kv = o.kv, .form = o.mla_form, .max_batch = B,
                         .max_new = o.steps, .ignore_eos = o.ignore_eos, .top_k = o.top_k, .temperature = o.temperature,
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
                snprintf(where, sizeof where, "%s:%d: ", msg_path(o.prompts_path).s, file.line_numbers[i]);
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
            FILE *log_csv = NULL, *dump = NULL;
            if (o.log_path) {
                log_csv = fopen(o.log_path, "w");
                if (!log_csv) die(1, "cannot write %s: %s", o.log_path, strerror(errno));
                fprintf(log_csv, "step,phase,sequences,n_tokens,pos,token,ms\n");
            }
            if (o.dump_path && !(dump = fopen(o.dump_path, "wb"))) die(1, "cannot write %s: %s", o.dump_path, strerror(errno));
            fprintf(stderr, "seed %llu | %s | %s %s | mla form %s | threads %d | top-k %d | temperature %g",
                    (unsigned long long)o.seed, variant_name(&m.cfg), o.kv ? "kv" : "no-kv", kv_dtype_name(o.kv_dtype),
                    m.cfg.variant == VARIANT_MLA ? mla_form_name(o.mla_form) : "n/a", parallel_threads(), o.top_k,
                    o.temperature);
            if (sch.n_requests > 1 || B > 1)
                fprintf(stderr, " | %d sequences in %d slots, seeds %llu..%llu", sch.n_requests, B,
                        (unsigned long long)o.seed, (unsigned long long)(o.seed + (uint64_t)sch.n_requests - 1));
            if (o.window) fprintf(stderr, " | window %d, %d sinks", o.window, o.window_sinks);
            fputc('\n', stderr);
            generate(&sch, &o, prompts, log_csv, dump);
            if (log_csv && fclose(log_csv) != 0) die(1, "cannot write %s", o.log_path);
            if (dump && fclose(dump) != 0) die(1, "cannot write %s", o.dump_path);
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
    return status;
}
