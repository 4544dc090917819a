/* attn_dump.c: --dump-attn (attn_dump.h). */
#include "serve/attn_dump.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/errmsg.h"
#include "serve/session.h"

/* The file's header: magic, then int32s, little-endian as the records (docs/PROFILE.md). */
static const char MAGIC[8] = {'A', 'T', 'T', 'N', 'D', 'U', 'M', 'P'};
enum { ATTN_DUMP_VERSION = 1, RECORD_INTS = 6 };

static void write_all(AttnDump *d, const void *p, size_t size, size_t n) {
    if (fwrite(p, size, n, d->f) != n) die(1, "cannot write %s: %s", msg_path(d->path).s, strerror(errno));
}

/* A mask of n entries from list, or NULL for all; dies when the list names an index >= n. */
static unsigned char *mask_of(const IndexList *list, int n, const char *flag, const char *what) {
    if (list->all) return NULL;
    if (index_list_max(list) >= n)
        die(EXIT_USAGE, "%s %d is out of range: the model has %d %s (0..%d)", flag, index_list_max(list), n, what,
            n - 1);
    unsigned char *mask = calloc((size_t)n, 1);
    if (!mask) die(1, "out of memory");
    for (int i = 0; i < n; i++) mask[i] = (unsigned char)index_list_has(list, i);
    return mask;
}

void attn_dump_open(AttnDump *d, const Model *m, const Options *o, int n_sequences) {
    const Config *c = &m->cfg;
    memset(d, 0, sizeof *d);
    const int last = index_list_max(&o->dump_attn_sequences);
    if (last >= n_sequences)
        die(EXIT_USAGE, "--dump-attn-seqs %d is out of range: the run has %d sequence%s (0..%d)", last, n_sequences,
            n_sequences == 1 ? "" : "s", n_sequences - 1);
    d->path = o->dump_attn_path, d->o = o, d->cfg = c;
    d->layers = mask_of(&o->dump_attn_layers, c->n_layers, "--dump-attn-layers", "layers");
    d->heads = mask_of(&o->dump_attn_heads, c->n_heads, "--dump-attn-heads", "heads");
    d->record.layers = d->layers;
    d->record.heads = d->heads;
}

void attn_dump_begin(AttnDump *d, FILE *f) {
    const Config *c = d->cfg;
    d->f = f;
    const int32_t header[6] = {ATTN_DUMP_VERSION, c->n_layers, c->n_heads, c->max_seq_len, RECORD_INTS, 0};
    write_all(d, MAGIC, 1, sizeof MAGIC);
    write_all(d, header, sizeof header[0], 6);
}

int attn_dump_wants_step(const AttnDump *d, int step) { return index_list_has(&d->o->dump_attn_steps, step); }

void attn_dump_step(AttnDump *d, int step) {
    const AttnRecord *r = &d->record;
    for (int e = 0; e < r->n_entries; e++) {
        const AttnRecordEntry *en = &r->entries[e];
        if (!index_list_has(&d->o->dump_attn_sequences, en->sequence)) continue;
        const int32_t head[RECORD_INTS] = {step, en->sequence, en->layer, en->head, en->pos, en->n_keys};
        write_all(d, head, sizeof head[0], RECORD_INTS);
        write_all(d, r->probs + en->offset, sizeof(float), (size_t)en->n_keys);
        d->records++;
    }
}

void attn_dump_close(AttnDump *d) {
    attn_record_free(&d->record);
    free(d->layers);
    free(d->heads);
}
