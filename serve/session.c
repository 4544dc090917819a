/* session.c: what the modes share (session.h). */
#include "serve/session.h"

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/errmsg.h"
#include "loader.h"
#include "serve/json.h"
#include "serve/textfile.h"
#include "serve/version.h"
#include "tokenizer/spm_c.h"

void die(int code, const char *fmt, ...) {
    char small[2048], *line = small;
    va_list ap, again;
    va_start(ap, fmt);
    va_copy(again, ap);
    const int n = vsnprintf(small, sizeof small, fmt, ap);
    if (n >= (int)sizeof small && (line = malloc((size_t)n + 1)) != NULL)
        vsnprintf(line, (size_t)n + 1, fmt, again);
    else
        line = small; /* cut, where memory is short */
    va_end(again);
    va_end(ap);
    /* a control character quoted from a flag, a prompt or a file (a newline, an escape
     * sequence's ESC or CSI) shows as '?': the message stays one line and cannot drive a terminal */
    utf8_mask_controls(line);
    fprintf(stderr, "run: %s\n", line);
    exit(code);
}

void check_written(FILE *f, const char *name) {
    if (fflush(f) != 0 || ferror(f)) die(1, "cannot write %s: %s", msg_path(name).s, strerror(errno ? errno : EIO));
}

void close_written(FILE *f, const char *name) {
    check_written(f, name);
    if (fclose(f) != 0) die(1, "cannot write %s: %s", msg_path(name).s, strerror(errno));
}

void check_model(int rc) {
    if (rc == MODEL_ERR_NONFINITE)
        die(1, "the model computes logits that are not finite numbers (NaN or infinity): its weights overflow "
               "float arithmetic");
    if (rc != 0) die(1, "out of memory");
}

const char *encode_error(int code) {
    static char too_long[96];
    snprintf(too_long, sizeof too_long, "is over %d bytes, more than the tokenizer encodes at once",
             SPM_MAX_TEXT_BYTES);
    return code == SPM_ERR_TEXT       ? "is not valid UTF-8 text"
           : code == SPM_ERR_NOMEM    ? "cannot be encoded: out of memory"
           : code == SPM_ERR_TOO_LONG ? too_long
                                      : "cannot be encoded by the tokenizer";
}

/* BOS and the token ids of prompt ("1 2 3"), for a model without a tokenizer. */
static int parse_token_ids(const Model *m, const char *prompt, int *tokens, int max_tokens, const char *where) {
    const int V = m->cfg.vocab_size;
    int n = 0;
    tokens[n++] = m->cfg.bos_id;
    for (const char *s = prompt;;) {
        s += strspn(s, " \t,");
        if (!*s) break;
        char *end;
        errno = 0;
        const long id = strtol(s, &end, 10);
        if (end == s || (*end && !strchr(" \t,", *end)) || errno == ERANGE || id < 0 || id >= V)
            die(1,
                "%sthe prompt is not token ids: generated weights (--shape) have no tokenizer, so a prompt is "
                "numbers 0..%d separated by spaces, and '%.*s' is not one",
                where, V - 1, (int)strcspn(s, " \t,") > 32 ? 32 : (int)strcspn(s, " \t,"), s);
        if (n == max_tokens) break; /* longer than the context: refused below */
        tokens[n++] = (int)id;
        s = end;
    }
    return n;
}

int encode_prompt(const Model *m, const char *prompt, int fill, int *tokens, int max_tokens, const char *where) {
    int n = m->tokenizer ? spm_encode(m->tokenizer, prompt, strlen(prompt), 1, tokens, max_tokens)
                         : parse_token_ids(m, prompt, tokens, max_tokens, where);
    if (n < 0) die(1, "%sthe prompt %s", where, encode_error(n));
    if (fill && (long)fill + n > m->cfg.max_seq_len)
        die(1, "%sthe prompt is %d tokens: from --fill %d on it runs past the %d-token context (to position %ld)",
            where, n, fill, m->cfg.max_seq_len, (long)fill + n - 1);
    if (n > m->cfg.max_seq_len)
        die(1, "%sthe prompt is %d tokens, longer than the context (%d tokens)", where, n, m->cfg.max_seq_len);
    if (n >= m->cfg.max_seq_len)
        die(1, "%sthe prompt is %d tokens and fills the whole context (%d): no room to generate", where, n,
            m->cfg.max_seq_len);
    return n;
}

