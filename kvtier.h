/* kvtier.h: a second tier for the KV cache, a file on disk behind the pool (--kv-offload).
 *
 * The tier is one file of block-sized slots. A preempted sequence's blocks are written to
 * slots (swap out) and read back into fresh pool blocks when it is admitted again (swap
 * in), instead of being recomputed. Each slot keeps a checksum of what was written, so a
 * block that comes back different is refused, never attended over.
 *
 * The file is created exclusively (a path that exists is refused, never overwritten) and
 * unlinked as soon as it is open: the data lives on while the descriptor does, and the
 * kernel removes it at any exit, on error, on SIGINT/SIGTERM and even on SIGKILL, with no
 * handler to get wrong. A file rather than a directory: one descriptor, one allocation of
 * slots, nothing to clean up but the descriptor. */
#ifndef KVTIER_H
#define KVTIER_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "kvcache.h"

typedef struct KVTier {
    int fd;
    size_t block_bytes;
    int n_slots;          /* slots the file has held at most: its size in blocks */
    uint64_t *sums;       /* (cap) checksum of each slot's block */
    int *free_slots, n_free, cap;
    /* what it did, for --info and the summary */
    int peak_slots;       /* slots in use at once, at most */
    long blocks_written, blocks_read;
    long blocks_kept;     /* blocks a swap held in the pool instead of writing: they were shared */
    double wait_ms;       /* spent in writes and reads */
} KVTier;

/* Creates the file at path (O_EXCL) and unlinks it. Returns -1 with errno set. */
int kv_tier_open(KVTier *t, const char *path, size_t block_bytes);
void kv_tier_close(KVTier *t);
/* Writes one block to a free slot. Returns the slot, or -1 (errno set; ENOSPC, EFBIG or
 * EIO for a short write), the slot given back. */
int kv_tier_write(KVTier *t, const void *block);
/* Reads slot back into block. Returns 0, or -1 on a short read (EIO) or a checksum that
 * does not match (EBADMSG). */
int kv_tier_read(KVTier *t, int slot, void *block);
void kv_tier_release(KVTier *t, int slot);
static inline int kv_tier_in_use(const KVTier *t) { return t->n_slots - t->n_free; }
/* 64-bit checksum of n bytes (n a multiple of 8). */
uint64_t kv_tier_checksum(const void *p, size_t n);

/* A sequence's cache swapped out: the slot of each of its blocks, and its length. A block
 * another sequence shares at the swap is not written: the swap holds it in the pool (a
 * shared block is copied before any write, so its contents stay), and the sequence takes
 * it back when it is swapped in. A prefix that preempted sequences share is thus swapped
 * once: it is written by none of them and stays in the pool once. */
typedef struct {
    KVPool *pool;
    int *slots; /* (n_blocks) the tier slot, or -1 - b: pool block b, held */
    int n_blocks, len;
    int n_kept; /* of them, held in the pool */
} KVSwapped;

/* Writes cache's blocks to the tier (those it shares: held instead) and resets the cache
 * (its blocks go back to the pool). Returns -1, with the cache reset and nothing held on
 * the tier or in the pool, when a write fails: the sequence is then recomputed. No window. */
int kv_swap_out(KVCache *cache, KVTier *t, KVSwapped *s);
/* Reads s back into cache (empty), its held blocks back in their places, and gives its
 * slots back. Returns -1, the cache reset and the slots and held blocks given back, when
 * the pool is short, or a read or a checksum fails. */
int kv_swap_in(KVCache *cache, KVTier *t, KVSwapped *s);
/* Gives s's slots and held blocks back without reading them. */
void kv_swap_drop(KVTier *t, KVSwapped *s);

