/* draft.c: prompt lookup and the corpus table (draft.h). */
#include "serve/draft.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/errmsg.h"
#include "kernels/fileio.h"
#include "tokenizer/spm_c.h"

int draft_ngram(const int *tokens, int n, int k, int *out) {
    for (int len = n - 1 < NGRAM_MAX ? n - 1 : NGRAM_MAX; len >= 1; len--) {
        const int *suffix = tokens + n - len;
        /* a match starts at s < n - len, so at least one token follows it */
        for (int s = n - len - 1; s >= 0; s--) {
            int same = 1;
            for (int i = 0; i < len && same; i++) same = tokens[s + i] == suffix[i];
            if (!same) continue;
            int count = 0;
            for (int i = s + len; i < n && count < k; i++) out[count++] = tokens[i];
            return count;
        }
    }
    return 0;
}

/* A piece twice over: alone, a leading space would be dropped at the start of the text. */
static size_t piece_text(const SpmTokenizer *t, int id, char *buf, size_t size) {
    const int twice[2] = {id, id};
    return spm_decode(t, twice, 2, buf, size);
}

int draft_matches(const Model *target, const Model *draft, char *err, size_t errlen) {
    const Config *a = &target->cfg, *b = &draft->cfg;
    if (!target->tokenizer || !draft->tokenizer) {
        snprintf(err, errlen, "a draft model needs a target and a draft with a tokenizer (a checkpoint, not --shape)");
        return -1;
    }
    if (a->vocab_size != b->vocab_size || a->bos_id != b->bos_id || a->eos_id != b->eos_id) {
        snprintf(err, errlen, "its vocabulary (%d tokens, BOS %d, EOS %d) is not the target's (%d, BOS %d, EOS %d)",
                 b->vocab_size, b->bos_id, b->eos_id, a->vocab_size, a->bos_id, a->eos_id);
        return -1;
    }
    char x[256], y[256];
    for (int id = 0; id < a->vocab_size; id++) {
        const size_t nx = piece_text(target->tokenizer, id, x, sizeof x), ny = piece_text(draft->tokenizer, id, y, sizeof y);
        if (nx != ny || memcmp(x, y, nx < sizeof x ? nx : sizeof x - 1) != 0) {
            snprintf(err, errlen, "its tokenizer is not the target's: token %d reads differently", id);
            return -1;
        }
    }
    return 0;
}

/* ---- the corpus table ---- */

static const char TABLE_MAGIC[8] = {'R', 'U', 'N', 'N', 'G', 'R', 'A', 'M'};
enum { TABLE_VERSION = 1, TABLE_HEADER_BYTES = 32 }; /* then a u32 count per order */
enum { MAX_CONTEXTS = 1 << 30 };                     /* an order's, so that its slots' count fits 32 bits */

static uint32_t le32(const unsigned char *b) {
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}
static uint64_t le64(const unsigned char *b) { return (uint64_t)le32(b) | (uint64_t)le32(b + 4) << 32; }

/* FNV-1a over every piece's bytes and a 0 byte, ids in order: train/ngram.py's pieces_hash. */
static uint64_t pieces_hash(const SpmTokenizer *tok) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int id = 0; id < spm_vocab_size(tok); id++) {
        const char *piece = spm_piece(tok, id);
        const unsigned char *p = (const unsigned char *)(piece ? piece : "");
        do h = (h ^ *p) * 0x100000001b3ull;
        while (*p++);
    }
    return h;
}

/* The slot a context of n ids hashes to: FNV-1a over the ids, folded to 32 bits. */
static uint32_t context_hash(const int *ids, int n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < n; i++) h = (h ^ (uint64_t)ids[i]) * 0x100000001b3ull;
    return (uint32_t)(h ^ h >> 32);
}

static int context_equal(const uint16_t *entry, const int *ids, int n) {
    for (int i = 0; i < n; i++)
        if (entry[i] != ids[i]) return 0;
    return 1;
}

