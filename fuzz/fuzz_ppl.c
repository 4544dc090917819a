/* fuzz_ppl.c: arbitrary bytes as a --ppl text file, through storyfile_parse.
 *
 * Checks textfile.h's promises: on success at least one story, each non-empty, valid
 * UTF-8 without NUL, with no white space at either end, and not a separator line; on
 * failure one non-empty message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "serve/textfile.h"
#include "kernels/utf8.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    StoryFile f;
    char err[256];
    err[0] = '\0';
    if (storyfile_parse(&f, (const char *)data, size, err, sizeof err) != 0) {
        if (err[0] == '\0' || f.stories || f.text || f.n_stories) abort();
        return 0;
    }
    if (f.n_stories < 1) abort();
    for (int i = 0; i < f.n_stories; i++) {
        const char *s = f.stories[i];
        size_t n = strlen(s);
        if (n == 0 || n > size || !utf8_valid(s, n) || is_space(s[0]) || is_space(s[n - 1])) abort();
        if (strcmp(s, "<|endoftext|>") == 0) abort();
    }
    storyfile_free(&f);
    return 0;
}
