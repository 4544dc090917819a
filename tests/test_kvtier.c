/* The KV cache's disk tier: exclusive creation, slots and their reuse, swap out and in
 * restoring every byte, and the failures it must catch (a truncated file, a block that
 * changed on disk, a file size limit) instead of handing back wrong blocks; the same for
 * a streamed cache, and which of its blocks are on the tier. */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvtier.h"
#include "testutil.h"

static Config small_mha(void) {
    Config c = {.variant = VARIANT_MHA, .n_layers = 2, .n_heads = 2, .head_dim = 8, .n_kv_heads = 2, .max_seq_len = 64};
    return c;
}

/* a path in the temporary directory that does not exist yet */
static void tier_path(char *buf, size_t n) {
    snprintf(buf, n, "%s/kvtier-test-%ld", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (long)getpid());
    unlink(buf);
}

/* the file is created exclusively and gone from the namespace once open */
static void test_open_is_exclusive_and_unlinked(void **state) {
    char path[256];
    tier_path(path, sizeof path);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fclose(f);
    KVTier t;
    assert_int_equal(kv_tier_open(&t, path, 64), -1);
    assert_int_equal(errno, EEXIST);
    struct stat st;
    assert_int_equal(stat(path, &st), 0); /* the existing file is left as it was */
    unlink(path);
    assert_int_equal(kv_tier_open(&t, path, 64), 0);
    assert_int_equal(stat(path, &st), -1);
    kv_tier_close(&t);
}

/* slots are reused once released; the peak and the counts follow */
static void test_slot_bookkeeping(void **state) {
    char path[256];
    tier_path(path, sizeof path);
    KVTier t;
    assert_int_equal(kv_tier_open(&t, path, 64), 0);
    unsigned char block[64], back[64];
    int slots[3];
    for (int i = 0; i < 3; i++) {
        memset(block, i + 1, sizeof block);
        slots[i] = kv_tier_write(&t, block);
        assert_int_equal(slots[i], i);
    }
    assert_int_equal(kv_tier_in_use(&t), 3);
    kv_tier_release(&t, slots[1]);
    assert_int_equal(kv_tier_in_use(&t), 2);
    memset(block, 9, sizeof block);
    assert_int_equal(kv_tier_write(&t, block), 1); /* the released slot, not a new one */
    assert_int_equal(t.n_slots, 3);
    assert_int_equal(t.peak_slots, 3);
    assert_int_equal(kv_tier_read(&t, 1, back), 0);
    assert_memory_equal(back, block, sizeof block);
    assert_int_equal(kv_tier_read(&t, 2, back), 0);
    memset(block, 3, sizeof block);
    assert_memory_equal(back, block, sizeof block);
    assert_int_equal(t.blocks_written, 4);
    assert_int_equal(t.blocks_read, 2);
    kv_tier_close(&t);
}

/* a cache swapped out and back lands in other blocks with every byte it had; a block
 * shared with another sequence is not written but held in the pool, and comes back as
 * the same block (a shared prefix is swapped once: by no one) */
