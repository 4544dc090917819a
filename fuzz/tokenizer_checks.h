/* tokenizer_checks.h: what the tokenizer harnesses (fuzz_tokenizer.c, fuzz_tokenizer_model.c)
 * check of spm_c.h on any loaded model; a broken promise calls abort(). */
#ifndef TOKENIZER_CHECKS_H
#define TOKENIZER_CHECKS_H

#include <stddef.h>

#include "tokenizer/spm_c.h"

enum { CHECK_MAX_IDS = 4096 };

/* Encodes text[0..len) with room for the full count (room 0), none (1), half (2) or one id
 * (3), and checks: SPM_ERR_TEXT exactly when utf8_valid refuses the text, SPM_ERR_TOO_LONG
 * exactly for valid text over SPM_MAX_TEXT_BYTES; for other valid text a count, or
 * SPM_ERR_OTHER when library_may_fail (a fuzzed model's library error); the same
 * full count whatever the room, nothing written past it, only ids inside the vocabulary, BOS
 * first when asked. Returns how many ids it wrote to ids (CHECK_MAX_IDS + 1 of room), or -1
 * when the text was refused or gives more than CHECK_MAX_IDS. */
int check_encode(const SpmTokenizer *t, const char *text, size_t len, int add_bos, int room, int library_may_fail,
                 int *ids);

/* Decodes ids[0..n) and checks: spm_decode gives valid UTF-8 of the length it reports; into a
 * short_size buffer a prefix, still valid UTF-8, cut at most one character early; the stream
 * (spm_stream_put per id, spm_stream_flush) gives valid UTF-8 pieces that concatenate to the
 * same text; when every id is inside the vocabulary, the text is the library's own DecodeIds
 * with its NUL bytes left out (a <0x00> piece prints nothing). */
void check_decode(const SpmTokenizer *t, const int *ids, int n, size_t short_size);

#endif
