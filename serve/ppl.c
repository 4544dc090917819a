/* ppl.c: --ppl FILE (modes.h): every story of a text file scored, each position's NLL from
 * the logits the scheduler reports for a scored request. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "loader.h"
#include "serve/json.h"
#include "serve/modes.h"
#include "serve/session.h"
#include "serve/textfile.h"
#include "tokenizer/spm_c.h"

/* -log softmax(l)[target] in double */
static double token_nll(const float *l, int V, int target) {
    float max = l[0];
    for (int i = 1; i < V; i++) max = l[i] > max ? l[i] : max;
    double sum = 0.0;
    for (int i = 0; i < V; i++) sum += exp((double)l[i] - max);
    return log(sum) + max - l[target];
}

typedef struct {
    double nll, nll_past; /* all targets; targets at positions past the context */
    long count, count_past;
    double nll_budget; /* with a window, targets from it to the context: what eviction changes, and every
                        * policy scores alike (a ring goes on past the context, eviction by attention restarts) */
    long count_budget;
    int stories;
    double story_s2, story_sn, story_n2; /* sums of s_i^2, s_i n_i, n_i^2: story i's NLL s_i over n_i tokens */
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

/* A story's tokens ids[0 .. n) scored: without a window in windows of the context (at most
 * a pass's SCHEDULER_PASS_TOKENS, whose rows of logits a step holds), each from an empty
 * cache, as train/model.py story_windows() does (the baseline past the context: restart);
 * with a ring or sinks, whole through the windowed cache, each position seeing what the
 * window keeps (eviction by attention stays within the context: in windows of it, each
 * through the budget). Each window is a scored request; position p's logits predict ids[p + 1]. */
static void score_story(Scheduler *sch, const int *ids, int n, NllSum *sum) {
    const Model *m = sch->model;
    const int ctx = m->cfg.max_seq_len < SCHEDULER_PASS_TOKENS ? m->cfg.max_seq_len : SCHEDULER_PASS_TOKENS;
    const int V = m->cfg.vocab_size;
    const int span = kv_rotates_by_place(sch->pool) ? n - 1 : ctx; /* inputs a request */
    for (int start = 0; start < n - 1; start += span) {
        const int len = n - 1 - start < span ? n - 1 - start : span;
        Request r = {.tokens = (int *)ids + start, .n_prompt = len, .cap_tokens = len + 1, .score = 1};
        if (scheduler_add(sch, &r) != 0) die(1, "out of memory");
        StepResult st;
        int rc;
        while ((rc = scheduler_step(sch, &st)) > 0)
            for (int k = 0; k < st.n_rows; k++) {
                const int target = start + st.rows[k].pos + 1;
                const double nll = token_nll(st.logits + (size_t)k * V, V, ids[target]);
                sum->nll += nll;
                sum->count++;
                if (target >= ctx) sum->nll_past += nll, sum->count_past++;
                if (sch->pool->window && target >= sch->pool->window && target < ctx)
                    sum->nll_budget += nll, sum->count_budget++;
            }
        check_model(rc);
    }
}

static void print_ppl(const Model *m, const Options *o, const NllSum *sum, int n_stories) {
    const int ctx = m->cfg.max_seq_len;
    const double mean = sum->nll / sum->count, se = nll_standard_error(sum), ppl = exp(mean);
    if (o->json) {
        json_begin("ppl", m, o, o->kv ? "kv" : "no-kv");
        fputs(", \"path\": ", stdout);
        json_text(stdout, o->ppl_path);
        printf(", \"stories\": %d, \"tokens\": %ld", n_stories, sum->count);
        json_field("mean_nll", mean);
        json_field("mean_nll_stderr", se);
        json_field("perplexity", ppl);
        json_field("perplexity_stderr", ppl * se);
        printf(", \"past_context\": ");
        if (sum->count_past) {
            printf("{\"from_position\": %d, \"tokens\": %ld, \"mean_nll\": ", ctx, sum->count_past);
            json_number(stdout, sum->nll_past / sum->count_past);
            putchar('}');
        } else {
            fputs("null", stdout);
        }
        printf(", \"past_budget\": ");
        if (sum->count_budget) {
            printf("{\"from_position\": %d, \"tokens\": %ld, \"mean_nll\": ", o->window, sum->count_budget);
            json_number(stdout, sum->nll_budget / sum->count_budget);
            putchar('}');
        } else {
            fputs("null", stdout);
        }
        json_end();
        return;
    }
    printf("ppl: %s | %d stories, %ld tokens | mean NLL %.4f nats/token | perplexity %.3f", o->ppl_path, n_stories,
           sum->count, mean, ppl);
    if (sum->count_past)
        printf(" | past the context (position %d on): %ld tokens, mean NLL %.4f", ctx, sum->count_past,
               sum->nll_past / sum->count_past);
    if (isnan(se))
        printf(" | PPL = %.3f (one story: no standard error)\n", ppl);
    else
        printf(" | PPL = %.3f +/- %.3f, mean NLL %.4f +/- %.4f (standard errors over %d stories)\n", ppl, ppl * se,
               mean, se, sum->stories);
}

/* Every story scored, with running estimates on stderr when it is a terminal, then one
 * line (or one JSON object) on stdout. */
int mode_ppl(const Model *m, KVPool *pool, const Options *o) {
    char err[256];
    StoryFile sf;
    if (storyfile_read(&sf, o->ppl_path, err, sizeof err) != 0) die(1, "%s", err);
    const int cap = 1 << 16;
    int *ids = malloc((size_t)cap * sizeof(int));
    if (!ids) die(1, "out of memory");
    Options scoring = *o;
    scoring.kv = 1; /* a window's positions each in one pass through the cache */
    Scheduler sch;
    scheduler_open(&sch, m, pool, NULL, &scoring, 1);
    const int progress = !o->quiet && isatty(STDERR_FILENO);
    NllSum sum = {0};
    for (int s = 0; s < sf.n_stories; s++) {
        const char *text = sf.stories[s];
        int n = spm_encode(m->tokenizer, text, strlen(text), 1, ids, cap - 1);
        if (n < 0 || n >= cap) {
            if (progress) fputs("\r\033[K", stderr);
            free(ids); /* held only in a register at this point, so LeakSanitizer would count it lost */
            die(1, "%s: story %d %s", input_name(o->ppl_path).s, s + 1,
                n < 0 ? encode_error(n) : "is longer than 65535 tokens");
        }
        ids[n++] = m->cfg.eos_id;
        const double nll_before = sum.nll;
        const long count_before = sum.count;
        score_story(&sch, ids, n, &sum);
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
    print_ppl(m, o, &sum, sf.n_stories);
    scheduler_free(&sch);
    storyfile_free(&sf);
    free(ids);
    return 0;
}
