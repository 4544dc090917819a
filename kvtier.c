/* kvtier.c: the on-disk tier of the KV cache (kvtier.h). */
#define _GNU_SOURCE
#include "kvtier.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/timer.h"

int kv_tier_open(KVTier *t, const char *path, size_t block_bytes) {
    memset(t, 0, sizeof *t);
    t->fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (t->fd < 0) return -1;
    unlink(path); /* gone from the namespace now; the kernel frees it when fd closes */
    t->block_bytes = block_bytes;
    return 0;
}

void kv_tier_close(KVTier *t) {
    if (t->fd >= 0) close(t->fd);
    free(t->sums);
    free(t->free_slots);
    memset(t, 0, sizeof *t);
    t->fd = -1;
}

uint64_t kv_tier_checksum(const void *p, size_t n) {
    const unsigned char *b = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h = (h ^ w) * 0x100000001b3ull;
        h ^= h >> 29;
    }
    return h ^ n;
}

static int take_slot(KVTier *t) {
    if (t->n_free) return t->free_slots[--t->n_free];
    if (t->n_slots == t->cap) {
        const int cap = t->cap ? 2 * t->cap : 64;
        uint64_t *sums = realloc(t->sums, (size_t)cap * sizeof *sums);
        if (!sums) return -1;
        t->sums = sums;
        int *fs = realloc(t->free_slots, (size_t)cap * sizeof *fs);
        if (!fs) return -1;
        t->free_slots = fs;
        t->cap = cap;
    }
    return t->n_slots++;
}

void kv_tier_release(KVTier *t, int slot) { t->free_slots[t->n_free++] = slot; }

int kv_tier_write(KVTier *t, const void *block) {
    const int slot = take_slot(t);
    if (slot < 0) {
        errno = ENOMEM;
        return -1;
    }
    const double t0 = now_ms();
    const ssize_t n = pwrite(t->fd, block, t->block_bytes, (off_t)slot * (off_t)t->block_bytes);
    t->wait_ms += now_ms() - t0;
    if (n != (ssize_t)t->block_bytes) {
        if (n >= 0) errno = EIO; /* a short write: the disk filled up mid-block */
        const int e = errno;
        kv_tier_release(t, slot);
        errno = e;
        return -1;
    }
    t->sums[slot] = kv_tier_checksum(block, t->block_bytes);
    t->blocks_written++;
    if (kv_tier_in_use(t) > t->peak_slots) t->peak_slots = kv_tier_in_use(t);
    return slot;
}

int kv_tier_read(KVTier *t, int slot, void *block) {
    const double t0 = now_ms();
    const ssize_t n = pread(t->fd, block, t->block_bytes, (off_t)slot * (off_t)t->block_bytes);
    t->wait_ms += now_ms() - t0;
    if (n != (ssize_t)t->block_bytes) {
        if (n >= 0) errno = EIO; /* a short read: the file was truncated */
        return -1;
    }
    t->blocks_read++;
    if (kv_tier_checksum(block, t->block_bytes) != t->sums[slot]) {
        errno = EBADMSG;
        return -1;
    }
    return 0;
}

static unsigned char *block_data(const KVPool *p, int b) { return p->data + (size_t)b * kv_block_bytes(p); }

void kv_swap_drop(KVTier *t, KVSwapped *s) {
    for (int i = 0; i < s->n_blocks; i++) kv_tier_release(t, s->slots[i]);
    free(s->slots);
    memset(s, 0, sizeof *s);
}

int kv_swap_out(KVCache *cache, KVTier *t, KVSwapped *s) {
    memset(s, 0, sizeof *s);
    const int n = kv_blocks_for(cache->len);
    if (n == 0) {
        kv_reset(cache);
        return 0;
    }
    s->slots = malloc((size_t)(n > 0 ? n : 1) * sizeof *s->slots);
    int rc = s->slots ? 0 : -1;
    for (int i = 0; i < n && rc == 0; i++) {
        const int slot = kv_tier_write(t, block_data(cache->pool, cache->blocks[i]));
        if (slot < 0)
            rc = -1;
        else
            s->slots[s->n_blocks++] = slot;
    }
    s->len = cache->len;
    kv_reset(cache);
    if (rc != 0) {
        const int e = errno;
        kv_swap_drop(t, s);
        errno = e;
    }
    return rc;
}

int kv_swap_in(KVCache *cache, KVTier *t, KVSwapped *s) {
    int rc = kv_reserve(cache, s->len);
    if (rc != 0) errno = ENOMEM;
    for (int i = 0; i < s->n_blocks && rc == 0; i++)
        rc = kv_tier_read(t, s->slots[i], block_data(cache->pool, cache->blocks[i]));
    const int e = errno;
    if (rc == 0)
        cache->len = s->len;
    else
        kv_reset(cache);
    kv_swap_drop(t, s);
    errno = e;
    return rc;
}
