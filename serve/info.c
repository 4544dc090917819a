/* info.c: --info (modes.h): the configuration, the parameters, the weights' and the KV
 * cache's bytes, and whether they fit in this machine's memory; computed from the shape and
 * the options alone, so that a model far larger than the machine can be sized. */
#include <stdio.h>

#include "loader.h"
#include "serve/modes.h"
#include "serve/session.h"

/* What --info reports, in bytes. */
typedef struct {
    size_t params, weight_bytes; /* the file's tensors */
    size_t model_bytes;          /* loaded: weights, MLA's derived matrices, RoPE tables */
    size_t per_token;            /* KV bytes a token, by the formula */
    size_t per_token_allocated;  /* in the pool's blocks */
    size_t block_bytes, pool_bytes;
    size_t scratch_bytes;        /* the scheduler's, about */
    size_t needed;               /* model_bytes + pool_bytes + scratch_bytes */
    int kept;                     /* positions a sequence keeps: the context, or the window */
    size_t kv_full, kv_batch;     /* one sequence's, the batch's, by the formula */
    size_t kv_contiguous;         /* the batch's full caches in the pool's layout */
    size_t tail_bytes;            /* int4, int2: one sequence's fp32 tail (kvcache.h) */
    size_t stage_bytes;           /* streaming (kvtier.h): the staging area, part of --kv-mem */
    size_t tier_bytes_full;       /* streaming: one full context's bytes on the tier beside the pool */
    double available, total;      /* this machine's memory; -1 when unknown */
    int fits;                     /* needed <= available */
} InfoFigures;

static InfoFigures figures_of(const Config *c, const Options *o, int pool_blocks) {
    InfoFigures f = {.params = model_param_count(c), .model_bytes = model_bytes_for(c)};
    f.weight_bytes = f.params * dtype_size(c->dtype);
    f.per_token = kv_bytes_per_token_for(c, o->kv_dtype);
    f.block_bytes = kv_block_bytes_for(c, o->kv_dtype);
    f.per_token_allocated = f.block_bytes / KV_BLOCK_TOKENS;
    f.pool_bytes = f.block_bytes * (size_t)pool_blocks;
    f.kept = o->window ? o->window : c->max_seq_len;
    f.kv_full = f.per_token * (size_t)f.kept;
    f.kv_batch = f.kv_full * (size_t)o->batch;
    f.kv_contiguous = f.per_token_allocated * (size_t)f.kept * (size_t)o->batch;
    f.scratch_bytes = scheduler_scratch_bytes(c, o->batch);
    f.tail_bytes = kv_tail_bytes_for(c, o->kv_dtype) * (o->draft ? 2 : 1);
    f.stage_bytes = stream_stage_bytes(c, o);
    const int over = kv_blocks_for(c->max_seq_len) - pool_blocks;
    f.tier_bytes_full = run_streams(o) && over > 0 ? (size_t)over * f.block_bytes : 0;
    f.needed = f.model_bytes + f.pool_bytes + f.stage_bytes + f.scratch_bytes + f.tail_bytes * (size_t)o->batch;
    if (machine_memory(&f.available, &f.total) != 0) f.available = f.total = -1.0;
    f.fits = f.available >= 0 && (double)f.needed <= f.available;
    return f;
}

/* --info as one JSON object. */
static void info_json(const Config *c, const Options *o, int pool_blocks, const InfoFigures *f) {
    const Model shape_only = {.cfg = *c};
    json_begin("info", &shape_only, o, o->kv ? "kv" : "no-kv");
    printf(", \"dtype\": \"%s\", \"dim\": %d, \"layers\": %d, \"heads\": %d, \"head_dim\": %d, \"kv_heads\": %d, "
           "\"kv_latent\": %d, \"rope_dim\": %d, \"hidden\": %d, \"vocab\": %d, \"rope_theta\": %g, "
           "\"model_window\": %d, \"window_from_model\": %s, \"parameters\": %zu, \"weight_bytes\": %zu, "
           "\"model_bytes\": %zu, \"kv_bytes_per_token\": %zu, \"kv_bytes_full\": %zu, \"kv_bytes_batch\": %zu, "
           "\"kv_bytes_per_token_allocated\": %zu, \"kv_pool_blocks\": %d, \"kv_block_tokens\": %d, "
           "\"kv_block_bytes\": %zu, \"kv_pool_bytes\": %zu, \"batch\": %d, \"kv_bytes_contiguous\": %zu, "
           "\"kv_tail_bytes\": %zu, \"scratch_bytes\": %zu, \"tier_stage_bytes\": %zu, \"tier_bytes_full\": %zu, "
           "\"memory_needed_bytes\": %zu, \"kernels\": \"%s\", \"matmul_tiles\": \"%s\"",
           c->dtype == DTYPE_BF16 ? "bf16" : "fp32", c->dim, c->n_layers, c->n_heads, c->head_dim, c->n_kv_heads,
           c->kv_latent, config_rope_width(c), c->hidden_dim, c->vocab_size, (double)c->rope_theta, c->window,
           o->window_from_model ? "true" : "false", f->params, f->weight_bytes, f->model_bytes, f->per_token,
           f->kv_full, f->kv_batch, f->per_token_allocated, pool_blocks, KV_BLOCK_TOKENS, f->block_bytes, f->pool_bytes,
           o->batch, f->kv_contiguous, f->tail_bytes, f->scratch_bytes, f->stage_bytes, f->tier_bytes_full, f->needed,
           kernels_simd_name(), matmul_tiles_name());
    if (f->available < 0)
        fputs(", \"memory_available_bytes\": null, \"memory_total_bytes\": null, \"fits_in_memory\": null", stdout);
    else
        printf(", \"memory_available_bytes\": %.0f, \"memory_total_bytes\": %.0f, \"fits_in_memory\": %s",
               f->available, f->total, f->fits ? "true" : "false");
    json_end();
}

