/* loader.h: reading a checkpoint (docs/FORMAT.md) into a Model (config.h).
 *
 * Every number of the header is checked before it is used, the embedded tokenizer
 * must match the model, every weight must be a finite number, and the weights are packed
 * for the kernels (kernels.h); MLA's absorbed-form matrices are derived from W_UK and W_UV. */
#ifndef LOADER_H
#define LOADER_H

#include <stddef.h>

#include "model.h"

/* On failure returns -1 and writes one sentence into err. */
int model_load(Model *m, const char *path, char *err, size_t errlen);
void model_free(Model *m);

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
