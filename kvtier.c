/* kvtier.c: the on-disk tier of the KV cache (kvtier.h). */
#define _GNU_SOURCE
#include "kvtier.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
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

/* FNV-1a's step on 8-byte words with a shift to mix the high bits down, in four
 * independent lanes (words i, i+1, i+2, i+3) so that the multiplies overlap: the reader
 * checks streamed layers at several times the speed of one chain. */
uint64_t kv_tier_checksum(const void *p, size_t n) {
    const unsigned char *b = p;
    uint64_t h[4] = {0xcbf29ce484222325ull, 0x84222325cbf29ce4ull, 0x9e3779b97f4a7c15ull, 0x7f4a7c159e3779b9ull};
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 4; k++) {
            uint64_t w;
            memcpy(&w, b + i + 8 * k, 8);
            h[k] = (h[k] ^ w) * 0x100000001b3ull;
            h[k] ^= h[k] >> 29;
        }
    for (int k = 0; i + 8 <= n; i += 8, k++) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h[k] = (h[k] ^ w) * 0x100000001b3ull;
        h[k] ^= h[k] >> 29;
    }
    uint64_t out = n;
    for (int k = 0; k < 4; k++) out = (out ^ h[k]) * 0x100000001b3ull, out ^= out >> 29;
    return out;
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
    for (int i = 0; i < s->n_blocks; i++)
        if (s->slots[i] >= 0)
            kv_tier_release(t, s->slots[i]);
        else
            kv_block_release(s->pool, -1 - s->slots[i]);
    free(s->slots);
    memset(s, 0, sizeof *s);
}

int kv_swap_out(KVCache *cache, KVTier *t, KVSwapped *s) {
    memset(s, 0, sizeof *s);
    s->pool = cache->pool;
    const int n = kv_blocks_for(cache->len);
    if (n == 0) {
        kv_reset(cache);
        return 0;
    }
    s->slots = malloc((size_t)(n > 0 ? n : 1) * sizeof *s->slots);
    int rc = s->slots ? 0 : -1;
    for (int i = 0; i < n && rc == 0; i++) {
        const int b = cache->blocks[i];
        if (cache->pool->refs[b] > 1) { /* shared: another sequence keeps it in the pool anyway */
            kv_block_hold(cache->pool, b);
            s->slots[s->n_blocks++] = -1 - b;
            s->n_kept++;
            continue;
        }
        const int slot = kv_tier_write(t, block_data(cache->pool, b));
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
    } else {
        t->blocks_kept += s->n_kept;
    }
    return rc;
}

int kv_swap_in(KVCache *cache, KVTier *t, KVSwapped *s) {
    int held[s->n_blocks > 0 ? s->n_blocks : 1];
    for (int i = 0; i < s->n_blocks; i++) held[i] = s->slots[i] < 0 ? -1 - s->slots[i] : -1;
    if (kv_place_blocks(cache, held, s->n_blocks) != 0) {
        kv_swap_drop(t, s);
        errno = ENOMEM;
        return -1;
    }
    int rc = 0;
    for (int i = 0; i < s->n_blocks && rc == 0; i++)
        if (s->slots[i] >= 0) rc = kv_tier_read(t, s->slots[i], block_data(cache->pool, cache->blocks[i]));
    const int e = errno;
    /* the held blocks' references are the cache's now: only the tier's slots go back */
    for (int i = 0; i < s->n_blocks; i++)
        if (s->slots[i] >= 0) kv_tier_release(t, s->slots[i]);
    if (rc == 0)
        cache->len = s->len;
    else
        kv_reset(cache);
    free(s->slots);
    memset(s, 0, sizeof *s);
    errno = e;
    return rc;
}

/* ---- streaming ---- */

static off_t stream_offset(const KVStream *s, int layer, int block) {
    return ((off_t)layer * s->max_blocks + block) * (off_t)s->layer_bytes;
}

/* n bytes at off, in as many preads as it takes; -1 on an error or a short read (EIO) */
static int read_fully(int fd, unsigned char *p, size_t n, off_t off) {
    while (n > 0) {
        const ssize_t r = pread(fd, p, n, off);
        if (r <= 0) {
            if (r == 0) errno = EIO; /* the file ends early: truncated */
            if (r < 0 && errno == EINTR) continue;
            return -1;
        }
        p += r, n -= (size_t)r, off += r;
    }
    return 0;
}

/* The reader: layer k of the pass into stage[k % 2], once attention is done with layer
 * k - 2 (used), as one read of the n_pass blocks, each layer's checksum checked. */
static void *stream_reader(void *arg) {
    KVStream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->closing && !(s->read < s->asked && s->read < s->used + 2)) pthread_cond_wait(&s->cv, &s->mu);
        if (s->closing) break;
        const long k = s->read;
        const int l = (int)(k % s->n_layers), n = s->n_pass, failed = s->err != 0;
        pthread_mutex_unlock(&s->mu);
        unsigned char *stage = s->stage[k % 2];
        int err = 0;
        if (!failed) {
            const double t0 = now_ms();
            const off_t off = stream_offset(s, l, 0);
            if (read_fully(s->tier->fd, stage, (size_t)n * s->layer_bytes, off) != 0)
                err = errno;
            for (int b = 0; b < n && !err; b++)
                if (kv_tier_checksum(stage + (size_t)b * s->layer_bytes, s->layer_bytes) !=
                    s->sums[(size_t)l * s->max_blocks + b])
                    err = EBADMSG;
            /* read once a pass: its pages would only take RAM from the pool */
            posix_fadvise(s->tier->fd, off, (off_t)n * (off_t)s->layer_bytes, POSIX_FADV_DONTNEED);
            s->read_ms += now_ms() - t0;
        }
        pthread_mutex_lock(&s->mu);
        if (err && !s->err) s->err = err;
        if (!failed) s->layers_read += n;
        s->read++;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