/* The next token of the context ids[0 .. n), or -1 when the table holds none. */
static int table_next(const NgramTable *t, const int *ids, int n) {
    for (uint32_t s = context_hash(ids, n) & t->mask[n];; s = (s + 1) & t->mask[n]) {
        const uint32_t e = t->slots[n][s];
        if (!e) return -1;
        const uint16_t *entry = t->entries[n] + (size_t)(e - 1) * (size_t)(n + 1);
        if (context_equal(entry, ids, n)) return entry[n];
    }
}

int draft_table(const NgramTable *t, const int *tokens, int n, int k, int *out) {
    int recent[NGRAM_TABLE_MAX_ORDERS]; /* the sequence's last tokens, the drafts so far included */
    int have = n < t->orders ? n : t->orders, count = 0;
    memcpy(recent, tokens + n - have, (size_t)have * sizeof *recent);
    while (count < k) {
        int next = -1;
        for (int len = have; len >= 1 && next < 0; len--) next = table_next(t, recent + have - len, len);
        if (next < 0) break;
        out[count++] = next;
        if (have == t->orders) memmove(recent, recent + 1, (size_t)--have * sizeof *recent);
        recent[have++] = next;
    }
    return count;
}

void ngram_table_free(NgramTable *t) {
    for (int n = 0; n <= NGRAM_TABLE_MAX_ORDERS; n++) free(t->entries[n]), free(t->slots[n]);
    memset(t, 0, sizeof *t);
}

/* Reads order n's count[n] entries at *off and indexes them; 0, or -1 with err. */
static int load_order(NgramTable *t, int fd, size_t *off, int n, const char *path, char *err, size_t errlen) {
    const size_t width = (size_t)n + 1, bytes = (size_t)t->count[n] * width * 2;
    unsigned char *raw = malloc(bytes ? bytes : 1);
    uint32_t cap = 2;
    while (cap < 2 * (uint64_t)t->count[n]) cap *= 2;
    t->entries[n] = malloc((size_t)t->count[n] * width * sizeof(uint16_t) + 1);
    t->slots[n] = calloc(cap, sizeof(uint32_t));
    t->mask[n] = cap - 1;
    if (!raw || !t->entries[n] || !t->slots[n]) {
        free(raw);
        return errmsg(err, errlen, -1, "--draft %s: out of memory for its %ld contexts of %d tokens", msg_path(path).s,
                      t->count[n], n);
    }
    if (read_at(fd, raw, bytes, *off) != 0) {
        free(raw);
        return errmsg(err, errlen, -1, "--draft %s: %s", msg_path(path).s, errno ? strerror(errno) : "it ended early");
    }
    *off += bytes;
    for (size_t i = 0; i < (size_t)t->count[n] * width; i++)
        t->entries[n][i] = (uint16_t)(raw[2 * i] | raw[2 * i + 1] << 8);
    free(raw);
    for (long e = 0; e < t->count[n]; e++) {
        const uint16_t *entry = t->entries[n] + (size_t)e * width;
        int ids[NGRAM_TABLE_MAX_ORDERS + 1];
        for (int i = 0; i <= n; i++) {
            if (entry[i] >= t->vocab_size)
                return errmsg(err, errlen, -1,
                              "--draft %s: context %ld of %d tokens holds token %d, past the vocabulary",
                              msg_path(path).s, e, n, entry[i]);
            ids[i] = entry[i];
        }
        uint32_t s = context_hash(ids, n) & t->mask[n];
        for (; t->slots[n][s]; s = (s + 1) & t->mask[n])
            if (context_equal(t->entries[n] + (size_t)(t->slots[n][s] - 1) * width, ids, n))
                return errmsg(err, errlen, -1, "--draft %s: context %ld of %d tokens appears twice", msg_path(path).s,
                              e, n);
        t->slots[n][s] = (uint32_t)e + 1;
    }
    return 0;
}

