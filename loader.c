/* loader.c: reading a checkpoint (docs/FORMAT.md; loader.h). */
#include "loader.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attention.h"
#include "kernels/errmsg.h"
#include "kernels/fileio.h"
#include "kernels/threads.h"
#include "tokenizer/spm_c.h"

#define HEADER_SIZE 128
#define FLAGS_OFFSET 104    /* u32: bit 0, an untied output head; other bits must be 0 */
#define WINDOW_OFFSET 108   /* u32: the model's sliding window (0: none), at most max_seq_len */
#define RESERVED_OFFSET 112 /* the header's last 16 bytes, zero */
#define FLAG_UNTIED_HEAD 1u
#define FORMAT_VERSION 1

static uint32_t rd_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd_u64(const unsigned char *p) { return (uint64_t)rd_u32(p) | (uint64_t)rd_u32(p + 4) << 32; }
static float rd_f32(const unsigned char *p) {
    uint32_t u = rd_u32(p);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

const char *variant_name(const Config *c) {
    static const char *names[] = {"mha", "gqa", "mqa"};
    static _Thread_local char mla[32];
    if (c->variant != VARIANT_MLA) return names[c->variant];
    snprintf(mla, sizeof mla, "mla%d", c->kv_latent); /* mla64, mla128 */
    return mla;
}

/* visit for one tensor: its field, shape, name and layer */
#define VISIT(field, rows, cols, name, layer) visit(ctx, &(TensorRef){field, rows, cols, name, layer})

void model_walk_tensors(const Config *c, Weights *w, TensorVisitor visit, void *ctx) {
    const int H = c->n_heads, hd = c->head_dim, D = c->dim;
    VISIT(&w->tok_embeddings, c->vocab_size, D, "tok_embeddings", -1);
    for (int l = 0; l < c->n_layers; l++) {
        LayerWeights *L = &w->layers[l];
        VISIT(&L->attn_norm, 1, D, "attn_norm", l);
        if (c->variant == VARIANT_MLA) {
            VISIT(&L->wq, H * (hd + c->rope_dim), D, "wq", l);
            VISIT(&L->wdkv, c->kv_latent, D, "wdkv", l);
            VISIT(&L->kv_norm, 1, c->kv_latent, "kv_norm", l);
            VISIT(&L->wkr, c->rope_dim, D, "wkr", l);
            VISIT(&L->wuk, H * hd, c->kv_latent, "wuk", l);
            VISIT(&L->wuv, H * hd, c->kv_latent, "wuv", l);
        } else {
            VISIT(&L->wq, H * hd, D, "wq", l);
            VISIT(&L->wk, c->n_kv_heads * hd, D, "wk", l);
            VISIT(&L->wv, c->n_kv_heads * hd, D, "wv", l);
        }
        VISIT(&L->wo, D, H * hd, "wo", l);
        VISIT(&L->ffn_norm, 1, D, "ffn_norm", l);
        VISIT(&L->w1, c->hidden_dim, D, "w1", l);
        VISIT(&L->w2, D, c->hidden_dim, "w2", l);
        VISIT(&L->w3, c->hidden_dim, D, "w3", l);
    }
    VISIT(&w->final_norm, 1, D, "final_norm", -1);
    if (c->untied_head) VISIT(&w->output, c->vocab_size, D, "output", -1);
}
#undef VISIT

static void count_elements(void *ctx, const TensorRef *t) { *(uint64_t *)ctx += (uint64_t)t->rows * (uint64_t)t->cols; }
static void count_tensors(void *ctx, const TensorRef *t) { (void)t, ++*(int *)ctx; }

size_t model_param_count(const Config *c) {
    uint64_t n = 0;
    Weights w;
    LayerWeights *layers = calloc((size_t)c->n_layers, sizeof *layers);
    if (!layers) return 0;
    w.layers = layers;
    model_walk_tensors(c, &w, count_elements, &n);
    free(layers);
    return (size_t)n;
}

/* The names config_check's messages give the fields: the header's (FORMAT.md) for a
 * checkpoint, --shape's keys where a flag set them. */
enum { F_DIM, F_LAYERS, F_HEADS, F_HEAD_DIM, F_FFN, F_VOCAB, F_CTX, F_KV_HEADS, F_LATENT, N_FIELD_NAMES };
static const char *const HEADER_NAMES[N_FIELD_NAMES] = {
    "dim", "n_layers", "n_heads", "head_dim", "hidden_dim", "vocab_size", "max_seq_len", "n_kv_heads", "kv_latent"};
static const char *const SHAPE_NAMES[N_FIELD_NAMES] = {"dim",   "layers", "heads",    "head_dim", "ffn",
                                                       "vocab", "ctx",    "kv_heads", "latent"};

int config_check(const Config *c, const char *what, char *err, size_t errlen) {
    const char *const *name = what[0] == '-' ? SHAPE_NAMES : HEADER_NAMES;
    const struct {
        int field, v, max;
    } dims[] = {
        {F_DIM, c->dim, MAX_DIM},
        {F_LAYERS, c->n_layers, MAX_LAYERS},
        {F_HEADS, c->n_heads, MAX_DIM},
        {F_HEAD_DIM, c->head_dim, MAX_DIM},
        {F_FFN, c->hidden_dim, MAX_DIM},
        {F_VOCAB, c->vocab_size, MAX_VOCAB},
        {F_CTX, c->max_seq_len, MAX_SEQ_LEN},
    };
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].v <= 0 || dims[i].v > dims[i].max)
            return errmsg(err, errlen, -1, "%s: %s = %d is out of range (1..%d)", what, name[dims[i].field], dims[i].v,
                          dims[i].max);
    if ((long)c->n_heads * (c->head_dim + (long)c->rope_dim) > MAX_DIM)
        return errmsg(err, errlen, -1, "%s: %s * (head_dim + rope_dim) = %ld is over %d", what, name[F_HEADS],
                      (long)c->n_heads * (c->head_dim + (long)c->rope_dim), MAX_DIM);
    if (c->kv_latent < 0 || c->kv_latent > MAX_DIM || c->rope_dim < 0 || c->rope_dim > MAX_DIM || c->n_kv_heads < 0 ||
        c->n_kv_heads > MAX_DIM)
        return errmsg(err, errlen, -1, "%s: %s, %s or rope_dim is out of range", what, name[F_KV_HEADS],
                      name[F_LATENT]);
    switch (c->variant) {
    case VARIANT_MHA:
        if (c->n_kv_heads != c->n_heads)
            return errmsg(err, errlen, -1, "%s: an MHA model needs %s == %s (%d != %d)", what, name[F_KV_HEADS],
                          name[F_HEADS], c->n_kv_heads, c->n_heads);
        break;
    case VARIANT_GQA:
        if (c->n_kv_heads <= 1 || c->n_kv_heads >= c->n_heads || c->n_heads % c->n_kv_heads != 0)
            return errmsg(err, errlen, -1, "%s: a GQA model needs 1 < %s < %s dividing %s (got %d, %d)", what,
                          name[F_KV_HEADS], name[F_HEADS], name[F_HEADS], c->n_kv_heads, c->n_heads);
        break;
    case VARIANT_MQA:
        if (c->n_kv_heads != 1)
            return errmsg(err, errlen, -1, "%s: an MQA model needs %s == 1 (got %d)", what, name[F_KV_HEADS],
                          c->n_kv_heads);
        break;
    case VARIANT_MLA:
        if (c->n_kv_heads != 0 || c->kv_latent <= 0 || c->rope_dim <= 0 || c->rope_dim % 2 != 0)
            return errmsg(err, errlen, -1, "%s: an MLA model needs %s == 0, %s > 0 and an even rope_dim > 0", what,
                          name[F_KV_HEADS], name[F_LATENT]);
        break;
    default: return errmsg(err, errlen, -1, "%s: unknown variant %d", what, (int)c->variant);
    }
    if (c->variant != VARIANT_MLA && (c->kv_latent != 0 || c->rope_dim != 0))
        return errmsg(err, errlen, -1, "%s: %s and rope_dim must be 0 for %s", what, name[F_LATENT], variant_name(c));
    if (c->head_dim % 2 != 0)
        return errmsg(err, errlen, -1, "%s: head_dim = %d is odd (RoPE rotates pairs)", what, c->head_dim);
    if (!(c->rope_theta > 1.0f && c->rope_theta < 1e9f))
        return errmsg(err, errlen, -1, "%s: rope_theta is not a sane number (over 1, under 1e9)", what);
    if (!(c->norm_eps > 0.0f && c->norm_eps < 1.0f))
        return errmsg(err, errlen, -1, "%s: norm_eps is not in (0, 1)", what);
    long rope_entries = (long)c->max_seq_len * (config_rope_width(c) / 2);
    if (rope_entries > MAX_ROPE_ENTRIES)
        return errmsg(err, errlen, -1, "%s: %s * rotated width / 2 = %ld is over %ld (the RoPE tables)", what,
                      name[F_CTX], rope_entries, (long)MAX_ROPE_ENTRIES);
    if (c->window < 0 || c->window > c->max_seq_len)
        return errmsg(err, errlen, -1, "%s: window = %d is out of range (0..%d, the context; 0: none)", what,
                      c->window, c->max_seq_len);
    if (c->bos_id < 0 || c->bos_id >= c->vocab_size || c->eos_id < 0 || c->eos_id >= c->vocab_size)
        return errmsg(err, errlen, -1, "%s: bos_id or eos_id is outside the vocabulary", what);
    return 0;
}