int mode_info(const Config *c, const Options *o, int pool_blocks) {
    const DType dt = o->kv_dtype;
    const size_t es = dtype_size(dt);
    const int batch = o->batch;
    const InfoFigures f = figures_of(c, o, pool_blocks);
    if (o->json) {
        info_json(c, o, pool_blocks, &f);
        return 0;
    }
    const double gib = 1024.0 * 1024.0 * 1024.0;
    printf("variant        %s\n", variant_name(c));
    if (o->shape)
        printf("weights        generated from the seed (--shape %s): no checkpoint, no tokenizer; the text they "
               "produce means nothing\n",
               o->shape);
    printf("dtype          %s\n", c->dtype == DTYPE_BF16 ? "bf16" : "fp32");
    printf("dim %d, layers %d, heads %d x %d, kv heads %d, latent %d, rope dim %d, hidden %d, vocab %d, context %d, "
           "rope theta %g\n",
           c->dim, c->n_layers, c->n_heads, c->head_dim, c->n_kv_heads, c->kv_latent, config_rope_width(c),
           c->hidden_dim, c->vocab_size, c->max_seq_len, (double)c->rope_theta);
    printf("parameters     %zu (%.2f M), %zu bytes of weights (%.2f GiB); %zu bytes once loaded\n", f.params,
           f.params / 1e6, f.weight_bytes, f.weight_bytes / gib, f.model_bytes);
    if (dtype_packed(dt)) {
        printf("KV cache       %d-bit codes, bf16 scales and mins (KIVI), a %zu-byte fp32 tail a sequence", dtype_bits(dt),
               f.tail_bytes);
    } else if (c->variant == VARIANT_MLA) {
        if (dtype_scaled(dt))
            printf("KV cache       L*(d_c+d_R+8) = %d*(%d+%d+8)", c->n_layers, c->kv_latent, c->rope_dim);
        else
            printf("KV cache       L*(d_c+d_R)*%zu = %d*(%d+%d)*%zu", es, c->n_layers, c->kv_latent, c->rope_dim, es);
    } else {
        if (dtype_scaled(dt))
            printf("KV cache       2*L*H_kv*(d_h+4) = 2*%d*%d*(%d+4)", c->n_layers, c->n_kv_heads, c->head_dim);
        else
            printf("KV cache       2*L*H_kv*d_h*%zu = 2*%d*%d*%d*%zu", es, c->n_layers, c->n_kv_heads, c->head_dim, es);
    }
    printf(" = %zu bytes/token; %zu bytes (%.2f GiB) at the full %s of %d, %zu bytes for %d sequence%s (%s%s)\n",
           f.per_token, f.kv_full, f.kv_full / gib, o->window ? "window" : "context", f.kept, f.kv_batch, batch,
           batch > 1 ? "s" : "", kv_dtype_name(dt), dtype_scaled(dt) ? ", a 4-byte scale a vector" : "");
    if (o->window)
        printf("window         %d positions a sequence%s, %d of them sinks kept for good; evicting: %s\n", o->window,
               o->window_from_model ? " (the model's own sliding window: the default of --window)" : "",
               o->window_sinks, evict_name(o));
    printf("allocated      %zu bytes/token; %zu bytes (%s)\n", f.per_token_allocated, f.pool_bytes, kv_dtype_name(dt));
    printf("KV pool        %d blocks of %d tokens, %zu bytes each (%zu bytes); a contiguous cache of the full %s "
           "for %d sequence%s would take %zu bytes\n",
           pool_blocks, KV_BLOCK_TOKENS, f.block_bytes, f.pool_bytes, o->window ? "window" : "context", batch,
           batch > 1 ? "s" : "", f.kv_contiguous);
    if (f.tier_bytes_full)
        printf("KV tier        streams a sequence's oldest blocks from --kv-offload: %zu bytes on disk at the full "
               "context, read each pass through a staging area of %zu bytes (in --kv-mem)\n",
               f.tier_bytes_full, f.stage_bytes);
    if (f.available >= 0)
        printf("memory         weights, pool and scratch (%.2f GiB) need %.2f GiB; this machine has %.2f GiB "
               "available of %.2f GiB: %s\n",
               f.scratch_bytes / gib, f.needed / gib, f.available / gib, f.total / gib,
               f.fits ? "it fits" : "it does not fit");
    else
        printf("memory         weights, pool and scratch need %.2f GiB; this machine's memory is unknown\n",
               f.needed / gib);
    printf("kernels        %s; products past 6 tokens in tiles of %s rows x tokens\n", kernels_simd_name(),
           matmul_tiles_name());
    return 0;
}
