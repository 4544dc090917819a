/* profile.c: --profile (profile.h). */
#include "serve/profile.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/errmsg.h"
#include "kernels/fileio.h"
#include "kernels/threads.h"
#include "serve/json.h"
#include "serve/session.h"

static const char *const PART_NAMES[PARTS] = {"attention", "projections", "ffn", "head", "sampling", "embedding"};
static const char *const STAGE_NAMES[STAGES_PER_LAYER] = {"projections", "attention", "ffn"};

static double mat_elements(Mat w) { return (double)w.rows * (double)w.cols; }
static double mat_bytes(Mat w) { return mat_elements(w) * (double)dtype_size(w.dtype); }

/* The products a token runs through in a layer: elements of the matrices each token reads
 * (its multiply-adds), and their bytes. Expanded MLA's W_UK and W_UV run over the keys of
 * each sequence instead (sequence_key_macs), read once a pass as well. */
static void layer_costs(Profile *p, const LayerWeights *w) {
    const Config *c = &p->model->cfg;
    Mat per_token[9];
    int n = 0;
    per_token[n++] = w->wq;
    if (c->variant == VARIANT_MLA) {
        per_token[n++] = w->wdkv, per_token[n++] = w->wkr;
        if (p->form == MLA_ABSORBED) {
            per_token[n++] = w->wuk_t, per_token[n++] = w->wuv_heads;
        } else {
            p->sequence_key_macs += mat_elements(w->wuk) + mat_elements(w->wuv);
            p->pass_weight_bytes += mat_bytes(w->wuk) + mat_bytes(w->wuv);
        }
    } else {
        per_token[n++] = w->wk, per_token[n++] = w->wv;
    }
    per_token[n++] = w->wo, per_token[n++] = w->w1, per_token[n++] = w->w3, per_token[n++] = w->w2;
    for (int i = 0; i < n; i++)
        p->token_macs += mat_elements(per_token[i]), p->pass_weight_bytes += mat_bytes(per_token[i]);
}

/* A number of a peaks file, or the run ends with one line naming it: the figures divide the
 * profile's, so a value outside (0, limit) would print as nonsense. */
static double peak_value(const char *path, const char *key, double value, double limit) {
    if (!(value > 0 && value < limit))
        die(1, "%s: %s = %g is out of range (over 0, under %g)", msg_path(path).s, key, value, limit);
    return value;
}

/* "key value" lines of build/roofline's output: the best streaming read and FMA rate. A
 * regular file only: a FIFO or a device would block or stream without end. */
static void read_peaks(Profile *p, const char *path) {
    char err[512];
    size_t size;
    const int fd = open_regular(path, "--profile-peaks ", &size, err, sizeof err);
    if (fd < 0) die(1, "%s", err);
    FILE *f = fdopen(fd, "r");
    if (!f) die(1, "cannot read %s: %s", msg_path(path).s, strerror(errno));
    char line[256], key[128];
    double value;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "%127s %lf", key, &value) == 2) {
            if (!strcmp(key, "bandwidth_best_GBps")) p->peak_GBps = peak_value(path, key, value, 1e6);
            if (!strcmp(key, "peak_best_GFLOPs")) p->peak_GFLOPs = peak_value(path, key, value, 1e9);
            if (!strcmp(key, "roofline_threads")) {
                p->peak_threads = (int)peak_value(path, key, value, TEAM_MAX_THREADS + 1);
                if (p->peak_threads != value)
                    die(1, "%s: roofline_threads = %g is not a whole number", msg_path(path).s, value);
            }
        }
    fclose(f);
    if (!(p->peak_GBps > 0) || !(p->peak_GFLOPs > 0))
        die(1,
            "%s has no bandwidth_best_GBps and peak_best_GFLOPs lines: --profile-peaks reads build/roofline's output",
            msg_path(path).s);
    p->peaks_path = path;
}

static double *layer_slots(const Config *c) {
    double *ms = calloc((size_t)c->n_layers * STAGES_PER_LAYER, sizeof *ms);
    if (!ms) die(1, "out of memory");
    return ms;
}

