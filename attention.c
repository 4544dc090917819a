/* attention.c: the attention variants (attention.h).
 *
 * Layout: RoPE; the specification of one query per variant (plain loops); then the
 * fast path, whose per-query arithmetic (scores, softmax, mix) is kept apart from the
 * scheduling that shares the queries among the threads. */
#include "attention.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- RoPE ---- */

int rope_tables_init(RopeTables *r, const Config *c) {
    const int width = config_rope_width(c), half = width / 2;
    const size_t n = (size_t)c->max_seq_len * (size_t)half;
    r->cos = malloc(n * sizeof(float));
    r->sin = malloc(n * sizeof(float));
    if (!r->cos || !r->sin) {
        rope_tables_free(r);
        return -1;
    }
    for (int pos = 0; pos < c->max_seq_len; pos++)
        for (int i = 0; i < half; i++) {
            double freq = pow((double)c->rope_theta, -2.0 * i / width);
            r->cos[(size_t)pos * half + i] = (float)cos(pos * freq);
            r->sin[(size_t)pos * half + i] = (float)sin(pos * freq);
        }
    return 0;
}

void rope_tables_free(RopeTables *r) {
    free(r->cos);
    free(r->sin);
    r->cos = r->sin = NULL;
}

void rope(const RopeTables *r, const Config *c, float *v, int pos) {
    const int half = config_rope_width(c) / 2;
    const float *cs = r->cos + (size_t)pos * half, *sn = r->sin + (size_t)pos * half;
    for (int i = 0; i < half; i++) {
        float v0 = v[2 * i], v1 = v[2 * i + 1];
        v[2 * i] = v0 * cs[i] - v1 * sn[i];
        v[2 * i + 1] = v0 * sn[i] + v1 * cs[i];
    }
}

/* Scores are scaled by 1/sqrt(width of a query head): head_dim, or MLA's head_dim + rope_dim. */
static float score_scale(const Config *c) { return 1.0f / sqrtf((float)config_query_width(c)); }

/* Query head h reads KV head h / (n_heads / n_kv_heads). */
static int kv_group_size(const Config *c) { return c->n_heads / c->n_kv_heads; }
static int kv_head_of(const Config *c, int h) { return h / kv_group_size(c); }

/* Where a query at pos stands for RoPE: its position, or with a window its place in it. */
static int query_place(const KVCache *c, int pos) {
    return kv_rotates_by_place(c->pool) ? kv_keys_seen(c, pos) - 1 : pos;
}

/* The rows a query at pos reads (KV head row `row` of layer l, oldest first) into dst as
 * floats, one row of row_width after another: dequantized and, with a window, whose keys
 * are stored before RoPE, the rotated part (from element rope_at; -1: none) turned by
 * each row's place. int4, int2: pos's own block in fp32, from `own` (its first row; NULL:
 * the cache's tail). Returns how many. */
static int gather_rows(const Layer *L, const KVCache *c, int row, int pos, int rope_at, const float *own, float *dst) {
    const KVPool *p = c->pool;
    const int n = kv_keys_seen(c, pos), w = p->row_width;
    for (int i = 0; i < n; i++) {
        float *r = dst + (size_t)i * w;
        if (!dtype_packed(p->dtype))
            kv_load(p, kv_row_in_slot(c, L->index, row, kv_kept_slot(c, pos, i)), r);
        else if (i / KV_BLOCK_TOKENS < pos / KV_BLOCK_TOKENS)
            block_dequantize_row(r, kv_row(c, L->index, row, i).data, i % KV_BLOCK_TOKENS, w, p->dtype,
                                 kv_per_channel(p, row));
        else
            memcpy(r, own ? own + (size_t)(i % KV_BLOCK_TOKENS) * w : kv_tail_row(c, L->index, row, i),
                   (size_t)w * sizeof(float));
        if (kv_rotates_by_place(p) && rope_at >= 0) rope(L->rope, L->cfg, r + rope_at, i);
    }
    return n;
}

/* ---- the specification: one query, plainly ---- */

/* out[d] = sum_j p[j] rows[j][d], j < n, in weighted_sum_rows' order (kernels.h): the
 * even j and the odd j in two ascending chains, then their sum. */
static void mix_reference(float *out, const float *p, int n, const float *rows, size_t stride, int width) {
    for (int d = 0; d < width; d++) {
        float even = 0.0f, odd = 0.0f;
        for (int j = 0; j < n; j++) {
            if (j % 2 == 0)
                even = fmaf(p[j], rows[(size_t)j * stride + d], even);
            else
                odd = fmaf(p[j], rows[(size_t)j * stride + d], odd);
        }
        out[d] = even + odd;
    }
}

/* y[i] = (row r0 + i of W) . x for i < n: each output one canonical dot, as matmul computes it */
static void matvec_reference(float *y, Mat w, int r0, int n, const float *x) {
    float row[w.cols];
    for (int i = 0; i < n; i++) {
        mat_row_f32(row, w, r0 + i);
        y[i] = dot(row, x, w.cols);
    }
}

/* out = sum_j softmax(scores)_j rows[j] over n keys, in chunks of ATTN_CHUNK_KEYS: each
 * chunk's softmax and weighted sum, merged into the chunks before it in order. scores
 * become each chunk's probabilities. */
static void attend_reference(float *out, float *scores, int n, const float *rows, size_t stride, int width) {
    float chunk_out[width], max = 0.0f, sum = 0.0f;
    for (int j0 = 0; j0 < n; j0 += ATTN_CHUNK_KEYS) {
        const int keys = n - j0 < ATTN_CHUNK_KEYS ? n - j0 : ATTN_CHUNK_KEYS;
        float chunk_max, chunk_sum;
        softmax_stats(scores + j0, keys, &chunk_max, &chunk_sum);
        mix_reference(j0 == 0 ? out : chunk_out, scores + j0, keys, rows + (size_t)j0 * stride, stride, width);
        if (j0 == 0)
            max = chunk_max, sum = chunk_sum;
        else
            softmax_merge(out, &max, &sum, chunk_out, chunk_max, chunk_sum, width);
    }
}

/* MHA, GQA, MQA: score_j = q . k_j / sqrt(d); p = softmax(scores); out = sum_j p_j v_j. */
static int kv_heads_query_reference(const Layer *L, const KVCache *cache, int h, const float *q, int pos, float *out) {
    const Config *c = L->cfg;
    const int g = kv_head_of(c, h), hd = c->head_dim, Hkv = c->n_kv_heads, most = kv_keys_seen(cache, pos);
    float *keys = malloc((size_t)most * (2 * hd + 1) * sizeof(float)); /* keys, values, scores */
    if (!keys) return -1;
    const int n = gather_rows(L, cache, g, pos, 0, NULL, keys);
    float *values = keys + (size_t)n * hd, *p = values + (size_t)n * hd;
    gather_rows(L, cache, Hkv + g, pos, -1, NULL, values);
    for (int j = 0; j < n; j++) p[j] = dot(q, keys + (size_t)j * hd, hd) * score_scale(c);
    attend_reference(out, p, n, values, (size_t)hd, hd);
    free(keys);
    return 0;
}

