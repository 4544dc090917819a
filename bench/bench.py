#!/usr/bin/env python3
"""bench/bench.py: the latency tables of the KV-cache post, for the C engine and for the
PyTorch reference, with a roofline analysis, the throughput of batched decoding, the KV cache
sizes and capacities and the --check-kv determinism table.

    /usr/bin/python3 bench/bench.py [CHECKPOINT ...] [--threads N] [--reps R] [--pt-reps R] [--out DIR]
                                    [--batches 1,4,16,64,256] [--capacity-mib 64,1024]
    /usr/bin/python3 bench/bench.py --quick [CHECKPOINT ...]

`make bench` runs the full bench, `make bench-quick` the quick mode (bench/bench.mk; the
knobs are BENCH_CHECKPOINTS, BENCH_THREADS, BENCH_REPS, BENCH_PT_REPS, BENCH_OUT,
BENCH_BATCHES, BENCH_FLAGS). bench/README.md explains every number.

Every checkpoint generates from "Once upon a time" greedily (-k 1), ignoring EOS, so every
run does the same work: once without and once with the KV cache, a warm-up round and then
--reps timed rounds; every figure is the median over the timed runs with its spread. The
full bench generates to the full context and adds the PyTorch reference (train/model.py,
eager, in this process), the roofline probe and --check-kv. Then B copies of the prompt
decode together (--kv --batch B) for the throughput table, and pools of given sizes are
filled to count the full-context sequences they hold. --quick measures the C engine alone,
64 decode steps a run, 3 timed rounds, batches of 1 and 16, and prints one table.

Results go to DIR/<machine>.md, DIR/<machine>.csv, DIR/<machine>-steps.csv and four plots
(--quick: <machine>-quick.* in bench/results/tmp/quick), where <machine> is e.g.
amd-epyc-2c-2t-avx512 (CPU model, physical cores, threads used, the engine's kernels).

Nothing is lost to a failure or Ctrl-C: a checkpoint that fails is left out of the rest of
the bench, PyTorch that is missing or crashes leaves the C results, and an interrupt stops
the measuring; each writes the report of what was measured, headed PARTIAL REPORT with what
is missing and why, and exits non-zero (130 after Ctrl-C). Nothing is ever estimated in
place of a measurement. The engine is ./run, or $RUN_BINARY when set (make test-asan).
"""
import argparse
import csv
import datetime
import glob
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.environ.get("RUN_BINARY") or os.path.join(ROOT, "run")   # make test-asan: the ASan build
ROOFLINE = os.path.join(ROOT, "build", "roofline")
PROMPT = "Once upon a time"
ORDER = ["mha", "gqa", "mqa", "mla64", "mla128"]
MODES = ("no-kv", "kv")
MODE_LABEL = {"no-kv": "no KV", "kv": "KV"}
PT_TOLERANCE = 1e-4        # max |logit difference| allowed for the oneDNN Linear path
QUICK_STEPS = 64           # --quick: decode steps per run and timed rounds; five checkpoints
QUICK_REPS = 3             # then take well under a minute on 2 idle cores
FULL_REPS, PT_REPS = 5, 3
MAX_BATCH = 256            # ./run --batch's limit
BATCHES = (1, 4, 16, 64, 256)
QUICK_BATCHES = (1, 16)
LARGE_BATCH = 128          # from here on a run takes seconds (MHA at 256 reads ~0.5 GB a step): fewer timed runs
LARGE_BATCH_REPS = 1
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


def log(msg):
    print(msg, flush=True)


def warn(msg):
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def median(xs):
    return statistics.median(xs)


# ---------------------------------------------------------------- the machine

def sh(cmd):
    try:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_model():
    for line in sh(["lscpu"]).splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown-cpu"


def physical_cores():
    pairs = set()
    for line in sh(["lscpu", "-p=CORE,SOCKET"]).splitlines():
        if line and not line.startswith("#"):
            pairs.add(tuple(line.split(",")))
    return len(pairs) or os.cpu_count() or 1


def logical_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_slug(model, cores, threads):
    s = model.lower()
    s = re.sub(r"\((r|tm)\)", "", s)
    s = re.sub(r"@.*$", "", s)                                # "@ 2.10GHz"
    s = re.sub(r"\b(\d+|[a-z]+)-cores?\b", "", s)             # "24-Cores", "eight-core"
    s = re.sub(r"\b(cpu|processor|with radeon graphics)\b", "", s)
    s = re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "cpu"
    return f"{s}-{cores}c-{threads}t"


def cpu_detail():
    """ "family F, model M, stepping S" from lscpu, to tell CPU generations apart."""
    vals = {}
    for line in sh(["lscpu"]).splitlines():
        k, _, v = line.partition(":")
        if k.strip() in ("CPU family", "Model", "Stepping", "Hypervisor vendor"):
            vals[k.strip()] = v.strip()
    parts = [f"{k.lower()} {vals[k]}" for k in ("CPU family", "Model", "Stepping") if k in vals]
    if "Hypervisor vendor" in vals:
        parts.append(f"virtual machine ({vals['Hypervisor vendor']})")
    return ", ".join(parts)


def cache_line(level):
    """The cache of that level, as lscpu tells it, or else as CPUID tells it (a VM may show no
    cache in lscpu, and its CPUID may describe the host's)."""
    for line in sh(["lscpu"]).splitlines():
        if line.startswith(f"{level} cache:"):
            return line.split(":", 1)[1].strip()
    n = sh(["getconf", f"LEVEL{level[1:]}_CACHE_SIZE"]).strip()  # glibc reads it from CPUID
    return f"{int(n) / 2**20:g} MiB (CPUID)" if n.isdigit() and int(n) > 0 else "?"


def size_bytes(text):
    """Bytes of a size as lscpu or cache_line write it ("48 MiB (1 instance)"), or None."""
    m = re.match(r"\s*([\d.]+)\s*([KMG])i?B?\b", text or "")
    return int(float(m.group(1)) * 1024 ** " KMG".index(m.group(2))) if m else None


def mem_total():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_jiffies():
    """(busy, steal) seconds of all CPUs since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq = v[:7]
    steal = v[7] if len(v) > 7 else 0
    return (user + nice + system + irq + softirq) / hz, steal / hz


def own_cpu_seconds():
    """CPU seconds used by this process and its waited-for children (the engine runs)."""
    import resource
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


class Background:
    """CPU time other processes use while the bench runs: all CPUs' busy time from /proc/stat
    minus this process's own (and its children's)."""

    def __init__(self):
        self.t, self.j, self.own = time.time(), cpu_jiffies(), own_cpu_seconds()

    def since(self):
        j = cpu_jiffies()
        if not (j and self.j):
            return None
        wall = time.time() - self.t
        other = max(0.0, (j[0] - self.j[0]) - (own_cpu_seconds() - self.own))
        return {"wall_s": wall, "other_cpu_s": other, "steal_s": j[1] - self.j[1],
                "other_frac": other / wall if wall > 0 else 0.0}


def git_describe():
    rev = sh(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"]).strip()
    if not re.fullmatch(r"[0-9a-f]+", rev):
        return "not a git checkout"
    dirty = sh(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"]).strip()
    return rev + (" with uncommitted changes" if dirty else "")


# ---------------------------------------------------------------- what the engine prints
# Every reading of ./run's output is in this section, so a change of its format is mended here.

def grab(pattern, text, what):
    m = re.search(pattern, text, re.M)
    if not m:
        raise BenchError(f"cannot read {what} in ./run --info's output")
    return m


def parse_info(out, ckpt):
    """Configuration, parameter count and KV cache bytes from ./run CKPT --info. The bytes per
    token of the cache's formula must agree with the allocation --info reports."""
    info = {"checkpoint": ckpt, "info_text": out}
    info["variant"] = grab(r"^variant\s+(\S+)", out, "the variant").group(1)
    info["dtype"] = grab(r"^dtype\s+(\S+)", out, "the dtype").group(1)
    m = grab(r"dim (\d+), layers (\d+), heads (\d+) x (\d+), kv heads (\d+), latent (\d+), rope dim (\d+), "
             r"hidden (\d+), vocab (\d+), context (\d+)", out, "the configuration")
    keys = ["dim", "layers", "heads", "head_dim", "kv_heads", "latent", "rope_dim", "hidden", "vocab", "context"]
    info.update(zip(keys, map(int, m.groups())))
    info["is_mla"] = info["latent"] > 0
    m = grab(r"^parameters\s+(\d+) .*?, (\d+) bytes of weights", out, "the parameter count")
    info["params"], info["weight_bytes"] = int(m.group(1)), int(m.group(2))
    m = grab(r"^KV cache\s.*= (\d+) bytes/token; (\d+) bytes at full context", out, "the KV cache size")
    info["kv_bytes_per_token"], info["kv_full_bytes"] = int(m.group(1)), int(m.group(2))
    m = grab(r"^allocated\s+(\d+) bytes/token; (\d+) bytes", out, "the KV cache allocation")
    info["kv_alloc_per_token"], info["kv_alloc_bytes"] = int(m.group(1)), int(m.group(2))
    m = re.search(r"^kernels\s+(\S+)", out, re.M)
    info["kernels"] = m.group(1) if m else "?"
    per_token, ctx = info["kv_bytes_per_token"], info["context"]
    if not (per_token == info["kv_alloc_per_token"] and per_token * ctx == info["kv_full_bytes"]
            == info["kv_alloc_bytes"]):
        raise BenchError(f"./run --info's KV cache figures disagree: {per_token} bytes/token x {ctx} tokens, "
                         f"{info['kv_full_bytes']} bytes at full context, but {info['kv_alloc_per_token']} "
                         f"bytes/token and {info['kv_alloc_bytes']} bytes allocated")
    return info


def parse_step_log(path):
    """The rows of a --log CSV: step,phase,sequences,n_tokens,pos,token,ms (pos and token are -1
    when more than one sequence is active)."""
    try:
        with open(path, newline="") as f:
            return [{"step": int(r["step"]), "phase": r["phase"], "sequences": int(r["sequences"]),
                     "pos": int(r["pos"]), "n_tokens": int(r["n_tokens"]), "token": int(r["token"]),
                     "ms": float(r["ms"])} for r in csv.DictReader(f)]
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise BenchError(f"cannot read the step log {rel(path)}: {type(e).__name__}: {e}")


def parse_pool_info(out, batch):
    """The paged pool of ./run CKPT --info --kv --batch B [flags]: its block size in tokens and
    bytes, and so the cache's bytes per token under those flags (a cache dtype changes them).
    The contiguous size it quotes must be bytes/token x context x B."""
    m = re.search(r"^KV pool\s+(\d+) blocks of (\d+) tokens, (\d+) bytes each \((\d+) bytes\); a contiguous cache "
                  r"of the full context for (\d+) sequences? would take (\d+) bytes", out, re.M)
    ctx = re.search(r"context (\d+)", out)
    if not (m and ctx):
        raise BenchError("cannot read the KV pool in ./run --info --kv --batch's output")
    n_blocks, block_tokens, block_bytes, _, seqs, contiguous = map(int, m.groups())
    per_token = block_bytes // block_tokens
    if per_token * block_tokens != block_bytes or seqs != batch or contiguous != per_token * int(ctx.group(1)) * batch:
        raise BenchError(f"./run --info's KV pool figures disagree: blocks of {block_tokens} tokens and {block_bytes} "
                         f"bytes, but {contiguous} bytes for {seqs} full contexts")
    return {"block_tokens": block_tokens, "block_bytes": block_bytes, "bytes_per_token": per_token,
            "n_blocks": n_blocks}


def parse_pool_line(stderr):
    """The `kv pool: ...` line a --kv run ends with: the pool's blocks, its peak use and the
    preemptions."""
    m = re.search(r"^kv pool: (\d+)-token blocks of (\d+) bytes \| peak (\d+) of (\d+) blocks in use.*"
                  r"\| preemptions (\d+)$", stderr, re.M)
    if not m:
        raise BenchError("cannot read the `kv pool:` line in ./run's stderr")
    keys = ("block_tokens", "block_bytes", "peak_blocks", "n_blocks", "preemptions")
    return dict(zip(keys, map(int, m.groups())))


def parse_check_kv(out):
    """The key=value fields of every `check-kv ...` line of ./run --check-kv."""
    return [dict(kv.split("=", 1) for kv in line[len("check-kv "):].split())
            for line in out.splitlines() if line.startswith("check-kv ")]


