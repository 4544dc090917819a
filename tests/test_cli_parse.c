/* cli_parse (cli.h): return codes, defaults, every flag, the messages ./run prints,
 * and messages cut to small buffers. tests/test_cli.py checks the same messages
 * end to end through ./run. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <string.h>

#include "serve/cli.h"
#include "testutil.h"

#define ARGC(a) ((int)(sizeof(a) / sizeof(a[0])))

static int parse(Options *o, int argc, char **argv, char *err, size_t errlen) {
    return cli_parse(o, argc, argv, err, errlen);
}

static void expect_usage_error(int argc, char **argv, const char *message) {
    Options o;
    char err[256];
    assert_int_equal(parse(&o, argc, argv, err, sizeof err), 2);
    assert_string_equal(err, message);
    assert_int_equal(o.usage_on_error, 0);
}

static void test_defaults(void **state) {
    char *argv[] = {"run", "m.bin"};
    Options o;
    char err[64];
    assert_int_equal(parse(&o, ARGC(argv), argv, err, sizeof err), 0);
    assert_string_equal(o.checkpoint, "m.bin");
    assert_string_equal(o.prompt, "");
    assert_int_equal(o.steps, 0);
    assert_int_equal(o.top_k, 40);
    assert_true(o.temperature == 1.0f);
    assert_int_equal(o.threads, 0);
    assert_int_equal(o.mla_form, MLA_EXPANDED); /* without the cache */
    assert_true(o.top_p == 1.0f);
    assert_int_equal(o.kv + o.quiet + o.verbose + o.ignore_eos + o.check_kv + o.info + o.json, 0);
    assert_null(o.prompt_path);
    assert_null(o.log_path);
    assert_null(o.ppl_path);
    assert_null(o.dump_path);
    assert_string_equal(err, "");
}

static void test_every_flag(void **state) {
    char *argv[] = {"run",       "-p",   "Once",  "-n",    "20", "-k",           "7",      "--top-p",
                    "0.9",       "-t",   "0.5",   "-s",    "99", "--kv",         "--mla",  "expand",
                    "--threads", "3",    "--log", "l.csv", "-q", "--ignore-eos", "--json", "--dump-logits",
                    "d.bin",     "m.bin"};
    Options o;
    char err[64];
    assert_int_equal(parse(&o, ARGC(argv), argv, err, sizeof err), CLI_RUN);
    assert_string_equal(o.prompt, "Once");
    assert_null(o.prompt_path);
    assert_int_equal(o.steps, 20);
    assert_int_equal(o.top_k, 7);
    assert_true(o.top_p == 0.9f);
    assert_true(o.temperature == 0.5f);
    assert_int_equal(o.seed, 99);
    assert_int_equal(o.mla_form, MLA_EXPANDED);
    assert_int_equal(o.threads, 3);
    assert_string_equal(o.log_path, "l.csv");
    assert_string_equal(o.dump_path, "d.bin");
    assert_string_equal(o.checkpoint, "m.bin");
    assert_int_equal(o.kv + o.quiet + o.ignore_eos + o.json, 4);
    char *modes[][4] = {{"run", "--check-kv", "m.bin", "-v"},
                        {"run", "--ppl", "s.txt", "m.bin"},
                        {"run", "--info", "m.bin", "--verbose"}};
    assert_int_equal(parse(&o, 4, modes[0], err, sizeof err), CLI_RUN);
    assert_int_equal(o.check_kv + o.verbose, 2);
    assert_int_equal(parse(&o, 4, modes[1], err, sizeof err), CLI_RUN);
    assert_string_equal(o.ppl_path, "s.txt");
    assert_int_equal(parse(&o, 4, modes[2], err, sizeof err), CLI_RUN);
    assert_int_equal(o.info + o.verbose, 2);
    char *absorb[] = {"run", "--mla", "absorb", "-"}; /* "-" alone is a file name */
    assert_int_equal(parse(&o, ARGC(absorb), absorb, err, sizeof err), 0);
    assert_int_equal(o.mla_form, MLA_ABSORBED);
    assert_string_equal(o.checkpoint, "-");
    /* the default form follows the mode: absorbed with the cache, expanded for --ppl */
    char *kv[] = {"run", "--kv", "m.bin"};
    assert_int_equal(parse(&o, ARGC(kv), kv, err, sizeof err), 0);
    assert_int_equal(o.mla_form, MLA_ABSORBED);
    char *kv_ppl[] = {"run", "--kv", "--ppl", "s.txt", "m.bin"};
    assert_int_equal(parse(&o, ARGC(kv_ppl), kv_ppl, err, sizeof err), 0);
    assert_int_equal(o.mla_form, MLA_EXPANDED);
}