/* MLA, expanded: head h's key of position j is [W_UK,h c_j ; k_R,j], its value W_UV,h c_j. */
static int mla_expanded_query_reference(const Layer *L, const KVCache *cache, int h, const float *q, int pos,
                                        float *out) {
    const Config *c = L->cfg;
    const LayerWeights *w = L->w;
    const int hd = c->head_dim, dc = c->kv_latent, rd = c->rope_dim, lw = dc + rd, most = kv_keys_seen(cache, pos);
    float *latents = malloc((size_t)most * (lw + hd + 1) * sizeof(float)); /* latents, values, scores */
    if (!latents) return -1;
    const int n = gather_rows(L, cache, 0, pos, dc, NULL, latents);
    float *values = latents + (size_t)n * lw, *p = values + (size_t)n * hd;
    float key[hd];
    for (int j = 0; j < n; j++) {
        const float *latent = latents + (size_t)j * lw, *k_rope = latent + dc;
        matvec_reference(key, w->wuk, h * hd, hd, latent);                     /* k_C,j = W_UK,h c_j */
        matvec_reference(values + (size_t)j * hd, w->wuv, h * hd, hd, latent); /* v_j = W_UV,h c_j */
        p[j] = dot_cat(q, key, hd, q + hd, k_rope, rd) * score_scale(c);       /* [q_C ; q_R] . [k_C ; k_R] */
    }
    attend_reference(out, p, n, values, (size_t)hd, hd);
    free(latents);
    return 0;
}

/* MLA, absorbed: q_lat = W_UK,h^T q_C; score_j = [q_lat ; q_R] . [c_j ; k_R,j];
 * out = W_UV,h (sum_j p_j c_j). Cached latents are never expanded. */
static int mla_absorbed_query_reference(const Layer *L, const KVCache *cache, int h, const float *q, int pos,
                                        float *out) {
    const Config *c = L->cfg;
    const LayerWeights *w = L->w;
    const int hd = c->head_dim, dc = c->kv_latent, rd = c->rope_dim, lw = dc + rd, most = kv_keys_seen(cache, pos);
    float q_abs[lw], ctx_lat[dc];
    float *latents = malloc((size_t)most * (lw + 1) * sizeof(float)); /* latents, scores */
    if (!latents) return -1;
    const int n = gather_rows(L, cache, 0, pos, dc, NULL, latents);
    float *p = latents + (size_t)n * lw;
    matvec_reference(q_abs, mat_block(w->wuk_t, h, dc), 0, dc, q); /* q_lat = W_UK,h^T q_C */
    memcpy(q_abs + dc, q + hd, (size_t)rd * sizeof(float));        /* q_R */
    for (int j = 0; j < n; j++) p[j] = dot(q_abs, latents + (size_t)j * lw, lw) * score_scale(c);
    attend_reference(ctx_lat, p, n, latents, (size_t)lw, dc); /* sum_j p_j c_j */
    matvec_reference(out, mat_block(w->wuv_heads, h, hd), 0, hd, ctx_lat);
    free(latents);
    return 0;
}

int attention_query_reference(const Layer *L, const KVCache *cache, int head, const float *q, int pos, MlaForm form,
                              float *out) {
    if (L->cfg->variant != VARIANT_MLA) return kv_heads_query_reference(L, cache, head, q, pos, out);
    if (form == MLA_ABSORBED) return mla_absorbed_query_reference(L, cache, head, q, pos, out);
    return mla_expanded_query_reference(L, cache, head, q, pos, out);
}

/* ---- the record of attention weights (--dump-attn) ---- */

void attn_record_clear(AttnRecord *r) {
    r->n_entries = r->finished = 0;
    r->n_probs = 0;
    r->active = 0;
}

void attn_record_free(AttnRecord *r) {
    free(r->entries);
    free(r->probs);
    free(r->slot);
    r->entries = NULL, r->probs = NULL, r->slot = NULL;
    r->cap_entries = 0, r->cap_probs = r->cap_slot = 0;
    attn_record_clear(r);
}

/* Grows *p (elements of `size` bytes, *cap of them) to hold at least n. */
static int grow(void **p, size_t *cap, size_t n, size_t size) {
    if (n <= *cap) return 0;
    size_t want = *cap ? *cap : 64;
    while (want < n) want *= 2;
    void *q = realloc(*p, want * size);
    if (!q) return -1;
    *p = q;
    *cap = want;
    return 0;
}

int attn_record_plan(AttnRecord *r, const Config *c, const TokenSlots *slots, const int *sequence) {
    const int H = c->n_heads, T = slots->T;
    r->active = 0;
    r->T = T;
    if (!sequence) return 0;
    if (grow((void **)&r->slot, &r->cap_slot, (size_t)c->n_layers * T * H, sizeof *r->slot) != 0) return -1;
    for (int l = 0; l < c->n_layers; l++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < H; h++) {
                int *slot = &r->slot[((size_t)l * T + t) * H + h];
                *slot = -1;
                if (sequence[t] < 0 || (r->layers && !r->layers[l]) || (r->heads && !r->heads[h])) continue;
                const int n_keys = kv_keys_seen(slots->cache[t], slots->pos[t]);
                const int n_chunks = (n_keys + ATTN_CHUNK_KEYS - 1) / ATTN_CHUNK_KEYS;
                size_t cap_entries = (size_t)r->cap_entries;
                if (grow((void **)&r->entries, &cap_entries, (size_t)r->n_entries + 1, sizeof *r->entries) != 0 ||
                    grow((void **)&r->probs, &r->cap_probs, r->n_probs + (size_t)n_keys + 2 * (size_t)n_chunks,
                         sizeof *r->probs) != 0)
                    return -1;
                r->cap_entries = (int)cap_entries;
                r->entries[r->n_entries] = (AttnRecordEntry){sequence[t], l, h, slots->pos[t], n_keys, r->n_probs};
                r->n_probs += (size_t)n_keys + 2 * (size_t)n_chunks;
                *slot = r->n_entries++;
                r->active = 1;
            }
    return 0;
}

void attn_record_finish(AttnRecord *r) {
    for (int e = r->finished; e < r->n_entries; e++) {
        const AttnRecordEntry *en = &r->entries[e];
        const int n_chunks = (en->n_keys + ATTN_CHUNK_KEYS - 1) / ATTN_CHUNK_KEYS;
        if (n_chunks == 1) continue;
        float *p = r->probs + en->offset;
        const float *stats = p + en->n_keys; /* (n_chunks, 2): max, sum */
        double top = stats[0], total = 0.0;
        for (int k = 1; k < n_chunks; k++) top = stats[2 * k] > top ? stats[2 * k] : top;
        for (int k = 0; k < n_chunks; k++) total += stats[2 * k + 1] * exp(stats[2 * k] - top);
        for (int k = 0; k < n_chunks; k++) {
            const double weight = stats[2 * k + 1] * exp(stats[2 * k] - top) / total;
            const int j1 = (k + 1) * ATTN_CHUNK_KEYS < en->n_keys ? (k + 1) * ATTN_CHUNK_KEYS : en->n_keys;
            for (int j = k * ATTN_CHUNK_KEYS; j < j1; j++) p[j] = (float)(p[j] * weight);
        }
    }
    r->finished = r->n_entries;
}

