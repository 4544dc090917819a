/* info.c: --info (modes.h): the configuration, the parameters, and the KV cache's bytes by
 * the formula and as allocated. */
#include <stdio.h>

#include "loader.h"
#include "serve/modes.h"
#include "serve/session.h"

/* --info as one JSON object: the configuration, the parameters, the KV cache's bytes per
 * token by the formula and as allocated, the pool. */
static void info_json(const Model *m, const KVPool *pool, const Options *o, size_t per_token, int kept) {
    const Config *c = &m->cfg;
    json_begin("info", m, o, o->kv ? "kv" : "no-kv");
    printf(", \"dtype\": \"%s\", \"dim\": %d, \"layers\": %d, \"heads\": %d, \"head_dim\": %d, \"kv_heads\": %d, "
           "\"kv_latent\": %d, \"rope_dim\": %d, \"hidden\": %d, \"vocab\": %d, \"context\": %d, \"parameters\": %zu, "
           "\"weight_bytes\": %zu, \"kv_bytes_per_token\": %zu, \"kv_bytes_full\": %zu, "
           "\"kv_bytes_per_token_allocated\": %zu, \"kv_pool_blocks\": %d, \"kv_block_tokens\": %d, "
           "\"kv_block_bytes\": %zu, \"kv_pool_bytes\": %zu, \"batch\": %d, \"kv_bytes_contiguous\": %zu, "
           "\"kernels\": \"%s\"",
           c->dtype == DTYPE_BF16 ? "bf16" : "fp32", c->dim, c->n_layers, c->n_heads, c->head_dim, c->n_kv_heads,
           c->kv_latent, config_rope_width(c), c->hidden_dim, c->vocab_size, c->max_seq_len, model_param_count(c),
           model_param_count(c) * dtype_size(c->dtype), per_token, per_token * (size_t)kept, kv_bytes_per_token(pool),
           pool->n_blocks, KV_BLOCK_TOKENS, kv_block_bytes(pool), kv_block_bytes(pool) * (size_t)pool->n_blocks,
           o->batch, kv_bytes_per_token(pool) * (size_t)kept * (size_t)o->batch, kernels_simd_name());
    json_end();
}

int mode_info(const Model *m, const KVPool *pool, const Options *o) {
    const Config *c = &m->cfg;
    const DType dt = pool->dtype;
    const int batch = o->batch;
    const size_t es = dtype_size(dt),
                 per_token =
                     c->variant == VARIANT_MLA
                         ? (size_t)c->n_layers * ((c->kv_latent + c->rope_dim) * es + (dt == DTYPE_I8 ? 8 : 0))
                         : 2 * (size_t)c->n_layers * c->n_kv_heads * (c->head_dim * es + (dt == DTYPE_I8 ? 4 : 0));
    const int kept = pool->window ? pool->window : c->max_seq_len;
    if (o->json) {
        info_json(m, pool, o, per_token, kept);
        return 0;
    }
    printf("variant        %s\n", variant_name(c));
    printf("dtype          %s\n", c->dtype == DTYPE_BF16 ? "bf16" : "fp32");
    printf("dim %d, layers %d, heads %d x %d, kv heads %d, latent %d, rope dim %d, hidden %d, vocab %d, context %d\n",
           c->dim, c->n_layers, c->n_heads, c->head_dim, c->n_kv_heads, c->kv_latent, config_rope_width(c),
           c->hidden_dim, c->vocab_size, c->max_seq_len);
    printf("parameters     %zu (%.2f M), %zu bytes of weights\n", model_param_count(c), model_param_count(c) / 1e6,
           model_param_count(c) * dtype_size(c->dtype));
    if (c->variant == VARIANT_MLA) {
        if (dt == DTYPE_I8)
            printf("KV cache       L*(d_c+d_R+8) = %d*(%d+%d+8)", c->n_layers, c->kv_latent, c->rope_dim);
        else
            printf("KV cache       L*(d_c+d_R)*%zu = %d*(%d+%d)*%zu", es, c->n_layers, c->kv_latent, c->rope_dim, es);
    } else {
        if (dt == DTYPE_I8)
            printf("KV cache       2*L*H_kv*(d_h+4) = 2*%d*%d*(%d+4)", c->n_layers, c->n_kv_heads, c->head_dim);
        else
            printf("KV cache       2*L*H_kv*d_h*%zu = 2*%d*%d*%d*%zu", es, c->n_layers, c->n_kv_heads, c->head_dim, es);
    }
    printf(" = %zu bytes/token; %zu bytes at full %s (%s%s)\n", per_token, per_token * kept,
           pool->window ? "window" : "context", kv_dtype_name(dt), dt == DTYPE_I8 ? ", a 4-byte scale a vector" : "");
    if (pool->window)
        printf("window         %d positions a sequence, %d of them sinks kept for good; the rest a ring\n",
               pool->window, pool->sinks);
    printf("allocated      %zu bytes/token; %zu bytes (%s)\n", kv_bytes_per_token(pool),
           kv_block_bytes(pool) * (size_t)pool->n_blocks, kv_dtype_name(dt));
    printf("KV pool        %d blocks of %d tokens, %zu bytes each (%zu bytes); a contiguous cache of the full %s "
           "for %d sequence%s would take %zu bytes\n",
           pool->n_blocks, KV_BLOCK_TOKENS, kv_block_bytes(pool), kv_block_bytes(pool) * (size_t)pool->n_blocks,
           pool->window ? "window" : "context", batch, batch > 1 ? "s" : "",
           kv_bytes_per_token(pool) * (size_t)kept * (size_t)batch);
    printf("kernels        %s\n", kernels_simd_name());
    return 0;
}
