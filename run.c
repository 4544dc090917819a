/* run.c: the command line. Generation with or without a KV cache, per-step
 * latency, --check-kv, --ppl, --info and --dump-logits.
 *
 *   ./run weights/gqa.bin -p "Once upon a time" --kv
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "loader.h"
#include "model.h"
#include "parallel.h"
#include "sampler.h"
#include "spm_c.h"
#include "textfile.h"
#include "utf8.h"

#define EXIT_USAGE 2

static void die(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("run: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(code);
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* ---- generation ---- */

typedef struct {
    Model *model;
    RunState *state;
    KVCache *cache;
    int kv;               /* keep the cache between steps */
    MlaForm form;
} Engine;

/* The logits after tokens[0..n): with the cache, the forward pass runs the tokens the
 * cache does not hold yet; without it, the whole sequence on an emptied cache. */
static void engine_step(Engine *e, const int *tokens, int n, float *logits) {
    if (!e->kv) kv_reset(e->cache);
    const int from = e->cache->len;
    if (model_forward(e->model, e->state, e->cache, tokens + from, n - from, e->form, logits, 0) != 0)
        die(1, "internal error: a forward pass of %d tokens at position %d does not fit", n - from, from);
}

/* What a negative spm_encode result means, after "the prompt" or "story N". */
static const char *encode_error(int code) {
    return code == SPM_ERR_TEXT ? "is not valid UTF-8 text" : code == SPM_ERR_NOMEM ? "cannot be encoded: out of memory"
                                                                                  : "cannot be encoded by the tokenizer";
}

static int encode_prompt(const Model *m, const char *prompt, int *tokens, int max_tokens) {
    int n = spm_encode(m->tokenizer, prompt, strlen(prompt), 1, tokens, max_tokens);
    if (n < 0) die(1, "the prompt %s", encode_error(n));
    if (n > m->cfg.max_seq_len)
        die(1, "the prompt is %d tokens, longer than the context (%d tokens)", n, m->cfg.max_seq_len);
    if (n >= m->cfg.max_seq_len)
        die(1, "the prompt is %d tokens and fills the whole context (%d): no room to generate", n, m->cfg.max_seq_len);
    return n;
}

typedef struct {
    int steps;            /* decode steps (tokens after the first) */
    double prefill_ms;
    double decode_ms;
    int prompt_tokens;
    int generated;
    int hit_eos;
    int context_full;
} RunStats;

