/* draft.h: prompt lookup, the drafter that needs no model (vLLM's "ngram", llama.cpp's
 * lookup decoding). The last n tokens of the sequence (n from NGRAM_MAX down to 1) are
 * looked for earlier in it, the most recent match first; the tokens that followed that
 * match are the draft. Stories repeat names and phrases, so a match often predicts what
 * the target will say next; with none the draft is empty and the step decodes plainly. */
#ifndef DRAFT_H
#define DRAFT_H

enum { NGRAM_MAX = 3 };

/* Up to k draft tokens after tokens[0 .. n) into out; returns how many (0: no match). */
int draft_ngram(const int *tokens, int n, int k, int *out);

#endif /* DRAFT_H */
