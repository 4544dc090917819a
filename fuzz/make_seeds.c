/* make_seeds.c: writes the seed corpora of the fuzz harnesses from valid inputs.
 *
 *   make_seeds OUTDIR TINY_TOKENIZER REAL_TOKENIZER NFKC_TOKENIZER
 *
 * OUTDIR/seeds-loader:    a tiny checkpoint of every variant (bf16 and fp32) with the
 *                         tiny test tokenizer embedded (tests/testutil.c writes them), and
 *                         one whose tokenizer has a one-rule charsmap (q -> "Once")
 * OUTDIR/seeds-tokenizer: prompts with their ids, in fuzz_tokenizer.c's input layout
 * OUTDIR/seeds-tokenizer_model: prompts with a whole model each (the tiny one, also with
 *                         a one-rule charsmap, other normalizer flags or more piece types;
 *                         the real one; a unigram NFKC one), in fuzz_tokenizer_model.c's
 *                         input layout
 * OUTDIR/seeds-cli:       valid argument vectors, NUL-separated
 * OUTDIR/seeds-ppl:       small story files */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "loader.h"
#include "model.h"
#include "tokenizer/spm_c.h"
#include "testutil.h"

static const char *g_out;

/* what: the file that could not be read or written, or what went wrong */
static void die(const char *what) {
    fprintf(stderr, "make_seeds: cannot go on: %s\n", what);
    exit(1);
}

/* What make_seeds appends to a model's bytes (protobuf merges it over the model's own). */
enum Extra {
    EXTRA_NONE,
    EXTRA_RULE,   /* a normalizer charsmap with one rule, q -> "Once" */
    EXTRA_FLAGS,  /* no dummy prefix, extra white space kept, white space as suffix */
    EXTRA_PIECES, /* a user-defined piece <tag>, an unused piece zzz, a control piece <ctl> */
};

static size_t extra_bytes(enum Extra e, unsigned char *out) {
    unsigned char a[sizeof(TestCharsmap) + 16], b[sizeof a + 16];
    size_t n = 0, k;
    switch (e) {
    case EXTRA_RULE: {
        TestCharsmap c;
        test_charsmap_init(&c, 'q', "Once");
        k = pb_put_bytes(b, 2, a, test_charsmap_encode(&c, a)); /* NormalizerSpec.precompiled_charsmap */
        n = pb_put_bytes(out, 3, b, k);                         /* ModelProto.normalizer_spec */
        break;
    }
    case EXTRA_FLAGS:
        k = pb_put_varint(a, 3, 0);      /* add_dummy_prefix */
        k += pb_put_varint(a + k, 4, 0); /* remove_extra_whitespaces */
        n = pb_put_bytes(out, 3, a, k);
        k = pb_put_varint(a, 24, 1); /* TrainerSpec.treat_whitespace_as_suffix */
        n += pb_put_bytes(out + n, 2, a, k);
        break;
    case EXTRA_PIECES: {
        static const struct {
            const char *piece;
            int type;
        } p[] = {{"<tag>", 4}, {"zzz", 5}, {"<ctl>", 3}};
        for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) {
            k = pb_put_bytes(a, 1, p[i].piece, strlen(p[i].piece)); /* SentencePiece.piece */
            k += pb_put_varint(a + k, 3, (uint64_t)p[i].type);      /* SentencePiece.type */
            n += pb_put_bytes(out + n, 1, a, k);                    /* ModelProto.pieces */
        }
        break;
    }
    default: break;
    }
    return n;
}

/* The bytes of a model file with the extra fields appended. */
static unsigned char *model_bytes(const char *path, enum Extra e, size_t *size) {
    size_t n;
    unsigned char *model = read_whole_file(path, &n);
    if (!model) die(path);
    unsigned char extra[sizeof(TestCharsmap) + 64];
    unsigned char *out = concat_bytes(model, n, extra, extra_bytes(e, extra), size);
    free(model);
    if (!out) die("out of memory");
    return out;
}

static void put(const char *dir, const char *name, const void *data, size_t n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", g_out, dir);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/%s/%s", g_out, dir, name);
    if (write_whole_file(path, data, n) != 0) die(path);
}

/* dim 16, 4 heads of 4, hidden 24, context 8: a few KB of weights */
static Config tiny_config(Variant v, int latent, int vocab, DType dt, int layers) {
    Config c = test_config(v, latent, vocab, dt);
    c.dim = 16;
    c.n_layers = layers;
    c.n_heads = 4;
    c.head_dim = 4;
    c.rope_dim = v == VARIANT_MLA ? 4 : 0;
    c.hidden_dim = 24;
    c.max_seq_len = 8;
    return c;
}