/* ---- the fast path ---- */

/* Row stride of k_exp and v_exp: n_heads*head_dim and 16 floats more. A head reads its
 * slice of every row; at a power-of-two stride those slices would all fall in the same few L1
 * sets and evict each other before the next query reads them again. */
static int mla_exp_stride(const Config *c) { return c->n_heads * c->head_dim + 16; }

/* n floats, 64-byte aligned, left untouched: scratch sized by the context, whose pages a
 * run only pays for as far as its sequences reach. NULL when out of memory. */
static float *alloc_floats_lazy(size_t n) {
    void *p = NULL;
    return posix_memalign(&p, 64, n * sizeof(float)) == 0 ? p : NULL;
}

int attn_scratch_init(AttnScratch *a, const Config *c, int max_tokens, int max_keys) {
    memset(a, 0, sizeof *a);
    a->max_keys = max_keys;
    a->max_chunks = (max_keys + ATTN_CHUNK_KEYS - 1) / ATTN_CHUNK_KEYS;
    const int chunk = max_keys < ATTN_CHUNK_KEYS ? max_keys : ATTN_CHUNK_KEYS;
    const size_t T = (size_t)max_tokens, H = (size_t)c->n_heads, hd = (size_t)c->head_dim;
    const size_t kv = (size_t)c->n_kv_heads * hd, dc = (size_t)c->kv_latent, rd = (size_t)c->rope_dim;
    const size_t expanded = dc ? (size_t)max_keys * (size_t)mla_exp_stride(c) : 0;
    const size_t threads = TEAM_MAX_THREADS, heads_an_item = H < ATTN_MAX_HEADS_PER_ITEM ? H : ATTN_MAX_HEADS_PER_ITEM;
    const size_t split_partials = a->max_chunks > 1 ? (size_t)ATTN_SPLIT_TOKENS * H * (size_t)a->max_chunks : 0;
    a->partial_width = (int)(dc > hd ? dc : hd);
    a->scores_stride = ((size_t)chunk + 15) / 16 * 16;
    a->scores_per_item = heads_an_item * a->scores_stride;
    a->blocks_per_row = kv_blocks_for(chunk);
    struct {
        float **p;
        size_t n;
        int lazy;
    } bufs[] = {
        {&a->q, T * H * (size_t)config_query_width(c), 0},
        {&a->k, T * kv, 0},
        {&a->v, T * kv, 0},
        {&a->latent, T * dc, 0},
        {&a->k_rope, T * rd, 0},
        {&a->rows, T * (dc + rd), 0},
        {&a->q_abs, T * H * (dc + rd), 0},
        {&a->ctx_lat, T * H * dc, 0},
        {&a->latents, dc ? (size_t)max_keys * (dc + rd) : 0, 1},
        {&a->k_exp, expanded, 1},
        {&a->v_exp, expanded, 1},
        {&a->window_rows, 2 * (size_t)max_keys * kv, 1},
        {&a->open, (size_t)KV_BLOCK_TOKENS * T * (dc ? dc + rd : 2 * kv), 1},
        {&a->scores, threads * 2 * a->scores_per_item, 1},
        {&a->chunk_out, a->max_chunks > 1 ? threads * heads_an_item * (size_t)a->partial_width : 0, 1},
        {&a->partials, split_partials * (size_t)a->partial_width, 1},
        {&a->partial_stats, split_partials * 2, 1},
    };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        if (bufs[i].n == 0) continue;
        if (!(*bufs[i].p = bufs[i].lazy ? alloc_floats_lazy(bufs[i].n) : alloc_floats_touched(bufs[i].n))) {
            attn_scratch_free(a);
            return -1;
        }
    }
    const size_t whole_items = H * T, split_items = split_partials;
    a->max_items = (int)(whole_items > split_items ? whole_items : split_items);
    a->items = malloc(3 * (size_t)a->max_items * sizeof(int));
    a->heads_an_item = (int)heads_an_item;
    a->row_blocks = malloc(threads * (size_t)a->blocks_per_row * heads_an_item * sizeof *a->row_blocks);
    a->row_scales = malloc(threads * (size_t)a->blocks_per_row * heads_an_item * sizeof *a->row_scales);
    a->open_rows = (size_t)KV_BLOCK_TOKENS * T; /* a sequence's tail adds at most 15 rows to its >= 1 tokens */
    a->open_at = malloc(2 * T * sizeof(int));
    a->open_end = a->open_at + T;
    if (!a->items || !a->row_blocks || !a->row_scales || !a->open_at) {
        attn_scratch_free(a);
        return -1;
    }
    return 0;
}

void attn_scratch_free(AttnScratch *a) {
    float *bufs[] = {a->q,      a->k,         a->v,        a->latent,        a->k_rope, a->rows,
                     a->q_abs,  a->ctx_lat,   a->latents,  a->k_exp,         a->v_exp,  a->window_rows,
                     a->scores, a->chunk_out, a->partials, a->partial_stats, a->open};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    free(a->items);
    free(a->row_blocks);
    free(a->row_scales);
    free(a->open_at);
    memset(a, 0, sizeof *a);
}

/* One layer's attention over the tokens of a pass, as one thread of the team runs it:
 * what every stage below reads. */
typedef struct {
    const Layer *L;
    AttnScratch *a;
    const TokenSlots *slots;
    float *heads;
    float scale;
    int windowed;  /* the keys and values were gathered into a->window_rows / a->latents */
    int out_width; /* floats of a head's weighted sum: head_dim, or kv_latent for absorbed MLA */
    MlaForm form;
    Worker *wk;
} AttnPass;

/* How many keys token t of the pass attends to (kvcache.h's kv_keys_seen). */
static int keys_of(const AttnPass *p, int t) { return kv_keys_seen(p->slots->cache[t], p->slots->pos[t]); }

/* How many chunks of ATTN_CHUNK_KEYS they make, and the keys of chunk k. */
static int chunks_of(const AttnPass *p, int t) { return (keys_of(p, t) + ATTN_CHUNK_KEYS - 1) / ATTN_CHUNK_KEYS; }
static int chunk_keys(const AttnPass *p, int t, int k) {
    const int rest = keys_of(p, t) - k * ATTN_CHUNK_KEYS;
    return rest < ATTN_CHUNK_KEYS ? rest : ATTN_CHUNK_KEYS;
}

/* Row `row` of the gathered copy, laid out as the pool's rows: each KV head's keys, then its values. */
static const float *window_head(const AttnPass *p, int row) {
    return p->a->window_rows + (size_t)row * p->a->max_keys * p->L->cfg->head_dim;
}

/* The end of the run of tokens in [t0, t1) that belong to t0's sequence. */
static int sequence_end(const TokenSlots *slots, int t0, int t1) {
    int end = t0 + 1;
    while (end < t1 && slots->cache[end] == slots->cache[t0]) end++;
    return end;
}

/* -- int4, int2 (kvcache.h): a pass's rows stay fp32 in a->open while its queries read
 * them; a block is quantized from them once its 16th row is written -- */