void profile_open(Profile *p, const Model *m, const KVPool *pool, const Options *o) {
    const Config *c = &m->cfg;
    memset(p, 0, sizeof *p);
    p->model = m, p->pool = pool, p->form = o->mla_form, p->per_layer = o->profile == 2;
    if (!(p->clock.ms = calloc((size_t)stage_slots(c), sizeof *p->clock.ms)) ||
        !(p->clock.wait_ms = calloc((size_t)stage_slots(c), sizeof *p->clock.wait_ms)))
        die(1, "out of memory");
    p->step.layer_ms = layer_slots(c);
    for (int i = 0; i < 2; i++) p->phases[i].layer_ms = layer_slots(c);
    for (int l = 0; l < c->n_layers; l++) layer_costs(p, &m->w.layers[l]);
    p->pass_weight_bytes += mat_bytes(m->w.tok_embeddings); /* the tied head */
    const int H = c->n_heads, hd = c->head_dim, rd = c->rope_dim, dc = c->kv_latent;
    const int score_width = c->variant != VARIANT_MLA ? hd : p->form == MLA_ABSORBED ? dc + rd : hd + rd;
    const int mix_width = c->variant == VARIANT_MLA && p->form == MLA_ABSORBED ? dc : hd;
    p->key_macs = (double)c->n_layers * H * (score_width + mix_width);
    if (o->profile_peaks) read_peaks(p, o->profile_peaks);
}

/* The parts of a step from the clock's slots: each layer's stages summed, then the pass's. */
static void parts_of(const Config *c, const double *slots, double part[PARTS]) {
    memset(part, 0, PARTS * sizeof *part);
    for (int l = 0; l < c->n_layers; l++) {
        part[PART_PROJECTIONS] += slots[stage_slot(l, STAGE_PROJECTIONS)];
        part[PART_ATTENTION] += slots[stage_slot(l, STAGE_ATTENTION)];
        part[PART_FFN] += slots[stage_slot(l, STAGE_FFN)];
    }
    part[PART_HEAD] = slots[pass_stage_slot(c, PASS_STAGE_HEAD)];
    part[PART_SAMPLING] = slots[pass_stage_slot(c, PASS_STAGE_SAMPLING)];
    part[PART_EMBEDDING] = slots[pass_stage_slot(c, PASS_STAGE_EMBEDDING)];
}

void profile_step(Profile *p, const StepResult *st) {
    const Config *c = &p->model->cfg;
    const double *ms = p->clock.ms;
    ProfileFigures *s = &p->step;
    s->steps = 1;
    s->step_ms = st->ms;
    for (int l = 0; l < c->n_layers; l++)
        for (int k = 0; k < STAGES_PER_LAYER; k++) s->layer_ms[l * STAGES_PER_LAYER + k] = ms[stage_slot(l, k)];
    parts_of(c, ms, s->part_ms);
    parts_of(c, p->clock.wait_ms, s->part_wait_ms);
    memset(p->clock.ms, 0, (size_t)stage_slots(c) * sizeof *p->clock.ms);
    memset(p->clock.wait_ms, 0, (size_t)stage_slots(c) * sizeof *p->clock.wait_ms);

    const int expanded = c->variant == VARIANT_MLA && p->form == MLA_EXPANDED;
    const double token_row_bytes = (double)c->dim * (double)dtype_size(p->model->w.tok_embeddings.dtype);
    s->weight_bytes = st->passes * p->pass_weight_bytes + st->n_tokens * token_row_bytes;
    s->kv_bytes = (double)kv_bytes_per_token(p->pool) * (double)(expanded ? st->sequence_keys : st->keys_read);
    s->flops =
        2.0 * (st->n_tokens * p->token_macs + (double)st->keys_read * p->key_macs +
               (double)st->sequence_keys * p->sequence_key_macs + (double)st->logit_rows * c->vocab_size * c->dim);

    ProfileFigures *sum = &p->phases[st->step == 0 ? 0 : 1];
    sum->steps++;
    sum->step_ms += s->step_ms;
    for (int k = 0; k < PARTS; k++) sum->part_ms[k] += s->part_ms[k], sum->part_wait_ms[k] += s->part_wait_ms[k];
    for (int i = 0; i < c->n_layers * STAGES_PER_LAYER; i++) sum->layer_ms[i] += s->layer_ms[i];
    sum->weight_bytes += s->weight_bytes, sum->kv_bytes += s->kv_bytes, sum->flops += s->flops;
}