static const char *const k_prompts[] = {
    "Once upon a time",
    "Tom had a red ball. He played with it every day!",
    "The caf\xC3\xA9 was na\xC3\xAFve, 7 cats said \"hello!\"",
    "A dragon \xF0\x9F\x90\x89 and \xE2\x82\xAC 45",
    "  two  spaces\tand a tab\n",
    "",
    "bad \xFF\xFE utf8",
    "cut \xE2\x82",
    "over \xF4\x90\x80\x80 long \xC0\xAF",
};

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: make_seeds OUTDIR TINY_TOKENIZER REAL_TOKENIZER NFKC_TOKENIZER\n");
        return 2;
    }
    g_out = argv[1];
    mkdir(g_out, 0755);
    char err[512];
    SpmTokenizer *tok[2] = {spm_load_file(argv[2], err, sizeof err), NULL};
    if (tok[0]) tok[1] = spm_load_file(argv[3], err, sizeof err);
    if (!tok[0] || !tok[1]) {
        fprintf(stderr, "make_seeds: %s\n", err);
        return 1;
    }

    /* loader */
    const struct {
        const char *name;
        Variant v;
        int latent;
        DType dt;
        int layers;
    } ck[] = {
        {"mha-bf16.bin", VARIANT_MHA, 0, DTYPE_BF16, 1},    {"gqa-bf16.bin", VARIANT_GQA, 0, DTYPE_BF16, 1},
        {"mqa-bf16.bin", VARIANT_MQA, 0, DTYPE_BF16, 1},    {"mla8-bf16.bin", VARIANT_MLA, 8, DTYPE_BF16, 1},
        {"mla16-bf16.bin", VARIANT_MLA, 16, DTYPE_BF16, 1}, {"gqa-f32-2layers.bin", VARIANT_GQA, 0, DTYPE_F32, 2},
        {"mla8-f32.bin", VARIANT_MLA, 8, DTYPE_F32, 1},
    };
    for (size_t i = 0; i < sizeof ck / sizeof ck[0]; i++) {
        Config c = tiny_config(ck[i].v, ck[i].latent, spm_vocab_size(tok[0]), ck[i].dt, ck[i].layers);
        char path[1024];
        snprintf(path, sizeof path, "%s/seeds-loader", g_out);
        mkdir(path, 0755);
        snprintf(path, sizeof path, "%s/seeds-loader/%s", g_out, ck[i].name);
        if (write_test_checkpoint(path, &c, argv[2], 11 + i) != 0) {
            fprintf(stderr, "make_seeds: cannot write %s\n", path);
            return 1;
        }
    }

    /* a checkpoint whose tokenizer normalizes */
    size_t rule_size;
    unsigned char *rule_model = model_bytes(argv[2], EXTRA_RULE, &rule_size);
    char rule_path[1024], ck_path[1024];
    snprintf(rule_path, sizeof rule_path, "%s/tiny-rule.model", g_out);
    snprintf(ck_path, sizeof ck_path, "%s/seeds-loader/gqa-bf16-charsmap.bin", g_out);
    Config rc = tiny_config(VARIANT_GQA, 0, spm_vocab_size(tok[0]), DTYPE_BF16, 1);
    if (write_whole_file(rule_path, rule_model, rule_size) != 0 ||
        write_test_checkpoint(ck_path, &rc, rule_path, 99) != 0)
        die(ck_path);
    free(rule_model);

    /* tokenizer_model: [flags][short buffer][text length, 2 bytes][text][model] */
    static const struct {
        const char *name;
        int model_arg;
        enum Extra extra;
        const char *text;
    } with_model[] = {
        {"tiny-plain", 2, EXTRA_NONE, "Once upon a time"},
        {"tiny-accents", 2, EXTRA_NONE, "The caf\xC3\xA9 \xF0\x9F\x90\x89 said \"hi\"!"},
        {"tiny-rule", 2, EXTRA_RULE, "q upon a q"},
        {"tiny-rule-bad", 2, EXTRA_RULE, "bad \xFF q"},
        {"tiny-flags", 2, EXTRA_FLAGS, "  two  spaces "},
        {"tiny-pieces", 2, EXTRA_PIECES, "a <tag> zzz <ctl>"},
        {"real", 3, EXTRA_NONE, "Tom had a red ball."},
        {"nfkc-fullwidth", 4, EXTRA_NONE, "\xEF\xBD\x86\xEF\xBD\x95ll \xE2\x91\xA0 moon"},
    };
    for (size_t i = 0; i < sizeof with_model / sizeof with_model[0]; i++) {
        size_t msize, tlen = strlen(with_model[i].text);
        unsigned char *m = model_bytes(argv[with_model[i].model_arg], with_model[i].extra, &msize);
        unsigned char head[4 + 64];
        head[0] = (unsigned char)(1 | (i % 4) << 1);
        head[1] = (unsigned char)(3 + 5 * i);
        head[2] = (unsigned char)tlen;
        head[3] = 0;
        memcpy(head + 4, with_model[i].text, tlen);
        size_t total;
        unsigned char *seed = concat_bytes(head, 4 + tlen, m, msize, &total);
        if (!seed) die("out of memory");
        put("seeds-tokenizer_model", with_model[i].name, seed, total);
        free(seed);
        free(m);
    }

    /* tokenizer: [flags][split][short buffer][text][int16 ids of the text] */
    for (size_t i = 0; i < sizeof k_prompts / sizeof k_prompts[0]; i++)
        for (int k = 0; k < 2; k++) {
            const char *p = k_prompts[i];
            size_t len = strlen(p);
            int ids[256];
            int n = spm_encode(tok[k], p, len, 1, ids, 256);
            if (n < 0) n = 0;
            if (n > 256) n = 256;
            unsigned char buf[3 + 512 + 64];
            size_t total = 3 + len + 2 * (size_t)n;
            buf[0] = (unsigned char)(k | 2 | (i % 4) << 2);
            buf[1] = (unsigned char)(total > 3 ? len * 255 / (total - 3) : 0);
            while (buf[1] < 255 && (total - 3) * buf[1] / 255 < len) buf[1]++; /* the split lands on len */
            buf[2] = (unsigned char)(5 + 7 * i);
            memcpy(buf + 3, p, len);
            for (int j = 0; j < n; j++) {
                buf[3 + len + 2 * j] = (unsigned char)(ids[j] & 0xFF);
                buf[3 + len + 2 * j + 1] = (unsigned char)(ids[j] >> 8 & 0xFF);
            }
            char name[64];
            snprintf(name, sizeof name, "prompt%zu-%s", i, k ? "real" : "tiny");
            put("seeds-tokenizer", name, buf, total);
        }

    /* cli: argument vectors, joined with NUL bytes */
    static const char *const argvs[][16] = {
        {"m.bin"},
        {"m.bin", "-p", "Once upon a time", "--kv"},
        {"m.bin", "-p", "Once upon a time", "-n", "20", "-s", "7", "--ignore-eos", "--log", "steps.csv"},
        {"m.bin", "-k", "1", "-t", "0", "-n", "40", "-q", "--dump-logits", "out.bin", "--threads", "2"},
        {"m.bin", "--mla", "absorb", "--check-kv", "-n", "30"},
        {"m.bin", "--mla", "expand", "--ppl", "stories.txt"},
        {"m.bin", "--info"},
        {"-h"},
        {"m.bin", "-t", "0.7", "-k", "4096", "-s", "9223372036854775807", "--threads", "256"},
        {"-p", "x", "m.bin", "-t", "1e-3", "-k", "40"},
    };
    for (size_t i = 0; i < sizeof argvs / sizeof argvs[0]; i++) {
        char buf[512], name[32];
        size_t n = 0;
        for (int j = 0; j < 16 && argvs[i][j]; j++) {
            size_t l = strlen(argvs[i][j]);
            if (j) buf[n++] = '\0';
            memcpy(buf + n, argvs[i][j], l);
            n += l;
        }
        snprintf(name, sizeof name, "argv%zu", i);
        put("seeds-cli", name, buf, n);
    }

    /* ppl */
    static const char *const stories[] = {
        "Once upon a time there was a cat. The cat liked milk.\n<|endoftext|>\n"
        "Tom had a red ball.\nHe played with it every day!\n<|endoftext|>\nLily saw a bird.\n<|endoftext|>\n",
        "  First story.\nSecond line.\n<|endoftext|>\n\nStory two.\n <|endoftext|> \n\n<|endoftext|>\nLast",
        "a <|endoftext|> b\n<|endoftext|>",
        "The caf\xC3\xA9 \xF0\x9F\x90\x89\r\n<|endoftext|>\r\n",
    };
    for (size_t i = 0; i < sizeof stories / sizeof stories[0]; i++) {
        char name[32];
        snprintf(name, sizeof name, "stories%zu.txt", i);
        put("seeds-ppl", name, stories[i], strlen(stories[i]));
    }
    spm_free(tok[0]);
    spm_free(tok[1]);
    return 0;
}
