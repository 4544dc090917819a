/* cli_parse (cli.h): return codes, defaults, every flag, the messages ./run prints,
 * and messages cut to small buffers. tests/test_cli.py checks the same messages
 * end to end through ./run. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <string.h>

#include "cli.h"
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
    assert_int_equal(o.mla_form, MLA_EXPANDED);  /* without the cache */
    assert_int_equal(o.kv + o.quiet + o.ignore_eos + o.check_kv + o.info, 0);
    assert_null(o.log_path);
    assert_null(o.ppl_path);
    assert_null(o.dump_path);
    assert_string_equal(err, "");
}

static void test_every_flag(void **state) {
    char *argv[] = {"run", "-p", "Once", "-n", "20", "-k", "7", "-t", "0.5", "-s", "99", "--kv", "--mla", "expand",
                    "--threads", "3", "--log", "l.csv", "-q", "--ignore-eos", "--check-kv", "--ppl", "s.txt", "--info",
                    "--dump-logits", "d.bin", "m.bin"};
    Options o;
    char err[64];
    assert_int_equal(parse(&o, ARGC(argv), argv, err, sizeof err), 0);
    assert_string_equal(o.prompt, "Once");
    assert_int_equal(o.steps, 20);
    assert_int_equal(o.top_k, 7);
    assert_true(o.temperature == 0.5f);
    assert_int_equal(o.seed, 99);
    assert_int_equal(o.mla_form, MLA_EXPANDED);
    assert_int_equal(o.threads, 3);
    assert_string_equal(o.log_path, "l.csv");
    assert_string_equal(o.ppl_path, "s.txt");
    assert_string_equal(o.dump_path, "d.bin");
    assert_string_equal(o.checkpoint, "m.bin");
    assert_int_equal(o.kv + o.quiet + o.ignore_eos + o.check_kv + o.info, 5);
    char *absorb[] = {"run", "--mla", "absorb", "-"};  /* "-" alone is a file name */
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

static void test_help(void **state) {
    Options o;
    char err[64];
    char *a[] = {"run", "m.bin", "-k", "5", "--help"};
    assert_int_equal(parse(&o, ARGC(a), a, err, sizeof err), 1);
    char *b[] = {"run", "-h"};
    assert_int_equal(parse(&o, ARGC(b), b, err, sizeof err), 1);
    char *c[] = {"run", "--bogus", "-h"};  /* flags are read in order: the error comes first */
    assert_int_equal(parse(&o, ARGC(c), c, err, sizeof err), 2);
    char *d[] = {"run", "-p", "-h"};       /* -h as the prompt; then no checkpoint */
    assert_int_equal(parse(&o, ARGC(d), d, err, sizeof err), 2);
    assert_string_equal(err, "no checkpoint given");
    assert_int_equal(o.usage_on_error, 1);
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
    char *e[] = {"run", "m.bin", "-t", "-1"};
    expect_usage_error(ARGC(e), e, "-t -1 is out of range (0..100)");
    char *f[] = {"run", "m.bin", "-t", "nan"};
    expect_usage_error(ARGC(f), f, "-t needs a number, got 'nan'");
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
        cmocka_unit_test(test_defaults), cmocka_unit_test(test_every_flag), cmocka_unit_test(test_help),
        cmocka_unit_test(test_messages), cmocka_unit_test(test_small_buffers),
    };
    return cmocka_run_group_tests_name("cli", tests, NULL, NULL);
}
