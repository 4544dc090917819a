/* draft.c: prompt lookup (draft.h). */
#include "serve/draft.h"

#include <stdio.h>
#include <string.h>

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