static int packed(const AttnPass *p) { return dtype_packed(p->slots->cache[0]->pool->dtype); }

/* Position pos's row in row group `row` of a->open, pos in token t's sequence's open rows. */
static float *open_row(const AttnPass *p, int row, int t, int pos) {
    const size_t at = (size_t)(p->a->open_at[t] - (p->slots->pos[t] - pos));
    return p->a->open + ((size_t)row * p->a->open_rows + at) * p->slots->cache[t]->pool->row_width;
}

/* Where each token's rows go in a->open: a sequence's rows start at its first block's
 * start (thread 0; the next shared operation waits for it). */
static void open_layout(const AttnPass *p) {
    if (!team_alone(p->wk)) return;
    const TokenSlots *s = p->slots;
    int at = 0;
    for (int t0 = 0, t1; t0 < s->T; t0 = t1) {
        t1 = sequence_end(s, t0, s->T);
        const int first = s->pos[t0] / KV_BLOCK_TOKENS * KV_BLOCK_TOKENS, end = s->pos[t1 - 1] + 1;
        for (int t = t0; t < t1; t++) p->a->open_at[t] = at + s->pos[t] - first, p->a->open_end[t] = end;
        at += end - first;
    }
}

/* Token t's row of row group `row` into a->open; a sequence's first token also brings the
 * earlier rows of its block from the cache's tail. */
static void open_store(const AttnPass *p, int t, int row, const float *src) {
    const KVCache *cache = p->slots->cache[t];
    const int pos = p->slots->pos[t];
    const size_t bytes = (size_t)cache->pool->row_width * sizeof(float);
    memcpy(open_row(p, row, t, pos), src, bytes);
    if (t == 0 || p->slots->cache[t - 1] != cache)
        for (int q = pos / KV_BLOCK_TOKENS * KV_BLOCK_TOKENS; q < pos; q++)
            memcpy(open_row(p, row, t, q), kv_tail_row(cache, p->L->index, row, q), bytes);
}

/* After every row of the pass is open: the tail keeps a sequence's last rows, and
 * the block whose last row token t wrote is quantized, a pure function of its 16 rows. */
static void open_close(const AttnPass *p, int t, int row) {
    const KVCache *cache = p->slots->cache[t];
    const int pos = p->slots->pos[t], w = cache->pool->row_width;
    if (pos >= p->a->open_end[t] - cache->pool->tail_positions)
        memcpy(kv_tail_row(cache, p->L->index, row, pos), open_row(p, row, t, pos), (size_t)w * sizeof(float));
    if (pos % KV_BLOCK_TOKENS == KV_BLOCK_TOKENS - 1)
        kv_store_block(cache, p->L->index, row, pos, open_row(p, row, t, pos - (KV_BLOCK_TOKENS - 1)), (size_t)w);
}

/* The end of the run of tokens in [t0, t1) whose positions share t0's block. */
static int block_end(const TokenSlots *slots, int t0, int t1) {
    int end = t0 + 1;
    while (end < t1 && slots->pos[end] / KV_BLOCK_TOKENS == slots->pos[t0] / KV_BLOCK_TOKENS) end++;
    return end;
}

/* Whether token t is the only one of its sequence in the pass (a decode step): then no
 * other query reads its rows. */
static int alone_in_sequence(const TokenSlots *slots, int t) {
    return (t == 0 || slots->cache[t - 1] != slots->cache[t]) &&
           (t + 1 == slots->T || slots->cache[t + 1] != slots->cache[t]);
}

/* Token t's keys of chunk k in row groups row .. row+groups-1 of the pass's layer, block by
 * block, listed in thread `thread`'s tables, a group's after the one before: from the cache's
 * blocks, or with a window from the copies gathered at `gathered` (`stride` floats a row,
 * group g's at gathered + g * group_stride), as blocks of KV_BLOCK_TOKENS rows. */
static RowBlocks item_rows(const AttnPass *p, int thread, int t, int k, int row, int groups, const float *gathered,
                           size_t stride, size_t group_stride) {
    const int first = k * ATTN_CHUNK_KEYS / KV_BLOCK_TOKENS, n = kv_blocks_for(chunk_keys(p, t, k));
    const size_t table = (size_t)thread * p->a->blocks_per_row * p->a->heads_an_item;
    const void **blocks = p->a->row_blocks + table;
    if (p->windowed) {
        for (int g = 0; g < groups; g++)
            for (int b = 0; b < n; b++)
                blocks[g * n + b] = gathered + g * group_stride + (size_t)(first + b) * KV_BLOCK_TOKENS * stride;
        return (RowBlocks){blocks, NULL, KV_BLOCK_TOKENS, stride, DTYPE_F32, 0, 0, 0, 0, groups, 0};
    }
    const KVCache *cache = p->slots->cache[t];
    const KVPool *pool = cache->pool;
    const float **scales = p->a->row_scales + table;
    const int own = dtype_packed(pool->dtype) ? p->slots->pos[t] / KV_BLOCK_TOKENS : -1; /* read in fp32 */
    for (int g = 0; g < groups; g++)
        for (int b = 0; b < n; b++) {
            const KVRow row_start = kv_row(cache, p->L->index, row + g, (first + b) * KV_BLOCK_TOKENS);
            blocks[g * n + b] = first + b == own ? open_row(p, row + g, t, own * KV_BLOCK_TOKENS) : row_start.data;
            scales[g * n + b] = row_start.scales;
        }
    return (RowBlocks){blocks,
                       scales,
                       KV_BLOCK_TOKENS,
                       (size_t)pool->row_width,
                       pool->dtype,
                       pool->n_scales,
                       pool->split,
                       own >= 0 && kv_per_channel(pool, row),
                       first + n - 1 == own,
                       groups,
                       alone_in_sequence(p->slots, t)};
}

/* -- the arithmetic of one chunk of an item, token t's heads h0 .. h0+nh-1 over chunk k of
 * its keys (the heads read the same rows): their scores into att (one row of
 * scores_stride a head), then the mix of the probabilities softmax made of them into out
 * (head h at out + (h - h0) * out_width) -- */

/* The rows of heads h0 .. h0+nh-1 from KV head row `row` on (the keys of a KV head, or
 * n_kv_heads rows on, its values): one row group, or one a KV head when they span several. */
static RowBlocks kv_head_rows(const AttnPass *p, int thread, int t, int k, int row, int nh) {
    const Config *c = p->L->cfg;
    const int groups = nh > kv_group_size(c) ? nh / kv_group_size(c) : 1;
    return item_rows(p, thread, t, k, row, groups, window_head(p, row), (size_t)c->head_dim,
                     (size_t)p->a->max_keys * c->head_dim);
}

static void kv_heads_scores(const AttnPass *p, int h0, int nh, int t, int k, int thread, float *att) {
    const Config *c = p->L->cfg;
    const int hd = c->head_dim;
    const float *q = p->a->q + ((size_t)t * c->n_heads + h0) * hd; /* (nh, hd), rotated */
    dot_row_blocks(att, p->a->scores_stride, q, (size_t)hd, nh, kv_head_rows(p, thread, t, k, kv_head_of(c, h0), nh),
                   chunk_keys(p, t, k), hd, p->scale);
}