/* Long names, --flag=value, abbreviations, "--", and argv left in its order. */
static void test_long_forms(void **state) {
    char *argv[] = {
        "run",  "--prompt=Once upon", "--n-predict", "12",          "--top-k=3",       "--top-p=0.25", "--temp",
        "0.75", "--seed=5",           "--quiet",     "--threads=2", "--kv-dtype=int8", "--ignore",     "m.bin"};
    char *copy[ARGC(argv)];
    memcpy(copy, argv, sizeof argv);
    Options o;
    char err[64];
    assert_int_equal(parse(&o, ARGC(argv), argv, err, sizeof err), CLI_RUN);
    assert_string_equal(o.prompt, "Once upon");
    assert_int_equal(o.steps, 12);
    assert_int_equal(o.top_k, 3);
    assert_true(o.top_p == 0.25f);
    assert_true(o.temperature == 0.75f);
    assert_int_equal(o.seed, 5);
    assert_int_equal(o.quiet + o.ignore_eos, 2); /* --ignore: the one flag it starts */
    assert_int_equal(o.threads, 2);
    assert_int_equal(o.kv_dtype, DTYPE_I8);
    assert_string_equal(o.checkpoint, "m.bin");
    assert_memory_equal(copy, argv, sizeof argv); /* not reordered */
    /* the checkpoint may come first; after "--" a name starting with '-' is the checkpoint */
    char *dashes[] = {"run", "-k", "2", "--", "-odd.bin"};
    assert_int_equal(parse(&o, ARGC(dashes), dashes, err, sizeof err), CLI_RUN);
    assert_string_equal(o.checkpoint, "-odd.bin");
    assert_int_equal(o.top_k, 2);
    /* a value may start with '-'; an empty value is a value */
    char *dash_value[] = {"run", "m.bin", "-p", "-h", "--log="};
    assert_int_equal(parse(&o, ARGC(dash_value), dash_value, err, sizeof err), CLI_RUN);
    assert_string_equal(o.prompt, "-h");
    assert_string_equal(o.log_path, "");
    /* short flags cluster, and a short flag's value may be attached */
    char *cluster[] = {"run", "-qk5", "m.bin"};
    assert_int_equal(parse(&o, ARGC(cluster), cluster, err, sizeof err), CLI_RUN);
    assert_int_equal(o.quiet, 1);
    assert_int_equal(o.top_k, 5);
    /* a second parse starts afresh (getopt's state is reset) */
    assert_int_equal(parse(&o, ARGC(argv), argv, err, sizeof err), CLI_RUN);
    assert_int_equal(o.top_k, 3);
    char *version[] = {"run", "--version"};
    assert_int_equal(parse(&o, ARGC(version), version, err, sizeof err), CLI_VERSION);
}

/* -f FILE and -p - name where the prompt comes from; the last -p wins; -p with -f is refused. */
static void test_prompt_sources(void **state) {
    Options o;
    char err[64];
    char *file[] = {"run", "-f", "prompt.txt", "m.bin"};
    assert_int_equal(parse(&o, ARGC(file), file, err, sizeof err), CLI_RUN);
    assert_string_equal(o.prompt_path, "prompt.txt");
    assert_int_equal(o.prompt_given, 1);
    char *stdin_prompt[] = {"run", "m.bin", "--prompt", "-"};
    assert_int_equal(parse(&o, ARGC(stdin_prompt), stdin_prompt, err, sizeof err), CLI_RUN);
    assert_string_equal(o.prompt_path, "-");
    char *last[] = {"run", "m.bin", "-p", "-", "-p", "Once"};
    assert_int_equal(parse(&o, ARGC(last), last, err, sizeof err), CLI_RUN);
    assert_null(o.prompt_path);
    assert_string_equal(o.prompt, "Once");
    char *both[] = {"run", "m.bin", "-p", "Once", "--file=p.txt"};
    expect_usage_error(ARGC(both), both, "-p and -f cannot be combined");
    char *serve[] = {"run", "m.bin", "-f", "p.txt", "--prompts", "all.txt"};
    expect_usage_error(ARGC(serve), serve, "-f and --prompts cannot be combined");
    char *serve_p[] = {"run", "m.bin", "-p", "Once", "--prompts", "all.txt"};
    expect_usage_error(ARGC(serve_p), serve_p, "-p and --prompts cannot be combined");
}