static int parse_header(Config *c, const unsigned char *h, char *err, size_t errlen) {
    if (memcmp(h, "AKVC", 4) != 0) return errmsg(err, errlen, -1, "checkpoint: bad magic (not an AKVC checkpoint)");
    uint32_t version = rd_u32(h + 4);
    if (version != FORMAT_VERSION)
        return errmsg(err, errlen, -1, "checkpoint: unsupported version %u (this program reads %d)", version,
                      FORMAT_VERSION);
    uint32_t variant = rd_u32(h + 8), dtype = rd_u32(h + 12);
    if (variant > VARIANT_MLA) return errmsg(err, errlen, -1, "checkpoint: unknown variant %u", variant);
    if (dtype > DTYPE_BF16) return errmsg(err, errlen, -1, "checkpoint: unknown dtype %u", dtype);
    for (int i = RESERVED_OFFSET; i < HEADER_SIZE; i++)
        if (h[i] != 0)
            return errmsg(err, errlen, -1, "checkpoint: reserved header byte %d is %u, not 0 (a newer format?)", i,
                          h[i]);
    const uint32_t flags = rd_u32(h + FLAGS_OFFSET), window = rd_u32(h + WINDOW_OFFSET);
    if (flags & ~FLAG_UNTIED_HEAD)
        return errmsg(err, errlen, -1, "checkpoint: unknown flags 0x%x in the header (a newer format?)", flags);
    c->variant = (Variant)variant;
    c->dtype = (DType)dtype;
    c->untied_head = (flags & FLAG_UNTIED_HEAD) != 0;
    /* the u32 fields from offset 16 on, in order, and the least and most each may take */
    const struct {
        int *field;
        const char *name;
        int min, max;
    } dims[] = {
        {&c->dim, "dim", 1, MAX_DIM},
        {&c->n_layers, "n_layers", 1, MAX_DIM},
        {&c->n_heads, "n_heads", 1, MAX_DIM},
        {&c->head_dim, "head_dim", 1, MAX_DIM},
        {&c->n_kv_heads, "n_kv_heads", 0, MAX_DIM},
        {&c->kv_latent, "kv_latent", 0, MAX_DIM},
        {&c->rope_dim, "rope_dim", 0, MAX_DIM},
        {&c->hidden_dim, "hidden_dim", 1, MAX_DIM},
        {&c->vocab_size, "vocab_size", 1, MAX_VOCAB},
        {&c->max_seq_len, "max_seq_len", 1, MAX_SEQ_LEN},
    };
    for (int i = 0; i < 10; i++) {
        uint32_t v = rd_u32(h + 16 + 4 * i);
        if (v > (uint32_t)dims[i].max) /* here, while the file's own number is at hand for the message */
            return errmsg(err, errlen, -1, "checkpoint: %s = %u is out of range (%d..%d)", dims[i].name, v, dims[i].min,
                          dims[i].max);
        *dims[i].field = (int)v;
    }
    if (window > (uint32_t)c->max_seq_len)
        return errmsg(err, errlen, -1, "checkpoint: window = %u is over the context (max_seq_len %d)", window,
                      c->max_seq_len);
    c->window = (int)window;
    c->rope_theta = rd_f32(h + 56);
    c->norm_eps = rd_f32(h + 60);
    uint32_t bos = rd_u32(h + 64), eos = rd_u32(h + 68);
    c->bos_id = bos > (uint32_t)MAX_VOCAB ? -1 : (int)bos;
    c->eos_id = eos > (uint32_t)MAX_VOCAB ? -1 : (int)eos;
    return config_check(c, "checkpoint", err, errlen);
}

