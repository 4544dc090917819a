/* run.c: main. Reads the command line, loads the checkpoint, sizes the KV cache pool, and
 * hands the run to its mode (serve/modes.h), each of which drives the model a step at a
 * time through the scheduler (serve/scheduler.h):
 *
 *   ./run weights/gqa.bin -p "Once upon a time" --kv
 *
 * main -> mode_generate -> scheduler_step -> model_forward_pass -> attention -> the kernels */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "kernels/threads.h"
#include "kvcache.h"
#include "kvtier.h"
#include "loader.h"
#include "model.h"
#include "serve/cli.h"
#include "serve/draft.h"
#include "serve/modes.h"
#include "serve/session.h"
#include "serve/textfile.h"
#include "serve/version.h"
#include "shape.h"
#include "tokenizer/spm_c.h"
#include "kernels/errmsg.h"

/* ---- the standard streams and the prompt ---- */

/* A closed standard descriptor would be handed to the next file opened (the checkpoint, a
 * log), and the story or a message would land in that file: a closed stdout is refused,
 * a closed stdin or stderr gets /dev/null. */
static void check_standard_streams(const Options *o) {
    if (fcntl(STDOUT_FILENO, F_GETFD) < 0) die(1, "cannot write standard output: it is closed");
    if (fcntl(STDIN_FILENO, F_GETFD) < 0) {
        if (o->prompt_path && !strcmp(o->prompt_path, "-")) die(1, "cannot read the prompt: standard input is closed");
        if (o->prompts_path && !strcmp(o->prompts_path, "-"))
            die(1, "cannot read the --prompts file: standard input is closed");
        if (open("/dev/null", O_RDONLY) != STDIN_FILENO) die(1, "cannot open /dev/null: %s", strerror(errno));
    }
    if (fcntl(STDERR_FILENO, F_GETFD) < 0 && open("/dev/null", O_WRONLY) != STDERR_FILENO) exit(1);
}

/* The prompt of -f FILE or -p - (standard input), its CRLF line breaks read as LF (as
 * --prompts reads them), without its trailing line breaks. */
static char *read_prompt(const char *path) {
    char err[512], *text;
    if (textfile_read_text(path, &text, err, sizeof err) != 0) die(1, "%s", err);
    size_t n = 0;
    for (const char *c = text; *c; c++)
        if (!(c[0] == '\r' && c[1] == '\n')) text[n++] = *c;
    while (n > 0 && (text[n - 1] == '\n' || text[n - 1] == '\r')) n--;
    text[n] = '\0';
    return text;
}

/* The least stack limit (ulimit -s) this program runs under, refused below rather than met by
 * SIGSEGV: its large scratch is on the heap, but the libraries' own frames take several KB. */
enum { MIN_STACK_BYTES = 32 << 10 };

/* The model's shape: --shape's, or the checkpoint's header (ck, left open: nothing else
 * of it is read yet), with -c's context; a window as long as the context slides nothing,
 * so it goes. A shape's context is only a default, so --fill past it (no -c) sets the
 * context to the fill plus the shape's own, room for the prompt and -n as the shape had. */
static Config model_config(Options *o, Checkpoint *ck) {
    Config c;
    char err[512];
    if (o->shape) {
        if (shape_parse(&c, o->shape, err, sizeof err) != 0) die(EXIT_USAGE, "%s", err);
    } else {
        if (checkpoint_open(ck, o->checkpoint, err, sizeof err) != 0) die(1, "%s", err);
        c = ck->cfg;
    }
    if (o->shape && !o->ctx_size && o->fill >= c.max_seq_len) {
        const long grown = (long)o->fill + c.max_seq_len;
        o->fill_grew_ctx = c.max_seq_len;
        c.max_seq_len = grown < MAX_SEQ_LEN ? (int)grown : MAX_SEQ_LEN; /* past it, check_limits refuses the fill */
    }
    if (o->ctx_size) {
        if (!o->shape && o->ctx_size > c.max_seq_len)
            die(EXIT_USAGE, "-c %d is more than the %d positions %s was trained for: at most %d", o->ctx_size,
                c.max_seq_len, msg_path(o->checkpoint).s, c.max_seq_len);
        c.max_seq_len = o->ctx_size;
        if (c.window >= c.max_seq_len) c.window = 0;
        if (config_check(&c, "-c", err, sizeof err) != 0) die(EXIT_USAGE, "%s", err);
    }
    return c;
}

/* The limits that depend on the model: -k, -n, --window, and what a model without a
 * tokenizer cannot do. */
