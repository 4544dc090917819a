/* attention.h: one layer's attention, for every variant, over the KV cache.
 *
 * MHA, GQA and MQA differ only in the number of KV heads (query head h reads KV head
 * h / (n_heads / n_kv_heads)). MLA (DeepSeek-V2, no query compression) caches a
 * latent c and a shared RoPE key k_R per position, and computes attention in one of
 * two forms: expanded (every head's keys and values materialized from the latents)
 * or absorbed (W_UK folded into the query, W_UV applied after the weighted sum).
 *
 * attention() is the fast path: threaded, pipelined, on the SIMD kernels.
 * attention_query_reference() is its specification: one query, single-threaded, plain
 * loops over the cache; the tests compare the two bit for bit. */
#ifndef ATTENTION_H
#define ATTENTION_H

#include "config.h"
#include "kernels/kernels.h"
#include "kernels/timer.h"
#include "kvcache.h"

/* Where the tokens of a pass go: token t is at position pos[t] of the sequence whose
 * cache is cache[t]. A sequence's tokens are consecutive in the pass and in order, and
 * its cache holds (or has reserved) every position up to its last token's. */
typedef struct {
    int T;
    KVCache *const *cache; /* (T) */
    const int *pos;        /* (T) */
} TokenSlots;

/* A query over more positions than this splits them into chunks of this many, oldest
 * first: each chunk's softmax and weighted sum, then the chunks merged in order
 * (kernels.h's softmax_merge). A constant of the arithmetic, never of the thread count or
 * the batch, so every split gives the same bits; a multiple of KV_BLOCK_TOKENS and even,
 * so a chunk starts on a block and on an even position. */
enum { ATTN_CHUNK_KEYS = 256 };

/* The most heads one item of attention takes together (they read the same rows while
 * those are in L1, widened once for all of them): 32, so that the MQA and MLA heads of a
 * shape with 32 query heads read each row once. It bounds the scores each thread keeps. */
enum { ATTN_MAX_HEADS_PER_ITEM = 32 };

/* The most tokens a pass may have for its chunks to be shared among the threads. */
enum { ATTN_SPLIT_TOKENS = 64 };

/* What a profiled pass charges its time to, per layer (slot layer * STAGES_PER_LAYER +
 * stage of the pass's StageClock): the products of the projections (Q, K, V or MLA's
 * latents, MLA's absorbed query and context products, W_O), attention itself (RoPE, the
 * cache's writes and reads, scores, softmax, weighted sums, MLA's expansion of cached
 * latents), and the FFN with the norms and residuals around it. */
enum { STAGE_PROJECTIONS, STAGE_ATTENTION, STAGE_FFN, STAGES_PER_LAYER };
static inline int stage_slot(int layer, int stage) { return layer * STAGES_PER_LAYER + stage; }

/* One recorded query head: the attention weights (softmax probabilities) of token `pos`
 * of sequence `sequence`, head `head` of layer `layer`, over its n_keys keys (oldest
 * first: positions 0 .. pos, or with a window the positions it keeps). */
typedef struct {
    int sequence, layer, head, pos, n_keys;
    size_t offset; /* into probs: n_keys probabilities, then each chunk's softmax max and sum */
} AttnRecordEntry;

/* The attention weights of chosen layers, heads and tokens, copied from the fast path as
 * it computes them (its arithmetic unchanged). A query over more than ATTN_CHUNK_KEYS
 * keys has a softmax a chunk; attn_record_finish scales chunk k's probabilities by its
 * share of the whole, sum_k e^(max_k - M) / sum_i sum_i e^(max_i - M) (M the largest
 * max), the weight softmax_merge gives its weighted sum. */
typedef struct {
    /* what to record, set by the caller: NULL records every layer / head */
    const unsigned char *layers; /* (n_layers) */
    const unsigned char *heads;  /* (n_heads) */
    /* what the passes since attn_record_clear recorded */
    AttnRecordEntry *entries;
    int n_entries, cap_entries;
    int finished; /* entries before it hold their final probabilities */
    float *probs;
    size_t n_probs, cap_probs;
    /* the pass being run */
    int active; /* it records anything */
    int T;      /* its tokens */
    int *slot;  /* (n_layers, T, n_heads) the entry of (layer, token, head), or -1 */
    size_t cap_slot;
} AttnRecord;

/* Empties the record (before a step). */
void attn_record_clear(AttnRecord *r);
/* Before a pass, on thread 0: an entry for each chosen layer and head of each token t
 * whose sequence[t] >= 0 (sequence NULL: none). Returns -1 when out of memory. */
int attn_record_plan(AttnRecord *r, const Config *c, const TokenSlots *slots, const int *sequence);
/* After the pass, on thread 0: the chunks' probabilities scaled into the whole softmax. */
void attn_record_finish(AttnRecord *r);
void attn_record_free(AttnRecord *r);

/* Scratch of one layer's attention for passes of up to max_tokens tokens over up to
 * max_keys positions. */
