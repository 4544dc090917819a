/* model.h: the transformer, its weights, its scratch state, and the forward pass.
 *
 * d_model 512, 4 layers, 16 query heads of dim 32, context 256, vocabulary 4096,
 * tied embedding/head, RMSNorm (eps 1e-5), SwiGLU FFN (hidden 1344), no biases,
 * interleaved RoPE (theta 10000). Five attention variants: mha, gqa, mqa (16, 4
 * and 1 KV heads) and mla64, mla128 (DeepSeek-V2 latent attention, d_c 64/128).
 * train/model.py computes the same function. */
#ifndef MODEL_H
#define MODEL_H

#include <stddef.h>

#include "kernels.h"
#include "kvcache.h"
#include "spm_c.h"

/* the longest context a checkpoint may have: a query's scores live on its thread's stack */
enum { MAX_SEQ_LEN = 8192 };
/* Tokens of per-token work (a residual add and norm, a cache write) worth handing to the
 * other threads: a hand-off costs ~0.5 us (parallel.h), a token's norm ~0.1 us. */
enum { MIN_TOKENS_THREADED = 16 };

typedef enum { VARIANT_MHA = 0, VARIANT_GQA = 1, VARIANT_MQA = 2, VARIANT_MLA = 3 } Variant;

typedef struct {
    Variant variant;
    DType dtype;        /* of every tensor in the file */
    int dim;            /* d_model */
    int n_layers;
    int n_heads;        /* query heads */
    int head_dim;
    int n_kv_heads;     /* MHA: n_heads; GQA: a divisor; MQA: 1; MLA: 0 */
    int kv_latent;      /* MLA: d_c; otherwise 0 */
    int rope_dim;       /* MLA: width of the decoupled RoPE part; otherwise 0 */
    int hidden_dim;     /* FFN */
    int vocab_size;
    int max_seq_len;
    float rope_theta;
    float norm_eps;
    int bos_id, eos_id;
} Config;

typedef struct {
    Mat attn_norm;      /* [dim] */
    Mat wq;             /* [n_heads*head_dim][dim]; MLA: [n_heads*(head_dim+rope_dim)][dim] */
    Mat wk, wv;         /* [n_kv_heads*head_dim][dim]                 (MHA, GQA, MQA) */
    Mat wdkv;           /* [kv_latent][dim]                           (MLA) */
    Mat kv_norm;        /* [kv_latent]                                (MLA) */
    Mat wkr;            /* [rope_dim][dim]                            (MLA) */
    Mat wuk, wuv;       /* [n_heads*head_dim][kv_latent]              (MLA) */
    /* absorbed MLA, derived at load, each head packed on its own (mat_block(wuk_t, h, kv_latent)): */
    Mat wuk_t;          /* [n_heads][kv_latent][head_dim]: W_UK,h transposed */
    Mat wuv_heads;      /* [n_heads][head_dim][kv_latent]: W_UV,h */
    Mat wo;             /* [dim][n_heads*head_dim] */
    Mat ffn_norm;       /* [dim] */
    Mat w1, w3;         /* [hidden_dim][dim] */
    Mat w2;             /* [dim][hidden_dim] */
} LayerWeights;

typedef struct {
    Mat tok_embeddings; /* [vocab_size][dim], also the output head */
    LayerWeights *layers;
    Mat final_norm;     /* [dim] */
} Weights;

typedef struct {
    Config cfg;
    Weights w;
    SpmTokenizer *tokenizer;  /* embedded in the checkpoint */
    float *rope_cos, *rope_sin;  /* [max_seq_len][rotated width / 2] */
    void *map;                /* the mmapped file, while loading */
    size_t map_size;
    void *weights;            /* the file's weights, packed (kernels.h), on huge pages where possible */
    void *derived;            /* storage of wuk_t and wuv_heads */
} Model;

/* Scratch for a forward pass over up to max_seq_len tokens; T is the number of
 * tokens in the current pass (1 when decoding with the cache). */
typedef struct {
    float *x;           /* (T, dim) residual stream */
    float *xb;          /* (T, dim) normalized input / sublayer output */
    float *heads;       /* (T, n_heads*head_dim) attention output, heads concatenated */
    float *q;           /* (T, n_heads*q_width), q_width = head_dim (+ rope_dim for MLA) */
    float *k, *v;       /* (T, n_kv_heads*head_dim) new keys and values (MHA, GQA, MQA) */
    float *latent;      /* (T, kv_latent) new latents c (MLA) */
    float *k_rope;      /* (T, rope_dim) new shared RoPE keys (MLA) */
    float *k_exp, *v_exp; /* (max_seq_len, mla_exp_stride) expanded keys/values (MLA, expand form) */
    float *q_abs;       /* (T, n_heads, kv_latent+rope_dim) absorbed queries [W_UK,h^T q_C ; q_R] (MLA) */
    float *ctx_lat;     /* (T, n_heads, kv_latent) attention-weighted latents (MLA, absorbed form) */
    float *hb, *hb2;    /* (T, hidden_dim) */
    float *logits;      /* (T, vocab_size) */
    int *tokens;        /* (max_seq_len + 1) the ids of the sequence being generated */
    int mla_absorb;     /* MLA: 1 = absorbed form, 0 = expanded form */
} RunState;

/* Row stride of k_exp and v_exp: n_heads*head_dim and 16 floats more. A head reads its
 * slice of every row; at a stride of 2 KB (512 floats) those slices all fall in 2 of L1's
 * 64 sets and evict each other long before the next query reads them again. */
static inline int mla_exp_stride(const Config *c) { return c->n_heads * c->head_dim + 16; }

/* Loads and checks a checkpoint (docs/FORMAT.md). On failure returns -1 and writes one
 * sentence into err. */
int model_load(Model *m, const char *path, char *err, size_t errlen);
void model_free(Model *m);
const char *variant_name(const Config *c);
/* Visits the tensors in file order (docs/FORMAT.md): visit(ctx, &field, rows, cols);
 * w->layers must have n_layers entries. */
typedef void (*TensorVisitor)(void *ctx, Mat *mat, int rows, int cols);
void model_walk_tensors(const Config *c, Weights *w, TensorVisitor visit, void *ctx);      /* "mha", "gqa", "mqa", "mla64", "mla128", ... */
size_t model_param_count(const Config *c);

int runstate_init(RunState *s, const Config *c);
void runstate_free(RunState *s);

/* Runs tokens[0..T) at positions pos0 .. pos0+T-1. The cache must hold positions
 * [0, pos0); this pass appends [pos0, pos0+T). Writes the logits of the last token
 * into logits (vocab_size floats), or of all T tokens ((T, vocab_size)) when all_logits.
 * The kernels share the work among the threads of a team (parallel.h): the caller's, or
 * one opened for this pass. */
void model_forward(const Model *m, RunState *s, KVCache *cache, const int *tokens, int T, int pos0,
                   float *logits, int all_logits);

/* attention.c: each reads s->xb (T, dim), writes s->heads (T, n_heads*head_dim) and
 * appends positions [pos0, pos0+T) of layer l to the cache. */
void attn_kv_heads(const Model *m, RunState *s, KVCache *cache, int l, int T, int pos0);
void attn_mla_expanded(const Model *m, RunState *s, KVCache *cache, int l, int T, int pos0);
void attn_mla_absorbed(const Model *m, RunState *s, KVCache *cache, int l, int T, int pos0);

/* Rotates interleaved pairs (v[2i], v[2i+1]) of v (width floats) for position pos. */
void rope(const Model *m, float *v, int width, int pos);

#endif /* MODEL_H */