def engine_message(stderr):
    """The engine's own last word on a failure: the last line it wrote to stderr."""
    lines = [x for x in stderr.strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else "no message"


# ---------------------------------------------------------------- running the engine

def run_engine(args, what, ok=(0,)):
    """ok: the exit codes that are results (--check-kv exits 1 when the runs differ)."""
    p = subprocess.run([RUN] + [str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode in (-signal.SIGINT, 128 + signal.SIGINT):   # Ctrl-C in a terminal reaches the engine too
        raise Interrupted(signal.SIGINT)
    if p.returncode < 0:
        raise BenchError(f"{what}: ./run was killed by {signal.Signals(-p.returncode).name}: "
                         f"{engine_message(p.stderr)}")
    if p.returncode not in ok:
        raise BenchError(f"{what}: ./run exited {p.returncode}: {engine_message(p.stderr)}")
    return p


def engine_info(ckpt):
    return parse_info(run_engine([ckpt, "--info"], "--info").stdout, ckpt)


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


def check_kv(info, args, n_gen):
    cmd = [info["checkpoint"], "--check-kv", "--ignore-eos", "-p", PROMPT, "--threads", args.threads]
    if n_gen < info["context"]:
        cmd += ["-n", n_gen]
    out = run_engine(cmd, "--check-kv", ok=(0, 1)).stdout
    lines = parse_check_kv(out)
    if not lines:
        raise BenchError(f"--check-kv printed no check-kv line: {out.strip()[-300:]}")
    return lines


def roofline(args, mib=None, no_peak=False, reps=None):
    cmd = [ROOFLINE, "--threads", str(args.threads)]
    if mib is not None:
        cmd += ["--mib", str(mib)]
    if reps is not None:
        cmd += ["--reps", str(reps)]
    if no_peak:
        cmd.append("--no-peak")
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise BenchError(f"{rel(cmd[0])} exited {p.returncode}: {engine_message(p.stderr)}")
    vals = {}
    for line in p.stdout.splitlines():
        k, _, v = line.partition(" ")
        vals[k] = v.strip()
    return vals


# ---------------------------------------------------------------- what was measured, and what not

class Checkpoint:
    """One checkpoint's measurements so far. error: why it was dropped from the rest of the
    bench (its runs until then stay in the report); part_errors: why one part of it failed."""

    def __init__(self, path):
        self.path, self.info, self.error = path, None, None
        self.runs = {(impl, mode): [] for impl in ("c", "pytorch") for mode in MODES}
        self.first_tokens = {}
        self.check_kv = None
        self.pt = {}
        self.part_errors = {}
        self.pool = {}           # kind of batch run -> parse_pool_info
        self.batch_runs = {}     # (kind, B) -> the timed runs' summaries
        self.capacity = {}       # (kind, MiB) -> the formula's count and the measured one

    @property
    def name(self):
        return label(self.info) if self.info else f"`{rel(self.path)}`"

    def stats(self, impl, mode):
        return cell_stats(self.runs[(impl, mode)])


class Bench:
    def __init__(self, args, paths):
        self.args = args
        self.ckpts = [Checkpoint(p) for p in paths]
        self.machine = {}
        self.roof = self.ws = None
        self.ws_probes = {}      # MiB -> bandwidth of the working-set probe over that many MiB, bytes/s
        self.ws_probed, self.ws_probe_error = False, None
        self.roof_error = self.pt_error = self.plot_error = None
        self.phase = "the start"
        self.interrupted = None

    def ok(self):
        """The checkpoints still being measured."""
        return [ck for ck in self.ckpts if ck.info and not ck.error]

    def fail(self, ck, why):
        ck.error = why
        warn(f"{ck.name if ck.info else rel(ck.path)}: {why}; going on without it")

    def n_gen(self, info):
        """./run's -n: the prefill's token and then args.steps decode steps (default: to the full context)."""
        return min(self.args.steps + 1, info["context"]) if self.args.steps else info["context"]

    def measured(self):
        return any(runs for ck in self.ckpts for runs in ck.runs.values())

    def missing(self):
        """(what, why) of everything the bench set out to measure and did not."""
        a, out = self.args, []
        stopped = "interrupted" if self.interrupted else "not reached"   # the banner says where
        if a.full and self.roof is None:
            out.append(("the roofline probe", self.roof_error or stopped))
        if a.pytorch and self.pt_error:
            out.append(("the PyTorch reference, every checkpoint", self.pt_error))
        for ck in self.ckpts:
            if ck.info is None:
                out.append((f"{ck.name}, everything", ck.error or stopped))
                continue
            why = ck.error or stopped
            for impl, reps, on in (("c", a.reps, True), ("pytorch", a.pt_reps, a.pytorch and not self.pt_error)):
                for mode in MODES:
                    n = len(ck.runs[(impl, mode)])
                    if on and n < reps:
                        out.append((f"{ck.name}, {MODE_LABEL[mode]}: {n} of {reps} timed "
                                    f"{'C' if impl == 'c' else 'PyTorch'} runs",
                                    ck.part_errors.get(impl, why)))
            if a.full and ck.check_kv is None:
                out.append((f"{ck.name}: the determinism check", ck.part_errors.get("check_kv", why)))
            bwhy = ck.part_errors.get("batch", why)
            for kind, _, batches, mibs in BATCH_CONFIGS:
                for B in kind_values(a.batches, batches):
                    n, reps = len(ck.batch_runs.get((kind, B), ())), batch_reps(a, B)
                    if n < reps:
                        out.append((f"{ck.name}, {cell_mode(kind, B)}: {n} of {reps} timed batch runs",
                                    ck.part_errors.get(("batch", kind, B), bwhy)))
                for mib in kind_values(a.capacity_mib, mibs):
                    if (kind, mib) not in ck.capacity:
                        out.append((f"{ck.name}: the capacity in {mib:g} MiB" + (f" ({kind})" if kind else ""),
                                    ck.part_errors.get("capacity", bwhy)))
        if a.full and a.batches and self.roof and not self.ws_probed:
            out.append(("the working-set bandwidth probes of the throughput table", self.ws_probe_error or stopped))
        if self.plot_error:
            out.append(("the plots", self.plot_error))
        return out


def c_run(b, ck, mode, rep):
    """One run of the engine (rep 0 is the warm-up); returns its figures."""
    info, args = ck.info, b.args
    path = os.path.join(b.tmpdir, f"c-{info['variant']}-{mode}-{rep}.csv")
    n_gen = b.n_gen(info)
    cmd = [info["checkpoint"], "-p", PROMPT, "-n", n_gen, "-k", 1, "-s", 0, "--ignore-eos", "-q",
           "--log", path, "--threads", args.threads] + (["--kv"] if mode == "kv" else [])
    run_engine(cmd, f"{MODE_LABEL[mode]} run")
    rows = parse_step_log(path)
    s = summarize_run(rows, min(n_gen - 1, info["context"] - rows[0]["n_tokens"]), f"{MODE_LABEL[mode]} run")
    first = ck.first_tokens.setdefault(mode, s["tokens"])
    if s["tokens"] != first:
        raise BenchError(f"greedy runs generated different tokens ({MODE_LABEL[mode]}, run {rep} against the "
                         "warm-up run)")
    log_rep("C", info["variant"], mode, rep, args.reps, s)
    return s


def c_rounds(b):
    """The engine's runs in rounds: one warm-up round, then args.reps timed rounds, each one run
    of every checkpoint and mode in turn. A VM's speed can drift by 10-30% for minutes at a time
    (other tenants on the same cores); in rounds a slow minute lands on one run of every cell
    instead of on every run of one cell."""
    for rep in range(b.args.reps + 1):
        name = "warm-up round" if rep == 0 else f"round {rep}/{b.args.reps}"
        log(f"bench: C engine, {name}")
        for ck in b.ok():
            for mode in MODES:
                if ck.error:
                    break
                b.phase = f"the C engine's {name} ({ck.name}, {MODE_LABEL[mode]})"
                try:
                    s = c_run(b, ck, mode, rep)
                except BenchError as e:
                    b.fail(ck, str(e))
                    break
                if rep:
                    ck.runs[("c", mode)].append(s)


# ---------------------------------------------------------------- batched decoding

def kind_values(given, kinds_own):
    """The batch sizes (or capacities) of a kind of run: those given that the kind runs."""
    return [x for x in given if kinds_own is None or x in kinds_own]


def batch_reps(args, batch):
    return args.reps if batch < LARGE_BATCH else args.large_batch_reps


def cell_mode(kind, batch):
    """The CSV's mode of a throughput cell: B=64, and the kind of run when it is not the default."""
    return f"B={batch}" + (f" {kind}" if kind else "")


def step_positions(pos, batch):
    """The positions one full step of a --batch run decodes: the first sequence is one ahead of
    the others (see batch_steps)."""
    return [pos] if batch == 1 else [pos + 1] + [pos] * (batch - 1)


def batch_steps(rows, batch, ctx, what):
    """The full decode steps of a `--kv --batch B` run of one prompt, each with the position its
    sequences decode. Step 0 computes the prompt once; at step 1 the first sequence decodes
    position n_prompt while the others compute their last prompt token on the shared prompt
    blocks; so at step k >= 2 every sequence decodes one token, the first at n_prompt + k - 1
    and the others at n_prompt + k - 2 (the position given here), and the first ends one step
    before them. A log of any other shape (a preemption, an engine that schedules otherwise)
    raises, since the positions and so the bytes would be wrong."""
    n_prompt = rows[0]["n_tokens"] if rows and rows[0]["phase"] == "prefill" else None
    if n_prompt is None or rows[0]["sequences"] != 1:
        raise BenchError(f"{what}: the step log does not start with the prompt's prefill")
    if batch == 1:
        full = [(r, r["pos"]) for r in rows[1:]]
        ok = all(r["phase"] == "decode" and r["sequences"] == 1 and p == n_prompt + r["step"] - 1 for r, p in full)
    else:
        full = [(r, n_prompt + r["step"] - 2) for r in rows[2:] if r["sequences"] == batch]
        tail = rows[2 + len(full):]
        ok = (len(rows) > 1 and rows[1]["phase"] == "mixed" and rows[1]["sequences"] == batch
              and all(r["phase"] == "decode" and r["n_tokens"] == batch and r["step"] == i + 2
                      for i, (r, _) in enumerate(full))
              and len(tail) <= 1 and all(r["sequences"] == batch - 1 for r in tail))
    if not (ok and full and full[-1][1] < ctx):
        raise BenchError(f"{what}: the step log is not one prefill, then steps of all {batch} sequences")
    return full


def summarize_batch(rows, batch, ctx, expect_full, what):
    """A throughput run's figures: the median of its full decode steps (B tokens each) and the
    position of the step in the middle (the lower middle): the step time grows with the
    position, so the median step is the one at the median position."""
    full = batch_steps(rows, batch, ctx, what)
    if len(full) != expect_full:
        raise BenchError(f"{what}: the step log has {len(full)} steps of all {batch} sequences, expected {expect_full}")
    ms = [r["ms"] for r, _ in full]
    return {"step_ms": median(ms), "pos": full[(len(full) - 1) // 2][1], "rows": rows,
            "total_ms": sum(r["ms"] for r in rows)}


def c_batch_run(b, ck, kind, flags, batch, rep):
    info, args = ck.info, b.args
    what = f"--batch {batch} run" + (f" ({kind})" if kind else "")
    path = os.path.join(b.tmpdir, f"c-{info['variant']}-batch{batch}{'-' + kind if kind else ''}-{rep}.csv")
    n_gen = b.n_gen(info)
    cmd = [info["checkpoint"], "-p", PROMPT, "--kv", "--batch", batch, "-n", n_gen, "-k", 1, "-s", 0, "--ignore-eos",
           "-q", "--log", path, "--threads", args.threads] + list(flags)
    run_engine(cmd, what)
    rows = parse_step_log(path)
    n_dec = min(n_gen - 1, info["context"] - rows[0]["n_tokens"])
    s = summarize_batch(rows, batch, info["context"], n_dec - (batch > 1), what)
    label_ = "warm-up" if rep == 0 else f"run {rep}/{batch_reps(args, batch)}"
    log(f"  [C] {info['variant']:6s} {cell_mode(kind, batch):7s} {label_:9s} step {s['step_ms']:8.3f} ms "
        f"(median full step), {batch * 1e3 / s['step_ms']:9.1f} tokens/s")
    return s


def read_pools(b, ck):
    """Each kind's pool figures, from ./run --info --kv --batch 1 with its flags."""
    for kind, flags, _, _ in BATCH_CONFIGS:
        out = run_engine([ck.info["checkpoint"], "--info", "--kv", "--batch", 1] + list(flags), "--info --kv").stdout
        ck.pool[kind] = parse_pool_info(out, 1)


def batch_rounds(b):
    """The throughput runs in rounds, as the latency runs: a warm-up round, then timed rounds,
    each one run of every checkpoint, kind and batch size that still wants one."""
    args = b.args
    for ck in b.ok():
        try:
            read_pools(b, ck)
        except BenchError as e:
            ck.part_errors["batch"] = str(e)
            warn(f"{ck.name}: {e}")
    rounds = max(batch_reps(args, B) for B in args.batches)
    for rep in range(rounds + 1):
        log(f"bench: batched decoding, {'warm-up round' if rep == 0 else f'round {rep}/{rounds}'}")
        for ck in b.ok():
            for kind, flags, batches, _ in BATCH_CONFIGS:
                for B in kind_values(args.batches, batches):
                    cell = ("batch", kind, B)   # a failed batch size (say, out of memory) costs that cell only
                    if "batch" in ck.part_errors or cell in ck.part_errors or rep > batch_reps(args, B):
                        continue
                    b.phase = f"the batched runs' round {rep} ({ck.name}, {cell_mode(kind, B)})"
                    try:
                        s = c_batch_run(b, ck, kind, flags, B, rep)
                    except BenchError as e:
                        ck.part_errors[cell] = str(e)
                        warn(f"{ck.name}: {e}; no more runs of {cell_mode(kind, B)}")
                        continue
                    if rep:
                        ck.batch_runs.setdefault((kind, B), []).append(s)


def capacity_formula(pool, ctx, mib):
    """(sequences, pool blocks, blocks a sequence): how many full-context sequences a pool of mib
    MiB holds, sized as ./run sizes it: floor(MiB x 2^20 / block bytes) blocks, of which a
    sequence of the full context takes ceil(context / block tokens)."""
    blocks = math.floor(mib * 2**20 / pool["block_bytes"])
    per_seq = -(-ctx // pool["block_tokens"])
    return blocks // per_seq, blocks, per_seq


def capacity_run(b, ck, kind, flags, mib):
    """The formula's count, and where it is at most the batch limit the measured one: N = count + 2
    sequences (at most the limit) in a pool of mib MiB, sampled (top-k 40, seeds 0..N-1) so that
    they differ and share no blocks (greedy copies would share their blocks when a preempted one
    comes back), to the full context. The measured count is the most sequences active in a step
    while the first admitted decode their last block, each then holding a full context's blocks;
    the pool's preemptions keep the rest waiting."""
    info, pool = ck.info, ck.pool[kind]
    ctx = info["context"]
    fits, blocks, per_seq = capacity_formula(pool, ctx, mib)
    out = {"formula": fits, "blocks": blocks, "per_seq": per_seq}
    if not 1 <= fits <= MAX_BATCH:
        return out   # the engine refuses a pool short of one sequence, and runs at most MAX_BATCH
    n = min(MAX_BATCH, fits + 2)
    what = f"capacity run ({mib:g} MiB, {n} sequences)"
    path = os.path.join(b.tmpdir, f"c-{info['variant']}-capacity-{mib:g}{'-' + kind if kind else ''}.csv")
    p = run_engine([info["checkpoint"], "-p", PROMPT, "--kv", "--batch", n, "--kv-mem", f"{mib:g}", "-k", 40, "-s", 0,
                    "--ignore-eos", "-q", "--log", path, "--threads", b.args.threads] + list(flags), what)
    rows, engine_pool = parse_step_log(path), parse_pool_line(p.stderr)
    n_prompt = rows[0]["n_tokens"]
    last_block = (ctx - 1) // pool["block_tokens"] * pool["block_tokens"]
    window = [r["sequences"] for r in rows if r["step"] >= 2 and last_block <= n_prompt + r["step"] - 2 < ctx]
    if not window:
        raise BenchError(f"{what}: the step log never reaches the context's last block")
    out.update(requested=n, measured=max(window), preemptions=engine_pool["preemptions"],
               engine_blocks=engine_pool["n_blocks"], rows=rows)
    log(f"  [C] {info['variant']:6s} {mib:g} MiB: {fits} full-context sequences by the formula, {max(window)} of {n} "
        f"active at the end of the context ({engine_pool['preemptions']} preemptions)")
    return out


def capacity_part(b):
    for ck in b.ok():
        for kind, flags, _, mibs in BATCH_CONFIGS:
            for mib in kind_values(b.args.capacity_mib, mibs):
                if "capacity" in ck.part_errors or kind not in ck.pool:
                    continue
                b.phase = f"the capacity runs ({ck.name}, {mib:g} MiB)"
                try:
                    ck.capacity[(kind, mib)] = capacity_run(b, ck, kind, flags, mib)
                except BenchError as e:
                    ck.part_errors["capacity"] = str(e)
                    warn(f"{ck.name}: {e}")


def batch_cost(ck, kind, batch, pos):
    """FLOPs and bytes of the full step of B sequences at pos, and its cache bytes alone."""
    per_token = ck.pool[kind]["bytes_per_token"]
    flops, nbytes = decode_cost_kv(ck.info, step_positions(pos, batch), per_token)
    return flops, nbytes, nbytes - ck.info["weight_bytes"]


def batch_bandwidth(b, nbytes):
    """(bytes/s, where it comes from) for a step whose working set, the weights and the cache
    rows it reads, is nbytes: the DRAM streaming bandwidth when that exceeds the last-level
    cache, else the working-set probe over that size (None while it has not run)."""
    llc = b.machine.get("llc_bytes")
    if llc and nbytes > llc:
        return float(b.roof["bandwidth_best_GBps"]) * 1e9, "DRAM"
    mib = max(1, math.ceil(nbytes / 2**20))
    return b.ws_probes.get(mib), f"{mib} MiB probe"


def ws_probe_part(b):
    """The working-set probe at the size of every throughput cell's step that fits in the
    last-level cache (or every cell's, when the cache size is unknown)."""
    b.phase = "the working-set bandwidth probes"
    sizes = set()
    for ck in b.ok():
        for (kind, B), runs in ck.batch_runs.items():
            nbytes = batch_cost(ck, kind, B, representative(runs)["pos"])[1]
            if batch_bandwidth(b, nbytes)[1] != "DRAM":
                sizes.add(max(1, math.ceil(nbytes / 2**20)))
    if sizes:
        log(f"bench: working-set bandwidth probes over {', '.join(f'{m}' for m in sorted(sizes))} MiB")
    try:
        for mib in sorted(sizes):
            # enough passes for a best-of, about 4 GiB read at the most
            r = roofline(b.args, mib=mib, no_peak=True, reps=max(7, min(50, 4096 // mib)))
            b.ws_probes[mib] = float(r["bandwidth_best_GBps"]) * 1e9
        b.ws_probed = True
    except (BenchError, KeyError, ValueError) as e:
        b.ws_probe_error = f"the probe failed: {e}"
        warn(b.ws_probe_error)


def pytorch_checkpoint(b, pt, ck):
    """PyTorch's runs of one checkpoint, on the engine's greedy sequence."""
    info, v = ck.info, ck.info["variant"]
    log(f"bench: PyTorch, {v}")
    model, prompt = pt.load(info["checkpoint"])
    c_rep = representative(ck.runs[("c", "kv")]) or representative(ck.runs[("c", "no-kv")])
    if c_rep is None:
        raise BenchError("no C run to compare with")
    if len(prompt) != c_rep["prompt_tokens"]:
        raise BenchError(f"PyTorch's prompt is {len(prompt)} tokens, the engine's {c_rep['prompt_tokens']}")
    n_total = min(info["context"], len(prompt) + b.n_gen(info) - 1)
    seq = (prompt + c_rep["tokens"])[:n_total]   # the tokens every greedy run feeds back
    paths, choice = pt.choose_paths(model, prompt, seq, n_total, b.args, v)
    ck.pt["choice"] = choice
    agree = []
    for mode in MODES:
        tag = " oneDNN" if choice["path"][mode] != "eager" else ""
        out = ck.runs[("pytorch", mode)]
        pt.runs(paths[mode], prompt, n_total, mode == "kv", b.args.pt_reps, v, out, tag=tag)
        c = representative(ck.runs[("c", mode)])
        agree.append("—" if c is None else str(common_prefix(out[0]["tokens"], c["tokens"])))
    ck.pt["agree"] = " / ".join(agree)
    nokv = representative(ck.runs[("c", "no-kv")])
    dec = [x["n_tokens"] for x in nokv["rows"] if x["phase"] == "decode"] if nokv else []
    ck.pt["head_ms"] = spread(pt.head_ms(model, round(statistics.fmean(dec)) if dec else len(prompt)))


def pytorch_part(b):
    b.phase = "loading PyTorch"
    log("bench: loading PyTorch")
    try:
        pt = PyTorchBench(b.args.threads)
    except Exception as e:   # not installed or broken: the C results must still be written
        b.pt_error = f"cannot load PyTorch: {type(e).__name__}: {e}"
        warn(f"{b.pt_error}; the report will have the C engine only")
        return
    b.machine["torch"] = (f"torch {pt.torch.__version__}, {pt.threads} thread{'s' if pt.threads > 1 else ''}, "
                          f"fp32 products on {blas_in_use()}; path per mode and checkpoint below")
    for ck in b.ok():
        b.phase = f"the PyTorch reference ({ck.name})"
        try:
            pytorch_checkpoint(b, pt, ck)
        except Exception as e:   # a crash inside torch or train/: keep everything else, name the failure
            path = os.path.join(b.tmpdir, f"pytorch-{ck.info['variant']}-error.txt")
            with open(path, "w") as f:
                f.write(traceback.format_exc())
            ck.part_errors["pytorch"] = f"PyTorch failed: {type(e).__name__}: {e} (traceback in {rel(path)})"
            warn(f"{ck.name}: {ck.part_errors['pytorch']}")


def read_checkpoints(b):
    """./run --info of every checkpoint: one that cannot be read is left out (and reported);
    raises BenchError, before anything is measured, when none can be or two are one variant."""
    b.phase = "reading the checkpoints"
    for ck in b.ckpts:
        try:
            ck.info = engine_info(ck.path)
        except BenchError as e:
            b.fail(ck, str(e))
    if not b.ok():
        raise BenchError("no checkpoint could be read: " + "; ".join(f"{rel(ck.path)}: {ck.error}" for ck in b.ckpts))
    seen = {}
    for ck in b.ok():
        v = ck.info["variant"]
        if v in seen:
            raise BenchError(f"two checkpoints of variant {v}: {rel(seen[v])} and {rel(ck.path)}; name one of each")
        seen[v] = ck.path

    def order(ck):   # the post's order, then other variants, then the unreadable files
        if not ck.info:
            return (len(ORDER) + 1, ck.path)
        v = ck.info["variant"]
        return (ORDER.index(v) if v in ORDER else len(ORDER), v)
    b.ckpts.sort(key=order)


def measure(b):
    """Every part of the bench in turn; a part that fails is noted in b and the rest goes on."""
    args, ok, m = b.args, b.ok(), b.machine
    # the same CPU model can come with or without AVX-512 (virtual machines mask it), so the
    # engine's kernels are part of the name
    m["slug"] = f"{machine_slug(m['cpu'], m['cores'], args.threads)}-{ok[0].info['kernels']}"
    b.base = m["slug"] + ("-quick" if args.quick else "")
    b.tmpdir = os.path.join(args.out, "tmp", b.base)
    os.makedirs(b.tmpdir, exist_ok=True)

    if args.full:
        b.phase = "the roofline probe"
        log("bench: roofline probe")
        try:
            roof = roofline(args, mib=args.roofline_mib, reps=args.roofline_reps)
            log(f"  bandwidth {float(roof['bandwidth_best_GBps']):.1f} GB/s, peak "
                f"{float(roof['peak_best_GFLOPs']):.1f} GFLOP/s ({roof['roofline_simd']})")
            biggest = max(ck.info["weight_bytes"] + ck.info["kv_alloc_bytes"] for ck in ok)
            ws = roofline(args, mib=max(1, math.ceil(biggest / 2**20)), no_peak=True, reps=50)
            log(f"  bandwidth over {ws['bandwidth_bytes']} bytes (a decode step's working set): "
                f"{float(ws['bandwidth_best_GBps']):.1f} GB/s")
            b.roof, b.ws = roof, ws
        except (BenchError, KeyError, ValueError) as e:
            b.roof_error = f"the probe failed: {e}"
            warn(b.roof_error)

    c_rounds(b)
    if args.batches:
        batch_rounds(b)
    if args.capacity_mib:
        log("bench: KV cache capacity")
        capacity_part(b)
    if args.batches and b.roof:
        ws_probe_part(b)
    if args.full:
        for ck in b.ok():
            b.phase = f"the determinism check ({ck.name})"
            log(f"bench: --check-kv, {ck.info['variant']}")
            try:
                ck.check_kv = check_kv(ck.info, args, b.n_gen(ck.info))
            except BenchError as e:
                ck.part_errors["check_kv"] = str(e)
                warn(f"{ck.name}: {e}")
    if args.pytorch:
        pytorch_part(b)


# ---------------------------------------------------------------- cost model of one step

def layer_macs_per_token(c, absorbed):
    """Weight multiply-accumulates of one layer for one token (projections, FFN)."""
    D, H, hd, F = c["dim"], c["heads"], c["head_dim"], c["hidden"]
    if c["is_mla"]:
        dc, rd = c["latent"], c["rope_dim"]
        macs = H * (hd + rd) * D + dc * D + rd * D          # W_Q, W_DKV, W_KR
        if absorbed:
            macs += 2 * H * hd * dc                         # W_UK,h^T q_C,h and W_UV,h ctx_h
    else:
        macs = H * hd * D + 2 * c["kv_heads"] * hd * D      # W_Q, W_K, W_V
    return macs + D * H * hd + 3 * D * F                    # W_O, W1, W3, W2


def attn_widths(c, absorbed):
    """(key width, value width) of one head's scores and weighted sum."""
    if not c["is_mla"]:
        return c["head_dim"], c["head_dim"]
    if absorbed:
        return c["latent"] + c["rope_dim"], c["latent"]
    return c["head_dim"] + c["rope_dim"], c["head_dim"]


def decode_cost_kv(c, positions, kv_bytes_per_token=None):
    """FLOPs and bytes of one cached decode step in which each sequence decodes one token at its
    position (pos+1 keys each): a batch shares one read of the weights, and each sequence reads
    its own cache. MLA: the absorbed form. Bytes: every weight once (file dtype) + the cache rows
    read (default: --info's bytes per token)."""
    keys = sum(p + 1 for p in positions)
    kw, vw = attn_widths(c, absorbed=True)
    per_token = c["layers"] * 2 * layer_macs_per_token(c, True) + 2 * c["vocab"] * c["dim"]   # with the tied head
    flops = len(positions) * per_token + c["layers"] * c["heads"] * 2 * (kw + vw) * keys
    nbytes = c["weight_bytes"] + keys * (kv_bytes_per_token or c["kv_bytes_per_token"])
    return flops, nbytes


def kv_width(c):
    """The post's d_kv, the width one token adds to the cache per layer: H_kv x d_h for MHA, GQA
    and MQA (d, d/G, d/h), which counts K or V once; MLA's latent d_c plus its RoPE key d_R,
    the one vector it caches for both."""
    return c["latent"] + c["rope_dim"] if c["is_mla"] else c["kv_heads"] * c["head_dim"]


def post_intensity(c, b):
    """The post's arithmetic intensity of a whole cached decode of n = context tokens at batch b,
    Θ((b n² d + b n d²) / (b n² d_kv + n d²)) taken without constants: a shape to set beside the
    measured intensity's growth with b, not a value to match it."""
    n, d, dkv = c["context"], c["dim"], kv_width(c)
    return (b * n * n * d + b * n * d * d) / (b * n * n * dkv + n * d * d)


def decode_cost_nokv(c, T):
    """FLOPs and bytes of one uncached step: the forward of all T tokens (causal attention,
    MLA in the expanded form: W_UK, W_UV applied to every latent), logits of the last token
    only (as the engine does). Bytes: every weight once."""
    kw, vw = attn_widths(c, absorbed=False)
    per_layer = 2 * T * layer_macs_per_token(c, False) + c["heads"] * 2 * (kw + vw) * T * (T + 1) // 2
    if c["is_mla"]:
        per_layer += 2 * 2 * T * c["heads"] * c["head_dim"] * c["latent"]
    flops = c["layers"] * per_layer + 2 * c["vocab"] * c["dim"]
    return flops, c["weight_bytes"]


# ---------------------------------------------------------------- PyTorch

def blas_in_use():
    """The BLAS this process's torch runs fp32 products on, from its mappings: Debian's torch
    calls the system libblas.so.3, which the alternatives point at the reference BLAS or at
    OpenBLAS (libopenblas0-pthread, which scripts/install-deps.sh installs)."""
    try:
        with open("/proc/self/maps") as f:
            libs = sorted({line.split()[-1] for line in f if "blas" in os.path.basename(line.split()[-1])})
    except OSError:
        return "unknown"
    if any("openblas" in lib for lib in libs):
        return "OpenBLAS (" + ", ".join(os.path.realpath(lib) for lib in libs if "openblas" in lib) + ")"
    return ("the reference BLAS (" + ", ".join(libs) + ")") if libs else "unknown"


class PyTorchBench:
    def __init__(self, threads):
        import torch
        sys.path.insert(0, os.path.join(ROOT, "train"))
        import export
        import model as ptmodel
        self.torch, self.export, self.ptmodel = torch, export, ptmodel
        torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()

    def load(self, ckpt):
        import sentencepiece as spm
        model = self.export.load_engine_checkpoint(ckpt)
        hdr = self.export.read_header(ckpt)
        with open(ckpt, "rb") as f:
            f.seek(hdr["tokenizer_offset"])
            proto = f.read(hdr["tokenizer_size"])
        sp = spm.SentencePieceProcessor(model_proto=proto)
        prompt = [hdr["bos_id"]] + sp.encode(PROMPT)
        return model, prompt

    def timed_generate(self, model, prompt, n_total, kv):
        """Transformer.generate with top_k=1, timed: the prefill and every decode step, each from
        building the input tensor to the argmax of the logits (what the engine's step times)."""
        torch, perf = self.torch, time.perf_counter
        rows = []
        with torch.no_grad():
            model.eval()
            model.set_absorb(kv)
            tokens = list(prompt)
            caches = [self.ptmodel.KVCache() for _ in model.layers] if kv else None
            t0 = perf()
            logits = model(torch.tensor([tokens]), start_pos=0, caches=caches, last_only=True)[0, -1]
            nxt = int(torch.argmax(logits))
            rows.append({"step": 0, "phase": "prefill", "pos": len(tokens) - 1, "n_tokens": len(tokens),
                         "token": nxt, "ms": (perf() - t0) * 1e3})
            while len(tokens) < n_total:
                tokens.append(nxt)
                t0 = perf()
                if kv:
                    logits = model(torch.tensor([[nxt]]), start_pos=len(tokens) - 1, caches=caches, last_only=True)[0, -1]
                else:
                    logits = model(torch.tensor([tokens]), last_only=True)[0, -1]
                nxt = int(torch.argmax(logits))
                rows.append({"step": len(rows), "phase": "decode", "pos": len(tokens) - 1, "n_tokens": len(tokens),
                             "token": nxt, "ms": (perf() - t0) * 1e3})
            model.set_absorb(False)
        return rows

    def onednn_model(self, model):
        return self.ptmodel.onednn_copy(model)

    def max_logit_diff(self, a, b, seq, prompt_len, kv_steps):
        """Largest |logit difference| of two models: all positions of one uncached forward of seq,
        and a cached prefill + kv_steps decode steps (MLA absorbed, as in the cached runs)."""
        torch = self.torch
        with torch.no_grad():
            x = torch.tensor([seq])
            d = float((a(x) - b(x)).abs().max())
            outs = []
            for m in (a, b):
                m.set_absorb(True)
                caches = [self.ptmodel.KVCache() for _ in m.layers]
                ls = [m(torch.tensor([seq[:prompt_len]]), start_pos=0, caches=caches)[0, -1]]
                for i in range(prompt_len, min(prompt_len + kv_steps, len(seq))):
                    ls.append(m(torch.tensor([[seq[i]]]), start_pos=i, caches=caches)[0, -1])
                m.set_absorb(False)
                outs.append(torch.stack(ls))
            return max(d, float((outs[0] - outs[1]).abs().max()))

    def time_forward(self, model, seq, reps=2, warm=True):
        torch = self.torch
        with torch.no_grad():
            x = torch.tensor([seq])
            if warm:
                model(x, last_only=True)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                model(x, last_only=True)
                ts.append(time.perf_counter() - t0)
        return min(ts)

    def time_kv_steps(self, model, seq, prompt_len, steps=8):
        """Median ms of a cached decode step (after a cached prefill of the prompt)."""
        torch = self.torch
        ts = []
        with torch.no_grad():
            model.set_absorb(True)
            caches = [self.ptmodel.KVCache() for _ in model.layers]
            model(torch.tensor([seq[:prompt_len]]), start_pos=0, caches=caches, last_only=True)
            for i in range(prompt_len, min(prompt_len + steps, len(seq))):
                t0 = time.perf_counter()
                model(torch.tensor([[seq[i]]]), start_pos=i, caches=caches, last_only=True)
                ts.append(time.perf_counter() - t0)
            model.set_absorb(False)
        return median(ts) if ts else 0.0

    def choose_paths(self, model, prompt, seq, n_total, args, variant):
        """The PyTorch path of each mode: plain eager fp32 (Transformer.forward as written), unless a
        run of that mode would take over args.pt_budget seconds; then the oneDNN Linear path, if its
        logits match plain eager within PT_TOLERANCE and it is faster at that mode's step.
        Returns {"no-kv": model, "kv": model} and a dict that says what was decided and why."""
        T0, T1 = len(prompt), len(seq)
        n_dec = n_total - T0
        t_small = self.time_forward(model, prompt)
        t_full = self.time_forward(model, seq, reps=1, warm=False)
        t_step = self.time_kv_steps(model, seq, T0)
        est = {"no-kv": sum(t_small + (t_full - t_small) * (T - T0) / max(1, T1 - T0) for T in range(T0, n_total + 1)),
               "kv": t_small + n_dec * t_step}
        info = {"est_eager_s": est, "eager_fwd_ms": (t_small * 1e3, t_full * 1e3), "eager_kv_step_ms": t_step * 1e3,
                "T": (T0, T1)}
        log(f"  [PyTorch] {variant}: plain eager forward {t_small * 1e3:.1f} ms at T={T0}, {t_full * 1e3:.1f} ms at "
            f"T={T1}, cached step {t_step * 1e3:.2f} ms: a run would take about {est['no-kv']:.0f} s without the "
            f"cache, {est['kv']:.0f} s with it")
        want = {m: args.pt_path == "mkldnn" or (args.pt_path == "auto" and est[m] > args.pt_budget)
                for m in ("no-kv", "kv")}
        paths = {m: model for m in want}
        info["path"] = {m: "eager" for m in want}
        info["why"] = {m: ("--pt-path eager" if args.pt_path == "eager" else
                           f"a plain eager run takes about {est[m]:.0f} s, within the {args.pt_budget:.0f} s budget")
                       for m in want}
        if not any(want.values()):
            return paths, info
        fast, converted = self.onednn_model(model)
        diff = self.max_logit_diff(model, fast, seq, T0, kv_steps=16)
        info.update(max_logit_diff=diff, converted=len(converted))
        t_full_fast = self.time_forward(fast, seq, reps=1)
        t_step_fast = self.time_kv_steps(fast, seq, T0)
        info["onednn_fwd_ms"], info["onednn_kv_step_ms"] = t_full_fast * 1e3, t_step_fast * 1e3
        log(f"  [PyTorch] {variant}: oneDNN Linear path ({len(converted)} layers): forward {t_full_fast * 1e3:.1f} ms "
            f"at T={T1}, cached step {t_step_fast * 1e3:.2f} ms; max |logit diff| vs eager {diff:.2e} "
            f"(tolerance {PT_TOLERANCE:g})")
        faster = {"no-kv": t_full_fast < t_full, "kv": t_step_fast < t_step}
        for m in want:
            if not want[m]:
                continue
            if args.pt_path == "mkldnn":
                if diff > PT_TOLERANCE:
                    raise BenchError(f"{variant}: the oneDNN Linear path differs from eager by {diff:.2e} "
                                     f"> {PT_TOLERANCE:g}")
                paths[m], info["path"][m], info["why"][m] = fast, "onednn-linear", "--pt-path mkldnn"
            elif diff > PT_TOLERANCE:
                info["why"][m] = (f"plain eager (about {est[m]:.0f} s a run) kept: the oneDNN Linear logits differ "
                                  f"by {diff:.1e} > {PT_TOLERANCE:g}")
            elif not faster[m]:
                info["why"][m] = f"plain eager (about {est[m]:.0f} s a run) kept: the oneDNN Linear path is not faster"
            else:
                paths[m], info["path"][m] = fast, "onednn-linear"
                info["why"][m] = (f"a plain eager run would take about {est[m]:.0f} s, over the "
                                  f"{args.pt_budget:.0f} s budget")
        return paths, info

    def head_ms(self, model, T, reps=3):
        """The tied head as Transformer.forward computes it (F.linear on all T positions): the ms
        of each of reps timed calls."""
        torch = self.torch
        F = torch.nn.functional
        x = torch.randn(1, T, model.cfg.dim)
        w = model.tok_embeddings.weight
        with torch.no_grad():
            F.linear(x, w)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                F.linear(x, w)
                ts.append((time.perf_counter() - t0) * 1e3)
        return ts

    def runs(self, model, prompt, n_total, kv, reps, variant, out, tag=""):
        """One warm-up run, then reps timed runs appended to out as each ends (an interrupted
        bench keeps the runs already done)."""
        mode = "kv" if kv else "no-kv"
        expect = n_total - len(prompt)
        for rep in range(reps + 1):
            rows = self.timed_generate(model, prompt, n_total, kv)
            s = summarize_run(rows, expect, f"PyTorch {variant} {mode}")
            log_rep(f"PyTorch{tag}", variant, mode, rep, reps, s)
            if rep:
                out.append(s)


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------- report

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


def latency_table(b, impl):
    rows = []
    for ck in b.ckpts:
        for mode in MODES if ck.info else ():
            st = ck.stats(impl, mode)
            rows.append([ck.name, MODE_LABEL[mode], st["step_ms"]["n"] if st else 0]
                        + [fmt_spread(st[q]) if st else "—" for q, _ in QUANTITIES])
    return md_table(["Attention Mechanism", "mode", "timed runs"] + [h for _, h in QUANTITIES], rows,
                    ["---", "---"] + ["---:"] * (1 + len(QUANTITIES)))


def speedup(ck, mode, q):
    """C median / PyTorch median, and PyTorch / C over the runs' extremes (least and most favourable)."""
    c, p = ck.stats("c", mode), ck.stats("pytorch", mode)
    if not c or not p:
        return None
    c, p = c[q], p[q]
    return {"ratio": c["median"] / p["median"], "lo": p["min"] / c["max"], "hi": p["max"] / c["min"]}


def rolling_median(xs, w):
    h = w // 2
    return [median(xs[max(0, i - h):i + h + 1]) for i in range(len(xs))]


def save_fig(plt, fig, path):
    fig.tight_layout()
    fig.savefig(path + ".part", format="png", dpi=120)
    plt.close(fig)
    os.replace(path + ".part", path)


def plot_per_step(plt, b, path):
    """Per-step decode latency, one panel per mode: every timed run's steps as faint points, and
    a rolling median of the per-position medians across runs as the line."""
    from matplotlib.ticker import MaxNLocator
    cks = [ck for ck in b.ckpts if ck.info]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, mode in zip(axes, MODES):
        top, raw = 0.0, []
        for i, ck in enumerate(cks):
            by_pos = {}
            for r in ck.runs[("c", mode)]:
                for x in r["rows"]:
                    if x["phase"] == "decode":
                        by_pos.setdefault(x["pos"], []).append(x["ms"])
            if not by_pos:
                continue
            pos = sorted(by_pos)
            pts = [(p, ms) for p in pos for ms in by_pos[p]]
            raw += [ms for _, ms in pts]
            ax.scatter([p for p, _ in pts], [ms for _, ms in pts], s=8, alpha=0.3, color=f"C{i}", linewidths=0)
            w = max(3, min(21, len(pos) // 5) | 1)
            line = rolling_median([median(by_pos[p]) for p in pos], w)
            ax.plot(pos, line, color=f"C{i}", lw=1.8, label=ck.name)
            top = max(top, max(line))
        # a few steps slowed by other processes would squash the lines: they stay off the axis, counted
        lim = top * 1.6
        off = sum(ms > lim for ms in raw)
        ax.set_ylim(0, lim or None)
        ax.set_title(f"{'without' if mode == 'no-kv' else 'with'} the KV cache"
                     + (f" ({off} slow point{'s' if off > 1 else ''} above the axis)" if off else ""))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("position of the decoded token")
        ax.set_ylabel("decode step, ms")
        ax.grid(alpha=0.3)
        if raw:
            ax.legend(fontsize=8)
    fig.suptitle(f"C engine: decode latency per step ({b.machine['slug']}); "
                 "lines: rolling median, points: every step of every timed run")
    save_fig(plt, fig, path)


def plot_decode_bars(plt, b, path):
    """The median decode step per variant and mode, PyTorch beside C when it ran."""
    cks = [ck for ck in b.ckpts if ck.info]
    impls = [i for i in ("c", "pytorch") if any(ck.runs[(i, m)] for ck in cks for m in MODES)]
    width = 0.8 / len(impls)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, mode in zip(axes, MODES):
        for j, impl in enumerate(impls):
            xs, hs, lo, hi = [], [], [], []
            for i, ck in enumerate(cks):
                st = ck.stats(impl, mode)
                if st:
                    s = st["step_ms"]
                    xs.append(i + (j - (len(impls) - 1) / 2) * width)
                    hs.append(s["median"])
                    lo.append(s["median"] - s["min"])
                    hi.append(s["max"] - s["median"])
            ax.bar(xs, hs, width, yerr=[lo, hi], capsize=3, color=f"C{j}",
                   label="C engine" if impl == "c" else "PyTorch (train/model.py, eager)")
            for x, h, up in zip(xs, hs, hi):   # above the error bar, which a label on the bar would cross
                ax.annotate(fmt(h), (x, h + up), xytext=(0, 3), textcoords="offset points", ha="center",
                            fontsize=8)
        ax.set_xticks(range(len(cks)), [ck.name for ck in cks], rotation=15, fontsize=8)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.2)   # room for the legend above the tallest bar's label
        ax.set_ylabel("decode step, ms (median)")
        ax.set_title(f"{'without' if mode == 'no-kv' else 'with'} the KV cache")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("Median decode step per variant (error bars: fastest to slowest timed run)")
    save_fig(plt, fig, path)


def plot_kv_cache(plt, b, path):
    """KV cache bytes against context length: --info's bytes per token, and its allocation at
    the full context as a dot; where the paged pool was read, the 16-token blocks one sequence
    holds as a step line, and a second panel with the pool B full contexts take against B, beside
    the capacity table's pool sizes (where a line crosses one is how many sequences fit)."""
    cks = [ck for ck in b.ckpts if ck.info]
    paged = [ck for ck in cks if "" in ck.pool]
    fig, axes = plt.subplots(1, 2 if paged else 1, figsize=(13 if paged else 8, 4.8), squeeze=False)
    ax = axes[0][0]
    for i, ck in enumerate(cks):
        ctx, per_token = ck.info["context"], ck.info["kv_bytes_per_token"]
        ax.plot([0, ctx], [0, per_token * ctx / 2**20], color=f"C{i}", label=f"{ck.name}: {per_token:,} bytes/token")
        ax.plot([ctx], [ck.info["kv_alloc_bytes"] / 2**20], "o", color=f"C{i}")
        if ck in paged:
            bt, bb = ck.pool[""]["block_tokens"], ck.pool[""]["block_bytes"]
            ns = list(range(0, ctx + 1))
            ax.step(ns, [-(-n // bt) * bb / 2**20 for n in ns], where="post", color=f"C{i}", lw=0.8, alpha=0.6)
    ax.set_xlabel("context length, tokens")
    ax.set_ylabel("KV cache of one sequence, MiB (fp32)")
    ax.set_title("One sequence's KV cache against context length\n(dots: ./run --info's allocation"
                 + ("; thin steps: the pool's 16-token blocks)" if paged else ")"), fontsize=10)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if paged:
        ax = axes[0][1]
        bs = [2 ** k for k in range(0, int(math.log2(MAX_BATCH)) + 1)]
        for i, ck in enumerate(cks):
            if ck in paged:
                pool, ctx = ck.pool[""], ck.info["context"]
                full = -(-ctx // pool["block_tokens"]) * pool["block_bytes"]
                ax.plot(bs, [B * full / 2**20 for B in bs], marker=".", color=f"C{i}", label=ck.name)
        for mib in b.args.capacity_mib or CAPACITY_MIB:
            ax.axhline(mib, color="grey", ls="--", lw=1)
            ax.annotate(f"{mib:g} MiB pool", (1, mib), xytext=(2, 3), textcoords="offset points", fontsize=8,
                        color="grey")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(bs, [str(B) for B in bs])
        ax.set_xlabel("sequences of the full context, B")
        ax.set_ylabel("KV cache pool, MiB")
        ax.set_title("The pool B full contexts take (on or under a pool size's line: they fit)", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    save_fig(plt, fig, path)


def plot_throughput(plt, b, path):
    """Aggregate decode tokens/s against B, one line per variant (error bars: the fastest and the
    slowest timed run); dashed, the roofline's bound where it was measured."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    bounds = False
    for i, ck in enumerate(ck for ck in b.ckpts if ck.info):
        fs = [f for f in (batch_figures(b, ck, "", B) for B in b.args.batches) if f]
        if not fs:
            continue
        xs, ys = [f["batch"] for f in fs], [f["tps"]["median"] for f in fs]
        err = [[y - f["tps"]["min"] for y, f in zip(ys, fs)], [f["tps"]["max"] - y for y, f in zip(ys, fs)]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=f"C{i}", label=ck.name)
        if all("bound" in f for f in fs):
            ax.plot(xs, [f["batch"] / f["bound"] for f in fs], ls="--", lw=1, color=f"C{i}", alpha=0.7)
            bounds = True
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain = FuncFormatter(lambda y, _: f"{y:,.0f}")   # 20,000 rather than 2 x 10^4
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xticks(list(b.args.batches), [str(B) for B in b.args.batches])
    ax.set_xlabel("batch size B (sequences decoded together)")
    ax.set_ylabel("aggregate decode tokens/s (B / median full step)")
    ax.set_title(f"Batched decoding with the KV cache ({b.machine['slug']})")
    ax.grid(alpha=0.3, which="both")
    handles, _ = ax.get_legend_handles_labels()
    if bounds:
        handles.append(Line2D([], [], color="grey", ls="--", label="roofline bound"))
    ax.legend(handles=handles, fontsize=8)
    save_fig(plt, fig, path)


def plots(b):
    """{name: path} of the plots made; a plot that cannot be made costs the plots, not the report."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        out = {}
        draws = [("per-step", plot_per_step), ("decode", plot_decode_bars), ("kv-cache", plot_kv_cache)]
        if any(ck.batch_runs for ck in b.ckpts):
            draws.append(("throughput", plot_throughput))
        for name, draw in draws:
            out[name] = os.path.join(b.args.out, f"{b.base}-{name}.png")
            draw(plt, b, out[name])
        return out
    except Exception as e:   # matplotlib missing or failing: the tables are the report
        b.plot_error = f"{type(e).__name__}: {e}"
        warn(f"the plots failed: {b.plot_error}")
        return {}


def image(pngs, name, alt):
    return [f"![{alt}]({os.path.basename(pngs[name])})", ""] if name in pngs else []


STATS_TEXT = (
    "Per run: the prefill's ms; the median of its decode steps' ms (**Decode, ms/token**: on a busy machine a "
    "few slow steps pull the mean far up while the median stays); tokens/s = 1000 / that median; and the mean "
    "of its decode steps (**Decode mean**, the post's \"Avg. Gen\"). Every cell is the median over the timed "
    "runs of that per-run figure ± the largest distance of a run's figure from it, so every timed run lies "
    "within the band; `{csv}` has each cell's minimum and maximum.")


def write_atomic(path, text):
    with open(path + ".part", "w", newline="") as f:
        f.write(text)
    os.replace(path + ".part", path)


def csv_text(rows):
    import io
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    return buf.getvalue()


def write_report(b):
    args, mach = b.args, b.machine
    base, out_dir = b.base, args.out
    csv_rows = []   # section, variant, mode, quantity, value, unit

    def add(section, variant, mode, quantity, value, unit):
        csv_rows.append([section, variant, mode, quantity, "" if value is None else value, unit])

    pngs = plots(b)
    cks = [ck for ck in b.ckpts if ck.info]
    have_pt = any(ck.runs[("pytorch", m)] for ck in cks for m in MODES)
    miss = b.missing()

    md = [f"# {'Quick latency comparison' if args.quick else 'Latency benchmark'}: {mach['slug']}", ""]
    add("report", "", "", "status", "partial" if miss or b.interrupted else "complete", "")
    if miss or b.interrupted:
        md += ["> **PARTIAL REPORT**: "
               + (f"the bench was interrupted ({b.interrupted})." if b.interrupted else "parts of the bench failed.")
               + " The tables hold what was measured before; not measured:", ">"]
        md += [f"> - {what}: {why}" for what, why in miss] + [""]
        if b.interrupted:
            add("report", "", "", "interrupted", b.interrupted, "")
        for what, why in miss:
            add("report", "", "", "missing", f"{what}: {why}", "")
    pre, during = mach.get("bg_before"), mach.get("bg_during")
    if (pre and pre["other_frac"] > 0.1) or (during and during["other_frac"] > 0.05):
        md += [f"> **The machine was not idle**: other processes kept "
               f"{pre['other_frac'] * 100 if pre else float('nan'):.0f}% of one CPU busy just before the bench "
               f"and {during['other_frac'] * 100 if during else float('nan'):.0f}% on average during it. "
               "Timings are disturbed.", ""]
    if args.full and args.steps:
        md += [f"> **Short runs**: every run was cut to {args.steps} decode steps (`--steps {args.steps}`) instead "
               "of the full context: the decode figures are those of the first positions, not comparable with "
               "full-context tables.", ""]

    rep = next(representative(ck.runs[("c", m)]) for ck in cks for m in MODES if ck.runs[("c", m)])
    n_prompt = rep["prompt_tokens"]
    n_dec = sum(x["phase"] == "decode" for x in rep["rows"])
    ctx = cks[0].info["context"]
    md += ["## Machine", "", md_table(["", ""], [
        ["CPU", mach["cpu"] + (f" ({mach['cpu_detail']})" if mach["cpu_detail"] else "")],
        ["cores", f"{mach['cores']} physical, {mach['logical']} logical CPUs"],
        ["threads used", f"{args.threads} (engine `--threads`" + (", `torch.set_num_threads`" if have_pt else "")
         + (", roofline probe" if b.roof else "") + f"); OMP_PROC_BIND={os.environ.get('OMP_PROC_BIND', '')}, "
         f"OMP_PLACES={os.environ.get('OMP_PLACES', '')}"],
        ["caches", f"L2 {mach['l2']}; L3 {mach['l3']}"],
        ["memory", f"{mach['mem'] / 2**30:.1f} GiB" if mach["mem"] else "?"],
        ["compiler", mach["compiler"]],
        ["engine", f"git {mach['git']}; kernels {cks[0].info['kernels']}"],
    ] + ([["PyTorch", mach["torch"]]] if have_pt else []) + [
        ["date", mach["date"]],
        ["other load", (f"load average {mach['load_start']:.2f} at the start; other processes used "
                        + (f"{pre['other_frac'] * 100:.0f}% of one CPU in the {pre['wall_s']:.0f} s before the bench"
                           if pre else "?")
                        + (f" and {during['other_cpu_s']:.1f} CPU-seconds during its {during['wall_s']:.0f} s "
                           f"({during['other_frac'] * 100:.1f}% of one CPU); hypervisor steal {during['steal_s']:.1f} s"
                           if during else ""))],
    ], ["---", "---"]), ""]

    md += ["## Method", "",
           f"Prompt \"{PROMPT}\" ({n_prompt} tokens with BOS), greedy (`-k 1`), EOS ignored: every run is one "
           f"prefill of {n_prompt} tokens, then {n_dec} decode steps (positions {n_prompt} to {n_prompt + n_dec - 1}"
           + (f", the full {ctx}-token context" if n_prompt + n_dec == ctx else "")
           + "), once without the KV cache (every step recomputes the whole sequence) and once with it (`--kv`). "
           "The engine times every step itself (`--log`). " + STATS_TEXT.format(csv=f"{base}.csv") + " "
           f"Each checkpoint and mode: 1 untimed warm-up run, then {args.reps} timed runs (C)"
           + (f" / {args.pt_reps} (PyTorch)" if have_pt else "") + ". The C runs go in rounds: a warm-up "
           "round, then each timed round one run of every checkpoint and mode in turn, so a minute in which the "
           "machine runs slow (other tenants of a VM) lands on one run of every cell rather than on all the runs "
           "of one. Within each C run, `./run` itself does one untimed forward of the prompt before the timed "
           "prefill (its `[warm-up]` line), as llama.cpp does after loading: a process's first forward runs cold. "
           "MLA uses the absorbed form with the cache and the expanded form without (the engine's and "
           "train/model.py's default). Checkpoints: " + ", ".join(f"`{rel(ck.path)}`" for ck in b.ckpts) + ".", ""]
    if args.quick:
        md += [f"Quick mode (`--quick`): the C engine only, with no PyTorch reference, roofline probe or determinism "
               f"check, and {n_dec} decode steps a run instead of the full context, so the decode figures are those "
               "of the first positions, lower than the full bench's: compare quick runs with quick runs "
               "(`make bench` for the full tables).", ""]

    # ---- latency
    md += ["## C engine", "", latency_table(b, "c"), ""]
    for ck in cks:
        v = ck.info["variant"]
        add("info", v, "", "params", ck.info["params"], "")
        add("info", v, "", "weight_bytes", ck.info["weight_bytes"], "bytes")
        add("info", v, "", "kv_bytes_per_token", ck.info["kv_bytes_per_token"], "bytes")
        add("info", v, "", "kv_allocated_bytes", ck.info["kv_alloc_bytes"], "bytes")
        for impl in ("c", "pytorch"):
            for mode in MODES:
                st = ck.stats(impl, mode)
                if not st:
                    continue
                add(impl, v, mode, "runs", st["step_ms"]["n"], "")
                for q, _ in QUANTITIES:
                    for k in ("median", "min", "max"):
                        add(impl, v, mode, f"{q}_{k}", f"{st[q][k]:.5g}", "tokens/s" if q == "tokens_per_s" else "ms")
    if have_pt:
        md += ["## PyTorch reference (train/model.py, eager)", "", latency_table(b, "pytorch"), ""]
        md += pytorch_notes(b, cks, add)
        rows = []
        for ck in cks:
            cells = []
            for mode in MODES:
                for q in ("prefill_ms", "step_ms"):
                    x = speedup(ck, mode, q)
                    cells.append("—" if x is None else f"{1 / x['ratio']:.1f}x ({x['lo']:.1f}–{x['hi']:.1f}x)")
                    if x is not None:
                        qq = "prefill" if q == "prefill_ms" else "decode"
                        add("ratio_c_over_pytorch", ck.info["variant"], mode, qq, f"{x['ratio']:.5f}", "")
                        add("speedup_range", ck.info["variant"], mode, f"{qq}_min", f"{x['lo']:.4g}", "x")
                        add("speedup_range", ck.info["variant"], mode, f"{qq}_max", f"{x['hi']:.4g}", "x")
            rows.append([ck.name] + cells)
        md += ["## C / PyTorch", "",
               "How many times faster the engine is: PyTorch median / C median per cell; in brackets the range "
               "over the runs' extremes (slowest C run against the fastest PyTorch run, and the reverse).", "",
               md_table(["Attention Mechanism", "Prefill (no KV)", "Decode (no KV)", "Prefill (KV)", "Decode (KV)"],
                        rows), ""]
    md += image(pngs, "decode", "median decode step per variant and mode")

    if b.roof and b.ws:
        md += roofline_section(b, cks, add)
    if any(ck.batch_runs for ck in cks):
        md += throughput_section(b, cks, add, pngs)
    md += kv_section(b, cks, pngs)
    if any(ck.capacity for ck in cks):
        md += capacity_section(b, cks, add)
    if len(BATCH_CONFIGS) > 1 and any(ck.pool for ck in cks):
        md += dtype_section(b, cks, add)
    if any(ck.check_kv for ck in cks):
        md += determinism_section(b, cks, add)
    if "per-step" in pngs:
        md += ["## Per-step latency", "",
               "The C engine's decode steps against their position, one panel per mode: every step of every timed "
               "run as a faint point, and a rolling median of the per-position medians across the runs as the line. "
               f"Every step of each cell's median-total run is in `{base}-steps.csv`.", ""]
        md += image(pngs, "per-step", "per-step decode latency with and without the cache")

    md_path = os.path.join(out_dir, f"{base}.md")
    csv_path = os.path.join(out_dir, f"{base}.csv")
    steps_path = os.path.join(out_dir, f"{base}-steps.csv")
    write_atomic(md_path, "\n".join(md))
    write_atomic(csv_path, csv_text([["section", "variant", "mode", "quantity", "value", "unit"]] + csv_rows))
    steps = [["impl", "variant", "mode", "batch", "flags", "step", "phase", "sequences", "pos", "n_tokens", "token",
              "ms"]]

    def step_rows(impl, v, mode, batch, flags, r):
        for x in r["rows"] if r else ():
            steps.append([impl, v, mode, batch, " ".join(flags), x["step"], x["phase"], x.get("sequences", 1), x["pos"],
                          x["n_tokens"], x["token"], f"{x['ms']:.4f}"])
    for ck in cks:
        for impl in ("c", "pytorch"):
            for mode in MODES:
                step_rows(impl, ck.info["variant"], mode, 1, (), representative(ck.runs[(impl, mode)]))
        for kind, flags, batches, mibs in BATCH_CONFIGS:   # the throughput runs: mode "batch", rows per B
            for B in kind_values(args.batches, batches):
                step_rows("c", ck.info["variant"], "batch", B, flags, representative(ck.batch_runs.get((kind, B))))
            for mib in kind_values(args.capacity_mib, mibs):   # and the capacity runs, with their pool size
                c = ck.capacity.get((kind, mib), {})
                if "rows" in c:
                    step_rows("c", ck.info["variant"], "capacity", c["requested"], ("--kv-mem", f"{mib:g}") + flags, c)
    write_atomic(steps_path, csv_text(steps))
    return [md_path, csv_path, steps_path] + list(pngs.values())


def pytorch_notes(b, cks, add):
    """Which PyTorch path each column timed, and why."""
    args = b.args
    prow, whys = [], []
    for ck in cks:
        ch = ck.pt.get("choice")
        if not ch:
            continue
        est = ch["est_eager_s"]
        prow.append([ck.name, ch["path"]["no-kv"], ch["path"]["kv"], f"{est['no-kv']:.0f} / {est['kv']:.0f}",
                     f"{ch['max_logit_diff']:.1e}" if "max_logit_diff" in ch else "not tried",
                     fmt_spread(ck.pt["head_ms"]) if "head_ms" in ck.pt else "—", ck.pt.get("agree", "—")])
        whys.append(f"{ck.name}: without the cache, {ch['why']['no-kv']}; with it, {ch['why']['kv']}.")
        for m in MODES:
            add("pytorch_path", ck.info["variant"], m, "path", ch["path"][m], "")
            add("pytorch_path", ck.info["variant"], m, "plain_eager_run_estimate", f"{est[m]:.1f}", "s")
        if "max_logit_diff" in ch:
            add("pytorch_path", ck.info["variant"], "", "onednn_max_abs_logit_diff", f"{ch['max_logit_diff']:.3g}", "")
    return ["Which PyTorch path each column timed. `eager` is `Transformer.forward` exactly as written "
            "(fp32 `nn.Linear`, on the BLAS named in the machine table: this Debian torch calls the system's "
            "libblas.so.3). `onednn-linear` is the same eager model with its "
            "`nn.Linear` layers replaced by fp32 oneDNN linears (torch.utils.mkldnn's MkldnnLinear as a plain "
            "eager module; MLA's W_UK and W_UV stay `nn.Linear` because the absorbed form reads their weights). "
            f"A mode switches to it only when a plain eager run of that mode would take over {args.pt_budget:.0f} s "
            "(estimated from timed forwards), its logits match plain eager within "
            f"{PT_TOLERANCE:g} (one uncached forward of the whole sequence, all positions, and a cached "
            "prefill + 16 steps), and it is faster at that mode's step"
            + (f"; `--pt-path {args.pt_path}` overrode this" if args.pt_path != "auto" else "")
            + ". On both paths the tied head is `F.linear` in `Transformer.forward`, computed for all T "
            "positions on the BLAS: its time at the average uncached T is shown (median of 3 calls ± spread). "
            "'C tokens agree' counts the greedy tokens PyTorch generated identically to the engine before the "
            "first difference (fp32 rounding orders differ).", "",
            md_table(["Attention Mechanism", "path (no KV)", "path (KV)", "plain eager run, est. s (no KV / KV)",
                      "oneDNN max logit diff vs eager", "tied head at avg T, ms", "C tokens agree (no KV / KV)"],
                     prow, ["---", "---", "---", "---:", "---:", "---:", "---:"]), ""] + ["- " + w for w in whys] + [""]


def roofline_section(b, cks, add):
    args, roof, ws = b.args, b.roof, b.ws
    bw = float(roof["bandwidth_best_GBps"]) * 1e9
    peak = float(roof["peak_best_GFLOPs"]) * 1e9
    bal = peak / bw
    ws_bw = float(ws["bandwidth_best_GBps"]) * 1e9
    md = ["## Roofline", "",
          f"This machine, {args.threads} thread{'s' if args.threads > 1 else ''} (`build/roofline`): "
          "streaming-read bandwidth "
          f"**{bw / 1e9:.1f} GB/s** (sum over a {int(roof['bandwidth_bytes']) / 2**20:.0f} MiB buffer, best of "
          f"{roof['bandwidth_reps']}; median {float(roof['bandwidth_median_GBps']):.1f}), peak fp32 "
          f"**{peak / 1e9:.1f} GFLOP/s** ({roof['roofline_simd']} FMA, {roof['peak_fma_chains']} independent chains "
          f"per thread, best of {roof['bandwidth_reps']}; median {float(roof['peak_median_GFLOPs']):.1f}); "
          f"machine balance **{bal:.1f} FLOP/byte**."
          + f" The same streaming read over {int(ws['bandwidth_bytes']) / 2**20:.0f} MiB, the size of the "
          f"largest decode step's working set (weights and a full KV cache), gives "
          f"**{float(ws['bandwidth_best_GBps']):.1f} GB/s** (the machine table gives the cache sizes). A step "
          "whose bytes stay in cache between steps need not stream them from DRAM; the last column gives its "
          "memory floor at that bandwidth, and that floor as a share of the measured time.", "",
          "Per decode step (the step at the median position, against the median step time): bytes = every "
          "weight once in the file's dtype "
          "(bf16: parameters x 2; the tied head reads the whole embedding table) plus, with the cache, the "
          "fp32 cache rows of the (position + 1) keys attended to; FLOPs = 2 per weight multiply-accumulate "
          "(all layers' matrices and the 4096 x 512 head; MLA with the cache adds the per-head W_UK,h^T and "
          "W_UV,h products; MLA without it expands W_UK c and W_UV c for every position) plus attention, "
          "per head 2 x key width x keys for the scores and 2 x value width x keys for the weighted sum "
          "(key/value widths: head_dim; MLA absorbed d_c+d_R / d_c; MLA expanded head_dim+d_R / head_dim). "
          "Without the cache a step is the forward of all T tokens (causal attention) with the logits of the "
          "last one. Norms, RoPE, softmax and SiLU are left out (well under 1%). "
          "Floors: bytes / bandwidth and FLOPs / peak; the larger is the roofline bound.", ""]
    rows = []
    for ck in cks:
        c, v = ck.info, ck.info["variant"]
        for mode in ("kv", "no-kv"):
            st = ck.stats("c", mode)
            if not st:
                continue
            dec = [x for x in representative(ck.runs[("c", mode)])["rows"] if x["phase"] == "decode"]
            x = dec[(len(dec) - 1) // 2]   # the step at the median position (lower middle)
            if mode == "kv":
                flops, nbytes = decode_cost_kv(c, [x["pos"]])
                where = f"pos {x['pos']}"
            else:
                flops, nbytes = decode_cost_nokv(c, x["n_tokens"])
                where = f"T {x['n_tokens']}"
            t = st["step_ms"]["median"] / 1e3
            mem_floor, cpu_floor = nbytes / bw, flops / peak
            bound = max(mem_floor, cpu_floor)
            ai = flops / nbytes
            rows.append([ck.name, MODE_LABEL[mode], where, f"{nbytes / 1e6:.2f}",
                         f"{flops / 1e6:.1f}", f"{ai:.2f}", "memory" if ai < bal else "compute",
                         fmt_spread(st["step_ms"]), f"{nbytes / t / 1e9:.1f}", f"{flops / t / 1e9:.1f}",
                         fmt(mem_floor * 1e3), fmt(cpu_floor * 1e3), f"{bound / t * 100:.0f}%",
                         f"{fmt(nbytes / ws_bw * 1e3)} ({nbytes / ws_bw / t * 100:.0f}%)"])
            add("roofline", v, mode, "step_pos", x["pos"], "")
            add("roofline", v, mode, "cache_resident_memory_floor_ms", f"{nbytes / ws_bw * 1e3:.6g}", "ms")
            for q, val, unit in (("step_bytes", nbytes, "bytes"), ("step_flops", flops, "FLOP"),
                                 ("arithmetic_intensity", ai, "FLOP/byte"), ("achieved_GBps", nbytes / t / 1e9, "GB/s"),
                                 ("achieved_GFLOPs", flops / t / 1e9, "GFLOP/s"), ("memory_floor_ms", mem_floor * 1e3, "ms"),
                                 ("compute_floor_ms", cpu_floor * 1e3, "ms")):
                add("roofline", v, mode, q, f"{val:.6g}", unit)
    md += [md_table(["Attention Mechanism", "mode", "step", "MB read", "MFLOP", "FLOP/byte", "bound by",
                     "measured ms", "achieved GB/s", "achieved GFLOP/s", "memory floor ms", "compute floor ms",
                     "bound / measured", "memory floor at working-set bandwidth, ms (/ measured)"],
                    rows, ["---"] * 3 + ["---:"] * 3 + ["---"] + ["---:"] * 7), "",
           f"Machine balance: {bal:.1f} FLOP/byte. A step whose arithmetic intensity is below it is bound by "
           "memory bandwidth, above it by the FMA rate. 'bound / measured' is how close the median step comes to "
           "the roofline (100% = at the roofline; above 100% the step ran faster than the DRAM floor allows, so its "
           "bytes came from cache).", ""]
    add("machine", "", "", "bandwidth_GBps", f"{bw / 1e9:.3f}", "GB/s")
    add("machine", "", "", "peak_GFLOPs", f"{peak / 1e9:.3f}", "GFLOP/s")
    add("machine", "", "", "balance", f"{bal:.3f}", "FLOP/byte")
    add("machine", "", "", "bandwidth_working_set_GBps", ws["bandwidth_best_GBps"], "GB/s")
    add("machine", "", "", "bandwidth_working_set_bytes", ws["bandwidth_bytes"], "bytes")
    add("machine", "", "", "last_level_cache_bytes", b.machine.get("llc_bytes") or "", "bytes")
    return md


LINEAR = 0.8   # a step time that grows by at least this share of B's factor grows "in proportion to B"


def batch_figures(b, ck, kind, batch):
    """Every figure of one throughput cell, or None when it has no timed run."""
    runs = ck.batch_runs.get((kind, batch))
    if not runs:
        return None
    st = spread([r["step_ms"] for r in runs])
    pos = representative(runs)["pos"]
    flops, nbytes, kv = batch_cost(ck, kind, batch, pos)
    t = st["median"] / 1e3
    f = {"batch": batch, "step": st, "pos": pos, "flops": flops, "bytes": nbytes, "kv": kv, "ai": flops / nbytes,
         "post": post_intensity(ck.info, batch),
         # one formula for all three, so rounding cannot put the median outside its range
         "tps": {"median": batch * 1e3 / st["median"], "min": batch * 1e3 / st["max"],
                 "max": batch * 1e3 / st["min"], "n": st["n"]}}
    if b.roof:
        bw, where = batch_bandwidth(b, nbytes)
        peak = float(b.roof["peak_best_GFLOPs"]) * 1e9
        f.update(bw=bw, bw_source=where)
        if bw:
            mem, cpu = nbytes / bw, flops / peak
            f.update(bound=max(mem, cpu), share=max(mem, cpu) / t,
                     bound_by="compute" if cpu > mem else "cache" if kv > ck.info["weight_bytes"] else "weights")
    return f


def batch_table(b, cks, add):
    """The throughput table's markdown rows and {(variant, kind): [figures by B]}; the CSV rows."""
    rows, figs = [], {}
    roof = bool(b.roof)
    for ck in cks:
        v = ck.info["variant"]
        for kind, _, _, _ in DEFAULT_KIND:
            fs = [f for f in (batch_figures(b, ck, kind, B) for B in b.args.batches) if f]
            figs[(v, kind)] = fs
            one = next((f for f in fs if f["batch"] == 1), None)
            for f in fs:
                gain = f["tps"]["median"] / one["tps"]["median"] if one else None
                row = [ck.name + (f" ({kind})" if kind else ""), f["batch"], f["step"]["n"], fmt_spread(f["step"]),
                       fmt_spread(f["tps"]), f"{gain:.2f}x" if gain else "—", f["pos"], fmt(f["kv"] / 1e6),
                       fmt(f["bytes"] / 1e6), fmt(f["flops"] / 1e6), f"{f['ai']:.2f}", f"{f['post']:.2f}"]
                if roof:
                    row += [f"{f['bw'] / 1e9:.1f} ({f['bw_source']})" if f.get("bw") else "—",
                            f"{f['batch'] / f['bound']:,.0f}" if "bound" in f else "—",
                            f"{f['share'] * 100:.0f}%" if "share" in f else "—", f.get("bound_by", "—")]
                rows.append(row)
                mode = cell_mode(kind, f["batch"])
                add("batch", v, mode, "runs", f["step"]["n"], "")
                for q, unit in (("step", "ms"), ("tps", "tokens/s")):
                    name = "step_ms" if q == "step" else "tokens_per_s"
                    for k in ("median", "min", "max"):
                        add("batch", v, mode, f"{name}_{k}", f"{f[q][k]:.6g}", unit)
                for q, val, unit in (("speedup_vs_b1", gain, "x"), ("step_pos", f["pos"], ""),
                                     ("kv_bytes", f["kv"], "bytes"), ("weight_bytes", ck.info["weight_bytes"], "bytes"),
                                     ("step_bytes", f["bytes"], "bytes"), ("step_flops", f["flops"], "FLOP"),
                                     ("arithmetic_intensity", f["ai"], "FLOP/byte"),
                                     ("post_intensity_formula", f["post"], "FLOP/byte")):
                    if val is not None:
                        add("batch", v, mode, q, val if isinstance(val, int) else f"{val:.6g}", unit)
                if f.get("bw"):
                    add("batch", v, mode, "bandwidth_GBps", f"{f['bw'] / 1e9:.6g}", "GB/s")
                    add("batch", v, mode, "bandwidth_source", f["bw_source"], "")
                if "bound" in f:
                    add("batch", v, mode, "roofline_bound_ms", f"{f['bound'] * 1e3:.6g}", "ms")
                    add("batch", v, mode, "roofline_tokens_per_s", f"{f['batch'] / f['bound']:.6g}", "tokens/s")
                    add("batch", v, mode, "roofline_share", f"{f['share']:.6g}", "")
                    add("batch", v, mode, "bound_by", f["bound_by"], "")
    header = ["Attention Mechanism", "B", "timed runs", "step, ms", "tokens/s", "/ B=1", "pos", "KV read, MB",
              "bytes read, MB", "MFLOP", "FLOP/byte", "post's Θ(AI)"]
    if roof:
        header += ["bandwidth, GB/s", "roofline bound, tokens/s", "share of bound", "bound by"]
    align = ["---"] + ["---:"] * (len(header) - 1 - roof) + ["---"] * roof   # "bound by" is a word
    return md_table(header, rows, align), figs


def crossover_lines(b, cks, figs):
    """For each variant, from the measurements: where the cache's bytes pass the weights', what
    the roofline says bounds each step, and from which B the measured step time grows in
    proportion to B."""
    out = []
    for ck in cks:
        fs = figs.get((ck.info["variant"], ""))
        if not fs:
            continue
        w = ck.info["weight_bytes"]
        past = next((f for f in fs if f["kv"] > w), None)
        if past:
            words = (f"its cache bytes pass its weight bytes ({w / 1e6:.1f} MB) from B={past['batch']} "
                     f"({past['kv'] / 1e6:.1f} MB of cache at position {past['pos']})")
        else:
            last = fs[-1]
            per_seq = last["kv"] / last["batch"]
            words = (f"its cache bytes stay below its weight bytes ({w / 1e6:.1f} MB) up to B={last['batch']} "
                     f"({last['kv'] / 1e6:.1f} MB at position {last['pos']}; they would pass them from about "
                     f"B={math.ceil(w / per_seq)})")
        if all("bound_by" in f for f in fs):
            groups = {}
            for f in fs:
                groups.setdefault(f["bound_by"], []).append(str(f["batch"]))
            words += ("; the roofline bounds its step by " + "; by ".join(
                f"{'the FMA rate' if k == 'compute' else 'reading the ' + k} at B = {', '.join(v)}"
                for k, v in groups.items()))
        pairs = [(x, y, (y["step"]["median"] / x["step"]["median"]), y["batch"] / x["batch"])
                 for x, y in zip(fs, fs[1:])]
        start = next((i for i in range(len(pairs)) if all(t >= LINEAR * r for _, _, t, r in pairs[i:])), None)
        steps = ", ".join(f"x{t:.2f} from B={x['batch']} to {y['batch']} (x{r:g} sequences)" for x, y, t, r in pairs)
        if not pairs:
            words += "; a single batch size says nothing of how the step grows"
        elif start is None:
            words += (f". Measured, the step time grew less than in proportion to B all the way to B={fs[-1]['batch']}, "
                      f"so a larger batch still bought throughput: {steps}")
        else:
            words += (f". Measured, the step time grows in proportion to B from B={pairs[start][0]['batch']} on: {steps}")
        out.append(f"- **{ck.name}**: {words}.")
    return out


def throughput_section(b, cks, add, pngs):
    args = b.args
    table, figs = batch_table(b, cks, add)
    large = [B for B in args.batches if B >= LARGE_BATCH]
    md = ["## Batched decoding: throughput", "",
          f"`./run CKPT -p \"{PROMPT}\" --kv --batch B -n {b.n_gen(cks[0].info)} -k 1 -s 0 --ignore-eos -q --log "
          f"FILE.csv --threads {args.threads}`: B copies of the prompt (sequence i with seed i; greedy, so the same "
          "tokens), decoded together on the paged KV cache"
          + (" to the full context" if not args.steps else f", cut at {args.steps} decode steps (`--steps`)")
          + ". Step 0 computes the prompt once; at step 1 the first sequence decodes while the others compute "
          "their last prompt token on the shared prompt blocks; from step 2 on every step is a **full step** "
          "of B tokens, one per sequence, and the first sequence ends one step before the others. A full step "
          "at step k decodes position k + (prompt tokens) - 2 for all sequences but the first, which is one "
          "ahead: **pos** is the former, at the full step in the middle of the run (the step time grows with the "
          "position, so the median step is the one at the median position).", "",
          "Per run: the median of its full steps' ms. **step, ms** is the median over the timed runs of that, ± "
          "the largest distance of a run from it; **tokens/s** = B x 1000 / that median step (B tokens a step; "
          "its spread from the fastest and slowest run); **/ B=1** is that throughput over B=1's. "
          f"Each batch size: 1 untimed warm-up run, then {args.reps} timed runs"
          + (f", but {args.large_batch_reps} for B = {', '.join(map(str, large))}: such a run takes seconds "
             "(MHA at B=256 reads about half a gigabyte a step), and the bench stays bounded"
             if large and args.large_batch_reps != args.reps else "")
          + "; the runs go in rounds, as the latency runs do.", "",
          "From the model's shape, for the full step at pos: **KV read** = the cache rows the B sequences "
          "attend to, (B x (pos + 1) + 1) x the cache's bytes per token (the first sequence reads one row more); "
          "**bytes read** = that plus every weight once, shared by the B tokens; **MFLOP** = B x the weight "
          "FLOPs of one token (the roofline section's count, with the tied head) plus attention over each "
          "sequence's keys; **FLOP/byte** = their quotient. **post's Θ(AI)** is the post's intensity of a "
          "whole cached decode, (b n² d + b n d²) / (b n² d_kv + n d²) at b = B, n = the context "
          f"({cks[0].info['context']}), d = d_model ({cks[0].info['dim']}), d_kv = d for MHA, d/G for GQA, "
          "d/h for MQA (H_kv x head_dim: K or V counted once) and, for MLA, its latent d_c plus the RoPE key "
          "d_R, the one vector it caches for both: a Θ() without the layers, the FFN or any constant, so "
          "compare how it grows with B against how the measured intensity grows, not the values.", ""]
    if b.roof:
        bal = float(b.roof["peak_best_GFLOPs"]) / float(b.roof["bandwidth_best_GBps"])
        md += ["Roofline: bound = max(FLOPs / FMA peak, bytes / bandwidth), **share of bound** = bound / the "
               "median step (the aggregate throughput over the roofline's), **bound by** which term is larger "
               "(and, for bytes, whether the cache's or the weights' are more). The bandwidth is chosen for the "
               "step's working set, the weights plus the cache rows it reads, all of which the next step reads "
               "again: when that exceeds the last-level cache"
               + (f" ({b.machine['l3']})" if b.machine.get("llc_bytes") else " (not known here: every cell "
                  "uses its probe)")
               + f" it comes from DRAM, at the streaming bandwidth of the Roofline section "
               f"({float(b.roof['bandwidth_best_GBps']):.1f} GB/s); otherwise the same streaming read is "
               "probed over that many MiB (the column names the size), since a set that fits may be served from "
               "the cache. A VM's CPUID may describe the host's cache: a probe over a size that does not really "
               f"fit measures DRAM's bandwidth anyway. Machine balance {bal:.1f} FLOP/byte.", ""]
    md += [table, ""] + image(pngs, "throughput", "aggregate decode throughput against the batch size")
    lines = crossover_lines(b, cks, figs)
    if lines:
        md += ["### From weight-bound to cache-bound", "",
               "A step reads the weights once for all B sequences, and each sequence's own cache; its FLOPs grow "
               "with B. While the weights are most of the bytes and the intensity is under the machine balance, a "
               "larger batch adds little time to a step (weight-bound); once the cache's bytes pass the weights' "
               "the memory floor grows in proportion to B (cache-bound), and once the intensity passes the "
               "machine balance the FMA rate sets the floor, which also grows in proportion to B. As measured "
               f"here (\"in proportion\": the step time grows by at least {LINEAR:.0%} of B's factor between "
               "one batch size and the next, and keeps doing so):", ""] + lines + [""]
    return md


def capacity_section(b, cks, add):
    args, rows = b.args, []
    for ck in cks:
        for kind, _, _, _ in DEFAULT_KIND:
            pool = ck.pool.get(kind)
            if not pool:
                continue
            row = [ck.name + (f" ({kind})" if kind else ""), f"{pool['bytes_per_token']:,}",
                   f"{pool['block_bytes']:,}", -(-ck.info["context"] // pool["block_tokens"])]
            for mib in args.capacity_mib:
                c = ck.capacity.get((kind, mib))
                mode = f"{mib:g} MiB" + (f" {kind}" if kind else "")
                if c is None:
                    row += ["—", "—", "—"]
                    continue
                f = c["formula"]
                for q in ("formula", "blocks", "per_seq", "measured", "requested", "preemptions", "engine_blocks"):
                    if q in c:
                        add("capacity", ck.info["variant"], mode, q, c[q], "")
                if "measured" in c:
                    agree = c["measured"] == f and c["engine_blocks"] == c["blocks"]
                    add("capacity", ck.info["variant"], mode, "agree", int(agree), "")
                    note = f" (all {c['requested']} asked; the batch limit)" if c["requested"] == f else \
                        f" of {c['requested']} ({c['preemptions']} preemptions)"
                    row += [f"{f:,}", f"{c['measured']}{note}", "yes" if agree else
                            f"no (pool {c['engine_blocks']} blocks, formula {c['blocks']})"
                            if c["engine_blocks"] != c["blocks"] else "no"]
                elif f > MAX_BATCH:
                    row += [f"{f:,}", f"≥ {MAX_BATCH} (the batch limit; not run)", "—"]
                else:
                    row += [f"{f:,}", "— (under one sequence: the engine refuses such a pool)", "—"]
            rows.append(row)
    header = ["Attention Mechanism", "KV bytes/token", "block, bytes", "blocks a full sequence"]
    for mib in args.capacity_mib:
        header += [f"{mib:g} MiB: formula", f"{mib:g} MiB: measured", "agree"]
    ctx = cks[0].info["context"]
    return ["## KV cache capacity", "",
            f"How many sequences of the full {ctx}-token context fit in a KV cache pool of a given size. "
            "**Formula**: the pool holds floor(MiB x 2^20 / block bytes) blocks of 16 tokens (the block bytes "
            "from `./run --info --kv`), and a sequence of the full context takes ceil(context / 16) of them. "
            "**Measured**: `./run CKPT -p \"" + PROMPT + "\" --kv --batch N --kv-mem MiB -k 40 -s 0 --ignore-eos` "
            f"with N = the formula's count + 2 (at most {MAX_BATCH}, the engine's batch limit), where the formula "
            f"gives at most {MAX_BATCH}: the pool preempts the latest admitted sequence when it runs short, and the "
            "figure is the most sequences active in one step (the log's `sequences`) while the first ones admitted "
            "decode the last 16-token block of the context, each then holding a full context's blocks. The runs "
            "sample (top-k 40, seeds 0..N-1) rather than decode greedily: greedy copies of one prompt are "
            "identical, and a preempted copy that comes back shares every block of a running one, so more of "
            "them than the formula's count run at once. 'agree': the measured count and the engine's block count "
            "(its `kv pool:` line) equal the formula's.", "",
            md_table(header, rows), ""]


def dtype_section(b, cks, add):
    """Speed and memory by --kv-dtype: bytes per token, full-context sequences in a pool of the
    kind's capacities, and decode tokens/s at its batch sizes (the same runs as the tables above)."""
    args, rows = b.args, []
    batches = [B for B in args.batches if all(B in kind_values(args.batches, own) for _, _, own, _ in BATCH_CONFIGS)]
    mibs = [m for m in args.capacity_mib if all(m in kind_values(args.capacity_mib, own) for _, _, _, own in BATCH_CONFIGS)]
    for ck in cks:
        v = ck.info["variant"]
        for kind, _, _, _ in BATCH_CONFIGS:
            pool = ck.pool.get(kind)
            if not pool:
                continue
            dtype = kind or "fp32"
            row = [ck.name, dtype, f"{pool['bytes_per_token']:,}"]
            for mib in mibs:
                c = ck.capacity.get((kind, mib))
                row.append(f"{c['formula']:,}" + (f" ({c['measured']} measured)" if "measured" in c else "") if c else "—")
            for B in batches:
                f = batch_figures(b, ck, kind, B)
                row.append(fmt_spread(f["tps"]) if f else "—")
                if f:
                    add("dtype", v, f"B={B} {dtype}", "tokens_per_s_median", f"{f['tps']['median']:.6g}", "tokens/s")
            add("dtype", v, dtype, "kv_bytes_per_token", pool["bytes_per_token"], "bytes")
            rows.append(row)
    header = ["Attention Mechanism", "--kv-dtype", "KV bytes/token"] + \
        [f"full-context sequences in {m:g} MiB" for m in mibs] + [f"tokens/s at B={B}" for B in batches]
    return ["## KV cache precision: speed and memory", "",
            "The same runs as the throughput and capacity tables, with `--kv-dtype bf16` and `int8` beside the "
            "default fp32. int8 stores a 4-byte scale beside every cached vector (a key or value head of one token; "
            "an MLA latent and its RoPE key). What each dtype costs in quality: `make quality`.", "",
            md_table(header, rows), ""]


def kv_section(b, cks, pngs):
    rows = []
    mha = next((ck.info["kv_bytes_per_token"] for ck in cks if ck.info["variant"] == "mha"), None)
    for ck in cks:
        i = ck.info
        rows.append([ck.name, f"{i['kv_bytes_per_token']:,}", f"{i['kv_alloc_bytes']:,}",
                     f"{i['kv_alloc_bytes'] / 2**20:.2f}",
                     f"{i['kv_bytes_per_token'] / mha:.3f}" if mha else "—"])
    ctx = cks[0].info["context"]
    return ["## KV cache size", "",
            "From `./run CKPT --info`: the cache's bytes per token from the model's shape (fp32 cache) and the "
            "bytes the engine allocates. For every checkpoint here they agree (bytes per token x context = the "
            "allocation); the bench stops measuring a checkpoint where they do not.", "",
            md_table(["Attention Mechanism", "KV cache, bytes/token", f"allocated for {ctx} tokens, bytes", "MiB",
                      "/ MHA's"], rows), ""] + image(pngs, "kv-cache", "KV cache bytes against context length")


def determinism_section(b, cks, add):
    rows = []
    for ck in cks:
        for c in ck.check_kv or ():
            rows.append([ck.name, c["a"], c["b"], c["steps"], c["identical_tokens"],
                         "none" if c["first_divergent_step"] == "-1" else c["first_divergent_step"],
                         "yes" if c["bitwise_identical"] == "1" else
                         f"no (from step {c['first_bitwise_difference']})", c["max_abs_logit_diff"]])
            for k in ("steps", "identical_tokens", "first_divergent_step", "bitwise_identical",
                      "first_bitwise_difference", "max_abs_logit_diff"):
                add("check_kv", c["variant"], f"{c['a']} vs {c['b']}", k, c[k], "")
    n = b.n_gen(cks[0].info)
    return ["## Determinism: with and without the cache", "",
            f"`./run CKPT --check-kv --ignore-eos -p \"{PROMPT}\" --threads {b.args.threads}"
            + (f" -n {n}" if n < cks[0].info["context"] else "") + "`: greedy generation with the cache against "
            "greedy generation without it, the logits of every step compared.", "",
            md_table(["Attention Mechanism", "with cache", "without cache", "steps", "identical tokens",
                      "first divergent step", "logits bitwise identical", "max |logit diff|"], rows,
                     ["---", "---", "---"] + ["---:"] * 5), ""]


# ---------------------------------------------------------------- main

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="*", help="engine checkpoints (default: every weights/*.bin)")
    ap.add_argument("--quick", action="store_true",
                    help=f"a quick comparison: the C engine only, {QUICK_STEPS} decode steps a run, {QUICK_REPS} "
                         "timed rounds after a warm-up round, no PyTorch, roofline probe or determinism check; "
                         "prints one table (make bench-quick)")
    ap.add_argument("--threads", type=int, default=logical_cpus(), help="threads (default: all cores, %(default)s)")
    ap.add_argument("--reps", type=int, default=None,
                    help=f"timed C runs per checkpoint and mode (default {FULL_REPS}; --quick: {QUICK_REPS})")
    ap.add_argument("--pt-reps", type=int, default=PT_REPS,
                    help=f"timed PyTorch runs per checkpoint and mode (default {PT_REPS})")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"decode steps per run (default: to the full context; --quick: {QUICK_STEPS}); a full "
                         "bench with fewer is headed 'Short runs'")
    ap.add_argument("--out", default=None,
                    help="output directory (default bench/results; --quick: bench/results/tmp/quick, git-ignored)")
    ap.add_argument("--pt-path", choices=["auto", "eager", "mkldnn"], default="auto",
                    help="PyTorch path per mode: auto (plain eager, unless a run of that mode would take over "
                         "--pt-budget seconds: then oneDNN Linear layers if their logits match and they are "
                         "faster), eager, or mkldnn (default auto)")
    ap.add_argument("--pt-budget", type=float, default=120.0,
                    help="seconds a plain eager PyTorch run may take before auto switches (default 120)")
    ap.add_argument("--skip-pytorch", action="store_true", help="measure the C engine only")
    ap.add_argument("--batches", default=None, metavar="B,B,...",
                    help="batch sizes of the throughput table, 1..256, or none (default "
                         f"{','.join(map(str, BATCHES))}; --quick: {','.join(map(str, QUICK_BATCHES))})")
    ap.add_argument("--large-batch-reps", type=int, default=LARGE_BATCH_REPS,
                    help=f"timed runs of a batch size from {LARGE_BATCH} on, after a warm-up (default "
                         f"{LARGE_BATCH_REPS}: such a run takes seconds); smaller ones get --reps")
    ap.add_argument("--capacity-mib", default=None, metavar="M,M,...",
                    help="KV pool sizes of the capacity table, MiB, or none (default "
                         f"{','.join(f'{m:g}' for m in CAPACITY_MIB)}; --quick: none)")
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"), help="the compiler, for the report")
    # for testing the script itself: a cheaper roofline probe, a shorter look at the load before
    ap.add_argument("--roofline-mib", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--roofline-reps", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--load-seconds", type=float, default=2.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.full = not args.quick
    args.pytorch = args.full and not args.skip_pytorch
    if args.reps is None:
        args.reps = QUICK_REPS if args.quick else FULL_REPS
    if args.steps is None and args.quick:
        args.steps = QUICK_STEPS
    if args.out is None:
        args.out = os.path.join(ROOT, "bench", "results", *(("tmp", "quick") if args.quick else ()))
    args.out = os.path.abspath(args.out)
    if args.threads < 1:
        ap.error("--threads must be at least 1")
    for name in ("reps", "pt_reps"):
        if getattr(args, name) < 2:
            ap.error(f"--{name.replace('_', '-')} must be at least 2: a spread needs two timed runs")
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be at least 1")
    args.batches = number_list(ap, "--batches", args.batches, QUICK_BATCHES if args.quick else BATCHES, int,
                               lambda x: 1 <= x <= MAX_BATCH, f"a whole number from 1 to {MAX_BATCH}")
    args.capacity_mib = number_list(ap, "--capacity-mib", args.capacity_mib, () if args.quick else CAPACITY_MIB,
                                    float, lambda x: 0 < x <= 1048576, "a size in MiB above 0, at most 1048576")
    if args.large_batch_reps < 1:
        ap.error("--large-batch-reps must be at least 1")
    if args.steps == 1 and any(B > 1 for B in args.batches):
        ap.error("--steps must be at least 2 with a batch above 1: its first decode step is the mixed one")
    return args


def number_list(ap, flag, text, default, kind, ok, what):
    """A flag's comma-separated numbers, sorted and without repeats ("none": no numbers)."""
    if text is None:
        return tuple(default)
    if text.strip().lower() == "none":
        return ()
    try:
        vals = sorted({kind(x) for x in text.split(",")})
    except ValueError:
        vals = None
    if not vals or not all(ok(v) for v in vals):
        ap.error(f"{flag} takes {what}, comma-separated, or none: {text!r}")
    return tuple(vals)


# OpenMP threads pinned one per core, for the engine, the roofline probe and PyTorch (set
# before torch loads libgomp). Unpinned, a thread woken from sleep can land on the CPU of
# the thread that woke it: on this project's 2-core VM, 5 of 12 two-thread prefills then
# took 9-23 ms instead of 1.6-1.9 ms; pinned, 12 of 12 took 1.6-2.1 ms. A user's own
# OMP_PROC_BIND / OMP_PLACES win.
PINNING = {"OMP_PROC_BIND": "true", "OMP_PLACES": "cores"}


def checkpoint_paths(args):
    """The checkpoints named, or every weights/*.bin; None (after one line on stderr) if there are none."""
    if args.checkpoints:
        missing = [c for c in args.checkpoints if not os.path.isfile(c)]
        if missing:
            warn(f"no such checkpoint: {', '.join(missing)}")
            return None
        return [os.path.abspath(c) for c in args.checkpoints]
    found = sorted(glob.glob(os.path.join(ROOT, "weights", "*.bin")))
    if not found:
        warn("weights/ holds no checkpoint (*.bin), so there is nothing to measure; train and export one first "
             "(weights/README.md), or name checkpoints: make bench BENCH_CHECKPOINTS=\"path/a.bin ...\"")
    return found or None


def survey(b):
    """The machine, and how busy other processes keep it over 2 s (--load-seconds) before the bench starts."""
    args, m = b.args, b.machine
    m.update(cpu=cpu_model(), cpu_detail=cpu_detail(), cores=physical_cores(), logical=logical_cpus(),
             mem=mem_total(), l2=cache_line("L2"), l3=cache_line("L3"), llc_bytes=size_bytes(cache_line("L3")),
             compiler=(sh([args.cc, "--version"]).splitlines() or ["?"])[0], git=git_describe(),
             date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             load_start=os.getloadavg()[0])
    b.phase = "measuring the machine's load"
    bg = Background()
    time.sleep(args.load_seconds)
    m["bg_before"] = bg.since()
    busy = m["bg_before"]["other_frac"] if m["bg_before"] else 0.0
    log(f"bench: {m['cpu']}, {m['cores']} cores, {args.threads} threads; load average {m['load_start']:.2f}; "
        f"other processes busy {busy * 100:.0f}% of one CPU")
    if busy > 0.1:
        log(f"bench: WARNING: other processes keep {busy * 100:.0f}% of one CPU busy: timings will be disturbed")
    b.bg = Background()


def main(argv=None):
    args = parse_args(argv)
    paths = checkpoint_paths(args)
    if paths is None:
        return 1
    for exe in (RUN,) + ((ROOFLINE,) if args.full else ()):
        if not os.access(exe, os.X_OK):
            warn(f"{rel(exe)} is not built (make run build/roofline)")
            return 1
    for k, v in PINNING.items():
        os.environ.setdefault(k, v)
    os.makedirs(args.out, exist_ok=True)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    t_start = time.time()
    b = Bench(args, paths)
    code = 0
    try:
        read_checkpoints(b)
        survey(b)
        measure(b)
    except BenchError as e:
        warn(str(e))
        return 1
    except Interrupted as e:
        b.interrupted = f"{e} during {b.phase}"
        code = 128 + e.signum
        warn(f"interrupted ({b.interrupted}); writing the report of what was measured (interrupt again to "
             "abandon it)")
    if getattr(b, "bg", None):
        b.machine["bg_during"] = b.bg.since()
    if not b.measured():
        warn("nothing was measured, so no report was written")
        return code or 1
    try:
        files = write_report(b)
    except Interrupted as e:
        warn("interrupted again: the report was not written")
        return 128 + e.signum
    log(f"bench: done in {time.time() - t_start:.0f} s; wrote " + ", ".join(rel(p) for p in files))
    print("\n" + latency_table(b, "c"))
    miss = b.missing()
    if miss or b.interrupted:
        warn(f"PARTIAL REPORT ({len(miss)} part{'s' if len(miss) != 1 else ''} not measured): {rel(files[0])}")
        return code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
