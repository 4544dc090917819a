/* testutil.c: see testutil.h */
#include <assert.h>
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

const char *g_tokenizer_path = "build/tests/tiny.model";

Config test_config(Variant v, int kv_latent, int vocab_size, DType dtype) {
    Config c = {0};
    c.variant = v;
    c.dtype = dtype;
    c.dim = 64;
    c.n_layers = 2;
    c.n_heads = 4;
    c.head_dim = 16;
    c.n_kv_heads = v == VARIANT_MHA ? 4 : v == VARIANT_GQA ? 2 : v == VARIANT_MQA ? 1 : 0;
    c.kv_latent = v == VARIANT_MLA ? kv_latent : 0;
    c.rope_dim = v == VARIANT_MLA ? 8 : 0;
    c.hidden_dim = 96;
    c.vocab_size = vocab_size;
    c.max_seq_len = 64;
    c.rope_theta = 10000.0f;
    c.norm_eps = 1e-5f;
    c.bos_id = 1;
    c.eos_id = 2;
    return c;
}

static void put_u32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static void put_u64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

void encode_header(unsigned char h[128], const Config *c, uint64_t tok_off, uint64_t tok_size, uint64_t w_off,
                   uint64_t w_size) {
    memset(h, 0, 128);
    memcpy(h, "AKVC", 4);
    put_u32(h + 4, 1);
    put_u32(h + 8, (uint32_t)c->variant);
    put_u32(h + 12, (uint32_t)c->dtype);
    const int f[10] = {c->dim,       c->n_layers, c->n_heads,    c->head_dim,   c->n_kv_heads,
                       c->kv_latent, c->rope_dim, c->hidden_dim, c->vocab_size, c->max_seq_len};
    for (int i = 0; i < 10; i++) put_u32(h + 16 + 4 * i, (uint32_t)f[i]);
    memcpy(h + 56, &c->rope_theta, 4);
    memcpy(h + 60, &c->norm_eps, 4);
    put_u32(h + 64, (uint32_t)c->bos_id);
    put_u32(h + 68, (uint32_t)c->eos_id);
    put_u64(h + 72, tok_off);
    put_u64(h + 80, tok_size);
    put_u64(h + 88, w_off);
    put_u64(h + 96, w_size);
    put_u32(h + 104, c->untied_head ? 1u : 0u); /* flags */
    put_u32(h + 108, (uint32_t)c->window);
}

float test_uniform(uint64_t *s) {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    uint32_t r = (uint32_t)((*s * 0x2545F4914F6CDD1Dull) >> 32);
    return (float)(r >> 8) / 8388608.0f - 1.0f;
}

static void put_value(unsigned char *p, DType dt, float v) {
    if (dt == DTYPE_BF16) {
        uint32_t u;
        memcpy(&u, &v, 4);
        uint16_t h = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16); /* round to nearest even */
        memcpy(p, &h, 2);
    } else {
        memcpy(p, &v, 4);
    }
}

struct Fill {
    unsigned char *p;
    DType dt;
    uint64_t state;
};

/* matrices: uniform in [-0.08, 0.08); vectors (norm weights): 1 +- 0.2 */
static void fill_tensor(void *ctx, const TensorRef *t) {
    struct Fill *f = ctx;
    for (long i = 0; i < (long)t->rows * t->cols; i++) {
        float v = t->rows == 1 ? 1.0f + 0.2f * test_uniform(&f->state) : 0.08f * test_uniform(&f->state);
        put_value(f->p, f->dt, v);
        f->p += dtype_size(f->dt);
    }
}

