/* draft.c: prompt lookup (draft.h). */
#include "serve/draft.h"

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