/* A phase's figures, means per step. */
typedef struct {
    double step_ms, part_ms[PARTS], part_wait_ms[PARTS], parts_ms, other_ms;
    double weight_bytes, kv_bytes, flops, GBps, GFLOPs;
} Means;

static Means means_of(const ProfileFigures *f) {
    Means m = {0};
    if (!f->steps) return m;
    m.step_ms = f->step_ms / f->steps;
    for (int k = 0; k < PARTS; k++)
        m.parts_ms += m.part_ms[k] = f->part_ms[k] / f->steps, m.part_wait_ms[k] = f->part_wait_ms[k] / f->steps;
    m.other_ms = m.step_ms - m.parts_ms;
    m.weight_bytes = f->weight_bytes / f->steps, m.kv_bytes = f->kv_bytes / f->steps, m.flops = f->flops / f->steps;
    m.GBps = f->step_ms > 0 ? (f->weight_bytes + f->kv_bytes) / (f->step_ms * 1e6) : 0.0;
    m.GFLOPs = f->step_ms > 0 ? f->flops / (f->step_ms * 1e6) : 0.0;
    return m;
}

static const char *const PHASE_NAMES[2] = {"prefill", "decode"};

void profile_print(FILE *out, const Profile *p) {
    const Config *c = &p->model->cfg;
    fprintf(out, "profile: means per step, thread 0's clock at the stages' barriers");
    if (p->peaks_path)
        fprintf(out, "; peaks from %s (%d threads): %.1f GB/s, %.1f GFLOP/s\n", msg_path(p->peaks_path).s,
                p->peak_threads, p->peak_GBps, p->peak_GFLOPs);
    else
        fputs("; no peaks (--profile-peaks FILE)\n", out);
    for (int ph = 0; ph < 2; ph++) {
        const ProfileFigures *f = &p->phases[ph];
        if (!f->steps) continue;
        const Means m = means_of(f);
        fprintf(out, "  %s, %d step%s: %.3f ms =", PHASE_NAMES[ph], f->steps, f->steps == 1 ? "" : "s", m.step_ms);
        for (int k = 0; k < PARTS; k++)
            fprintf(out, "%s %s %.3f (%.0f%%)", k ? " +" : "", PART_NAMES[k], m.part_ms[k],
                    m.step_ms > 0 ? 100.0 * m.part_ms[k] / m.step_ms : 0.0);
        fprintf(out, " + other %.3f\n", m.other_ms);
        if (threads_count() > 1) { /* a team's waits; alone there are none */
            fprintf(out, "  %s: of which the threads waited for one another (each barrier, first arrival to last):",
                    PHASE_NAMES[ph]);
            for (int k = 0; k < PARTS; k++) fprintf(out, "%s %s %.3f", k ? "," : "", PART_NAMES[k], m.part_wait_ms[k]);
            fputc('\n', out);
        }
        fprintf(out, "  %s: read %.2f MB of weights and %.2f MB of KV cache, %.2f MFLOP: %.1f GB/s, %.1f GFLOP/s",
                PHASE_NAMES[ph], m.weight_bytes / 1e6, m.kv_bytes / 1e6, m.flops / 1e6, m.GBps, m.GFLOPs);
        if (p->peaks_path)
            fprintf(out, " (%.0f%% and %.0f%% of the peaks)", 100.0 * m.GBps / p->peak_GBps,
                    100.0 * m.GFLOPs / p->peak_GFLOPs);
        fputc('\n', out);
        for (int l = 0; p->per_layer && l < c->n_layers; l++) {
            fprintf(out, "    layer %d:", l);
            for (int k = 0; k < STAGES_PER_LAYER; k++)
                fprintf(out, "%s %s %.3f ms", k ? "," : "", STAGE_NAMES[k],
                        f->layer_ms[l * STAGES_PER_LAYER + k] / f->steps);
            fputc('\n', out);
        }
    }
}