/* Modes exclude each other, and outputs that only a generation writes are refused beside them. */
static void test_one_mode(void **state) {
    char *a[] = {"run", "m.bin", "--info", "--check-kv", "--ppl", "s.txt"};
    expect_usage_error(ARGC(a), a, "--info and --check-kv cannot be combined: one mode a run");
    char *b[] = {"run", "m.bin", "--ppl", "s.txt", "--check-batch", "--batch", "2"};
    expect_usage_error(ARGC(b), b, "--ppl and --check-batch cannot be combined: one mode a run");
    char *c[] = {"run", "m.bin", "--check-kv", "--log", "l.csv"};
    expect_usage_error(ARGC(c), c, "--log records a generation: it takes no --check-kv");
    char *d[] = {"run", "m.bin", "--info", "--dump-logits", "d.bin"};
    expect_usage_error(ARGC(d), d, "--dump-logits records a generation: it takes no --info");
    char *e[] = {"run", "m.bin", "--ppl", "s.txt", "--prompts", "p.txt"};
    expect_usage_error(ARGC(e), e, "--prompts serves a generation: it takes no --ppl");
    char *f[] = {"run", "m.bin", "--check-batch", "--json"};
    expect_usage_error(ARGC(f), f, "--check-batch needs --batch B");
    char *g[] = {"run", "m.bin", "-q", "-v"};
    expect_usage_error(ARGC(g), g, "-q and -v cannot be combined");
    char *h[] = {"run", "m.bin", "--ppl", "s.txt", "--batch", "3"};
    expect_usage_error(ARGC(h), h, "--ppl scores one sequence at a time: it takes no --batch");
    char *ok[] = {"run", "m.bin", "--check-batch", "--batch", "2", "--prompts", "p.txt"};
    Options o;
    assert_int_equal(parse(&o, ARGC(ok), ok, NULL, 0), CLI_RUN);
}

static void test_help(void **state) {
    Options o;
    char err[64];
    char *a[] = {"run", "m.bin", "-k", "5", "--help"};
    assert_int_equal(parse(&o, ARGC(a), a, err, sizeof err), 1);
    char *b[] = {"run", "-h"};
    assert_int_equal(parse(&o, ARGC(b), b, err, sizeof err), 1);
    char *c[] = {"run", "--bogus", "-h"}; /* flags are read in order: the error comes first */
    assert_int_equal(parse(&o, ARGC(c), c, err, sizeof err), 2);
    char *d[] = {"run", "-p", "-h"}; /* -h as the prompt; then no checkpoint */
    assert_int_equal(parse(&o, ARGC(d), d, err, sizeof err), 2);
    assert_string_equal(err, "no checkpoint given");
    assert_int_equal(o.usage_on_error, 1);
}

/* --shape stands for the checkpoint; -c is the context, checked against the model later */
static void test_shape_and_context(void **state) {
    Options o;
    char err[256];
    char *a[] = {"run", "--shape", "llama2-7b,kv_heads=1", "-c", "32768", "--info"};
    assert_int_equal(parse(&o, ARGC(a), a, err, sizeof err), 0);
    assert_string_equal(o.shape, "llama2-7b,kv_heads=1");
    assert_null(o.checkpoint);
    assert_int_equal(o.ctx_size, 32768);
    char *b[] = {"run", "m.bin", "--ctx-size=131072"};
    assert_int_equal(parse(&o, ARGC(b), b, err, sizeof err), 0);
    assert_int_equal(o.ctx_size, 131072);
    assert_null(o.shape);
    char *c[] = {"run", "m.bin", "--shape", "gqa"};
    expect_usage_error(ARGC(c), c,
                       "--shape generates a model's weights: it takes no checkpoint (got 'm.bin'); give one or the other");
    char *d[] = {"run", "--shape", "gqa", "-c", "131073"};
    expect_usage_error(ARGC(d), d, "-c 131073 is out of range (1..131072)");
    char *e[] = {"run", "--shape", "gqa", "-c", "0"};
    expect_usage_error(ARGC(e), e, "-c 0 is out of range (1..131072)");
    char *f[] = {"run", "-c", "64"};
    assert_int_equal(parse(&o, ARGC(f), f, err, sizeof err), 2);
    assert_string_equal(err, "no checkpoint given");
}