size_t kv_stream_stage_bytes(const KVPool *p, int max_blocks) { return 2 * (size_t)max_blocks * p->layer_bytes; }

int kv_stream_open(KVStream *s, KVTier *t, const KVPool *p, int max_blocks) {
    memset(s, 0, sizeof *s);
    s->tier = t;
    s->n_layers = p->n_layers;
    s->max_blocks = max_blocks;
    s->layer_bytes = p->layer_bytes;
    s->sums = malloc((size_t)p->n_layers * (size_t)max_blocks * sizeof *s->sums);
    for (int i = 0; i < 2; i++) s->stage[i] = aligned_alloc(64, (size_t)max_blocks * p->layer_bytes);
    if (!s->sums || !s->stage[0] || !s->stage[1] || pthread_mutex_init(&s->mu, NULL) != 0) {
        kv_stream_close(s);
        errno = ENOMEM;
        return -1;
    }
    pthread_cond_init(&s->cv, NULL);
    s->started = pthread_create(&s->reader, NULL, stream_reader, s) == 0;
    if (!s->started) {
        kv_stream_close(s);
        errno = EAGAIN;
        return -1;
    }
    return 0;
}

void kv_stream_restart_figures(KVStream *s) {
    s->blocks_written = s->layers_read = s->peak_blocks = 0;
    s->wait_ms = s->read_ms = 0.0;
}

void kv_stream_close(KVStream *s) {
    if (s->started) {
        pthread_mutex_lock(&s->mu);
        s->closing = 1;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->reader, NULL);
        pthread_cond_destroy(&s->cv);
        pthread_mutex_destroy(&s->mu);
    }
    free(s->sums);
    free(s->stage[0]);
    free(s->stage[1]);
    memset(s, 0, sizeof *s);
}

int kv_stream_spill(KVStream *s, KVCache *cache, int blocks) {
    const KVPool *p = cache->pool;
    int moved = 0;
    while (moved < blocks && (cache->n_disk + 1) * KV_BLOCK_TOKENS <= cache->len && cache->n_disk < cache->n_blocks) {
        const int b = cache->n_disk;
        const unsigned char *block = block_data(p, cache->blocks[b]);
        const double t0 = now_ms();
        for (int l = 0; l < s->n_layers; l++) {
            const unsigned char *layer = block + (size_t)l * s->layer_bytes;
            const ssize_t w = pwrite(s->tier->fd, layer, s->layer_bytes, stream_offset(s, l, b));
            if (w != (ssize_t)s->layer_bytes) {
                if (w >= 0) errno = EIO; /* a short write: the disk filled up mid-layer */
                s->tier->wait_ms += now_ms() - t0;
                return -1;
            }
            s->sums[(size_t)l * s->max_blocks + b] = kv_tier_checksum(layer, s->layer_bytes);
        }
        s->tier->wait_ms += now_ms() - t0;
        kv_drop_oldest(cache);
        cache->stream = s;
        s->n = cache->n_disk;
        s->unsettled++;
        s->blocks_written++;
        if (s->n > s->peak_blocks) s->peak_blocks = s->n;
        moved++;
    }
    return moved;
}

void kv_stream_drop(KVStream *s, KVCache *cache) {
    if (cache->stream != s) return;
    s->n = 0;
    cache->stream = NULL;
    kv_reset(cache); /* the tier's region is reused from its start by the next sequence */
}

void kv_stream_begin(KVCache *cache) {
    KVStream *s = cache->stream;
    if (!s || !cache->n_disk) return;
    cache->stage = NULL;
    if (s->unsettled) { /* what was spilled goes to the disk, and out of the page cache */
        const double t0 = now_ms();
        if (fdatasync(s->tier->fd) != 0 && !s->err) s->err = errno;
        posix_fadvise(s->tier->fd, 0, 0, POSIX_FADV_DONTNEED);
        s->tier->wait_ms += now_ms() - t0;
        s->unsettled = 0;
    }
    pthread_mutex_lock(&s->mu);
    s->n_pass = cache->n_disk;
    s->asked += s->n_layers;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

void kv_stream_layer(KVCache *cache, int l) {
    KVStream *s = cache->stream;
    if (!s || !cache->n_disk) return;
    const long k = s->asked - s->n_layers + l;
    const double t0 = now_ms();
    pthread_mutex_lock(&s->mu);
    s->used = k; /* layer k - 1 is done: its staging is free */
    pthread_cond_broadcast(&s->cv);
    while (s->read <= k) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    s->wait_ms += now_ms() - t0;
    cache->stage = s->stage[k % 2];
}

int kv_stream_end(KVCache *cache) {
    KVStream *s = cache->stream;
    if (!s || !cache->n_disk) return 0;
    pthread_mutex_lock(&s->mu);
    s->used = s->asked;
    const int err = s->err;
    pthread_mutex_unlock(&s->mu);
    cache->stage = NULL;
    if (err) errno = err;
    return err ? -1 : 0;
}
