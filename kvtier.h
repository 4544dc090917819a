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

/* A sequence's cache swapped out: the slot of each of its blocks, and its length. */
typedef struct {
    int *slots; /* (n_blocks) */
    int n_blocks, len;
} KVSwapped;

/* Writes cache's blocks to the tier and resets the cache (its blocks go back to the pool).
 * Returns -1, with the cache reset and nothing held on the tier, when a write fails: the
 * sequence is then recomputed. No window. */
int kv_swap_out(KVCache *cache, KVTier *t, KVSwapped *s);
/* Reads s back into cache (empty) and gives its slots back. Returns -1, the cache reset
 * and the slots given back, when the pool is short, or a read or a checksum fails. */
int kv_swap_in(KVCache *cache, KVTier *t, KVSwapped *s);
/* Gives s's slots back without reading them. */
void kv_swap_drop(KVTier *t, KVSwapped *s);

#endif /* KVTIER_H */