/* A request of the prompt's n tokens, with room for one more. */
static Request request_of(const int *prompt, int n, int index, uint64_t seed) {
    Request r = {.index = index, .n_prompt = n, .cap_tokens = n + 1, .seed = seed};
    if (!(r.tokens = malloc((size_t)r.cap_tokens * sizeof(int)))) die(1, "out of memory");
    memcpy(r.tokens, prompt, (size_t)n * sizeof(int));
    return r;
}

RequestList requests_of(const Model *m, const Options *o) {
    RequestList l = {0};
    int *prompt = malloc((size_t)(m->cfg.max_seq_len + 1) * sizeof(int));
    if (!prompt) die(1, "out of memory");
    if (o->prompts_path) {
        PromptFile *file = calloc(1, sizeof *file);
        char err[512];
        if (!file) die(1, "out of memory");
        if (promptfile_read(file, o->prompts_path, err, sizeof err) != 0) die(1, "%s", err);
        l.file = file;
        l.n = file->n_prompts;
        l.texts = (const char **)file->prompts;
    } else {
        l.n = o->batch;
        if (!(l.texts = malloc((size_t)l.n * sizeof *l.texts))) die(1, "out of memory");
        for (int i = 0; i < l.n; i++) l.texts[i] = o->prompt;
    }
    if (o->seed > (uint64_t)INT64_MAX - (uint64_t)(l.n - 1)) /* each printed seed must be one -s takes */
        die(EXIT_USAGE, "-s %llu with %d sequences: the last one's seed, s+%d, passes the largest seed, %lld",
            (unsigned long long)o->seed, l.n, l.n - 1, (long long)INT64_MAX);
    if (!(l.requests = calloc((size_t)l.n, sizeof *l.requests))) die(1, "out of memory");
    for (int i = 0; i < l.n; i++) {
        char where[320] = "";
        if (o->prompts_path)
            snprintf(where, sizeof where, "%s:%d: ", input_name(o->prompts_path).s,
                     ((PromptFile *)l.file)->line_numbers[i]);
        const int n = o->prompts_path || i == 0
                          ? encode_prompt(m, l.texts[i], o->fill, prompt, m->cfg.max_seq_len + 1, where)
                          : l.requests[0].n_prompt;
        l.requests[i] = request_of(prompt, n, i, o->seed + (uint64_t)i);
    }
    free(prompt);
    return l;
}

void requests_free(RequestList *l) {
    for (int i = 0; i < l->n; i++) free(l->requests[i].tokens);
    free(l->requests);
    if (l->file) {
        promptfile_free(l->file);
        free(l->file);
    } else {
        free(l->texts);
    }
    memset(l, 0, sizeof *l);
}

void scheduler_open(Scheduler *sch, const Model *m, KVPool *pool, const Drafter *draft, const Options *o,
                    int max_batch) {
    *sch = (Scheduler){.model = m,
                       .pool = pool,
                       .kv = o->kv,
                       .form = o->mla_form,
                       .max_batch = max_batch,
                       .max_new = o->steps,
                       .ignore_eos = o->ignore_eos,
                       .top_k = o->top_k,
                       .top_p = o->top_p,
                       .temperature = o->temperature,
                       .draft_k = o->draft ? o->draft_k : 0,
                       .draft_model = o->draft && draft ? draft->model : NULL,
                       .draft_pool = o->draft && draft ? draft->pool : NULL,
                       .draft_table = o->draft && draft ? draft->table : NULL,
                       .fill = o->fill,
                       .preempt_rule = o->kv_offload && o->preempt_swap < 0};
    if (scheduler_init(sch) != 0) die(1, "out of memory (or no thread could be started) for %d slots", max_batch);
}