/* tokens: room for max_seq_len + 1 ids, the first n of them the prompt */
static void generate(Engine *e, const Options *o, Sampler *sampler, FILE *log_csv, FILE *dump, int *tokens, int n) {
    const Model *m = e->model;
    const int max_seq = m->cfg.max_seq_len, V = m->cfg.vocab_size;
    float *logits = malloc((size_t)V * sizeof(float));
    SpmStream *stream = spm_stream_new(m->tokenizer);
    if (!logits || !stream) die(1, "out of memory");
    RunStats st = {0};
    st.prompt_tokens = n;

    for (int i = 1; i < n; i++) utf8_fputs_sanitized(spm_stream_put(stream, tokens[i]), stdout);
    fflush(stdout);

    /* Warm-up, as llama.cpp does after loading: one untimed forward of the prompt, then
     * an empty cache. A process's first forward runs cold (its weights come from DRAM);
     * that is a cost of loading, so the timed prefill below runs warm, like every decode step. The
     * arithmetic is batch-invariant, so the prefill's logits are the same bits either way. */
    double warm0 = now_ms();
    engine_step(e, tokens, n, logits);
    kv_reset(e->cache);
    if (!o->quiet) fprintf(stderr, "[warm-up] tokens %d ms %.3f (untimed; cache emptied)\n", n, now_ms() - warm0);

    double t0 = now_ms();
    engine_step(e, tokens, n, logits);
    int next = sampler_sample(sampler, logits);
    st.prefill_ms = now_ms() - t0;
    if (dump) fwrite(logits, sizeof(float), (size_t)V, dump);
    if (!o->quiet) fprintf(stderr, "[prefill] tokens %d next %d ms %.3f\n", n, next, st.prefill_ms);
    if (log_csv) fprintf(log_csv, "0,prefill,%d,%d,%d,%.4f\n", n - 1, n, next, st.prefill_ms);

    for (;;) {
        st.generated++;
        if (next == m->cfg.eos_id && !o->ignore_eos) { st.hit_eos = 1; break; }
        utf8_fputs_sanitized(spm_stream_put(stream, next), stdout);
        fflush(stdout);
        if (o->steps && st.generated >= o->steps) break;
        if (n >= max_seq) { st.context_full = 1; break; }
        tokens[n++] = next;
        t0 = now_ms();
        engine_step(e, tokens, n, logits);
        next = sampler_sample(sampler, logits);
        double ms = now_ms() - t0;
        st.steps++;
        st.decode_ms += ms;
        if (dump) fwrite(logits, sizeof(float), (size_t)V, dump);
        if (!o->quiet) fprintf(stderr, "[step %d] pos %d token %d ms %.3f\n", st.steps, n - 1, next, ms);
        if (log_csv) fprintf(log_csv, "%d,decode,%d,%d,%d,%.4f\n", st.steps, n - 1, n, next, ms);
    }
    utf8_fputs_sanitized(spm_stream_flush(stream), stdout);
    fputc('\n', stdout);
    fflush(stdout);

    double avg = st.steps ? st.decode_ms / st.steps : 0.0;
    fprintf(stderr,
            "summary: %s %s | prefill %d tokens %.3f ms | decode %d steps, %.3f ms/token, %.1f tokens/s | "
            "KV cache %zu bytes%s | stop: %s\n",
            variant_name(&m->cfg), e->kv ? "kv" : "no-kv", st.prompt_tokens, st.prefill_ms, st.steps, avg,
            avg > 0 ? 1000.0 / avg : 0.0, e->kv ? kv_bytes_allocated(e->cache) : (size_t)0,
            e->kv ? "" : " (recomputed every step)",
            st.hit_eos ? "eos" : st.context_full ? "context full" : "steps");
    spm_stream_free(stream);
    free(logits);
}

/* generate() inside one team (parallel.h), so that every forward pass of the run uses it
 * instead of opening an OpenMP region of its own: the other threads stay awake, spinning,
 * while a token is sampled and printed. */
typedef struct {
    Engine *e;
    const Options *o;
    Sampler *sampler;
    FILE *log_csv, *dump;
    int *tokens, n;
} Generation;

static void generate_in_team(void *arg) {
    Generation *g = arg;
    generate(g->e, g->o, g->sampler, g->log_csv, g->dump, g->tokens, g->n);
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
    int n = encode_prompt(m, o->prompt, prompt, m->cfg.max_seq_len + 1);
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
    double nll = 0.0;
    long count = 0;
    e->kv = 0;
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
        /* windows of the context, as train/model.py story_windows() */
        for (int start = 0; start < n - 1; start += ctx) {
            int len = n - start < ctx + 1 ? n - start : ctx + 1;  /* inputs len-1, targets len-1 */
            kv_reset(e->cache);
            model_forward(m, e->state, e->cache, ids + start, len - 1, e->form, logits, 1);
            for (int t = 0; t < len - 1; t++) {
                const float *l = logits + (size_t)t * V;
                float max = l[0];
                for (int i = 1; i < V; i++) max = l[i] > max ? l[i] : max;
                double sum = 0.0;
                for (int i = 0; i < V; i++) sum += exp((double)l[i] - max);
                nll += log(sum) + max - l[ids[start + t + 1]];
                count++;
            }
        }
    }
    printf("ppl: %s | %d stories, %ld tokens | mean NLL %.4f nats/token | perplexity %.3f\n", path, sf.n_stories,
           count, nll / count, exp(nll / count));
    storyfile_free(&sf);
    free(ids);
    free(logits);
}

/* ---- --info ---- */

