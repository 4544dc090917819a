/* The KV cache's disk tier: exclusive creation, slots and their reuse, swap out and in
 * restoring every byte, and the failures it must catch (a truncated file, a block that
 * changed on disk, a file size limit) instead of handing back wrong blocks. */
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
 * shared with another sequence stays in the pool for it */
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
    assert_int_equal(kv_blocks_in_use(&p), 2); /* b's shared blocks */
    KVCache other; /* takes the freed blocks, so a's come back elsewhere */
    assert_int_equal(kv_init(&other, &p, 64), 0);
    assert_int_equal(kv_reserve(&other, 16), 0);
    assert_int_equal(kv_swap_in(&a, &t, &s), 0);
    assert_int_equal(a.len, 40);
    assert_int_equal(kv_tier_in_use(&t), 0);
    for (int i = 0; i < 3; i++) assert_memory_equal(p.data + (size_t)a.blocks[i] * bytes, before + i * bytes, bytes);
    kv_free(&other);
    kv_free(&a);
    kv_free(&b);
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

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_open_is_exclusive_and_unlinked), cmocka_unit_test(test_slot_bookkeeping),
        cmocka_unit_test(test_swap_round_trip),                cmocka_unit_test(test_truncated_and_corrupt),
        cmocka_unit_test(test_file_size_limit),
    };
    return cmocka_run_group_tests_name("kvtier", tests, NULL, NULL);
}