static void json_key_number(const char *key, double v, int first) {
    printf("%s\"%s\": ", first ? "" : ", ", key);
    json_number(stdout, v);
}

/* v, or null when the figure is not known */
static void json_optional(const char *key, double v, int known) {
    printf(", \"%s\": ", key);
    if (known)
        json_number(stdout, v);
    else
        fputs("null", stdout);
}

void profile_json(const Profile *p) {
    const Config *c = &p->model->cfg;
    printf(", \"profile\": {\"per_layer\": %s, \"peaks_source\": \"%s\", \"peaks_path\": ",
           p->per_layer ? "true" : "false", p->peaks_path ? "roofline_file" : "none");
    if (p->peaks_path)
        json_text(stdout, p->peaks_path);
    else
        fputs("null", stdout);
    json_optional("peak_GBps", p->peak_GBps, p->peaks_path != NULL);
    json_optional("peak_GFLOPs", p->peak_GFLOPs, p->peaks_path != NULL);
    json_optional("peak_threads", p->peak_threads, p->peaks_path != NULL);
    for (int ph = 0; ph < 2; ph++) {
        const ProfileFigures *f = &p->phases[ph];
        const Means m = means_of(f);
        char key[64];
        printf(", \"%s\": {", PHASE_NAMES[ph]);
        json_key_number("steps", f->steps, 1);
        json_key_number("step_ms_mean", m.step_ms, 0);
        for (int k = 0; k < PARTS; k++) {
            snprintf(key, sizeof key, "%s_ms_mean", PART_NAMES[k]);
            json_key_number(key, m.part_ms[k], 0);
        }
        for (int k = 0; k < PARTS; k++) {
            snprintf(key, sizeof key, "%s_wait_ms_mean", PART_NAMES[k]);
            json_key_number(key, m.part_wait_ms[k], 0);
        }
        json_key_number("parts_ms_mean", m.parts_ms, 0);
        json_key_number("other_ms_mean", m.other_ms, 0);
        json_key_number("weight_bytes_mean", m.weight_bytes, 0);
        json_key_number("kv_bytes_mean", m.kv_bytes, 0);
        json_key_number("flops_mean", m.flops, 0);
        json_key_number("GBps", m.GBps, 0);
        json_key_number("GFLOPs", m.GFLOPs, 0);
        json_optional("bandwidth_share_of_peak", p->peak_GBps > 0 ? m.GBps / p->peak_GBps : 0, p->peak_GBps > 0);
        json_optional("flops_share_of_peak", p->peak_GFLOPs > 0 ? m.GFLOPs / p->peak_GFLOPs : 0, p->peak_GFLOPs > 0);
        fputs(", \"layers\": [", stdout);
        for (int l = 0; l < c->n_layers; l++) {
            fputs(l ? ", {" : "{", stdout);
            for (int k = 0; k < STAGES_PER_LAYER; k++) {
                snprintf(key, sizeof key, "%s_ms_mean", STAGE_NAMES[k]);
                json_key_number(key, f->steps ? f->layer_ms[l * STAGES_PER_LAYER + k] / f->steps : 0.0, k == 0);
            }
            fputc('}', stdout);
        }
        fputs("]}", stdout);
    }
    fputc('}', stdout);
}

void profile_csv_header(FILE *csv) {
    for (int k = 0; k < PARTS; k++) fprintf(csv, ",%s_ms", PART_NAMES[k]);
    fputs(",weight_bytes,kv_bytes,flops", csv);
}

void profile_csv_row(FILE *csv, const Profile *p) {
    const ProfileFigures *s = &p->step;
    for (int k = 0; k < PARTS; k++) fprintf(csv, ",%.4f", s->part_ms[k]);
    fprintf(csv, ",%.0f,%.0f,%.0f", s->weight_bytes, s->kv_bytes, s->flops);
}

void profile_close(Profile *p) {
    free(p->clock.ms);
    free(p->clock.wait_ms);
    free(p->step.layer_ms);
    for (int i = 0; i < 2; i++) free(p->phases[i].layer_ms);
    memset(p, 0, sizeof *p);
}