/* Copies element (r, c) of a packed matrix to dst, in its dtype. */
static void copy_element(char *dst, Mat w, int r, int c) {
    size_t es = dtype_size(w.dtype);
    memcpy(dst, (const char *)w.data + mat_packed_offset(w.rows, w.cols, w.dtype, r, c) * es, es);
}

/* The per-head matrices of the absorbed form, each head packed on its own so that
 * mat_block can hand out one head whatever head_dim and kv_latent are:
 *   wuk_t     [H][dc][hd]: W_UK,h transposed
 *   wuv_heads [H][hd][dc]: W_UV,h (wuv's rows, regrouped by head) */
static int derive_absorbed(Model *m) {
    const Config *c = &m->cfg;
    const int H = c->n_heads, hd = c->head_dim, dc = c->kv_latent;
    const size_t es = dtype_size(c->dtype), per_matrix = (size_t)H * dc * hd * es;
    void *aligned = NULL;
    char *rowmajor = malloc(per_matrix);
    if (posix_memalign(&aligned, 64, 2 * per_matrix * (size_t)c->n_layers) != 0) aligned = NULL;
    char *store = aligned;
    if (!store || !rowmajor) {
        free(store);
        free(rowmajor);
        return -1;
    }
    m->derived = store;
    for (int l = 0; l < c->n_layers; l++) {
        LayerWeights *L = &m->w.layers[l];
        char *wuk_t = store + 2 * per_matrix * (size_t)l, *wuv_heads = wuk_t + per_matrix;
        for (int h = 0; h < H; h++)
            for (int k = 0; k < dc; k++)
                for (int d = 0; d < hd; d++)
                    copy_element(rowmajor + (((size_t)h * dc + k) * hd + d) * es, L->wuk, h * hd + d, k);
        mat_pack_blocks(wuk_t, rowmajor, H, dc, hd, c->dtype);
        L->wuk_t = (Mat){wuk_t, H * dc, hd, c->dtype};
        for (int r = 0; r < H * hd; r++)
            for (int k = 0; k < dc; k++) copy_element(rowmajor + ((size_t)r * dc + k) * es, L->wuv, r, k);
        mat_pack_blocks(wuv_heads, rowmajor, H, hd, dc, c->dtype);
        L->wuv_heads = (Mat){wuv_heads, H * hd, dc, c->dtype};
    }
    free(rowmajor);
    return 0;
}