static void check_limits(const Config *c, const Options *o) {
    const int ctx = c->max_seq_len;
    if (o->top_k > c->vocab_size)
        die(EXIT_USAGE, "-k %d is out of range (1..%d, the vocabulary)", o->top_k, c->vocab_size);
    if (o->steps > ctx && (!o->window || o->check_kv || o->evict != KV_EVICT_OLDEST))
        die(EXIT_USAGE, "-n %d is out of range (1..%d, the context%s)", o->steps, ctx,
            o->check_kv ? "" : o->window ? "; --evict h2o and block keep positions' own rotation" : "; more with --window");
    if (o->window > ctx) die(EXIT_USAGE, "%s %d is out of range (1..%d, the context)", o->window_flag, o->window, ctx);
    if (o->evict == KV_EVICT_H2O && o->window < 2)
        die(EXIT_USAGE, "--kv-budget %d is too small for --evict h2o (2..%d)", o->window, ctx);
    if (o->evict == KV_EVICT_BLOCK && (o->window < 2 * KV_BLOCK_TOKENS || o->window % KV_BLOCK_TOKENS))
        die(EXIT_USAGE, "--kv-budget %d does not suit --evict block: whole blocks of %d, at least %d", o->window,
            KV_BLOCK_TOKENS, 2 * KV_BLOCK_TOKENS);
    if (o->window && o->window <= o->window_sinks)
        die(EXIT_USAGE, "%s %d leaves no room beside the %d sink positions", o->window_flag, o->window,
            o->window_sinks);
    if (o->fill && (long)o->fill + 1 > ctx)
        die(EXIT_USAGE, "--fill %d is out of range (1..%d: the prompt needs a position of the %d-token context)",
            o->fill, ctx - 1, ctx);
    if (o->mla_given && c->variant != VARIANT_MLA)
        die(EXIT_USAGE, "--mla chooses an MLA model's form: %s has no latent attention", variant_name(c));
    if (o->dump_path && (o->batch > 1 || o->prompts_path))
        die(EXIT_USAGE, "--dump-logits writes one sequence's logits: it takes no --batch or --prompts");
    if (o->shape && o->ppl_path)
        die(EXIT_USAGE, "--ppl scores text, and generated weights (--shape) have no tokenizer to read it with");
}

/* Blocks of the KV cache pool: --kv-mem MiB (less a stream's staging area), or the full
 * contexts (or windows) of the batch (one without the cache, whose passes empty it after
 * them). */
static int pool_blocks(const Config *c, const Options *o) {
    const size_t block_bytes = kv_block_bytes_for(c, o->kv_dtype);
    const int one_sequence = kv_blocks_for(o->window ? o->window : c->max_seq_len);
    const int row_width = c->variant == VARIANT_MLA ? c->kv_latent + c->rope_dim : c->head_dim;
    if (dtype_packed(o->kv_dtype) && row_width % 16)
        die(EXIT_USAGE, "--kv-dtype %s packs rows in slices of 16 elements; this model's rows have %d",
            kv_dtype_name(o->kv_dtype), row_width);
    /* int4, int2: each sequence's fp32 tail comes out of --kv-mem too, as does streaming's staging area */
    const double tails = (double)(o->kv ? o->batch : 1) * (o->draft ? 2 : 1) * (double)kv_tail_bytes_for(c, o->kv_dtype);
    const double blocks =
        o->kv_mem_mb > 0.0f
            ? fmax(0.0, floor(((double)o->kv_mem_mb * 1048576.0 - tails - (double)stream_stage_bytes(c, o)) /
                              (double)block_bytes))
            : (double)(o->kv ? o->batch : 1) * one_sequence;
    if (run_streams(o) && blocks < 2)
        die(EXIT_USAGE,
            "--kv-mem %g MB holds %.0f block%s of %zu bytes beside the tier's staging area (%.0f bytes); "
            "streaming needs 2 at least",
            (double)o->kv_mem_mb, blocks, blocks == 1 ? "" : "s", block_bytes, (double)stream_stage_bytes(c, o));
    if (blocks < one_sequence && !run_streams(o))
        die(EXIT_USAGE,
            "--kv-mem %g MB holds %.0f block%s of %zu bytes; one sequence of the full %s (%d tokens) needs %d%s",
            (double)o->kv_mem_mb, blocks, blocks == 1 ? "" : "s", block_bytes, o->window ? "window" : "context",
            o->window ? o->window : c->max_seq_len, one_sequence,
            o->kv_offload ? " (--kv-offload streams the rest from disk at --batch 1 alone: no --window, --prompts "
                            "or checks)"
                          : "");
    if (blocks > INT_MAX)
        die(EXIT_USAGE, "--kv-mem %g MB is more blocks than this program counts", (double)o->kv_mem_mb);
    return (int)blocks;
}