static void kv_heads_mix(const AttnPass *p, int h0, int nh, int t, int k, int thread, const float *att, float *out) {
    const Config *c = p->L->cfg;
    const int hd = c->head_dim;
    weighted_sum_row_blocks(out, (size_t)hd, att, p->a->scores_stride, nh,
                            kv_head_rows(p, thread, t, k, c->n_kv_heads + kv_head_of(c, h0), nh), chunk_keys(p, t, k),
                            hd);
}

/* The expanded form reads one sequence's latents, gathered into a->latents, and its keys
 * and values expanded from them into a->k_exp and a->v_exp: each head its own rows. */
static void mla_expanded_scores(const AttnPass *p, int h0, int nh, int t, int k, float *att) {
    const Config *c = p->L->cfg;
    const int hd = c->head_dim, rd = c->rope_dim, dc = c->kv_latent, j0 = k * ATTN_CHUNK_KEYS;
    const size_t es = (size_t)mla_exp_stride(c), lw = (size_t)(dc + rd);
    for (int h = h0; h < h0 + nh; h++) {
        const float *q = p->a->q + ((size_t)t * c->n_heads + h) * (hd + rd); /* [q_C ; q_R] */
        dot_rows_cat(att + (size_t)(h - h0) * p->a->scores_stride, chunk_keys(p, t, k), p->scale, q,
                     p->a->k_exp + j0 * es + (size_t)h * hd, es, hd, q + hd, p->a->latents + j0 * lw + dc, lw, rd);
    }
}

static void mla_expanded_mix(const AttnPass *p, int h0, int nh, int t, int k, const float *att, float *out) {
    const Config *c = p->L->cfg;
    const int hd = c->head_dim;
    const size_t es = (size_t)mla_exp_stride(c);
    for (int h = h0; h < h0 + nh; h++)
        weighted_sum_rows(out + (size_t)(h - h0) * hd, att + (size_t)(h - h0) * p->a->scores_stride,
                          p->a->v_exp + (size_t)k * ATTN_CHUNK_KEYS * es + (size_t)h * hd, es, chunk_keys(p, t, k), hd);
}

/* MLA, absorbed: the queries were taken into the latent space beforehand (mla_absorb_queries)
 * and the weighted latents are taken out after every item (mla_expand_contexts), each as one
 * product per head over the pass's tokens, so an item reads only the latents. */
static RowBlocks latent_rows(const AttnPass *p, int thread, int t, int k) {
    return item_rows(p, thread, t, k, 0, 1, p->a->latents, (size_t)(p->L->cfg->kv_latent + p->L->cfg->rope_dim), 0);
}

static void mla_absorbed_scores(const AttnPass *p, int h0, int nh, int t, int k, int thread, float *att) {
    const Config *c = p->L->cfg;
    const int lw = c->kv_latent + c->rope_dim;
    const float *q_abs = p->a->q_abs + ((size_t)t * c->n_heads + h0) * lw; /* (nh, lw): [q_lat ; q_R] */
    dot_row_blocks(att, p->a->scores_stride, q_abs, (size_t)lw, nh, latent_rows(p, thread, t, k), chunk_keys(p, t, k),
                   lw, p->scale);
}

static void mla_absorbed_mix(const AttnPass *p, int nh, int t, int k, int thread, const float *att, float *out) {
    const int dc = p->L->cfg->kv_latent; /* out: (nh, dc), sum_j p_j c_j */
    weighted_sum_row_blocks(out, (size_t)dc, att, p->a->scores_stride, nh, latent_rows(p, thread, t, k),
                            chunk_keys(p, t, k), dc);
}

static void chunk_scores(const AttnPass *p, int h0, int nh, int t, int k, int thread, float *att) {
    if (p->L->cfg->variant != VARIANT_MLA)
        kv_heads_scores(p, h0, nh, t, k, thread, att);
    else if (p->form == MLA_ABSORBED)
        mla_absorbed_scores(p, h0, nh, t, k, thread, att);
    else
        mla_expanded_scores(p, h0, nh, t, k, att);
}

static void chunk_mix(const AttnPass *p, int h0, int nh, int t, int k, int thread, const float *att, float *out) {
    if (p->L->cfg->variant != VARIANT_MLA)
        kv_heads_mix(p, h0, nh, t, k, thread, att, out);
    else if (p->form == MLA_ABSORBED)
        mla_absorbed_mix(p, nh, t, k, thread, att, out);
    else
        mla_expanded_mix(p, h0, nh, t, k, att, out);
}

/* Where token t's head h0's result goes (out_width floats a head, heads consecutive): the
 * heads, or MLA's weighted latents. */
static float *item_out(const AttnPass *p, int t, int h0) {
    const int H = p->L->cfg->n_heads;
    const float *base = p->L->cfg->variant == VARIANT_MLA && p->form == MLA_ABSORBED ? p->a->ctx_lat : p->heads;
    return (float *)base + ((size_t)t * H + h0) * p->out_width;
}

/* A chunk's weighted sum kept for the merge after the split (token t0 + slot), and its statistics. */
static float *partial_out(const AttnPass *p, int slot, int h, int k) {
    return p->a->partials + (((size_t)slot * p->L->cfg->n_heads + h) * p->a->max_chunks + k) * p->a->partial_width;
}
static float *partial_stats(const AttnPass *p, int slot, int h, int k) {
    return p->a->partial_stats + (((size_t)slot * p->L->cfg->n_heads + h) * p->a->max_chunks + k) * 2;
}

/* -- the scheduling of the items among the threads -- */

/* The order of the items (first head, token, chunk): sequence by sequence, and inside one
 * sequence's tokens head group by head group. A decode step (one token a sequence) thus
 * runs a token's heads together, which share its cache rows (GQA's groups, MLA's
 * latents); a prefill runs each head group over all its tokens, which share those rows.
 * Split: an item a chunk, for passes of few tokens over long contexts; otherwise an item
 * a token, all its chunks (chunk -1). Returns the number of items written. */
static int order_items(const AttnPass *p, int *items, int t0, int t1, int heads_per_item, int split) {
    int n = 0;
    for (int r0 = t0, r1; r0 < t1; r0 = r1) {
        r1 = sequence_end(p->slots, r0, t1);
        for (int h = 0; h < p->L->cfg->n_heads; h += heads_per_item)
            for (int t = r0; t < r1; t++)
                for (int k = split ? 0 : -1; k < (split ? chunks_of(p, t) : 0); k++) {
                    items[3 * n] = h;
                    items[3 * n + 1] = t;
                    items[3 * n + 2] = k;
                    n++;
                }
    }
    return n;
}

/* The most heads an item takes: as many of the `sharing` heads that read the same rows as
 * divide them, up to ATTN_MAX_HEADS_PER_ITEM; with `side_by_side`, whole groups of them side
 * by side, as many as divide n_heads (the pool keeps a block's KV heads together, so such an
 * item reads one run of memory a block). */
