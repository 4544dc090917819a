/* loader.h: reading a checkpoint (docs/FORMAT.md) into a Model (config.h).
 *
 * Every number of the header is checked before it is used, the embedded tokenizer
 * must match the model, every weight must be a finite number, and the weights are packed
 * for the kernels (kernels.h); MLA's absorbed-form matrices are derived from W_UK and W_UV. */
#ifndef LOADER_H
#define LOADER_H

#include <stddef.h>

#include "model.h"

/* The limits of a model's numbers, for checkpoints and --shape alike. */
enum { MAX_DIM = 65536, MAX_LAYERS = 256, MAX_VOCAB = 262144 };

/* On failure returns -1 and writes one sentence into err. */
int model_load(Model *m, const char *path, char *err, size_t errlen);
/* The same, with the context cut to ctx positions (0: the trained context; never more than
 * it), before the RoPE tables are sized. */
int model_load_with_context(Model *m, const char *path, int ctx, char *err, size_t errlen);
/* A checkpoint's checked configuration from its header and section sizes alone: no
 * tokenizer, no weights are read. */
int model_read_config(Config *c, const char *path, char *err, size_t errlen);

/* model_load in two steps over one open file, so that a run can size everything from the
 * header before it allocates anything, and the file read is the one whose size was taken:
 * checkpoint_open reads and checks the header (cfg), checkpoint_load the tokenizer and the
 * weights (as model_load_with_context), checkpoint_close closes the file. */
typedef struct {
    int fd;
    const char *path;
    size_t size;
    Config cfg;
    uint64_t tok_off, tok_size, w_off;
} Checkpoint;
int checkpoint_open(Checkpoint *ck, const char *path, char *err, size_t errlen);
int checkpoint_load(Model *m, const Checkpoint *ck, int ctx, char *err, size_t errlen);
/* The embedded tokenizer, loaded and checked against the header (its pieces, BOS and EOS);
 * NULL with one sentence in err when it is not what the header says (checkpoint_load's
 * first step; --info's only one besides the header). */
SpmTokenizer *checkpoint_tokenizer(const Checkpoint *ck, char *err, size_t errlen);
void checkpoint_close(Checkpoint *ck);
/* Checks a configuration against the limits above, the variant's head counts and the RoPE
 * tables' bound; `what` starts the message: "checkpoint", whose messages name the header's
 * fields, or a flag ("--shape", "-c"), whose messages name --shape's keys. 0 or -1. */
int config_check(const Config *c, const char *what, char *err, size_t errlen);
/* A model of shape c (bf16, checked by config_check) whose weights are generated from seed
 * (loader.c's generate_tensor: deterministic, norms of 1, matrices of std 0.02), packed as
 * model_load packs a file's, MLA's absorbed matrices derived alike; no tokenizer (NULL). */
int model_generate(Model *m, const Config *c, uint64_t seed, char *err, size_t errlen);
void model_free(Model *m);
/* Bytes a model of shape c takes once loaded: its weights, MLA's derived matrices, the
 * RoPE tables (the rest is small). */
size_t model_bytes_for(const Config *c);

/* "mha", "gqa", "mqa", "mla64", "mla128", ... */
const char *variant_name(const Config *c);

/* One tensor of the file: its field in the weights, its shape, and its name as
 * docs/FORMAT.md lists it (layer -1: not a layer's). */
typedef struct {
    Mat *mat;
    int rows, cols;
    const char *name;
    int layer;
} TensorRef;

/* Visits the tensors in file order (docs/FORMAT.md); w->layers must have n_layers entries. */
typedef void (*TensorVisitor)(void *ctx, const TensorRef *t);
void model_walk_tensors(const Config *c, Weights *w, TensorVisitor visit, void *ctx);
size_t model_param_count(const Config *c);

#endif /* LOADER_H */
