/* tokenizer_checks.c: see tokenizer_checks.h */
#include "tokenizer_checks.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/utf8.h"

#define TEXT_CAP (1 << 20)

long spm_test_library_decode(const SpmTokenizer *t, const int *ids, int n, char *buf, size_t bufsize);

static char *g_a, *g_b, *g_c; /* TEXT_CAP each */

static void init_buffers(void) {
    if (g_a) return;
    g_a = malloc(TEXT_CAP);
    g_b = malloc(TEXT_CAP);
    g_c = malloc(TEXT_CAP);
    if (!g_a || !g_b || !g_c) abort();
}

int check_encode(const SpmTokenizer *t, const char *text, size_t len, int add_bos, int room, int library_may_fail,
                 int *ids) {
    const int full = spm_encode(t, text, len, add_bos, NULL, 0);
    const int valid = len == 0 || utf8_valid(text, len);
    const int too_long = valid && len > SPM_MAX_TEXT_BYTES;
    if ((full == SPM_ERR_TEXT) == valid || (full == SPM_ERR_TOO_LONG) != too_long ||
        (full < 0 && full != SPM_ERR_TEXT && full != SPM_ERR_TOO_LONG &&
         !(library_may_fail && full == SPM_ERR_OTHER))) {
        fprintf(stderr, "spm_encode says %d, utf8_valid says %d\n", full, valid);
        abort();
    }
    if (full < 0 || full > CHECK_MAX_IDS) return -1; /* refused, or too long to check the rest: fine */
    const int max_ids = room == 0 ? full : room == 1 ? 0 : room == 2 ? full / 2 : (full > 0 ? 1 : 0);
    ids[max_ids] = -7; /* a canary just past the room */
    if (spm_encode(t, text, len, add_bos, max_ids ? ids : NULL, max_ids) != full || ids[max_ids] != -7) abort();
    for (int i = 0; i < max_ids; i++)
        if (ids[i] < 0 || ids[i] >= spm_vocab_size(t)) abort();
    if (add_bos && max_ids > 0 && ids[0] != spm_bos_id(t)) abort();
    return max_ids;
}

/* Checks spm_decode's text in g_a (length len) against the library's DecodeIds. */
static void check_against_library(const SpmTokenizer *t, const int *ids, int n, size_t len) {
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= spm_vocab_size(t)) return; /* the library refuses these */
    long lib = spm_test_library_decode(t, ids, n, g_c, TEXT_CAP);
    if (lib < 0 || lib >= TEXT_CAP) {
        if (lib < 0) abort();
        return;
    }
    size_t kept = 0; /* the library's text without its NUL bytes */
    for (long i = 0; i < lib; i++)
        if (g_c[i] != '\0') g_c[kept++] = g_c[i];
    if (kept != len || memcmp(g_a, g_c, len) != 0) {
        fprintf(stderr, "library [%.*s]\nours    [%.*s]\n", (int)kept, g_c, (int)len, g_a);
        abort();
    }
}

void check_decode(const SpmTokenizer *t, const int *ids, int n, size_t short_size) {
    init_buffers();
    size_t len = spm_decode(t, ids, n, g_a, TEXT_CAP);
    if (len >= TEXT_CAP) return; /* did not fit: nothing more to compare */
    if (strlen(g_a) != len || !utf8_valid(g_a, len)) abort();
    /* a short buffer: a prefix, valid UTF-8, the same reported length */
    if (spm_decode(t, ids, n, short_size ? g_b : NULL, short_size) != len) abort();
    if (short_size > 0) {
        size_t cut = strlen(g_b);
        if (cut >= short_size || memcmp(g_a, g_b, cut) != 0 || !utf8_valid(g_b, cut)) abort();
        if (short_size > len && cut != len) abort();
        if (cut + 4 < short_size && cut < len) abort(); /* cut no further back than one character */
    }
    /* the stream */
    SpmStream *s = spm_stream_new(t);
    if (!s) abort();
    size_t at = 0;
    for (int i = 0; i <= n; i++) {
        const char *piece = i < n ? spm_stream_put(s, ids[i]) : spm_stream_flush(s);
        size_t pl = strlen(piece);
        if (!utf8_valid(piece, pl) || at + pl > len || memcmp(g_a + at, piece, pl) != 0) abort();
        at += pl;
    }
    if (at != len || spm_stream_flush(s)[0] != '\0') abort();
    spm_stream_free(s);
    check_against_library(t, ids, n, len);
}