void json_begin(const char *type, const Model *m, const Options *o, const char *mode) {
    printf("{\"type\": \"%s\", \"version\": \"%s\", \"commit\": ", type, RUN_VERSION);
    json_text(stdout, build_commit());
    fputs(", \"checkpoint\": ", stdout);
    if (o->checkpoint)
        json_text(stdout, o->checkpoint);
    else
        fputs("null", stdout);
    fputs(", \"shape\": ", stdout);
    if (o->shape)
        json_text(stdout, o->shape);
    else
        fputs("null", stdout);
    /* weights from the seed: whatever text they produce means nothing */
    printf(", \"generated_weights\": %s, \"context\": %d", o->shape ? "true" : "false", m->cfg.max_seq_len);
    printf(", \"variant\": \"%s\", \"mode\": \"%s\", \"kv_dtype\": \"%s\", \"mla_form\": ", variant_name(&m->cfg), mode,
           kv_dtype_name(o->kv_dtype));
    if (m->cfg.variant == VARIANT_MLA && strcmp(type, "check-kv") != 0)
        printf("\"%s\"", mla_form_name(o->mla_form));
    else
        fputs("null", stdout); /* --check-kv names the form of each run it compares */
    printf(", \"window\": %d, \"window_sinks\": %d, \"evict\": ", o->window, o->window ? o->window_sinks : 0);
    if (o->window)
        printf("\"%s\"", evict_name(o));
    else
        fputs("null", stdout);
    printf(", \"threads\": %d, \"seed\": %llu", threads_count(), (unsigned long long)o->seed);
}

size_t scheduler_scratch_bytes(const Config *c, int max_batch) {
    const size_t T = (size_t)scheduler_max_tokens(c, max_batch), qw = (size_t)config_query_width(c);
    const size_t H = (size_t)c->n_heads, kv = (size_t)c->n_kv_heads * c->head_dim, lat = (size_t)c->kv_latent,
                 lr = lat + (size_t)c->rope_dim;
    /* a token's floats: its logits, the residual and normed streams, the heads' output, the
     * FFN's two hidden rows, attention's query, keys, values and MLA's latent rows */
    const size_t floats = (size_t)c->vocab_size + 2 * (size_t)c->dim + H * (size_t)c->head_dim +
                          2 * (size_t)c->hidden_dim + H * qw + 2 * kv + 2 * lr + H * lr + H * lat;
    return T * floats * sizeof(float);
}

int run_streams(const Options *o) {
    return o->kv && o->kv_offload && o->batch == 1 && !o->prompts_path && !o->window && !o->check_kv &&
           !o->check_batch && !o->ppl_path;
}

size_t stream_stage_bytes(const Config *c, const Options *o) {
    return run_streams(o) ? 2 * (size_t)kv_blocks_for(c->max_seq_len) * (kv_block_bytes_for(c, o->kv_dtype) / c->n_layers)
                          : 0;
}

int machine_memory(double *available, double *total) {
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    long long avail_kb = -1, total_kb = -1;
    while (f && fgets(line, sizeof line, f)) {
        sscanf(line, "MemAvailable: %lld kB", &avail_kb);
        sscanf(line, "MemTotal: %lld kB", &total_kb);
    }
    if (f) fclose(f);
    if (avail_kb >= 0 && total_kb >= 0) {
        *available = 1024.0 * (double)avail_kb, *total = 1024.0 * (double)total_kb;
        return 0;
    }
    const long page = sysconf(_SC_PAGESIZE), pages = sysconf(_SC_PHYS_PAGES), free_pages = sysconf(_SC_AVPHYS_PAGES);
    if (page <= 0 || pages <= 0 || free_pages < 0) return -1;
    *available = (double)page * (double)free_pages, *total = (double)page * (double)pages;
    return 0;
}

void json_field(const char *key, double value) {
    printf(", \"%s\": ", key);
    json_number(stdout, value);
}

void json_end(void) { fputs("}\n", stdout); }
