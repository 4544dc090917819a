/* draft.h: the drafters that need no model. Prompt lookup (vLLM's "ngram", llama.cpp's
 * lookup decoding): the last n tokens of the sequence (n from NGRAM_MAX down to 1) are
 * looked for earlier in it, the most recent match first; the tokens that followed that
 * match are the draft. Stories repeat names and phrases, so a match often predicts what
 * the target will say next; with none the draft is empty and the step decodes plainly.
 * A corpus table (--draft TABLE, llama.cpp's static lookup cache): the token that most
 * often followed each context of the training stories. */
#ifndef DRAFT_H
#define DRAFT_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"

enum { NGRAM_MAX = 3 };

/* Up to k draft tokens after tokens[0 .. n) into out; returns how many (0: no match). */
int draft_ngram(const int *tokens, int n, int k, int *out);

/* A corpus n-gram table (train/ngram.py writes it; docs/FORMAT.md, "N-gram table"): for
 * contexts of 1 to orders tokens, the next token to draft. Each order is a hash table of
 * its contexts, so a lookup costs one or two probes. */
enum { NGRAM_TABLE_MAX_ORDERS = 8 };
typedef struct {
    int orders, vocab_size;
    long count[NGRAM_TABLE_MAX_ORDERS + 1];        /* contexts of each order */
    uint16_t *entries[NGRAM_TABLE_MAX_ORDERS + 1]; /* (count[n], n + 1): a context's ids, oldest
                                                    * first, then its next token */
    uint32_t *slots[NGRAM_TABLE_MAX_ORDERS + 1];   /* (mask[n] + 1) entry index + 1; 0: empty */
    uint32_t mask[NGRAM_TABLE_MAX_ORDERS + 1];
} NgramTable;

/* Reads and checks the table at path for target: its vocabulary and tokenizer pieces must
 * be the target's. Returns 0; 1 when the file does not begin as a table does (or cannot be
 * read: the checkpoint loader then says why), t holding nothing and err untouched; or -1
 * with one sentence in err (t holding nothing). */
int ngram_table_load(NgramTable *t, const char *path, const Model *target, char *err, size_t errlen);
void ngram_table_free(NgramTable *t);

/* Up to k draft tokens after tokens[0 .. n) into out, each the table's next token for the
 * longest context it holds that ends the sequence so far (the drafts included); returns
 * how many (0: the table holds no context of the last token). */
int draft_table(const NgramTable *t, const int *tokens, int n, int k, int *out);

/* The other drafter, a small model (--draft CKPT), proposes its own tokens for the target:
 * both must speak one vocabulary. 0 when draft has the target's vocabulary size, BOS and
 * EOS and a tokenizer whose every piece reads as the target's; else -1 and one sentence in
 * err. */
int draft_matches(const Model *target, const Model *draft, char *err, size_t errlen);

#endif /* DRAFT_H */