/* Refuses, before anything big is allocated, a run whose weights, pool and scratch exceed
 * the memory this machine has free. */
static void check_memory(const Config *c, const Options *o, int blocks) {
    const double weights = (double)model_bytes_for(c),
                 pool = (double)blocks * (double)kv_block_bytes_for(c, o->kv_dtype) + (double)stream_stage_bytes(c, o),
                 scratch = (double)scheduler_scratch_bytes(c, o->batch);
    double available, total;
    if (machine_memory(&available, &total) != 0 || weights + pool + scratch <= available) return;
    const double gib = 1024.0 * 1024.0 * 1024.0;
    die(1,
        "not enough memory: the weights (%.2f GiB), the KV cache pool (%.2f GiB) and the scratch of a pass of the "
        "whole context (%.2f GiB) need %.2f GiB, and this machine has %.2f GiB available (%.2f GiB in all); see --info",
        weights / gib, pool / gib, scratch / gib, (weights + pool + scratch) / gib, available / gib, total / gib);
}

/* --draft CKPT: the draft model, cut to the target's context, and a pool of its caches with
 * as many blocks as the target's (the same positions for the run's sequences), or where the
 * target's cache streams (`streams`) its whole context. A draft
 * that cannot be read, or of another vocabulary or tokenizer, is a bad --draft: exit 2.
 * (A file that begins as a corpus table is read as one: ngram_table_load.) */
static void load_draft(Model *dm, KVPool *dpool, const Model *m, const Options *o, int blocks, int streams) {
    Checkpoint ck = {.fd = -1};
    char err[512];
    if (checkpoint_open(&ck, o->draft_path, err, sizeof err) != 0) die(EXIT_USAGE, "--draft: %s", err);
    const int ctx = ck.cfg.max_seq_len < m->cfg.max_seq_len ? ck.cfg.max_seq_len : m->cfg.max_seq_len;
    if (checkpoint_load(dm, &ck, ctx, err, sizeof err) != 0) die(EXIT_USAGE, "--draft: %s", err);
    checkpoint_close(&ck);
    if (draft_matches(m, dm, err, sizeof err) != 0) die(EXIT_USAGE, "--draft %s: %s", msg_path(o->draft_path).s, err);
    if (streams && blocks < kv_blocks_for(dm->cfg.max_seq_len)) blocks = kv_blocks_for(dm->cfg.max_seq_len);
    if (kv_pool_init(dpool, &dm->cfg, o->kv_dtype, blocks) != 0) die(1, "out of memory: the draft model's KV cache pool");
}