typedef struct {
    float *q;             /* (T, n_heads*query_width) queries, rotated in place */
    float *k, *v;         /* (T, n_kv_heads*head_dim) new keys and values (MHA, GQA, MQA) */
    float *latent;        /* (T, kv_latent) new latents c, before their norm (MLA) */
    float *k_rope;        /* (T, rope_dim) new shared RoPE keys (MLA) */
    float *rows;          /* (T, kv_latent+rope_dim) the rows the cache stores (MLA) */
    float *q_abs;         /* (T, n_heads, kv_latent+rope_dim) absorbed queries [W_UK,h^T q_C ; q_R] (MLA) */
    float *ctx_lat;       /* (T, n_heads, kv_latent) attention-weighted latents (MLA, absorbed) */
    float *latents;       /* (max_keys, kv_latent+rope_dim) one sequence's cached [c ; k_R] (MLA, expanded) */
    float *k_exp, *v_exp; /* (max_keys, mla_exp_stride) expanded keys and values (MLA, expanded) */
    float *window_rows;   /* (2*n_kv_heads, max_keys, head_dim) one sequence's window, gathered */
    /* int4, int2 (kvcache.h): the fp32 rows of the blocks a pass writes, the earlier rows of
     * each sequence's first block (its tail) then the pass's, a row group (open_rows rows)
     * after another; token t's row at open_at[t], its sequence's run ends at position open_end[t] */
    float *open;
    int *open_at, *open_end;
    size_t open_rows;
    int *items; /* (max_items, 3) the (first head, token, chunk) order of the queries */
    int max_keys, max_chunks;
    /* a pass of few tokens over long contexts runs each chunk as an item of its own, on
     * every thread, then merges the chunks (ATTN_SPLIT_TOKENS tokens at most): */
    float *partials;      /* (ATTN_SPLIT_TOKENS, n_heads, max_chunks, partial_width) each chunk's weighted sum */
    float *partial_stats; /* (ATTN_SPLIT_TOKENS, n_heads, max_chunks, 2) its softmax's max and sum */
    /* each thread's own (TEAM_MAX_THREADS of each, touched only by the threads that run):
     * on the heap rather than the threads' stacks, whose size the user sets */
    float *scores;            /* (threads, 2, heads an item, scores_stride) two chunks' scores, then probabilities */
    size_t scores_stride;     /* a head's: a chunk's keys, rounded up to a 64-byte line */
    float *chunk_out;         /* (threads, heads an item, partial_width) a chunk's weighted sum, before its merge */
    int partial_width;        /* the widest weighted sum a head makes: head_dim, or MLA's kv_latent */
    size_t scores_per_item;   /* min(n_heads, ATTN_MAX_HEADS_PER_ITEM) * scores_stride */
    const void **row_blocks;  /* (threads, heads_an_item, blocks_per_row) the blocks a chunk of an item's rows spans */
    const float **row_scales; /* (threads, heads_an_item, blocks_per_row) their int8 scales */
    int blocks_per_row;
    int heads_an_item; /* the most heads an item takes, and so the most row groups */
    int max_items;
    /* set by the caller, NULL when off: the pass's stage clock (--profile) and the
     * attention weights it records (--dump-attn) */
    StageClock *clock;
    AttnRecord *record;
} AttnScratch;

int attn_scratch_init(AttnScratch *a, const Config *c, int max_tokens, int max_keys);
void attn_scratch_free(AttnScratch *a);

/* Layer L for the T tokens of slots:
 *   reads xb (T, dim), the normalized input;
 *   writes what the cache keeps for each token at its position;
 *   writes heads (T, n_heads*head_dim): token t's query attends to positions 0 .. pos[t]
 *   of its own sequence.
 * Every thread of wk's team calls it with the same arguments (threads.h); heads is whole
 * when it returns on every thread. The caller applies W_O, and advances each cache's len
 * once every layer has run. The two MLA forms compute the same function in different
 * orders; form is ignored otherwise. */
void attention(const Layer *L, AttnScratch *a, const TokenSlots *slots, const float *xb, float *heads, MlaForm form,
               Worker *wk);

/* The specification of one query: head `head` of a query at position pos over positions
 * 0 .. pos of layer L in the cache, written plainly (scores, softmax, weighted sum).
 * q is the query as attention() leaves it in a->q: rotated; MLA's [q_C ; q_R].
 * out: (head_dim). The same arithmetic in the same order as the fast path, so equal bit
 * for bit. Returns 0, or -1 when out of memory. */
int attention_query_reference(const Layer *L, const KVCache *cache, int head, const float *q, int pos, MlaForm form,
                              float *out);

/* RoPE's tables for model c, and the rotation of interleaved pairs (v[2i], v[2i+1]) of v
 * (config_rope_width floats) for position pos. */
int rope_tables_init(RopeTables *r, const Config *c);
void rope_tables_free(RopeTables *r);
void rope(const RopeTables *r, const Config *c, float *v, int pos);

#endif /* ATTENTION_H */