/* Reading the weights tensor by tensor: each is read into `rowmajor`, checked, and packed
 * into the heap copy. The first failure stops the walk's work and keeps its message. */
typedef struct {
    int fd;
    const char *path;
    size_t offset; /* in the file, of the next tensor */
    char *dst;     /* in the heap copy */
    DType dt;
    char *rowmajor; /* (rowmajor_bytes) one tensor as the file holds it */
    size_t rowmajor_bytes;
    char *err;
    size_t errlen;
    int failed;
} PackCursor;

/* 2^64 / the golden ratio: consecutive counters land far apart */
#define GOLDEN 0x9E3779B97F4A7C15ull

/* bf16 of a finite float, rounded to nearest even (the exporter's rounding) */
static inline uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* Why a read_at of the checkpoint failed: an error, or the file ended first (it shrank
 * since its size was taken). Returns code with the message in err. */
static int read_failed(const char *path, int code, char *err, size_t errlen) {
    if (errno) return errmsg(err, errlen, code, "cannot read checkpoint %s: %s", msg_path(path).s, strerror(errno));
    return errmsg(err, errlen, code, "checkpoint %s shrank while it was being read (truncated?)", msg_path(path).s);
}

/* Visitor: the next tensor, read and checked or generated, goes packed into the heap copy. */
static void pack_tensor(void *ctx, const TensorRef *t) {
    PackCursor *cur = ctx;
    const size_t n = (size_t)t->rows * (size_t)t->cols, bytes = n * dtype_size(cur->dt);
    if (cur->failed) return;
    if (bytes > cur->rowmajor_bytes) {
        free(cur->rowmajor);
        cur->rowmajor_bytes = bytes;
        if (!(cur->rowmajor = malloc(bytes))) {
            cur->failed = errmsg(cur->err, cur->errlen, 1, "out of memory loading %s", msg_path(cur->path).s);
            return;
        }
    }
    if (read_at(cur->fd, cur->rowmajor, bytes, cur->offset) != 0) {
        cur->failed = read_failed(cur->path, 1, cur->err, cur->errlen);
        return;
    }
    const long bad = first_nonfinite(cur->rowmajor, n, cur->dt);
    if (bad >= 0) {
        const int row = (int)(bad / t->cols), col = (int)(bad % t->cols);
        const char *what = cur->dt == DTYPE_BF16 ? ((const uint16_t *)cur->rowmajor)[bad] & 0x7Fu ? "NaN" : "infinite"
                           : ((const uint32_t *)cur->rowmajor)[bad] & 0x7FFFFFu ? "NaN"
                                                                                : "infinite";
        if (t->layer >= 0)
            cur->failed = errmsg(cur->err, cur->errlen, 1, "checkpoint: weight [%d][%d] of %s in layer %d is %s", row,
                                 col, t->name, t->layer, what);
        else
            cur->failed =
                errmsg(cur->err, cur->errlen, 1, "checkpoint: weight [%d][%d] of %s is %s", row, col, t->name, what);
        return;
    }
    mat_pack(cur->dst, cur->rowmajor, t->rows, t->cols, cur->dt);
    *t->mat = (Mat){cur->dst, t->rows, t->cols, cur->dt};
    cur->offset += bytes;
    cur->dst += bytes;
}

