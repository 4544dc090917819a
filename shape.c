/* shape.c: --shape's presets and parser (shape.h). */
#include "shape.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/errmsg.h"
#include "loader.h"

/* A preset's numbers; the variant follows from kv_heads and latent as for a SPEC. */
typedef struct {
    const char *name;
    int layers, dim, heads, head_dim, kv_heads, ffn, vocab, ctx, latent, rope_dim, window;
    float rope_theta;
} Preset;

static const Preset PRESETS[] = {
    /* name                    layers  dim heads hd  kv   ffn    vocab   ctx  latent rope window theta */
    {"llama2-7b", 32, 4096, 32, 128, 32, 11008, 32000, 4096, 0, 0, 0, 10000.0f},
    {"llama2-70b", 80, 8192, 64, 128, 8, 28672, 32000, 4096, 0, 0, 0, 10000.0f},
    {"tinyllama-1.1b", 22, 2048, 32, 64, 4, 5632, 32000, 2048, 0, 0, 0, 10000.0f},
    {"mistral-7b", 32, 4096, 32, 128, 8, 14336, 32000, 32768, 0, 0, 4096, 1e6f},
    /* DeepSeek-V2-Lite's attention (qk_nope = v_head = 128, qk_rope 64, kv_lora_rank 512)
     * with its first, dense FFN in every layer: our blocks have no mixture of experts */
    {"deepseek-v2-lite-attn", 27, 2048, 16, 128, 0, 10944, 102400, 32768, 512, 64, 0, 10000.0f},
    /* the shipped checkpoints' shapes (weights/) */
    {"mha", 4, 512, 16, 32, 16, 1344, 4096, 256, 0, 0, 0, 10000.0f},
    {"gqa", 4, 512, 16, 32, 4, 1344, 4096, 256, 0, 0, 0, 10000.0f},
    {"mqa", 4, 512, 16, 32, 1, 1344, 4096, 256, 0, 0, 0, 10000.0f},
    {"mla64", 4, 512, 16, 32, 0, 1344, 4096, 256, 64, 16, 0, 10000.0f},
    {"mla128", 4, 512, 16, 32, 0, 1344, 4096, 256, 128, 16, 0, 10000.0f},
};
enum { N_PRESETS = sizeof PRESETS / sizeof PRESETS[0] };

const char *shape_preset_names(void) {
    static char names[256];
    if (!names[0])
        for (int i = 0; i < N_PRESETS; i++) {
            if (i) strcat(names, ", ");
            strcat(names, PRESETS[i].name);
        }
    return names;
}

/* The keys of a SPEC, in the order -h and the messages list them. */
enum { K_LAYERS, K_DIM, K_HEADS, K_KV_HEADS, K_HEAD_DIM, K_FFN, K_VOCAB, K_CTX, K_LATENT, K_ROPE_DIM, K_ROPE_THETA,
       K_WINDOW, N_KEYS };
static const char *const KEYS[N_KEYS] = {"layers", "dim",    "heads",    "kv_heads",   "head_dim", "ffn",
                                         "vocab",  "ctx",    "latent",   "rope_dim",   "rope_theta", "window"};
#define KEY_LIST "layers, dim, heads, kv_heads, head_dim, ffn, vocab, ctx, latent, rope_dim, rope_theta, window"

/* One key=value of spec (len bytes at item) into values[]; 0 or 2 with the message. */
static int parse_item(const char *item, size_t len, double values[N_KEYS], int given[N_KEYS], char *err,
                      size_t errlen) {
    const char *eq = memchr(item, '=', len);
    if (!eq) return errmsg(err, errlen, 2, "--shape: '%.*s' is not key=value (keys: " KEY_LIST ")", (int)len, item);
    const size_t key_len = (size_t)(eq - item);
    int k = 0;
    while (k < N_KEYS && !(strlen(KEYS[k]) == key_len && !strncmp(KEYS[k], item, key_len))) k++;
    if (k == N_KEYS)
        return errmsg(err, errlen, 2, "--shape: unknown key '%.*s' (keys: " KEY_LIST ")", (int)key_len, item);
    if (given[k]) return errmsg(err, errlen, 2, "--shape: %s is given twice", KEYS[k]);
    char value[64];
    const size_t value_len = len - key_len - 1;
    if (value_len == 0 || value_len >= sizeof value)
        return errmsg(err, errlen, 2, "--shape: %s needs a number, got '%.*s'", KEYS[k], (int)value_len, eq + 1);
    memcpy(value, eq + 1, value_len);
    value[value_len] = '\0';
    char *end;
    errno = 0;
    if (k == K_ROPE_THETA) {
        values[k] = strtod(value, &end);
        if (end == value || *end || errno == ERANGE)
            return errmsg(err, errlen, 2, "--shape: rope_theta needs a number, got '%s'", value);
        if (!(values[k] > 1.0 && values[k] < 1e9))
            return errmsg(err, errlen, 2, "--shape: rope_theta %s is out of range (over 1, under 1e9)", value);
    } else {
        const long v = strtol(value, &end, 10);
        if (end == value || *end) return errmsg(err, errlen, 2, "--shape: %s needs an integer, got '%s'", KEYS[k], value);
        if (errno == ERANGE || v < 0 || v > INT_MAX)
            return errmsg(err, errlen, 2, "--shape: %s = %s is out of range", KEYS[k], value);
        values[k] = (double)v;
    }
    given[k] = 1;
    return 0;
}

