/* spm_c.h: a small C API over the SentencePiece C++ library (spm_c.cc).
 *
 * Loading, encoding and a streaming decoder that prints text as tokens are generated.
 * No C++ exception ever crosses this API: every function catches everything and reports
 * an error through its return value. A loaded SpmTokenizer is read-only, so several
 * threads may use one at a time; an SpmStream belongs to one thread. */
#ifndef SPM_C_H
#define SPM_C_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct SpmTokenizer SpmTokenizer;

/* Loading: on failure return NULL and write one clear sentence into err (errlen bytes,
 * always NUL-terminated; err may be NULL when errlen is 0). The model is untrusted input:
 * one the library could not use safely, or whose text this API could not print as promised,
 * is refused the same way: a malformed precompiled_charsmap in its normalizer, any
 * denormalizer, a piece that is not valid UTF-8 or holds a NUL byte, a score that is not a
 * finite number, an unknown surface (unk_surface) that is not valid UTF-8. */
SpmTokenizer *spm_load_file(const char *path, char *err, size_t errlen);
/* data: a serialized ModelProto (the bytes of a .model file); the bytes are copied. */
SpmTokenizer *spm_load_bytes(const void *data, size_t size, char *err, size_t errlen);
void spm_free(SpmTokenizer *t); /* NULL is fine */

/* Number of pieces (ids are 0 .. vocab_size - 1); 0 for NULL. */
int spm_vocab_size(const SpmTokenizer *t);
/* BOS / EOS ids, or -1 when the model has none (or t is NULL). */
int spm_bos_id(const SpmTokenizer *t);
int spm_eos_id(const SpmTokenizer *t);
/* Piece id as the model stores it ("\xe2\x96\x81the", "<0x0A>"), valid while t lives; NULL for an
 * id out of range (or t NULL). */
const char *spm_piece(const SpmTokenizer *t, int id);

/* spm_encode's errors: distinct negative values, so that callers can say what went wrong. */
enum {
    SPM_ERR_TEXT = -1,     /* the text is not valid UTF-8 (overlong forms, surrogates and code
                           points above U+10FFFF included) or holds a NUL byte */
    SPM_ERR_NOMEM = -2,    /* out of memory */
    SPM_ERR_OTHER = -3,    /* bad arguments, add_bos on a model without BOS, more than INT_MAX
                           ids, or the library reported an error */
    SPM_ERR_TOO_LONG = -4, /* valid text of more than SPM_MAX_TEXT_BYTES bytes */
};

/* The longest text spm_encode takes: the library's memory grows with the text it encodes
 * at once, many times faster than the text, so a longer one is refused before it gets there. */
enum { SPM_MAX_TEXT_BYTES = 1 << 18 };

/* Encodes text (len bytes, not necessarily NUL-terminated). Prepends BOS when add_bos.
 * Returns the number of ids (may exceed max_ids: then only max_ids were written, so callers
 * can detect "too long"), or one of the SPM_ERR_* values above. ids may be NULL when max_ids
 * is 0. */
int spm_encode(const SpmTokenizer *t, const char *text, size_t len, int add_bos, int *ids, int max_ids);

/* Streaming decoder: feed one id at a time as tokens are generated; it returns text that is
 * ready to print. Feeding a whole sequence and then calling spm_stream_flush gives exactly
 * what SentencePiece's DecodeIds gives for that sequence (with NUL bytes left out: a <0x00>
 * byte piece prints nothing). The stream keeps a pointer to t: free the stream first. */
typedef struct SpmStream SpmStream;
SpmStream *spm_stream_new(const SpmTokenizer *t); /* NULL on bad argument or no memory */
void spm_stream_free(SpmStream *s);               /* NULL is fine */

/* Appends the text of `id` to the stream and returns a NUL-terminated string of newly
 * completed text (valid UTF-8), owned by the stream and valid until the next call. Rules:
 * - normal pieces: U+2581 becomes ' '; while the stream has emitted nothing yet, a piece
 *   loses one leading space (SentencePiece's dummy prefix) when the model's normalizer adds
 *   one, as DecodeIds does for the whole sequence;
 * - byte-fallback pieces (<0xNN>): bytes are buffered until they form complete UTF-8
 *   characters, then emitted; an invalid or interrupted byte sequence becomes U+FFFD per bad
 *   byte, as SentencePiece's decoder does;
 * - control ids (BOS/EOS) emit nothing of their own but, like any non-byte piece, end a
 *   pending byte sequence (whose bytes then come out as U+FFFD, as in DecodeIds);
 * - out-of-range ids (id < 0 or >= vocab size) are ignored: they emit nothing and leave the
 *   stream as it was;
 * - unknown (<unk>) emits the model's unknown surface, by default " \u2047 ".
 * Returns "" (never NULL) when nothing is ready or on any error. */
const char *spm_stream_put(SpmStream *s, int id);
/* Flushes any buffered incomplete bytes (as U+FFFD each) at the end of generation; the
 * stream can go on being used afterwards. Returns "" (never NULL) when nothing was pending. */
const char *spm_stream_flush(SpmStream *s);

/* Decodes a whole id sequence into buf (NUL-terminated, truncated to bufsize, cut at a UTF-8
 * character boundary so buf stays valid UTF-8); returns the full length needed, without the
 * NUL (as snprintf does). Same rules as the stream, including the final flush. buf may be
 * NULL when bufsize is 0. Returns 0 (and writes "" when it can) on bad arguments. */
size_t spm_decode(const SpmTokenizer *t, const int *ids, int n, char *buf, size_t bufsize);

#ifdef __cplusplus
}
#endif

#endif /* SPM_C_H */
