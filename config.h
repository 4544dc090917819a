/* config.h: the model's shape and its weights: the types the model's files share
 * (model.h has the loaded model). Needs only the kernels' matrix type.
 *
 * The shipped checkpoints: d_model 512, 4 layers, 16 query heads of dim 32, context 256,
 * vocabulary 4096, tied embedding/head, RMSNorm (eps 1e-5), SwiGLU FFN (hidden 1344), no
 * biases, interleaved RoPE (theta 10000). Five attention variants: mha, gqa, mqa (16, 4
 * and 1 KV heads) and mla64, mla128 (DeepSeek-V2 latent attention, d_c 64/128). --shape
 * and imported models take other shapes, an untied head and a sliding window (Config).
 * train/model.py computes the same function. */
#ifndef CONFIG_H
#define CONFIG_H

#include <stddef.h>

#include "kernels/kernels.h"

/* The longest context a model may have, and the most entries each RoPE table may hold
 * (max_seq_len x rotated width / 2): a head_dim of 128 at the longest context, so the
 * two tables stay within 64 MiB whatever the shape. */
enum { MAX_SEQ_LEN = 131072, MAX_ROPE_ENTRIES = MAX_SEQ_LEN * 64 };

typedef enum { VARIANT_MHA = 0, VARIANT_GQA = 1, VARIANT_MQA = 2, VARIANT_MLA = 3 } Variant;

/* MLA's two ways of computing the same attention (attention.h). */
typedef enum { MLA_ABSORBED, MLA_EXPANDED } MlaForm;

typedef struct {
    Variant variant;
    DType dtype; /* of every tensor in the file */
    int dim;     /* d_model */
    int n_layers;
    int n_heads; /* query heads */
    int head_dim;
    int n_kv_heads; /* MHA: n_heads; GQA: a divisor; MQA: 1; MLA: 0 */
    int kv_latent;  /* MLA: d_c; otherwise 0 */
    int rope_dim;   /* MLA: width of the decoupled RoPE part; otherwise 0 */
    int hidden_dim; /* FFN */
    int vocab_size;
    int max_seq_len;
    int window; /* the model's sliding window (0: none); the default of --window */
    float rope_theta;
    float norm_eps;
    int bos_id, eos_id;
    int untied_head; /* 1: an output head of its own (Weights.output); 0: tied to tok_embeddings */
} Config;

/* Width of the vectors RoPE rotates: MLA's decoupled part, or a whole head. */
static inline int config_rope_width(const Config *c) { return c->variant == VARIANT_MLA ? c->rope_dim : c->head_dim; }
/* Width of a query head: MLA's [q_C ; q_R], or a head. */
static inline int config_query_width(const Config *c) {
    return c->head_dim + (c->variant == VARIANT_MLA ? c->rope_dim : 0);
}

typedef struct {
    Mat attn_norm; /* [dim] */
    Mat wq;        /* [n_heads*head_dim][dim]; MLA: [n_heads*(head_dim+rope_dim)][dim] */
    Mat wk, wv;    /* [n_kv_heads*head_dim][dim]                 (MHA, GQA, MQA) */
    Mat wdkv;      /* [kv_latent][dim]                           (MLA) */
    Mat kv_norm;   /* [kv_latent]                                (MLA) */
    Mat wkr;       /* [rope_dim][dim]                            (MLA) */
    Mat wuk, wuv;  /* [n_heads*head_dim][kv_latent]              (MLA) */
    /* absorbed MLA, derived at load, each head packed on its own (mat_block(wuk_t, h, kv_latent)): */
    Mat wuk_t;     /* [n_heads][kv_latent][head_dim]: W_UK,h transposed */
    Mat wuv_heads; /* [n_heads][head_dim][kv_latent]: W_UV,h */
    Mat wo;        /* [dim][n_heads*head_dim] */
    Mat ffn_norm;  /* [dim] */
    Mat w1, w3;    /* [hidden_dim][dim] */
    Mat w2;        /* [dim][hidden_dim] */
} LayerWeights;

typedef struct {
    Mat tok_embeddings; /* [vocab_size][dim], also the output head unless untied */
    LayerWeights *layers;
    Mat final_norm; /* [dim] */
    Mat output;     /* [vocab_size][dim], the untied head (cfg.untied_head); else empty */
} Weights;

/* The matrix of the output head: its own, or the embedding (tied). */
static inline Mat weights_head(const Config *c, const Weights *w) {
    return c->untied_head ? w->output : w->tok_embeddings;
}

/* cos and sin of every position's rotation angles (attention.h's rope_tables_init) */
typedef struct {
    float *cos, *sin; /* [max_seq_len][config_rope_width / 2] */
} RopeTables;

/* What one layer's attention reads of a model: the shape, the layer's weights, RoPE's
 * tables, and which layer it is (its rows in the cache). */
typedef struct {
    const Config *cfg;
    const LayerWeights *w;
    const RopeTables *rope;
    int index;
} Layer;

#endif /* CONFIG_H */