static void test_swap_round_trip(void **state) {
    const Config c = small_mha();
    KVPool p;
    assert_int_equal(kv_pool_init(&p, &c, DTYPE_F32, 8), 0);
    KVCache a, b;
    assert_int_equal(kv_init(&a, &p, 64), 0);
    assert_int_equal(kv_init(&b, &p, 64), 0);
    assert_int_equal(kv_reserve(&a, 40), 0);
    kv_fill_generated(&a, 40, 7);
    a.len = 40;
    kv_share_prefix(&b, &a, 20);
    const size_t bytes = kv_block_bytes(&p);
    unsigned char *before = malloc(3 * bytes);
    for (int i = 0; i < 3; i++) memcpy(before + i * bytes, p.data + (size_t)a.blocks[i] * bytes, bytes);
    char path[256];
    tier_path(path, sizeof path);
    KVTier t;
    assert_int_equal(kv_tier_open(&t, path, bytes), 0);
    KVSwapped s;
    assert_int_equal(kv_swap_out(&a, &t, &s), 0);
    assert_int_equal(a.len, 0);
    assert_int_equal(s.n_blocks, 3);
    assert_int_equal(s.len, 40);
    assert_int_equal(s.n_kept, 2);
    assert_int_equal(t.blocks_written, 1);
    assert_int_equal(t.blocks_kept, 2);
    assert_int_equal(kv_blocks_in_use(&p), 2); /* b's shared blocks, held by the swap too */
    assert_int_equal(p.refs[b.blocks[0]], 2);
    kv_free(&b); /* the swap's hold keeps them */
    assert_int_equal(kv_blocks_in_use(&p), 2);
    KVCache other; /* takes the freed blocks, so a's come back elsewhere */
    assert_int_equal(kv_init(&other, &p, 64), 0);
    assert_int_equal(kv_reserve(&other, 16), 0);
    assert_int_equal(kv_swap_in(&a, &t, &s), 0);
    assert_int_equal(a.len, 40);
    assert_int_equal(kv_tier_in_use(&t), 0);
    assert_int_equal(t.blocks_read, 1);
    for (int i = 0; i < 3; i++) assert_memory_equal(p.data + (size_t)a.blocks[i] * bytes, before + i * bytes, bytes);
    assert_int_equal(kv_blocks_in_use(&p), 4); /* a's 3 and other's 1: no reference left over */
    kv_free(&other);
    kv_free(&a);
    assert_int_equal(kv_blocks_in_use(&p), 0);
    kv_tier_close(&t);
    kv_pool_free(&p);
    free(before);
}

/* a truncated file is a short read, a changed block a checksum: both refused, the cache
 * reset and the slots given back */
static void test_truncated_and_corrupt(void **state) {
    const Config c = small_mha();
    KVPool p;
    assert_int_equal(kv_pool_init(&p, &c, DTYPE_F32, 8), 0);
    KVCache a;
    assert_int_equal(kv_init(&a, &p, 64), 0);
    const size_t bytes = kv_block_bytes(&p);
    char path[256];
    tier_path(path, sizeof path);
    KVTier t;
    assert_int_equal(kv_tier_open(&t, path, bytes), 0);
    KVSwapped s;

    assert_int_equal(kv_reserve(&a, 40), 0);
    kv_fill_generated(&a, 40, 3);
    a.len = 40;
    assert_int_equal(kv_swap_out(&a, &t, &s), 0);
    assert_int_equal(ftruncate(t.fd, (off_t)(2 * bytes + bytes / 2)), 0);
    assert_int_equal(kv_swap_in(&a, &t, &s), -1);
    assert_int_equal(errno, EIO);
    assert_int_equal(a.len, 0);
    assert_int_equal(kv_blocks_in_use(&p), 0);
    assert_int_equal(kv_tier_in_use(&t), 0);

    assert_int_equal(kv_reserve(&a, 40), 0);
    kv_fill_generated(&a, 40, 3);
    a.len = 40;
    assert_int_equal(kv_swap_out(&a, &t, &s), 0);
    const unsigned char flip = 0x5a;
    assert_int_equal(pwrite(t.fd, &flip, 1, (off_t)s.slots[1] * (off_t)bytes + 17), 1);
    assert_int_equal(kv_swap_in(&a, &t, &s), -1);
    assert_int_equal(errno, EBADMSG);
    assert_int_equal(a.len, 0);
    assert_int_equal(kv_blocks_in_use(&p), 0);
    kv_free(&a);
    kv_tier_close(&t);
    kv_pool_free(&p);
}

/* a file size limit (a full disk's stand-in) fails the write that crosses it: the swap
 * out gives back what it wrote and reports it, the cache reset for a recompute */