static int most_heads(int sharing, int n_heads, int side_by_side) {
    int k = sharing < ATTN_MAX_HEADS_PER_ITEM ? sharing : ATTN_MAX_HEADS_PER_ITEM;
    while (sharing % k != 0) k--;
    if (side_by_side && k == sharing)
        while (2 * k <= ATTN_MAX_HEADS_PER_ITEM && n_heads % (2 * k) == 0) k *= 2;
    return k;
}

/* Heads an item takes: the most, halved while the pass has too few items (`units` an item
 * of the most heads) to share among the threads. */
static int heads_per_item(int most, long units, int n_heads, int threads) {
    int k = most;
    while (k % 2 == 0 && units * (n_heads / k) < 4L * threads) k /= 2;
    return k;
}

/* One chunk of work a thread does: chunk k of item (h0, t); `split`: the chunk is an item
 * of its own, kept for the merge after all items. */
typedef struct {
    int h0, t, k, n_chunks, split;
    int slot; /* t's place among the tokens of run_queries */
} Unit;

/* The first unit of item i, of the items before hi; 0 when none. */
static int first_unit(const AttnPass *p, long i, long hi, int t0, Unit *u) {
    if (i >= hi) return 0;
    const int *item = p->a->items + 3 * i;
    *u = (Unit){item[0], item[1], item[2] < 0 ? 0 : item[2], chunks_of(p, item[1]), item[2] >= 0, item[1] - t0};
    return 1;
}

/* A chunk's probabilities (att, after its softmax) and statistics into the record, for
 * the heads of unit u it records. Each thread writes its own units' entries. */
static void record_chunk(const AttnPass *p, const Unit *u, int nh, const float *att, const float *chunk_max,
                         const float *chunk_sum) {
    AttnRecord *r = p->a->record;
    const int H = p->L->cfg->n_heads, keys = chunk_keys(p, u->t, u->k);
    for (int h = 0; h < nh; h++) {
        const int e = r->slot[((size_t)p->L->index * r->T + u->t) * H + u->h0 + h];
        if (e < 0) continue;
        const AttnRecordEntry *en = &r->entries[e];
        float *dst = r->probs + en->offset;
        memcpy(dst + (size_t)u->k * ATTN_CHUNK_KEYS, att + (size_t)h * p->a->scores_stride,
               (size_t)keys * sizeof(float));
        dst[en->n_keys + 2 * u->k] = chunk_max[h];
        dst[en->n_keys + 2 * u->k + 1] = chunk_sum[h];
    }
}

/* Unit u's softmax and weighted sum, its scores in att: a lone chunk straight into the
 * item's output; a split chunk into its partial; otherwise the first chunk into the
 * output and each later one merged into it, in order (max and sum: the statistics of the
 * chunks merged so far, one a head). */
static void finish_unit(const AttnPass *p, const Unit *u, int nh, int thread, float *att, float *max, float *sum) {
    const int keys = chunk_keys(p, u->t, u->k), w = p->out_width;
    float chunk_max[ATTN_MAX_HEADS_PER_ITEM], chunk_sum[ATTN_MAX_HEADS_PER_ITEM];
    for (int h = 0; h < nh; h++)
        softmax_stats(att + (size_t)h * p->a->scores_stride, keys, &chunk_max[h], &chunk_sum[h]);
    if (p->a->record && p->a->record->active) record_chunk(p, u, nh, att, chunk_max, chunk_sum);
    float *out = item_out(p, u->t, u->h0);
    float *chunk =
        u->n_chunks > 1 ? p->a->chunk_out + (size_t)thread * p->a->heads_an_item * p->a->partial_width : NULL;
    if (u->n_chunks == 1) {
        chunk_mix(p, u->h0, nh, u->t, u->k, thread, att, out);
    } else if (u->split) {
        const int slot = u->slot;
        chunk_mix(p, u->h0, nh, u->t, u->k, thread, att, chunk);
        for (int h = 0; h < nh; h++) {
            memcpy(partial_out(p, slot, u->h0 + h, u->k), chunk + (size_t)h * w, (size_t)w * sizeof(float));
            float *stats = partial_stats(p, slot, u->h0 + h, u->k);
            stats[0] = chunk_max[h], stats[1] = chunk_sum[h];
        }
    } else if (u->k == 0) {
        chunk_mix(p, u->h0, nh, u->t, 0, thread, att, out);
        for (int h = 0; h < nh; h++) max[h] = chunk_max[h], sum[h] = chunk_sum[h];
    } else {
        chunk_mix(p, u->h0, nh, u->t, u->k, thread, att, chunk);
        for (int h = 0; h < nh; h++)
            softmax_merge(out + (size_t)h * w, &max[h], &sum[h], chunk + (size_t)h * w, chunk_max[h], chunk_sum[h], w);
    }
}

/* After a split pass: each (token, head) of more than one chunk merges its chunks' partials
 * in order, as an item that ran them all would have. */
static void merge_split_chunks(const AttnPass *p, int t0, int t1) {
    const int H = p->L->cfg->n_heads, w = p->out_width;
    Share sh =
        share_begin(p->wk, (long)(t1 - t0) * H, SHARE_SPLIT, parallel_mode((long)(t1 - t0) * H * p->a->max_chunks * w));
    for (long lo, hi; share_next(&sh, &lo, &hi);)
        for (long i = lo; i < hi; i++) {
            const int slot = (int)(i / H), h = (int)(i % H), n = chunks_of(p, t0 + slot);
            if (n == 1) continue;
            float *out = item_out(p, t0 + slot, h);
            const float *stats = partial_stats(p, slot, h, 0);
            float max = stats[0], sum = stats[1];
            memcpy(out, partial_out(p, slot, h, 0), (size_t)w * sizeof(float));
            for (int k = 1; k < n; k++) {
                stats = partial_stats(p, slot, h, k);
                softmax_merge(out, &max, &sum, partial_out(p, slot, h, k), stats[0], stats[1], w);
            }
        }
    share_end(&sh);
}

/* The queries of tokens [t0, t1), `sharing` heads reading the same rows, shared among the
 * threads by items. A thread's run of chunks is software-pipelined: the next chunk's scores
 * are computed before this one's softmax and mix, so softmax's first load never waits on
 * the scores just stored. */
