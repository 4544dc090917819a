/* draft.h: prompt lookup, the drafter that needs no model (vLLM's "ngram", llama.cpp's
 * lookup decoding). The last n tokens of the sequence (n from NGRAM_MAX down to 1) are
 * looked for earlier in it, the most recent match first; the tokens that followed that
 * match are the draft. Stories repeat names and phrases, so a match often predicts what
 * the target will say next; with none the draft is empty and the step decodes plainly. */
#ifndef DRAFT_H
#define DRAFT_H

#include <stddef.h>

#include "model.h"

enum { NGRAM_MAX = 3 };

/* Up to k draft tokens after tokens[0 .. n) into out; returns how many (0: no match). */
int draft_ngram(const int *tokens, int n, int k, int *out);

/* The other drafter, a small model (--draft CKPT), proposes its own tokens for the target:
 * both must speak one vocabulary. 0 when draft has the target's vocabulary size, BOS and
 * EOS and a tokenizer whose every piece reads as the target's; else -1 and one sentence in
 * err. */
int draft_matches(const Model *target, const Model *draft, char *err, size_t errlen);

#endif /* DRAFT_H */
