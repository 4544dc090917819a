/* shape.h: --shape SPEC, a model's shape without a checkpoint (docs/SHAPES.md).
 *
 * SPEC is a preset (llama2-7b, mistral-7b, ..., or one of our five shipped shapes), a list
 * of key=value, or a preset followed by keys that override it:
 *
 *   llama2-7b                      tinyllama-1.1b,kv_heads=32 (its MHA twin)
 *   layers=2,dim=256,heads=8       tinyllama-1.1b,latent=256  (an MLA twin)
 *
 * Keys: layers, dim, heads, kv_heads, head_dim, ffn, vocab, ctx, latent, rope_dim,
 * rope_theta, window. The variant follows from the heads: latent > 0 is MLA (no KV heads;
 * rope_dim defaults to head_dim / 2, DeepSeek-V2's 64 of 128); otherwise kv_heads == heads
 * is MHA, 1 MQA, a divisor between them GQA. The weights are bf16, BOS 1, EOS 2; the
 * result passes config_check (loader.h), the same limits a checkpoint meets. */
#ifndef SHAPE_H
#define SHAPE_H

#include <stddef.h>

#include "config.h"

/* Parses spec into c: 0, or 2 (a usage error) with one sentence in err. */
int shape_parse(Config *c, const char *spec, char *err, size_t errlen);

/* The presets' names, comma-separated (for messages and -h). */
const char *shape_preset_names(void);

#endif /* SHAPE_H */