/* Streaming: one sequence whose cache outgrows the pool (--kv-offload at --batch 1).
 *
 * When the pool runs short, the sequence's oldest blocks go to the tier (kv_stream_spill)
 * and stay there: a query reads every position, oldest first, so the oldest blocks are
 * the ones each layer reads first, and read-ahead starts from them; the newest block,
 * which the pass writes, is always in the pool. Every pass reads each layer of them once,
 * in order, into a staging area the cache's rows then point into (KVCache's stage), so
 * attention sees the same rows in the same order as from the pool: the same bits.
 *
 * On the tier the streamed blocks lie layer-major, (n_layers, max_blocks, layer_bytes), so
 * a layer of them is one sequential read. A reader thread reads layer k of a pass into
 * stage[k % 2] with pread while attention computes layer k - 1 from the other: one layer
 * of read-ahead, double-buffered; the staging area (2 * max_blocks * layer_bytes) is part
 * of the RAM budget (--kv-mem). Each layer of each block has a checksum; a short read or a
 * mismatch ends the pass with an error (model.h's MODEL_ERR_TIER), never with an output.
 *
 * The page cache is bypassed in effect: the reader drops each layer's pages after reading
 * them (POSIX_FADV_DONTNEED), and spilled blocks are written back and dropped
 * (fdatasync, then DONTNEED) before the next pass reads them, so the cache the tier holds
 * takes no RAM and every read comes from the disk.
 *
 * Streaming uses the tier file from offset 0; it is only opened where no sequence is
 * ever swapped (one slot: nothing to preempt). */
typedef struct KVStream {
    KVTier *tier;
    int n_layers, max_blocks;
    size_t layer_bytes;
    uint64_t *sums;          /* (n_layers, max_blocks) checksum of each streamed block's layers */
    int n;                   /* blocks on the tier: the sequence's first n */
    int unsettled;           /* of them, spilled since the last write-back */
    unsigned char *stage[2]; /* (max_blocks, layer_bytes) each */
    pthread_t reader;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int started, closing;
    long asked, read, used; /* layers since open: asked of the reader, read by it, done with */
    int n_pass;             /* blocks the layers of the pass being run cover */
    int err;                /* errno of the first failed read, write or checksum; 0 */
    /* what it did, for the summary */
    int peak_blocks;
    long blocks_written;     /* blocks spilled */
    long layers_read;        /* block layers read */
    double wait_ms, read_ms; /* attention waiting for a layer; the reader reading */
} KVStream;

/* Staging bytes of a stream of up to max_blocks blocks. */
size_t kv_stream_stage_bytes(const KVPool *p, int max_blocks);
/* A stream over t for sequences of up to max_blocks blocks of pool p: allocates the
 * staging area and starts the reader. Returns -1 (errno set). */
int kv_stream_open(KVStream *s, KVTier *t, const KVPool *p, int max_blocks);
void kv_stream_close(KVStream *s);
/* Starts its figures (blocks, bytes, times) over: the warm-up's are not the run's. */
void kv_stream_restart_figures(KVStream *s);
/* Moves up to `blocks` of cache's oldest pool blocks to the tier (those its next pass does
 * not write: wholly below len), between passes. Returns how many it moved, or -1 when a
 * write fails (errno set: ENOSPC, EFBIG, EIO), the cache unchanged. */
int kv_stream_spill(KVStream *s, KVCache *cache, int blocks);
/* Gives the tier's blocks of cache back (before kv_reset / kv_free). */
void kv_stream_drop(KVStream *s, KVCache *cache);
/* A pass over cache (thread 0, after the pass is laid out): asks the reader for each
 * layer of its tier blocks. Nothing for a cache without any. */
void kv_stream_begin(KVCache *cache);
/* Before layer l's attention (thread 0): the previous layer's staging goes back to the
 * reader, and waits until layer l is read; cache->stage points at it. */
void kv_stream_layer(KVCache *cache, int l);
/* After the pass (thread 0): 0, or -1 when a read failed (the pass's outputs are void). */
int kv_stream_end(KVCache *cache);

#endif /* KVTIER_H */