int ngram_table_load(NgramTable *t, const char *path, const Model *target, char *err, size_t errlen) {
    memset(t, 0, sizeof *t);
    char open_err[8];
    size_t size;
    const int fd = open_regular(path, "", &size, open_err, sizeof open_err);
    if (fd < 0) return 1;
    unsigned char head[TABLE_HEADER_BYTES + 4 * NGRAM_TABLE_MAX_ORDERS];
    if (size < sizeof TABLE_MAGIC || read_at(fd, head, sizeof TABLE_MAGIC, 0) != 0 ||
        memcmp(head, TABLE_MAGIC, sizeof TABLE_MAGIC) != 0) {
        close(fd);
        return 1;
    }
    int rc = -1;
    if (!target->tokenizer) {
        errmsg(err, errlen, -1, "--draft %s: a table drafts for a model with a tokenizer (a checkpoint, not --shape)",
               msg_path(path).s);
        goto out;
    }
    if (size < TABLE_HEADER_BYTES || read_at(fd, head, TABLE_HEADER_BYTES, 0) != 0) {
        errmsg(err, errlen, -1, "--draft %s: too short for an n-gram table's header", msg_path(path).s);
        goto out;
    }
    const uint32_t version = le32(head + 8), vocab = le32(head + 12), orders = le32(head + 16);
    if (version != TABLE_VERSION) {
        errmsg(err, errlen, -1, "--draft %s: an n-gram table of version %u, where this program reads version %d",
               msg_path(path).s, version, TABLE_VERSION);
        goto out;
    }
    if (le32(head + 20) != 0) {
        errmsg(err, errlen, -1, "--draft %s: the n-gram table's reserved field is not 0", msg_path(path).s);
        goto out;
    }
    if (orders < 1 || orders > NGRAM_TABLE_MAX_ORDERS) {
        errmsg(err, errlen, -1, "--draft %s: contexts of up to %u tokens, where 1 to %d are allowed", msg_path(path).s,
               orders, NGRAM_TABLE_MAX_ORDERS);
        goto out;
    }
    if ((int)vocab != target->cfg.vocab_size || le64(head + 24) != pieces_hash(target->tokenizer)) {
        errmsg(
            err, errlen, -1, "--draft %s: the table was built with another tokenizer than the target's (%u tokens, %s)",
            msg_path(path).s, vocab, (int)vocab == target->cfg.vocab_size ? "other pieces" : "another vocabulary size");
        goto out;
    }
    t->orders = (int)orders, t->vocab_size = (int)vocab;
    size_t off = TABLE_HEADER_BYTES + 4 * (size_t)orders, want = off;
    if (size < off || read_at(fd, head + TABLE_HEADER_BYTES, 4 * (size_t)orders, TABLE_HEADER_BYTES) != 0) {
        errmsg(err, errlen, -1, "--draft %s: too short for an n-gram table's header", msg_path(path).s);
        goto out;
    }
    for (int n = 1; n <= t->orders; n++) {
        t->count[n] = le32(head + TABLE_HEADER_BYTES + 4 * (n - 1));
        if (t->count[n] > MAX_CONTEXTS) {
            errmsg(err, errlen, -1, "--draft %s: %ld contexts of %d tokens, more than the %d a table may hold",
                   msg_path(path).s, t->count[n], n, MAX_CONTEXTS);
            goto out;
        }
        want += (size_t)t->count[n] * ((size_t)n + 1) * 2;
    }
    if (want != size) {
        errmsg(err, errlen, -1, "--draft %s: %zu bytes, where its header gives %zu", msg_path(path).s, size, want);
        goto out;
    }
    for (int n = 1; n <= t->orders; n++)
        if (load_order(t, fd, &off, n, path, err, errlen) != 0) goto out;
    rc = 0;
out:
    close(fd);
    if (rc != 0) ngram_table_free(t);
    return rc;
}