static void test_file_size_limit(void **state) {
    const Config c = small_mha();
    KVPool p;
    assert_int_equal(kv_pool_init(&p, &c, DTYPE_F32, 8), 0);
    KVCache a;
    assert_int_equal(kv_init(&a, &p, 64), 0);
    const size_t bytes = kv_block_bytes(&p);
    char path[256];
    tier_path(path, sizeof path);
    KVTier t;
    assert_int_equal(kv_tier_open(&t, path, bytes), 0);
    assert_int_equal(kv_reserve(&a, 40), 0);
    kv_fill_generated(&a, 40, 5);
    a.len = 40;
    struct rlimit old, lim;
    getrlimit(RLIMIT_FSIZE, &old);
    lim = old;
    lim.rlim_cur = (rlim_t)(bytes + bytes / 2); /* one block and a half */
    void (*was)(int) = signal(SIGXFSZ, SIG_IGN);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    KVSwapped s;
    const int rc = kv_swap_out(&a, &t, &s);
    const int e = errno;
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, was);
    assert_int_equal(rc, -1);
    assert_true(e == EFBIG || e == EIO);
    assert_int_equal(a.len, 0);
    assert_int_equal(s.n_blocks, 0);
    assert_int_equal(kv_tier_in_use(&t), 0);
    assert_int_equal(kv_blocks_in_use(&p), 0);
    kv_free(&a);
    kv_tier_close(&t);
    kv_pool_free(&p);
}

/* ---- streaming ---- */

/* a cache of `len` generated positions in a pool of its own blocks: what a streamed one
 * must read back */
static void filled(KVPool *p, KVCache *a, int blocks, int len, uint64_t seed) {
    const Config c = small_mha();
    assert_int_equal(kv_pool_init(p, &c, DTYPE_F32, blocks), 0);
    assert_int_equal(kv_init(a, p, 64), 0);
    assert_int_equal(kv_reserve(a, len), 0);
    kv_fill_generated(a, len, seed);
}

/* A stream over a pool of `blocks` blocks holding len filled positions, on a fresh tier. */
static void streamed(KVPool *p, KVCache *a, int blocks, int len, uint64_t seed, KVTier *t, KVStream *s) {
    filled(p, a, blocks, len, seed);
    char path[256];
    tier_path(path, sizeof path);
    assert_int_equal(kv_tier_open(t, path, kv_block_bytes(p)), 0);
    assert_int_equal(kv_stream_open(s, t, p, a->max_blocks), 0);
}

/* Closes what streamed opened. */
static void unstreamed(KVPool *p, KVCache *a, KVTier *t, KVStream *s) {
    kv_free(a);
    kv_stream_close(s);
    kv_tier_close(t);
    kv_pool_free(p);
}

/* every row of layer l of positions [0, len): the same bytes in a and ref */
static void assert_layer_equal(const KVCache *a, const KVCache *ref, int l, int len) {
    const KVPool *p = ref->pool;
    for (int pos = 0; pos < len; pos++)
        for (int r = 0; r < 2 * p->n_kv_heads; r++)
            assert_memory_equal(kv_row(a, l, r, pos).data, kv_row(ref, l, r, pos).data, p->row_bytes);
}

/* which blocks are on the tier: only whole ones below len, oldest first, each given back
 * to the pool; a pass reads every layer of them back, the same bytes, pass after pass;
 * dropping the stream gives the pool everything back */
