/* testutil.h: what the C tests share: small random checkpoints written in the
 * engine's format (docs/FORMAT.md), and file helpers. */
#ifndef TESTUTIL_H
#define TESTUTIL_H

#include <stddef.h>
#include <stdint.h>

#include "loader.h"
#include "model.h"
#include "tokenizer/spm_c.h"

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
/* Reads path as some reader of the program would: 0 or -1 with one sentence in err. */
typedef int (*PathReader)(const char *path, char *err, size_t errlen);
/* Fails the test unless `read` refuses, at once and with what fileio.c calls each, paths
 * that are not regular files: a new FIFO (whose open would block until a writer came),
 * /dev/zero (which streams without end) and a directory. An alarm turns a hang into a
 * failure. */
void expect_special_files_refused(PathReader read);
/* A path of 4000 bytes that does not exist (below /nonexistent). */
void long_missing_path(char path[4001]);
/* Runs fn(arg, worker) on every thread of a team of n threads (threads.h), as a step of
 * the forward pass runs, and returns when all have returned; n = 1: on the calling thread
 * alone. Dies (assert) when the team cannot be opened. */
void run_on_team(int n, void (*fn)(void *arg, Worker *w), void *arg);

/* Reorders a pool's free blocks (all of them free) through kv_init, kv_reserve and kv_free,
 * so that the next ones handed out are order[0], order[1], ... (order: room for n_blocks),
 * none of them at its own index and consecutive ones apart: a cache's block ids then differ
 * from their places in its table, and a read that took one for the other would land in
 * another block. A fresh pool hands out 0, 1, 2, ..., where the two agree. Returns -1 when
 * the pool has fewer than 2 blocks or some are in use. */
int scramble_free_blocks(KVPool *pool, int *order);

/* The tokenizer model the tests use (argv[1] of every test binary). */
extern const char *g_tokenizer_path;
float test_uniform(uint64_t *state); /* in [-1, 1) */

/* Protobuf wire format, to edit serialized SentencePiece models (ModelProto): a field
 * appended after a model's bytes is merged over it, so appending `3 { 2: charsmap }` replaces
 * the normalizer's precompiled_charsmap and keeps the rest. Each writes one field to out
 * (room for n + 15 bytes) and returns the bytes written. */
size_t pb_put_bytes(unsigned char *out, unsigned field, const void *data, size_t n);
size_t pb_put_varint(unsigned char *out, unsigned field, uint64_t v);
size_t pb_put_float(unsigned char *out, unsigned field, float v);
/* A malloc'd copy of a[0..na) followed by b[0..nb); its size in *n. */
unsigned char *concat_bytes(const void *a, size_t na, const void *b, size_t nb, size_t *n);

/* A SentencePiece precompiled charsmap (normalizer.cc's format: a little-endian uint32 trie
 * size in bytes, the darts-clone double array, then NUL-terminated strings) holding one rule:
 * the byte `from` becomes the string `to`. The array has 512 units: the root (0) leads to
 * block TEST_TRIE_BASE, where `from` is unit TEST_TRIE_BASE ^ from, whose leaf, the value
 * unit TEST_TRIE_LEAF, holds the offset of `to` in the strings. Tests corrupt the fields. */
enum { TEST_TRIE_UNITS = 512, TEST_TRIE_BASE = 256, TEST_TRIE_LEAF = 384 };
typedef struct {
    uint32_t trie_bytes; /* the size field: 4 * TEST_TRIE_UNITS when sound */
    uint32_t units[TEST_TRIE_UNITS];
    char strings[64];
    size_t strings_len; /* bytes of strings written, NULs included */
} TestCharsmap;
void test_charsmap_init(TestCharsmap *c, unsigned char from, const char *to);
/* Serializes c into out (room for 4 + 4 * TEST_TRIE_UNITS + strings_len bytes); returns the size. */
size_t test_charsmap_encode(const TestCharsmap *c, unsigned char *out);

#endif
