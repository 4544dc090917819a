/* fuzz_cli.c: arbitrary argument vectors for cli_parse.
 *
 * The input is split at NUL bytes into argv[1..] (argv[0] is "run"). Besides memory
 * errors, it checks what cli.h promises: the return is 0, 1 or 2; an error message is
 * non-empty and NUL-terminated within the buffer (a second, 16-byte buffer checks
 * the cut); a 0 return leaves options inside their documented ranges; argv is not reordered. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "serve/cli.h"

#define MAX_ARGS 64

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check(int rc, const Options *o, const char *err, size_t errlen) {
    if (rc < CLI_RUN || rc > CLI_VERSION) abort();
    if (rc == CLI_USAGE_ERROR) {
        size_t n = strnlen(err, errlen);
        if (n == 0 || n == errlen) abort();
    }
    if (rc == CLI_RUN) {
        if (!o->checkpoint == !o->shape || !o->prompt) abort(); /* one model source: a checkpoint or a shape */
        if (o->ctx_size < 0 || o->ctx_size > MAX_SEQ_LEN) abort();
        if (!(o->top_p >= 0.0f && o->top_p <= 1.0f) || (o->quiet && o->verbose)) abort();
        if (o->steps < 0 || o->steps > (1 << 20) || o->top_k < 1 || o->top_k > (1 << 20)) abort();
        if (!(o->temperature >= 0.0f && o->temperature <= 100.0f)) abort();
        if (o->threads < 0 || o->threads > TEAM_MAX_THREADS ||
            (o->mla_form != MLA_ABSORBED && o->mla_form != MLA_EXPANDED))
            abort();
        if ((int64_t)o->seed < 0) abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *buf = malloc(size + 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    buf[size] = '\0';
    char *argv[MAX_ARGS + 2];
    int argc = 0;
    argv[argc++] = "run";
    for (size_t i = 0; argc <= MAX_ARGS;) {
        argv[argc++] = buf + i;
        char *nul = memchr(buf + i, '\0', size + 1 - i);
        i = (size_t)(nul - buf) + 1;
        if (i > size) break;
    }
    argv[argc] = NULL;
    char *order[MAX_ARGS + 2];
    memcpy(order, argv, sizeof order);
    Options o;
    char err[512], small[16];
    int rc = cli_parse(&o, argc, argv, err, sizeof err);
    check(rc, &o, err, sizeof err);
    if (memcmp(order, argv, (size_t)(argc + 1) * sizeof *argv) != 0) abort();
    int rc2 = cli_parse(&o, argc, argv, small, sizeof small);
    if (rc2 != rc) abort();
    check(rc2, &o, small, sizeof small);
    if (rc == CLI_USAGE_ERROR && strncmp(small, err, strlen(small)) != 0) abort(); /* the cut is a prefix */
    free(buf);
    return 0;
}
