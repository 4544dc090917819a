/* testutil.h: what the C tests share: small random checkpoints written in the
 * engine's format (docs/FORMAT.md), and file helpers. */
#ifndef TESTUTIL_H
#define TESTUTIL_H

#include <stddef.h>
#include <stdint.h>

#include "loader.h"
#include "model.h"
#include "spm_c.h"

/* A small config of a variant: dim 64, 2 layers, 4 heads of 16, hidden 96, context 64;
 * GQA 2 KV heads; MLA rope_dim 8 and the given latent. */
Config test_config(Variant v, int kv_latent, int vocab_size, DType dtype);
/* Writes a checkpoint with random weights (seeded) and the tokenizer file's bytes
 * embedded. Returns 0 on success. */
int write_test_checkpoint(const char *path, const Config *c, const char *tokenizer_path, uint64_t seed);
/* Header bytes for c, with the given section offsets (FORMAT.md layout). */
void encode_header(unsigned char h[128], const Config *c, uint64_t tok_off, uint64_t tok_size, uint64_t w_off,
                   uint64_t w_size);
unsigned char *read_whole_file(const char *path, size_t *size);
int write_whole_file(const char *path, const void *data, size_t size);
/* A unique path under build/tests/tmp for this process. */
const char *temp_path(const char *name);
/* The tokenizer model the tests use (argv[1] of every test binary). */
extern const char *g_tokenizer_path;
float test_uniform(uint64_t *state);  /* in [-1, 1) */

#endif
