"""What every part of the bench shares: the paths and settings, the errors and the
interrupt, progress lines, the statistics of timed runs (median and spread), and the
formatting of figures and markdown tables."""
import math
import os
import signal
import statistics
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


RUN = os.environ.get("RUN_BINARY") or os.path.join(ROOT, "run")   # make test-asan: the ASan build


ROOFLINE = os.path.join(ROOT, "build", "roofline")


PROMPT = "Once upon a time"


ORDER = ["mha", "gqa", "mqa", "mla64", "mla128"]


MODES = ("no-kv", "kv")


MODE_LABEL = {"no-kv": "no KV", "kv": "KV"}


MAX_BATCH = 256            # ./run --batch's limit


LARGE_BATCH = 128          # from here on a run takes seconds (MHA at 256 reads ~0.5 GB a step): fewer timed runs


CAPACITY_MIB = (64.0, 1024.0)


# The kinds of throughput run: a name for the tables ("" is the engine's defaults), the extra
# ./run flags of every run of that kind, and the batch sizes and capacities in MiB it runs (None:
# all of --batches / --capacity-mib). The cache dtypes run the batch sizes issue 24 compares.
BATCH_CONFIGS = (("", (), None, None),
                 ("bf16", ("--kv-dtype", "bf16"), (1, 64), (64.0,)),
                 ("int8", ("--kv-dtype", "int8"), (1, 64), (64.0,)))


DEFAULT_KIND = BATCH_CONFIGS[:1]   # the throughput and capacity tables, the plots, the crossings


# (per-run quantity, table heading): every table cell is the median over the timed runs of one
# of these, with its spread
QUANTITIES = [("prefill_ms", "Prefill, ms"), ("step_ms", "Decode, ms/token (median step)"),
              ("tokens_per_s", "tokens/s"), ("mean_step_ms", "Decode mean, ms/token")]


class BenchError(Exception):
    pass


class Interrupted(BaseException):
    """SIGINT or SIGTERM: not an Exception, so no handler of a failed part swallows it."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def on_signal(signum, _frame):
    raise Interrupted(signum)


def rel(path):
    r = os.path.relpath(path, ROOT)
    return path if r.startswith("..") else r


def read_stories(path):
    """The stories of a TinyStoriesV2-layout file (separated by <|endoftext|> lines), stripped,
    empty ones dropped."""
    with open(path, encoding="utf-8") as f:
        return [s.strip() for s in f.read().split("<|endoftext|>") if s.strip()]


def log(msg):
    print(msg, flush=True)


def warn(msg):
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def median(xs):
    return statistics.median(xs)


def engine_message(stderr):
    """The engine's own last word on a failure: the last line it wrote to stderr."""
    lines = [x for x in stderr.strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else "no message"


def log_rep(engine, name, mode, rep, reps, s):
    """One progress line per run; rep 0 is the warm-up."""
    label_ = "warm-up" if rep == 0 else f"run {rep}/{reps}"
    log(f"  [{engine}] {name:6s} {mode:5s} {label_:9s} prefill {s['prefill_ms']:8.3f} ms | "
        f"decode {s['step_ms']:8.3f} ms/token (median step)")


def summarize_run(rows, expect_decode, what):
    """A run's figures from its per-step rows: the prefill, the median and the mean decode step
    (on a busy machine a few slow steps pull the mean far above the median), tokens/s."""
    pre = [r for r in rows if r["phase"] == "prefill"]
    dec = [r for r in rows if r["phase"] == "decode"]
    if len(pre) != 1 or len(dec) != expect_decode or not dec:
        raise BenchError(f"{what}: the step log has {len(pre)} prefill and {len(dec)} decode rows, "
                         f"expected 1 and {expect_decode}")
    dec_ms = [r["ms"] for r in dec]
    step = median(dec_ms)
    return {"prefill_ms": pre[0]["ms"], "step_ms": step, "mean_step_ms": statistics.fmean(dec_ms),
            "tokens_per_s": 1e3 / step, "total_ms": pre[0]["ms"] + sum(dec_ms), "rows": rows,
            "prompt_tokens": pre[0]["n_tokens"], "tokens": [r["token"] for r in pre + dec]}


def spread(values):
    return {"median": median(values), "min": min(values), "max": max(values), "n": len(values)}


def cell_stats(runs):
    return {q: spread([r[q] for r in runs]) for q, _ in QUANTITIES} if runs else None


def representative(runs):
    """The run whose total time is the median one (the lower middle for an even count)."""
    if not runs:
        return None
    return sorted(runs, key=lambda r: r["total_ms"])[(len(runs) - 1) // 2]


def kind_values(given, kinds_own):
    """The batch sizes (or capacities) of a kind of run: those given that the kind runs."""
    return [x for x in given if kinds_own is None or x in kinds_own]


def batch_reps(args, batch):
    return args.reps if batch < LARGE_BATCH else args.large_batch_reps


def cell_mode(kind, batch):
    """The CSV's mode of a throughput cell: B=64, and the kind of run when it is not the default."""
    return f"B={batch}" + (f" {kind}" if kind else "")


def fmt(x, digits=3):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.1f}"
    if abs(x) >= 10:
        return f"{x:.2f}"
    return f"{x:.{digits}f}"


def fmt_spread(s):
    """A median and its spread: ± the largest distance of a run from the median, so that every
    timed run lies within the band; a single run (a partial report) has no spread to give."""
    if s["n"] < 2:
        return f"{fmt(s['median'])} (1 run)"
    return f"{fmt(s['median'])} ± {fmt(max(s['max'] - s['median'], s['median'] - s['min']))}"


def label(info):
    v = info["variant"]
    if v == "mha":
        return "MHA"
    if v == "gqa":
        return f"GQA (G={info['heads'] // info['kv_heads']})"
    if v == "mqa":
        return "MQA"
    if info["is_mla"]:
        return f"MLA d_latent={info['latent']}"
    return v.upper()


def md_table(header, rows, align=None):
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def image(pngs, name, alt):
    return [f"![{alt}]({os.path.basename(pngs[name])})", ""] if name in pngs else []
