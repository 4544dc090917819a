/* fuzz_tokenizer_model.c: arbitrary bytes as a serialized SentencePiece model (the tokenizer a
 * checkpoint embeds), then text and ids through it.
 *
 * Input: byte 0: add_bos (bit 0) and the room for ids (bits 1-2: exact, none, half, one);
 * byte 1 sizes a short decode buffer; bytes 2-3 the text's length (little endian, cut to what
 * is there); the text; the rest is the model, loaded with spm_load_bytes. When it loads, the
 * text is encoded (invalid UTF-8 and NUL bytes included) and its ids decoded, then the
 * text's bytes, read as uint16 and mapped to -1 .. vocabulary size, are decoded as ids.
 *
 * Checked, besides memory errors: a refusal is one non-empty line; a loaded model keeps
 * tokenizer_checks.h's promises (the library may refuse valid text only with SPM_ERR_OTHER). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/spm_c.h"
#include "tokenizer_checks.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 4) return 0;
    const int add_bos = data[0] & 1, room = (data[0] >> 1) & 3;
    const size_t short_size = data[1];
    size_t text_len = (size_t)data[2] | (size_t)data[3] << 8;
    if (text_len > size - 4) text_len = size - 4;
    const char *text = (const char *)data + 4;
    char err[512];
    err[0] = 'x';
    SpmTokenizer *t = spm_load_bytes(data + 4 + text_len, size - 4 - text_len, err, sizeof err);
    if (!t) {
        const size_t n = strnlen(err, sizeof err);
        if (n == 0 || n == sizeof err || memchr(err, '\n', n)) abort();
        return 0;
    }
    static int ids[CHECK_MAX_IDS + 1];
    int n = check_encode(t, text, text_len, add_bos, room, 1, ids);
    if (n >= 0) check_decode(t, ids, n, short_size);
    n = (int)(text_len / 2);
    if (n > CHECK_MAX_IDS) n = CHECK_MAX_IDS;
    const unsigned span = (unsigned)spm_vocab_size(t) + 2; /* mostly pieces, some out of range */
    for (int i = 0; i < n; i++)
        ids[i] = (int)(((uint8_t)text[2 * i] | (unsigned)(uint8_t)text[2 * i + 1] << 8) % span) - 1;
    check_decode(t, ids, n, short_size);
    spm_free(t);
    return 0;
}