static void test_stream_bookkeeping(void **state) {
    KVPool p, rp;
    KVCache a, ref;
    KVTier t;
    KVStream s;
    streamed(&p, &a, 3, 40, 11, &t, &s);
    filled(&rp, &ref, 4, 40, 11);
    assert_int_equal(kv_blocks_in_use(&p), 3);
    assert_int_equal(kv_stream_spill(&s, &a, 1), 1);
    assert_int_equal(a.n_disk, 1);
    assert_int_equal(s.n, 1);
    assert_int_equal(kv_blocks_in_use(&p), 2);
    assert_int_equal(kv_stream_spill(&s, &a, 5), 1); /* block 2 holds position 40, written next */
    assert_int_equal(a.n_disk, 2);
    assert_int_equal(kv_stream_spill(&s, &a, 5), 0);
    assert_int_equal(kv_blocks_in_use(&p), 1);
    assert_int_equal(s.peak_blocks, 2);
    assert_int_equal(s.blocks_written, 2);
    assert_int_equal(kv_reserve(&a, 64), 0); /* the pool holds the rest of the context now */
    for (int pass = 0; pass < 3; pass++) {
        kv_stream_begin(&a);
        for (int l = 0; l < p.n_layers; l++) {
            kv_stream_layer(&a, l);
            assert_non_null(a.stage);
            assert_layer_equal(&a, &ref, l, 40);
        }
        assert_int_equal(kv_stream_end(&a), 0);
        assert_null(a.stage);
    }
    assert_int_equal(s.layers_read, 3 * p.n_layers * 2);
    kv_stream_drop(&s, &a);
    assert_int_equal(a.n_disk, 0);
    assert_int_equal(s.n, 0);
    assert_int_equal(kv_blocks_in_use(&p), 0);
    kv_free(&ref);
    kv_pool_free(&rp);
    unstreamed(&p, &a, &t, &s);
}

/* a pass over streamed blocks that cannot be read whole (a truncated file), or one that
 * changed on disk, ends with an error instead of attending over them */
static void test_stream_truncated_and_corrupt(void **state) {
    for (int corrupt = 0; corrupt < 2; corrupt++) {
        KVPool p;
        KVCache a;
        KVTier t;
        KVStream s;
        streamed(&p, &a, 4, 40, 5, &t, &s);
        assert_int_equal(kv_stream_spill(&s, &a, 2), 2);
        if (corrupt) {
            const unsigned char flip = 0x5a;
            assert_int_equal(pwrite(t.fd, &flip, 1, (off_t)p.layer_bytes + 3), 1); /* layer 0 of block 1 */
        } else {
            assert_int_equal(ftruncate(t.fd, (off_t)p.layer_bytes), 0);
        }
        kv_stream_begin(&a);
        for (int l = 0; l < p.n_layers; l++) kv_stream_layer(&a, l);
        assert_int_equal(kv_stream_end(&a), -1);
        assert_int_equal(errno, corrupt ? EBADMSG : EIO);
        kv_stream_drop(&s, &a);
        unstreamed(&p, &a, &t, &s);
    }
}

/* a spill that crosses a file size limit (a full disk) fails and leaves the cache as it was */
static void test_stream_file_size_limit(void **state) {
    KVPool p;
    KVCache a;
    KVTier t;
    KVStream s;
    streamed(&p, &a, 4, 40, 9, &t, &s);
    struct rlimit old, lim;
    getrlimit(RLIMIT_FSIZE, &old);
    lim = old;
    lim.rlim_cur = (rlim_t)p.layer_bytes; /* layer 1 of block 0 lies past it */
    void (*was)(int) = signal(SIGXFSZ, SIG_IGN);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    const int rc = kv_stream_spill(&s, &a, 1);
    const int e = errno;
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, was);
    assert_int_equal(rc, -1);
    assert_true(e == EFBIG || e == EIO);
    assert_int_equal(a.n_disk, 0);
    assert_int_equal(s.n, 0);
    assert_int_equal(kv_blocks_in_use(&p), 3);
    unstreamed(&p, &a, &t, &s);
}

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_open_is_exclusive_and_unlinked), cmocka_unit_test(test_slot_bookkeeping),
        cmocka_unit_test(test_swap_round_trip),                cmocka_unit_test(test_truncated_and_corrupt),
        cmocka_unit_test(test_file_size_limit),                cmocka_unit_test(test_stream_bookkeeping),
        cmocka_unit_test(test_stream_truncated_and_corrupt),   cmocka_unit_test(test_stream_file_size_limit),
    };
    return cmocka_run_group_tests_name("kvtier", tests, NULL, NULL);
}