int shape_parse(Config *c, const char *spec, char *err, size_t errlen) {
    double v[N_KEYS] = {0};
    int given[N_KEYS] = {0};
    const Preset *preset = NULL;
    if (!*spec) return errmsg(err, errlen, 2, "--shape needs a preset (%s) or key=value,...", shape_preset_names());
    for (const char *item = spec;;) {
        const size_t len = strcspn(item, ",");
        if (len == 0) return errmsg(err, errlen, 2, "--shape: an empty item in '%s'", spec);
        if (item == spec && !memchr(item, '=', len)) {
            for (int i = 0; i < N_PRESETS && !preset; i++)
                if (strlen(PRESETS[i].name) == len && !strncmp(PRESETS[i].name, item, len)) preset = &PRESETS[i];
            if (!preset)
                return errmsg(err, errlen, 2, "--shape: unknown preset '%.*s' (presets: %s)", (int)len, item,
                              shape_preset_names());
        } else {
            const int rc = parse_item(item, len, v, given, err, errlen);
            if (rc) return rc;
        }
        if (!item[len]) break;
        item += len + 1;
    }
    /* what is not given comes from the preset, or without one from these defaults */
    if (!preset) {
        for (int k = K_LAYERS; k <= K_HEADS; k++)
            if (!given[k])
                return errmsg(err, errlen, 2, "--shape: without a preset, layers, dim and heads are needed (%s is not given)",
                              KEYS[k]);
        if (!given[K_HEAD_DIM] && (int)v[K_HEADS] > 0 && (int)v[K_DIM] % (int)v[K_HEADS] != 0)
            return errmsg(err, errlen, 2, "--shape: heads = %d does not divide dim = %d: give head_dim",
                          (int)v[K_HEADS], (int)v[K_DIM]);
    }
    const Preset p = preset ? *preset
                            : (Preset){.layers = (int)v[K_LAYERS],
                                       .dim = (int)v[K_DIM],
                                       .heads = (int)v[K_HEADS],
                                       .head_dim = (int)v[K_HEADS] > 0 ? (int)v[K_DIM] / (int)v[K_HEADS] : 0,
                                       .kv_heads = (int)v[K_HEADS],
                                       .ffn = ((int)v[K_DIM] * 8 / 3 + 63) / 64 * 64, /* SwiGLU's 2/3 of 4 dim */
                                       .vocab = 32000,
                                       .ctx = 4096,
                                       .rope_theta = 10000.0f};
#define PICK(key, field) (given[key] ? (int)v[key] : p.field)
    memset(c, 0, sizeof *c);
    c->dtype = DTYPE_BF16;
    c->n_layers = PICK(K_LAYERS, layers);
    c->dim = PICK(K_DIM, dim);
    c->n_heads = PICK(K_HEADS, heads);
    c->head_dim = PICK(K_HEAD_DIM, head_dim);
    c->hidden_dim = PICK(K_FFN, ffn);
    c->vocab_size = PICK(K_VOCAB, vocab);
    c->max_seq_len = PICK(K_CTX, ctx);
    c->window = PICK(K_WINDOW, window);
    c->rope_theta = given[K_ROPE_THETA] ? (float)v[K_ROPE_THETA] : p.rope_theta;
    c->norm_eps = 1e-5f;
    c->bos_id = 1;
    c->eos_id = 2;
    /* the variant: a latent makes MLA; KV heads (or latent=0) make one of the others */
    const int latent = PICK(K_LATENT, latent);
    if (latent > 0) {
        if (given[K_KV_HEADS] && v[K_KV_HEADS] != 0)
            return errmsg(err, errlen, 2, "--shape: latent = %d makes MLA, which has no KV heads: drop kv_heads=%d",
                          latent, (int)v[K_KV_HEADS]);
        c->variant = VARIANT_MLA;
        c->kv_latent = latent;
        c->rope_dim = given[K_ROPE_DIM] ? (int)v[K_ROPE_DIM] : p.latent > 0 ? p.rope_dim : c->head_dim / 2;
    } else {
        if (given[K_ROPE_DIM])
            return errmsg(err, errlen, 2, "--shape: rope_dim is MLA's decoupled RoPE width: it needs latent > 0");
        c->n_kv_heads = given[K_KV_HEADS] ? (int)v[K_KV_HEADS] : p.latent > 0 ? c->n_heads : p.kv_heads;
        c->variant = c->n_kv_heads == c->n_heads ? VARIANT_MHA : c->n_kv_heads == 1 ? VARIANT_MQA : VARIANT_GQA;
    }
#undef PICK
    if (c->variant != VARIANT_MLA && c->n_heads > 0 && c->n_kv_heads > c->n_heads)
        return errmsg(err, errlen, 2, "--shape: kv_heads = %d is more than heads = %d", c->n_kv_heads, c->n_heads);
    if (c->variant != VARIANT_MLA && c->n_heads > 0 && c->n_kv_heads > 0 && c->n_heads % c->n_kv_heads != 0)
        return errmsg(err, errlen, 2, "--shape: kv_heads = %d does not divide heads = %d", c->n_kv_heads, c->n_heads);
    return config_check(c, "--shape", err, errlen) ? 2 : 0;
}