int main(int argc, char **argv) {
    struct rlimit stack;
    if (getrlimit(RLIMIT_STACK, &stack) == 0 && stack.rlim_cur != RLIM_INFINITY && stack.rlim_cur < MIN_STACK_BYTES) {
        /* a string and _exit: printf to the unbuffered stderr and exit's handlers need more stack */
        char line[128];
        snprintf(line, sizeof line, "run: the stack limit (ulimit -s) is %llu KB, below the %d KB this program needs\n",
                 (unsigned long long)stack.rlim_cur >> 10, MIN_STACK_BYTES >> 10);
        fputs(line, stderr);
        _exit(EXIT_USAGE);
    }
    /* a file size limit (ulimit -f) then fails the write with EFBIG, which every output and
     * the tier report in one line, where SIGXFSZ would end the run without one */
    signal(SIGXFSZ, SIG_IGN);
    Options o;
    size_t errlen = 256; /* room for the longest message with every argument in it */
    for (int i = 0; i < argc; i++) errlen += strlen(argv[i]);
    char *usage_err = malloc(errlen);
    if (!usage_err) die(1, "out of memory");
    const int rc = cli_parse(&o, argc, argv, usage_err, errlen);
    if (rc == CLI_HELP || rc == CLI_VERSION) {
        if (rc == CLI_HELP)
            cli_usage(stdout);
        else
            printf("run %s (commit %s)\n", RUN_VERSION, build_commit());
        exit(0);
    }
    if (rc != CLI_RUN) {
        if (o.usage_on_error) cli_usage(stderr);
        die(EXIT_USAGE, "%s", usage_err);
    }
    check_standard_streams(&o);
    char *prompt_text = o.prompt_path ? read_prompt(o.prompt_path) : NULL;
    if (prompt_text) o.prompt = prompt_text;
    if (o.threads > 0)
        threads_set(o.threads);
    else if (threads_check_env(usage_err, errlen) != 0)
        die(EXIT_USAGE, "%s", usage_err);
    free(usage_err);

    Checkpoint ck = {.fd = -1};
    const Config cfg = model_config(&o, &ck);
    /* the model's own sliding window, the default of --window; part of the model, so a run
     * without the cache keeps it too (its recompute passes go through the window) */
    if (!o.window && cfg.window) o.window = cfg.window, o.window_sinks = 0, o.window_from_model = 1;
    /* what --window refuses (serve/cli.c), the model's own window refuses too */
    if (o.window_from_model && (o.draft || o.fill || dtype_packed(o.kv_dtype) || o.kv_offload))
        die(EXIT_USAGE, "%s takes no window, and this model has its own sliding window of %d positions",
            o.draft        ? "--draft (a ring cannot be rolled back)"
            : o.fill       ? "--fill"
            : o.kv_offload ? "--kv-offload"
                           : "--kv-dtype int4 or int2 (whole blocks)",
            cfg.window);
    if (!o.top_k_given && o.top_k > cfg.vocab_size) o.top_k = cfg.vocab_size; /* the default keeps them all */
    check_limits(&cfg, &o);
    const int blocks = pool_blocks(&cfg, &o);
    if (o.info) { /* from the shape alone: no weights, no pool; a checkpoint's tokenizer is checked */
        char err[512];
        SpmTokenizer *tokenizer = o.shape ? NULL : checkpoint_tokenizer(&ck, err, sizeof err);
        if (!o.shape && !tokenizer) die(1, "%s", err);
        spm_free(tokenizer);
        checkpoint_close(&ck);
        const int status = mode_info(&cfg, &o, blocks);
        free(prompt_text);
        close_written(stdout, "standard output");
        return status;
    }
    check_memory(&cfg, &o, blocks);
    Model m;
    char err[512];
    if (o.shape ? model_generate(&m, &cfg, o.seed, err, sizeof err) != 0
                : checkpoint_load(&m, &ck, cfg.max_seq_len, err, sizeof err) != 0)
        die(1, "%s", err);
    checkpoint_close(&ck);
    m.cfg.window = cfg.window;
    KVPool pool;
    if (kv_pool_init(&pool, &m.cfg, o.kv_dtype, blocks) != 0)
        die(1, "out of memory: the KV cache pool of %d blocks takes %.0f bytes", blocks,
            (double)blocks * (double)kv_block_bytes_for(&m.cfg, o.kv_dtype));
    if (o.window) kv_pool_set_window(&pool, o.window, o.window_sinks, o.evict);
    if (o.draft) kv_pool_set_rollback(&pool);
    KVTier tier = {.fd = -1};
    KVStream stream = {0};
    if (o.kv_offload) {
        if (kv_tier_open(&tier, o.kv_offload, kv_block_bytes(&pool)) != 0)
            die(EXIT_USAGE, "--kv-offload %s: cannot create the tier file: %s", msg_path(o.kv_offload).s,
                strerror(errno));
        if (o.preempt_swap) pool.tier = &tier;
        if (run_streams(&o)) {
            if (kv_stream_open(&stream, &tier, &pool, kv_blocks_for(m.cfg.max_seq_len)) != 0)
                die(1, "out of memory (or no thread could be started) for the tier's staging area of %.0f bytes",
                    (double)stream_stage_bytes(&m.cfg, &o));
            pool.stream = &stream;
        }
    }

    Model draft_model;
    KVPool draft_pool;
    NgramTable table;
    Drafter draft = {NULL, NULL, NULL};
    const int table_rc = o.draft_path ? ngram_table_load(&table, o.draft_path, &m, err, sizeof err) : 1;
    if (table_rc < 0) die(EXIT_USAGE, "%s", err);
    if (table_rc == 0) {
        draft.table = &table;
    } else if (o.draft_path) {
        load_draft(&draft_model, &draft_pool, &m, &o, blocks, pool.stream != NULL);
        draft = (Drafter){&draft_model, &draft_pool, NULL};
    }
    int status;
    if (o.check_spec)
        status = mode_check_spec(&m, &pool, &draft, &o);
    else if (o.check_kv)
        status = mode_check_kv(&m, &pool, &o);
    else if (o.ppl_path)
        status = mode_ppl(&m, &pool, &o);
    else if (o.check_batch)
        status = mode_check_batch(&m, &pool, &o);
    else
        status = mode_generate(&m, &pool, &draft, &o);

    if (draft.table)
        ngram_table_free(&table);
    else if (o.draft_path)
        kv_pool_free(&draft_pool), model_free(&draft_model);
    kv_pool_free(&pool);
    kv_stream_close(&stream);
    kv_tier_close(&tier);
    model_free(&m);
    free(prompt_text);
    close_written(stdout, "standard output"); /* --ppl and --check-kv print only at the end */
    return status;
}