static void test_messages(void **state) {
    char *a[] = {"run", "m.bin", "--bogus"};
    expect_usage_error(ARGC(a), a, "unknown flag --bogus (see -h)");
    char *b[] = {"run", "m.bin", "-n"};
    expect_usage_error(ARGC(b), b, "-n needs a value (see -h)");
    char *c[] = {"run", "m.bin", "-n", "0"};
    expect_usage_error(ARGC(c), c, "-n 0 is out of range (1..1048576)");
    char *d[] = {"run", "m.bin", "-n", "ten"};
    expect_usage_error(ARGC(d), d, "-n needs an integer, got 'ten'");
    char *d2[] = {"run", "m.bin", "-s", "99999999999999999999"}; /* past a long: out of range too */
    expect_usage_error(ARGC(d2), d2, "-s 99999999999999999999 is out of range (0..9223372036854775807)");
    char *e[] = {"run", "m.bin", "-t", "-1"};
    expect_usage_error(ARGC(e), e, "-t -1 is out of range (0..100)");
    char *f[] = {"run", "m.bin", "-t", "nan"};
    expect_usage_error(ARGC(f), f, "-t needs a number, got 'nan'");
    char *f2[] = {"run", "m.bin", "-t", "1e39"}; /* overflows a float: out of range, not "needs a number" */
    expect_usage_error(ARGC(f2), f2, "-t 1e39 is out of range (0..100)");
    char *f3[] = {"run", "m.bin", "--kv-mem", "-inf"};
    expect_usage_error(ARGC(f3), f3, "--kv-mem -inf is out of range (0..1048576)");
    char *g[] = {"run", "m.bin", "--threads", "10000"};
    expect_usage_error(ARGC(g), g, "--threads 10000 is out of range (1..256)");
    char *h[] = {"run", "m.bin", "-s", "-1"};
    expect_usage_error(ARGC(h), h, "-s -1 is out of range (0..9223372036854775807)");
    char *i[] = {"run", "m.bin", "--mla", "fold"};
    expect_usage_error(ARGC(i), i, "--mla takes absorb or expand, got 'fold'");
    char *j[] = {"run", "m.bin", "other.bin"};
    expect_usage_error(ARGC(j), j, "unexpected argument 'other.bin' (one checkpoint only; see -h)");
    char *k[] = {"run", "m.bin", "-k", "0"};
    expect_usage_error(ARGC(k), k, "-k 0 is out of range (1..1048576)");
    /* long forms: the message names the flag as its long name */
    char *l[] = {"run", "m.bin", "--n-predict=0"};
    expect_usage_error(ARGC(l), l, "--n-predict 0 is out of range (1..1048576)");
    char *m[] = {"run", "m.bin", "--top-p", "1.5"};
    expect_usage_error(ARGC(m), m, "--top-p 1.5 is out of range (0..1)");
    char *n[] = {"run", "m.bin", "--kv=yes"};
    expect_usage_error(ARGC(n), n, "--kv takes no value, got '--kv=yes'");
    char *p[] = {"run", "m.bin", "--check"};
    expect_usage_error(ARGC(p), p, "--check is ambiguous (see -h)");
    char *q[] = {"run", "m.bin", "--seed"};
    expect_usage_error(ARGC(q), q, "--seed needs a value (see -h)");
    char *r[] = {"run", "m.bin", "--bogus=1"};
    expect_usage_error(ARGC(r), r, "unknown flag --bogus (see -h)");
    char *t[] = {"run", "m.bin", "-qx"};
    expect_usage_error(ARGC(t), t, "unknown flag -x (see -h)");
    char *u[] = {"run", "m.bin", "--kv", "-qx"}; /* not mistaken for a value given to --kv */
    expect_usage_error(ARGC(u), u, "unknown flag -x (see -h)");
}

/* a message longer than the buffer is cut, still NUL-terminated; no buffer at all is fine */
static void test_small_buffers(void **state) {
    char *a[] = {"run", "m.bin", "--a-long-unknown-flag"};
    Options o;
    char err[8];
    memset(err, 'x', sizeof err);
    assert_int_equal(parse(&o, ARGC(a), a, err, sizeof err), 2);
    assert_string_equal(err, "unknown");
    assert_int_equal(parse(&o, ARGC(a), a, NULL, 0), 2);
    char *b[] = {"run"};
    assert_int_equal(parse(&o, ARGC(b), b, NULL, 0), 2);
    assert_int_equal(o.usage_on_error, 1);
}

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),       cmocka_unit_test(test_every_flag),    cmocka_unit_test(test_long_forms),
        cmocka_unit_test(test_prompt_sources), cmocka_unit_test(test_one_mode),      cmocka_unit_test(test_help),
        cmocka_unit_test(test_messages),       cmocka_unit_test(test_small_buffers), cmocka_unit_test(test_shape_and_context),
    };
    return cmocka_run_group_tests_name("cli", tests, NULL, NULL);
}