/* Storage for the weights of m->cfg and its RoPE tables; 0 or -1 when out of memory. */
static int alloc_model(Model *m) {
    const Config *c = &m->cfg;
    /* a heap copy in the packed layout of kernels.h, on huge pages (page-cache mappings of a
     * file are never huge); exactly its size, so a read past the last tensor is a heap
     * overflow that ASan reports */
    m->weights = alloc_huge(model_param_count(c) * dtype_size(c->dtype));
    m->w.layers = calloc((size_t)c->n_layers, sizeof(LayerWeights));
    return m->weights && m->w.layers && rope_tables_init(&m->rope, c) == 0 ? 0 : -1;
}

/* ---- generated weights ---- */

/* The tensors of a generated model, each with its place in the heap copy, and the work of
 * filling them in items of at most GEN_BLOCK_ROWS rows. */
enum { GEN_BLOCK_ROWS = 64 };
typedef struct {
    TensorRef t;
    char *dst;   /* the packed tensor */
    long first;  /* its first item */
} GenTensor;
typedef struct {
    GenTensor *tensors;
    int n_tensors, max_cols;
    long n_items;
    uint64_t key;
    float scale;          /* of a centred sum of two bytes, -255..255 */
    char *scratch;        /* (threads, GEN_BLOCK_ROWS * max_cols) bf16 rows, one block a thread */
    char *next;           /* walk_generated: where the next tensor goes */
} Generator;

/* Visitor: the next tensor's place and items. */
static void place_tensor(void *ctx, const TensorRef *t) {
    Generator *g = ctx;
    GenTensor *gt = &g->tensors[g->n_tensors++];
    gt->t = *t;
    gt->dst = g->next;
    gt->first = g->n_items;
    g->n_items += (t->rows + GEN_BLOCK_ROWS - 1) / GEN_BLOCK_ROWS;
    if (t->cols > g->max_cols) g->max_cols = t->cols;
    g->next += (size_t)t->rows * (size_t)t->cols * sizeof(uint16_t);
    *t->mat = (Mat){gt->dst, t->rows, t->cols, DTYPE_BF16};
}

/* Element i's value from its 16 bits: two bytes whose centred sum is scaled (bf16). */
static inline uint16_t generated_value(unsigned bits, float scale) {
    return bf16_of((float)((int)(bits & 0xFF) + (int)(bits >> 8 & 0xFF) - 255) * scale);
}