static void run_queries(const AttnPass *p, int t0, int t1, int sharing) {
    const int H = p->L->cfg->n_heads, threads = p->wk->threads, T = t1 - t0;
    long chunks = 0, keys = 0;
    for (int t = t0; t < t1; t++) chunks += chunks_of(p, t), keys += keys_of(p, t);
    int sequences = 0;
    for (int r = t0; r < t1; r = sequence_end(p->slots, r, t1)) sequences++;
    /* a KV head read by one query head (MHA) does too little work a row to hide the row's
     * latency; in a decode pass (a token a sequence) no other token reads its rows, so an
     * item takes several such KV heads, whose rows lie side by side (where KV heads serve
     * several query heads, GQA's twin, that measured slower) */
    const int side_by_side = sharing == 1 && p->L->cfg->variant != VARIANT_MLA && sequences == T;
    const int most = most_heads(sharing, H, side_by_side);
    /* too few items for the threads while each item takes every head that reads its rows, and
     * chunks to share instead: splitting the chunks, rather than the heads, reads the rows once */
    const int split = chunks > T && T <= ATTN_SPLIT_TOKENS && (long)T * (H / most) < 4L * threads;
    const int nh = heads_per_item(most, split ? chunks : T, H, threads);
    const long n_items = (split ? chunks : T) * (H / nh);
    if (team_alone(p->wk)) order_items(p, p->a->items, t0, t1, nh, split);
    const int thread = p->wk->thread;
    float *att[2]; /* two chunks' scores, then probabilities: this thread's own */
    att[0] = p->a->scores + (size_t)thread * 2 * p->a->scores_per_item;
    att[1] = att[0] + p->a->scores_per_item;
    float max[ATTN_MAX_HEADS_PER_ITEM], sum[ATTN_MAX_HEADS_PER_ITEM];
    Share sh = share_begin(p->wk, n_items, SHARE_SPLIT, parallel_mode(keys * H * p->L->cfg->head_dim));
    for (long lo, hi; share_next(&sh, &lo, &hi);) {
        long i = lo;
        Unit cur = {0}, prev = {0};
        int have = first_unit(p, i, hi, t0, &cur), have_prev = 0, buf = 0;
        while (have || have_prev) {
            if (have) chunk_scores(p, cur.h0, nh, cur.t, cur.k, thread, att[buf]);
            if (have_prev) finish_unit(p, &prev, nh, thread, att[buf ^ 1], max, sum);
            have_prev = have;
            if (!have) break;
            prev = cur;
            buf ^= 1;
            if (!cur.split && cur.k + 1 < cur.n_chunks)
                cur.k++;
            else
                have = first_unit(p, ++i, hi, t0, &cur);
        }
    }
    share_end(&sh);
    if (split) merge_split_chunks(p, t0, t1);
}

/* -- each variant: its projections, its cache writes, then its queries -- */

/* Token t's key for KV head g (rotated, unless a window rotates keys when read) and its
 * value, into the cache; the queries of the group's heads rotated, by their place. */
static void kv_heads_store(const AttnPass *p, int t, int g) {
    const Config *c = p->L->cfg;
    const int Hkv = c->n_kv_heads, hd = c->head_dim, G = kv_group_size(c);
    const KVCache *cache = p->slots->cache[t];
    const int pos = p->slots->pos[t];
    float *q = p->a->q + ((size_t)t * c->n_heads + (size_t)g * G) * hd; /* (G, hd) */
    for (int i = 0; i < G; i++) rope(p->L->rope, c, q + (size_t)i * hd, query_place(cache, pos));
    float *k = p->a->k + ((size_t)t * Hkv + g) * hd;
    if (!kv_rotates_by_place(cache->pool)) rope(p->L->rope, c, k, pos);
    const float *v = p->a->v + ((size_t)t * Hkv + g) * hd;
    if (packed(p)) {
        open_store(p, t, g, k);
        open_store(p, t, Hkv + g, v);
        return;
    }
    kv_store(cache->pool, kv_key(cache, p->L->index, g, pos), k);
    kv_store(cache->pool, kv_value(cache, p->L->index, g, pos), v);
}

/* Token t's queries get q_R rotated; [RMSNorm(c) ; k_R] goes into the cache, k_R rotated
 * unless a window rotates keys when read. */
static void mla_store(const AttnPass *p, int t) {
    const Config *c = p->L->cfg;
    const int H = c->n_heads, qw = c->head_dim + c->rope_dim, dc = c->kv_latent, rd = c->rope_dim;
    const KVCache *cache = p->slots->cache[t];
    const int pos = p->slots->pos[t];
    for (int h = 0; h < H; h++)
        rope(p->L->rope, c, p->a->q + ((size_t)t * H + h) * qw + c->head_dim, query_place(cache, pos));
    float *row = p->a->rows + (size_t)t * (dc + rd);
    rmsnorm(row, p->a->latent + (size_t)t * dc, p->L->w->kv_norm, dc, c->norm_eps);
    memcpy(row + dc, p->a->k_rope + (size_t)t * rd, (size_t)rd * sizeof(float));
    if (!kv_rotates_by_place(cache->pool)) rope(p->L->rope, c, row + dc, pos);
    if (packed(p))
        open_store(p, t, 0, row);
    else
        kv_store(cache->pool, kv_latent(cache, p->L->index, pos), row);
}

/* The pass's three projections, then its cache writes, `stores` a token (a KV head's key
 * and value, or MLA's row), `store_work` floats in all; with int4 or int2 every open row
 * then closed. */
static void project_and_store(const AttnPass *p, const MatmulJob projections[3], int stores, long store_work) {
    const int T = p->slots->T, mla = p->L->cfg->variant == VARIANT_MLA;
    matmul_jobs(p->wk, projections, 3);
    stage_end(p->a->clock, p->wk, stage_slot(p->L->index, STAGE_PROJECTIONS));
    if (packed(p)) open_layout(p);
    Share sh = share_begin(p->wk, (long)T * stores, SHARE_SPLIT, parallel_mode(store_work));
    for (long lo, hi; share_next(&sh, &lo, &hi);)
        for (long i = lo; i < hi; i++) {
            if (mla)
                mla_store(p, (int)i);
            else
                kv_heads_store(p, (int)(i / stores), (int)(i % stores));
        }
    share_end(&sh);
    if (!packed(p)) return;
    const KVPool *pool = p->slots->cache[0]->pool;
    const int rows = kv_row_groups(pool);
    sh = share_begin(p->wk, (long)T * rows, SHARE_SPLIT, parallel_mode((long)T * rows * pool->row_width));
    for (long lo, hi; share_next(&sh, &lo, &hi);)
        for (long i = lo; i < hi; i++) open_close(p, (int)(i / rows), (int)(i % rows));
    share_end(&sh);
}

/* With a window, one sequence (tokens [t0, t1)): its keys and values gathered as its last
 * token sees them (its earlier tokens in the pass see a prefix of them: a window only
 * slides once it is full, one token a pass), a row (a KV head's keys or values) an item;
 * then its queries. */
static void kv_heads_window_sequence(const AttnPass *p, int t0, int t1) {
    const Config *c = p->L->cfg;
    const int t = t1 - 1;
    Share sh = share_begin(p->wk, 2L * c->n_kv_heads, SHARE_SPLIT,
                           parallel_mode(2L * c->n_kv_heads * c->head_dim * keys_of(p, t)));
    for (long lo, hi; share_next(&sh, &lo, &hi);)
        for (long r = lo; r < hi; r++)
            gather_rows(p->L, p->slots->cache[t], (int)r, p->slots->pos[t], r < c->n_kv_heads ? 0 : -1, NULL,
                        (float *)window_head(p, (int)r));
    share_end(&sh);
    run_queries(p, t0, t1, kv_group_size(c));
}