int write_test_checkpoint(const char *path, const Config *c, const char *tokenizer_path, uint64_t seed) {
    size_t tok_size;
    unsigned char *tok = read_whole_file(tokenizer_path, &tok_size);
    if (!tok) return -1;
    size_t n_params = model_param_count(c), es = dtype_size(c->dtype);
    uint64_t tok_off = 128, w_off = (tok_off + tok_size + 63) / 64 * 64, w_size = (uint64_t)n_params * es;
    size_t total = (size_t)(w_off + w_size);
    unsigned char *buf = calloc(1, total);
    if (!buf) {
        free(tok);
        return -1;
    }
    encode_header(buf, c, tok_off, tok_size, w_off, w_size);
    memcpy(buf + tok_off, tok, tok_size);
    struct Fill fill = {buf + w_off, c->dtype, seed * 0x9E3779B97F4A7C15ull + 1};
    Weights w = {0};
    w.layers = calloc((size_t)c->n_layers, sizeof *w.layers);
    if (w.layers) model_walk_tensors(c, &w, fill_tensor, &fill);
    int rc = w.layers ? write_whole_file(path, buf, total) : -1;
    free(w.layers);
    free(buf);
    free(tok);
    return rc;
}

unsigned char *read_whole_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc(n > 0 ? (size_t)n : 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) *size = (size_t)n;
    return buf;
}

int write_whole_file(const char *path, const void *data, size_t size) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = fwrite(data, 1, size, f);
    return (fclose(f) == 0 && w == size) ? 0 : -1;
}

const char *temp_path(const char *name) {
    static char buf[8][512];
    static int next = 0;
    mkdir("build", 0755);
    mkdir("build/tests", 0755);
    mkdir("build/tests/tmp", 0755);
    char *p = buf[next++ % 8];
    snprintf(p, 512, "build/tests/tmp/%d-%s", (int)getpid(), name);
    return p;
}

void expect_special_files_refused(PathReader read) {
    const char *fifo = temp_path("fifo");
    unlink(fifo);
    if (mkfifo(fifo, 0600) != 0) abort();
    const struct {
        const char *path, *kind;
    } cases[] = {
        {fifo, "is a FIFO, not a regular file"},
        {"/dev/zero", "is a character device, not a regular file"},
        {".", "is a directory, not a regular file"},
    };
    alarm(20);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char err[512] = "";
        if (read(cases[i].path, err, sizeof err) != -1 || !strstr(err, cases[i].kind)) {
            fprintf(stderr, "%s: '%s', not '%s'\n", cases[i].path, err, cases[i].kind);
            abort();
        }
    }
    alarm(0);
    unlink(fifo);
}

void long_missing_path(char path[4001]) {
    strcpy(path, "/nonexistent");
    for (size_t n = strlen(path); n + 2 <= 4000; n += 2) strcat(path, "/d");
}

static size_t put_varint(unsigned char *out, uint64_t v) {
    size_t n = 0;
    while (v >= 0x80) {
        out[n++] = (unsigned char)(v | 0x80);
        v >>= 7;
    }
    out[n++] = (unsigned char)v;
    return n;
}

size_t pb_put_bytes(unsigned char *out, unsigned field, const void *data, size_t n) {
    size_t k = put_varint(out, (uint64_t)field << 3 | 2);
    k += put_varint(out + k, n);
    memcpy(out + k, data, n);
    return k + n;
}

size_t pb_put_varint(unsigned char *out, unsigned field, uint64_t v) {
    size_t k = put_varint(out, (uint64_t)field << 3);
    return k + put_varint(out + k, v);
}

size_t pb_put_float(unsigned char *out, unsigned field, float v) {
    size_t k = put_varint(out, (uint64_t)field << 3 | 5);
    uint32_t u;
    memcpy(&u, &v, 4);
    put_u32(out + k, u);
    return k + 4;
}

unsigned char *concat_bytes(const void *a, size_t na, const void *b, size_t nb, size_t *n) {
    unsigned char *out = malloc(na + nb ? na + nb : 1);
    if (!out) return NULL;
    memcpy(out, a, na);
    memcpy(out + na, b, nb);
    *n = na + nb;
    return out;
}