/* Rows [r0, r1) of tensor `index`, row-major, into dst: a norm's gains are 1; a matrix's
 * element i (row-major in the tensor) takes 16 bits of mix64(key + tensor + i / 4), lane
 * i % 4, as two bytes whose centred sum is scaled. The values depend on the seed, the
 * tensor and the element only: not on the threads, the ISA or the packing. */
static void generate_rows(const Generator *g, int index, const TensorRef *t, int r0, int r1, uint16_t *dst) {
    const size_t i0 = (size_t)r0 * (size_t)t->cols, i1 = (size_t)r1 * (size_t)t->cols;
    if (t->rows == 1) { /* every vector of a model is a norm's gains */
        for (size_t i = i0; i < i1; i++) dst[i - i0] = 0x3F80; /* bf16 1.0 */
        return;
    }
    const uint64_t key = g->key + (uint64_t)index * 0xD1B54A32D192ED03ull;
    const float scale = g->scale;
    size_t i = i0;
    for (; i < i1 && (i & 3); i++) /* up to a whole quad */
        dst[i - i0] = generated_value((unsigned)(mix64(key + (i >> 2) * GOLDEN) >> (16 * (i & 3))), scale);
    uint16_t *out = dst + (i - i0);
    const size_t quads = (i1 - i) / 4, q0 = i >> 2;
    for (size_t q = 0; q < quads; q++) { /* the bulk, four values a hash, in a loop that vectorizes */
        const uint64_t h = mix64(key + (q0 + q) * GOLDEN);
        for (int lane = 0; lane < 4; lane++) out[4 * q + lane] = generated_value((unsigned)(h >> (16 * lane)), scale);
    }
    for (i += 4 * quads; i < i1; i++)
        dst[i - i0] = generated_value((unsigned)(mix64(key + (i >> 2) * GOLDEN) >> (16 * (i & 3))), scale);
}

/* One thread's share of the items: each block of rows generated into its scratch, then
 * packed into place by mat_pack_rows (model_load's mat_pack, a block at a time). */
static void generate_share(Generator *g, Worker *w) {
    uint16_t *rows = (uint16_t *)(g->scratch + (size_t)w->thread * GEN_BLOCK_ROWS * g->max_cols * sizeof(uint16_t));
    Share sh = share_begin(w, g->n_items, SHARE_SPLIT, PARALLEL_TAKE_OVER);
    int k = 0;
    for (long lo, hi; share_next(&sh, &lo, &hi);)
        for (long item = lo; item < hi; item++) {
            while (k > 0 && g->tensors[k].first > item) k--; /* items come in order within a run */
            while (k + 1 < g->n_tensors && g->tensors[k + 1].first <= item) k++;
            const GenTensor *gt = &g->tensors[k];
            const int r0 = (int)(item - gt->first) * GEN_BLOCK_ROWS,
                      r1 = r0 + GEN_BLOCK_ROWS < gt->t.rows ? r0 + GEN_BLOCK_ROWS : gt->t.rows;
            generate_rows(g, k, &gt->t, r0, r1, rows);
            mat_pack_rows(gt->dst, rows, gt->t.rows, gt->t.cols, DTYPE_BF16, r0, r1);
        }
    share_end(&sh);
}

static void generate_member(void *arg, Worker *w) {
    while (team_wait(w)) {
        generate_share(arg, w);
        team_barrier(w);
    }
}

/* The weights of m->cfg (bf16) generated from seed into m->weights, on the thread team;
 * 0, or -1 when out of memory. */
static int generate_weights(Model *m, uint64_t seed) {
    const Config *c = &m->cfg;
    Generator g = {.key = mix64(seed ^ 0x5348415045ull), .next = m->weights};
    /* triangular on -255..255 (two bytes summed, centred) has std sqrt(2 (256^2 - 1) / 12);
     * scaled to std 0.02, an ordinary initialization: RMSNorm's output has unit scale, so
     * projections and logits stay of order 0.02 * sqrt(width) */
    g.scale = 0.02f / sqrtf(2.0f * (256.0f * 256.0f - 1.0f) / 12.0f);
    int n_tensors = 0;
    model_walk_tensors(c, &m->w, count_tensors, &n_tensors);
    const int threads = threads_count();
    if (!(g.tensors = malloc((size_t)n_tensors * sizeof *g.tensors))) return -1;
    model_walk_tensors(c, &m->w, place_tensor, &g);
    g.scratch = malloc((size_t)threads * GEN_BLOCK_ROWS * (size_t)g.max_cols * sizeof(uint16_t));
    Team *team = g.scratch && threads > 1 ? team_open(threads, generate_member, &g) : NULL;
    if (!g.scratch || (threads > 1 && !team)) {
        free(g.scratch);
        free(g.tensors);
        return -1;
    }
    if (team) {
        Worker *lead = team_leader(team);
        team_post(team);
        generate_share(&g, lead);
        team_barrier(lead);
        team_close(team);
    } else {
        Worker alone = worker_alone();
        generate_share(&g, &alone);
    }
    free(g.scratch);
    free(g.tensors);
    return 0;
}