/* MHA, GQA, MQA: heads (T, H*hd) from xb (T, dim). */
static void attention_kv_heads(const AttnPass *p, const float *xb) {
    const Config *c = p->L->cfg;
    const LayerWeights *w = p->L->w;
    AttnScratch *a = p->a;
    const int H = c->n_heads, Hkv = c->n_kv_heads, hd = c->head_dim, T = p->slots->T;
    const MatmulJob qkv[] = {
        {a->q, H * hd, xb, c->dim, w->wq, T},   /* q: (T, H*hd) */
        {a->k, Hkv * hd, xb, c->dim, w->wk, T}, /* k: (T, Hkv*hd) */
        {a->v, Hkv * hd, xb, c->dim, w->wv, T}, /* v: (T, Hkv*hd) */
    };
    project_and_store(p, qkv, Hkv, (long)T * (Hkv + H) * hd);
    if (!p->windowed)
        run_queries(p, 0, T, kv_group_size(c));
    else
        for (int t0 = 0, t1; t0 < T; t0 = t1) {
            t1 = sequence_end(p->slots, t0, T);
            kv_heads_window_sequence(p, t0, t1);
        }
    stage_end(a->clock, p->wk, stage_slot(p->L->index, STAGE_ATTENTION));
}

/* One sequence's latents as its last token in the pass sees them, into a->latents, by
 * thread 0 (the next shared operation waits for them). */
static void mla_gather(const AttnPass *p, int t_last) {
    if (team_alone(p->wk))
        gather_rows(p->L, p->slots->cache[t_last], 0, p->slots->pos[t_last], p->L->cfg->kv_latent,
                    packed(p) ? open_row(p, 0, t_last, p->slots->pos[t_last] / KV_BLOCK_TOKENS * KV_BLOCK_TOKENS)
                              : NULL,
                    p->a->latents);
}

/* MLA, expanded, one sequence (tokens [t0, t1)): its latents gathered, every head's keys
 * and values expanded from them, then its tokens' queries. */
static void mla_expanded_sequence(const AttnPass *p, int t0, int t1) {
    const Config *c = p->L->cfg;
    const LayerWeights *w = p->L->w;
    AttnScratch *a = p->a;
    const int lw = c->kv_latent + c->rope_dim, es = mla_exp_stride(c);
    const int n_keys = keys_of(p, t1 - 1);
    mla_gather(p, t1 - 1);
    /* rows of latents are [c ; k_R]: the products read the first dc floats of each */
    const MatmulJob expand[] = {
        {a->k_exp, es, a->latents, lw, w->wuk, n_keys}, /* k_C: (n_keys, H*hd), stride es */
        {a->v_exp, es, a->latents, lw, w->wuv, n_keys}, /* v:   (n_keys, H*hd), stride es */
    };
    matmul_jobs(p->wk, expand, 2);
    run_queries(p, t0, t1, 1);
}

/* q_abs = [W_UK,h^T q_C ; q_R] for every token and head: (T, H, dc + rd), one product a
 * head over the pass's tokens. */
static void mla_absorb_queries(const AttnPass *p) {
    const Config *c = p->L->cfg;
    AttnScratch *a = p->a;
    const int H = c->n_heads, hd = c->head_dim, rd = c->rope_dim, dc = c->kv_latent, qw = hd + rd, lw = dc + rd;
    const int T = p->slots->T;
    MatmulJob heads[H];
    for (int h = 0; h < H; h++) /* head h's q_C of every token, at a stride of H queries */
        heads[h] = (MatmulJob){a->q_abs + (size_t)h * lw,        H * lw, a->q + (size_t)h * qw, H * qw,
                               mat_block(p->L->w->wuk_t, h, dc), T};
    matmul_jobs(p->wk, heads, H);
    if (team_alone(p->wk))
        for (size_t i = 0; i < (size_t)T * H; i++)
            memcpy(a->q_abs + i * lw + dc, a->q + i * qw + hd, (size_t)rd * sizeof(float));
}

/* heads = W_UV,h ctx_lat for every token and head: (T, H*hd) */
static void mla_expand_contexts(const AttnPass *p) {
    const Config *c = p->L->cfg;
    AttnScratch *a = p->a;
    const int H = c->n_heads, hd = c->head_dim, dc = c->kv_latent;
    MatmulJob heads[H];
    for (int h = 0; h < H; h++)
        heads[h] = (MatmulJob){p->heads + (size_t)h * hd,
                               H * hd,
                               a->ctx_lat + (size_t)h * dc,
                               H * dc,
                               mat_block(p->L->w->wuv_heads, h, hd),
                               p->slots->T};
    matmul_jobs(p->wk, heads, H);
}

/* MLA: heads (T, H*hd) from xb (T, dim), in the form asked for. */
static void attention_mla(const AttnPass *p, const float *xb) {
    const Config *c = p->L->cfg;
    const LayerWeights *w = p->L->w;
    AttnScratch *a = p->a;
    const int H = c->n_heads, qw = c->head_dim + c->rope_dim, dc = c->kv_latent, rd = c->rope_dim, T = p->slots->T;
    StageClock *clock = a->clock;
    const MatmulJob projections[] = {
        {a->q, H * qw, xb, c->dim, w->wq, T},    /* q: (T, H*(hd+rd)) */
        {a->latent, dc, xb, c->dim, w->wdkv, T}, /* c: (T, dc) */
        {a->k_rope, rd, xb, c->dim, w->wkr, T},  /* k_R: (T, rd) */
    };
    project_and_store(p, projections, 1, (long)T * (H * rd + dc + rd));
    if (p->form == MLA_EXPANDED) {
        for (int t0 = 0, t1; t0 < T; t0 = t1) {
            t1 = sequence_end(p->slots, t0, T);
            if (packed(p)) t1 = block_end(p->slots, t0, t1); /* tokens of another block read this one packed */
            mla_expanded_sequence(p, t0, t1);
        }
        stage_end(clock, p->wk, stage_slot(p->L->index, STAGE_ATTENTION));
        return;
    }
    stage_end(clock, p->wk, stage_slot(p->L->index, STAGE_ATTENTION)); /* the cache's writes */
    mla_absorb_queries(p);
    stage_end(clock, p->wk, stage_slot(p->L->index, STAGE_PROJECTIONS));
    if (!p->windowed)
        run_queries(p, 0, T, H);
    else
        for (int t0 = 0, t1; t0 < T; t0 = t1) {
            t1 = sequence_end(p->slots, t0, T);
            mla_gather(p, t1 - 1);
            run_queries(p, t0, t1, H);
        }
    stage_end(clock, p->wk, stage_slot(p->L->index, STAGE_ATTENTION));
    mla_expand_contexts(p);
    stage_end(clock, p->wk, stage_slot(p->L->index, STAGE_PROJECTIONS));
}

void attention(const Layer *L, AttnScratch *a, const TokenSlots *slots, const float *xb, float *heads, MlaForm form,
               Worker *wk) {
    const int windowed = slots->T > 0 && slots->cache[0]->pool->window > 0;
    const int out_width = L->cfg->variant == VARIANT_MLA && form == MLA_ABSORBED ? L->cfg->kv_latent : L->cfg->head_dim;
    const AttnPass p = {L, a, slots, heads, score_scale(L->cfg), windowed, out_width, form, wk};
    if (L->cfg->variant != VARIANT_MLA)
        attention_kv_heads(&p, xb);
    else
        attention_mla(&p, xb);
}