static void info(const Model *m, const KVCache *cache) {
    const Config *c = &m->cfg;
    size_t es = 4;  /* the cache holds fp32 */
    size_t formula = c->variant == VARIANT_MLA ? (size_t)c->n_layers * (c->kv_latent + c->rope_dim) * es
                                               : 2 * (size_t)c->n_layers * c->n_kv_heads * c->head_dim * es;
    printf("variant        %s\n", variant_name(c));
    printf("dtype          %s\n", c->dtype == DTYPE_BF16 ? "bf16" : "fp32");
    printf("dim %d, layers %d, heads %d x %d, kv heads %d, latent %d, rope dim %d, hidden %d, vocab %d, context %d\n",
           c->dim, c->n_layers, c->n_heads, c->head_dim, c->n_kv_heads, c->kv_latent,
           config_rope_width(c), c->hidden_dim, c->vocab_size, c->max_seq_len);
    printf("parameters     %zu (%.2f M), %zu bytes of weights\n", model_param_count(c), model_param_count(c) / 1e6,
           model_param_count(c) * dtype_size(c->dtype));
    if (c->variant == VARIANT_MLA)
        printf("KV cache       L*(d_c+d_R)*4 = %d*(%d+%d)*4 = %zu bytes/token; %zu bytes at full context\n",
               c->n_layers, c->kv_latent, c->rope_dim, formula, formula * c->max_seq_len);
    else
        printf("KV cache       2*L*H_kv*d_h*4 = 2*%d*%d*%d*4 = %zu bytes/token; %zu bytes at full context\n",
               c->n_layers, c->n_kv_heads, c->head_dim, formula, formula * c->max_seq_len);
    printf("allocated      %zu bytes/token; %zu bytes (fp32)\n", kv_bytes_per_token(cache), kv_bytes_allocated(cache));
    printf("kernels        %s\n", kernels_simd_name());
}

int main(int argc, char **argv) {
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
    free(usage_err);
    if (o.threads > 0) parallel_set_threads(o.threads);

    Model m;
    char err[512];
    if (model_load(&m, o.checkpoint, err, sizeof err) != 0) die(1, "%s", err);
    if (o.top_k > m.cfg.vocab_size) die(EXIT_USAGE, "-k %d is out of range (1..%d, the vocabulary)", o.top_k, m.cfg.vocab_size);
    if (o.steps > m.cfg.max_seq_len)
        die(EXIT_USAGE, "-n %d is out of range (1..%d, the context)", o.steps, m.cfg.max_seq_len);

    RunState state;
    KVCache cache;
    int *tokens = malloc((size_t)(m.cfg.max_seq_len + 1) * sizeof(int));  /* the sequence generated */
    if (!tokens || runstate_init(&state, &m.cfg, m.cfg.max_seq_len) != 0 || kv_init(&cache, &m.cfg, m.cfg.max_seq_len) != 0)
        die(1, "out of memory");
    Engine e = {&m, &state, &cache, o.kv, o.mla_form};

    if (o.info) {
        info(&m, &cache);
    } else if (o.check_kv) {
        check_kv(&e, &o);
    } else if (o.ppl_path) {
        perplexity(&e, o.ppl_path);
    } else {
        int n_prompt = encode_prompt(&m, o.prompt, tokens, m.cfg.max_seq_len + 1);
        Sampler sampler;
        if (sampler_init(&sampler, m.cfg.vocab_size, o.top_k, o.temperature, o.seed) != 0) die(1, "out of memory");
        FILE *log_csv = NULL, *dump = NULL;
        if (o.log_path) {
            log_csv = fopen(o.log_path, "w");
            if (!log_csv) die(1, "cannot write %s: %s", o.log_path, strerror(errno));
            fprintf(log_csv, "step,phase,pos,n_tokens,token,ms\n");
        }
        if (o.dump_path && !(dump = fopen(o.dump_path, "wb"))) die(1, "cannot write %s: %s", o.dump_path, strerror(errno));
        fprintf(stderr, "seed %llu | %s | %s | mla form %s | threads %d | top-k %d | temperature %g\n",
                (unsigned long long)o.seed, variant_name(&m.cfg), o.kv ? "kv" : "no-kv",
                m.cfg.variant == VARIANT_MLA ? mla_form_name(o.mla_form) : "n/a", parallel_threads(), o.top_k,
                o.temperature);
        Generation g = {&e, &o, &sampler, log_csv, dump, tokens, n_prompt};
        parallel_team(generate_in_team, &g);
        if (log_csv && fclose(log_csv) != 0) die(1, "cannot write %s", o.log_path);
        if (dump && fclose(dump) != 0) die(1, "cannot write %s", o.dump_path);
        sampler_free(&sampler);
    }
    kv_free(&cache);
    runstate_free(&state);
    free(tokens);
    model_free(&m);
    return 0;
}