/* Reads and checks the header of an open checkpoint of `size` bytes into c, with its
 * sections' offsets; 0 or -1 with the message. */
static int read_header(int fd, const char *path, size_t size, Config *c, uint64_t *tok_off, uint64_t *tok_size,
                       uint64_t *w_off, char *err, size_t errlen) {
    unsigned char h[HEADER_SIZE];
    if (size < HEADER_SIZE)
        return errmsg(err, errlen, -1, "checkpoint %s is truncated: %zu bytes, shorter than the %d-byte header",
                      msg_path(path).s, size, HEADER_SIZE);
    if (read_at(fd, h, HEADER_SIZE, 0) != 0) return read_failed(path, -1, err, errlen);
    if (parse_header(c, h, err, errlen) != 0) return -1;
    *tok_off = rd_u64(h + 72), *tok_size = rd_u64(h + 80), *w_off = rd_u64(h + 88);
    const uint64_t w_size = rd_u64(h + 96);
    if (*tok_off < HEADER_SIZE || *tok_off > size || *tok_size == 0 || *tok_size > size - *tok_off)
        return errmsg(err, errlen, -1,
                      "checkpoint: the tokenizer (offset %llu, %llu bytes) lies outside the file (%zu bytes)",
                      (unsigned long long)*tok_off, (unsigned long long)*tok_size, size);
    if (*w_off % 64 != 0 || *w_off < *tok_off + *tok_size || *w_off > size || w_size != size - *w_off)
        return errmsg(err, errlen, -1,
                      "checkpoint: the weights (offset %llu, %llu bytes) do not end the %zu-byte file as they should "
                      "(truncated?)",
                      (unsigned long long)*w_off, (unsigned long long)w_size, size);
    const uint64_t expect = (uint64_t)model_param_count(c) * dtype_size(c->dtype);
    if (w_size != expect)
        return errmsg(err, errlen, -1, "checkpoint: weights hold %llu bytes but the dimensions imply %llu",
                      (unsigned long long)w_size, (unsigned long long)expect);
    return 0;
}

int checkpoint_open(Checkpoint *ck, const char *path, char *err, size_t errlen) {
    memset(ck, 0, sizeof *ck);
    ck->path = path;
    if ((ck->fd = open_regular(path, "checkpoint ", &ck->size, err, errlen)) < 0) return -1;
    if (read_header(ck->fd, path, ck->size, &ck->cfg, &ck->tok_off, &ck->tok_size, &ck->w_off, err, errlen) != 0) {
        checkpoint_close(ck);
        return -1;
    }
    return 0;
}

void checkpoint_close(Checkpoint *ck) {
    if (ck->fd >= 0) close(ck->fd);
    ck->fd = -1;
}

int model_read_config(Config *c, const char *path, char *err, size_t errlen) {
    Checkpoint ck;
    memset(c, 0, sizeof *c);
    if (checkpoint_open(&ck, path, err, errlen) != 0) return -1;
    *c = ck.cfg;
    checkpoint_close(&ck);
    return 0;
}