/* darts-clone unit fields: bits 0-7 the label, bit 8 "has a leaf", bits 10-31 the offset to
 * the children (shifted by 8 more when bit 9 is set); a value unit has bit 31 set. */
void test_charsmap_init(TestCharsmap *c, unsigned char from, const char *to) {
    memset(c, 0, sizeof *c);
    c->trie_bytes = 4 * TEST_TRIE_UNITS;
    const uint32_t child = TEST_TRIE_BASE ^ from;
    c->units[0] = (uint32_t)TEST_TRIE_BASE << 10;
    c->units[child] = (child ^ TEST_TRIE_LEAF) << 10 | 1u << 8 | from;
    /* strings: "" first, so that the rule's value (1) is not 0 */
    c->strings[0] = '\0';
    size_t len = strlen(to);
    memcpy(c->strings + 1, to, len + 1);
    c->strings_len = len + 2;
    c->units[TEST_TRIE_LEAF] = 1u << 31 | 1;
}

size_t test_charsmap_encode(const TestCharsmap *c, unsigned char *out) {
    put_u32(out, c->trie_bytes);
    for (int i = 0; i < TEST_TRIE_UNITS; i++) put_u32(out + 4 + 4 * i, c->units[i]);
    memcpy(out + 4 + 4 * TEST_TRIE_UNITS, c->strings, c->strings_len);
    return 4 + 4 * TEST_TRIE_UNITS + c->strings_len;
}

/* ---- a team for the tests ---- */

typedef struct {
    void (*fn)(void *arg, Worker *w);
    void *arg;
} TeamJob;

static void job_member(void *arg, Worker *w) {
    const TeamJob *j = arg;
    while (team_wait(w)) {
        j->fn(j->arg, w);
        team_barrier(w);
    }
}

void run_on_team(int n, void (*fn)(void *arg, Worker *w), void *arg) {
    if (n == 1) {
        Worker alone = worker_alone();
        fn(arg, &alone);
        return;
    }
    TeamJob job = {fn, arg};
    Team *t = team_open(n, job_member, &job);
    assert(t);
    Worker *lead = team_leader(t);
    team_post(t);
    fn(arg, lead);
    team_barrier(lead);
    team_close(t);
}

/* ---- pools that hand out blocks out of order ---- */

static int greatest_common_divisor(int a, int b) { return b ? greatest_common_divisor(b, a % b) : a; }

/* order[i] = (3 i + 1) % n, or with the next stride coprime to n: consecutive table
 * positions land blocks apart; then each i left at its own place swaps with the next. */
static int scrambled_order(int n, int *order) {
    if (n < 2) return -1;
    int stride = 3;
    while (greatest_common_divisor(stride, n) != 1) stride++;
    for (int i = 0; i < n; i++) order[i] = (int)(((long)i * stride + 1) % n);
    for (int i = 0; i < n; i++)
        if (order[i] == i) { /* order[next] is not i (order[i] is): the swap leaves neither in place */
            const int next = (i + 1) % n, kept = order[next];
            order[next] = i;
            order[i] = kept;
        }
    return 0;
}

int scramble_free_blocks(KVPool *pool, int *order) {
    const int n = pool->n_blocks;
    if (pool->n_free != n || scrambled_order(n, order) != 0) return -1;
    /* Take every block, one a cache, then give them back last-out-first: the pool's free
     * blocks are a stack, so the block given back last is the next handed out. */
    KVCache *holders = calloc((size_t)n, sizeof *holders);
    int *holder_of = malloc((size_t)n * sizeof *holder_of);
    if (!holders || !holder_of) return -1;
    for (int i = 0; i < n; i++) {
        if (kv_init(&holders[i], pool, 1) != 0 || kv_reserve(&holders[i], 1) != 0) return -1;
        holder_of[holders[i].blocks[0]] = i;
    }
    for (int i = n - 1; i >= 0; i--) kv_free(&holders[holder_of[order[i]]]);
    free(holders);
    free(holder_of);
    return 0;
}