SpmTokenizer *checkpoint_tokenizer(const Checkpoint *ck, char *err, size_t errlen) {
    const Config *c = &ck->cfg;
    char *bytes = malloc((size_t)ck->tok_size ? (size_t)ck->tok_size : 1), why[256];
    if (!bytes) {
        errmsg(err, errlen, -1, "out of memory loading %s", msg_path(ck->path).s);
        return NULL;
    }
    if (read_at(ck->fd, bytes, (size_t)ck->tok_size, (size_t)ck->tok_off) != 0) {
        read_failed(ck->path, -1, err, errlen);
        free(bytes);
        return NULL;
    }
    SpmTokenizer *t = spm_load_bytes(bytes, (size_t)ck->tok_size, why, sizeof why);
    free(bytes);
    if (!t) {
        errmsg(err, errlen, -1, "checkpoint: the embedded tokenizer: %s", why);
        return NULL;
    }
    if (spm_vocab_size(t) != c->vocab_size || spm_bos_id(t) != c->bos_id || spm_eos_id(t) != c->eos_id) {
        errmsg(err, errlen, -1,
               "checkpoint: the embedded tokenizer (%d pieces, bos %d, eos %d) does not match the model (%d, bos %d, "
               "eos %d)",
               spm_vocab_size(t), spm_bos_id(t), spm_eos_id(t), c->vocab_size, c->bos_id, c->eos_id);
        spm_free(t);
        return NULL;
    }
    return t;
}

/* The file is read with pread, never mapped: a mapped file that shrinks under the reader
 * kills it with SIGBUS, while a read just comes up short. */
int checkpoint_load(Model *m, const Checkpoint *ck, int ctx, char *err, size_t errlen) {
    memset(m, 0, sizeof *m);
    const char *path = ck->path;
    PackCursor cur = {.fd = ck->fd, .path = path, .err = err, .errlen = errlen};
    Config *c = &m->cfg;
    *c = ck->cfg;
    if (ctx < 0 || ctx > c->max_seq_len) {
        errmsg(err, errlen, -1, "a context of %d is more than the %d positions %s was trained for", ctx,
               c->max_seq_len, msg_path(path).s);
        goto bad;
    }
    if (ctx > 0) c->max_seq_len = ctx;

    if (!(m->tokenizer = checkpoint_tokenizer(ck, err, errlen))) goto bad;
    if (alloc_model(m) != 0) goto out_of_memory;
    cur.offset = (size_t)ck->w_off;
    cur.dst = m->weights;
    cur.dt = c->dtype;
    model_walk_tensors(c, &m->w, pack_tensor, &cur);
    free(cur.rowmajor);
    cur.rowmajor = NULL;
    if (cur.failed) goto bad;
    if (c->variant == VARIANT_MLA && derive_absorbed(m) != 0) goto out_of_memory;
    return 0;
out_of_memory:
    errmsg(err, errlen, -1, "out of memory loading %s", msg_path(path).s);
bad:
    free(cur.rowmajor);
    model_free(m);
    return -1;
}

int model_load_with_context(Model *m, const char *path, int ctx, char *err, size_t errlen) {
    Checkpoint ck;
    memset(m, 0, sizeof *m);
    if (checkpoint_open(&ck, path, err, errlen) != 0) return -1;
    const int rc = checkpoint_load(m, &ck, ctx, err, errlen);
    checkpoint_close(&ck);
    return rc;
}

int model_load(Model *m, const char *path, char *err, size_t errlen) {
    return model_load_with_context(m, path, 0, err, errlen);
}

int model_generate(Model *m, const Config *c, uint64_t seed, char *err, size_t errlen) {
    memset(m, 0, sizeof *m);
    m->cfg = *c;
    if (c->dtype != DTYPE_BF16) return errmsg(err, errlen, -1, "generated weights are bf16 only");
    if (config_check(c, "--shape", err, errlen) != 0) return -1;
    if (alloc_model(m) != 0 || generate_weights(m, seed) != 0 ||
        (c->variant == VARIANT_MLA && derive_absorbed(m) != 0)) {
        model_free(m);
        return errmsg(err, errlen, -1, "out of memory generating the weights (or no thread could be started)");
    }
    return 0;
}

size_t model_bytes_for(const Config *c) {
    const size_t es = dtype_size(c->dtype);
    size_t bytes = model_param_count(c) * es;
    if (c->variant == VARIANT_MLA) bytes += 2 * (size_t)c->n_layers * c->n_heads * c->kv_latent * c->head_dim * es;
    bytes += 2 * (size_t)c->max_seq_len * (size_t)(config_rope_width(c) / 2) * sizeof(float);
    return bytes;
}

void model_free(Model *m) {
    spm_free(m->tokenizer);
    free(m->w.layers);
    rope_tables_free(&m->rope);
    free(m->derived);
    free(m->weights);
    memset(m, 0, sizeof *m);
}
