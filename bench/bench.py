#!/usr/bin/env python3
"""bench/bench.py: the latency tables of the KV-cache post, for the C engine and for the
PyTorch reference, with a roofline analysis, the KV cache sizes and the --check-kv
determinism table.

    /usr/bin/python3 bench/bench.py [CHECKPOINT ...] [--threads N] [--reps R] [--pt-reps R] [--out DIR]
    /usr/bin/python3 bench/bench.py --quick [CHECKPOINT ...]

`make bench` runs the full bench, `make bench-quick` the quick mode (bench/bench.mk; the
knobs are BENCH_CHECKPOINTS, BENCH_THREADS, BENCH_REPS, BENCH_PT_REPS, BENCH_OUT,
BENCH_FLAGS). bench/README.md explains every number.

Every checkpoint generates from "Once upon a time" greedily (-k 1), ignoring EOS, so every
run does the same work: once without and once with the KV cache, a warm-up round and then
--reps timed rounds; every figure is the median over the timed runs with its spread. The
full bench generates to the full context and adds the PyTorch reference (train/model.py,
eager, in this process), the roofline probe and --check-kv. --quick measures the C engine
alone, 64 decode steps a run, 3 timed rounds, and prints one table.

Results go to DIR/<machine>.md, DIR/<machine>.csv, DIR/<machine>-steps.csv and three plots
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
    """The rows of a --log CSV: step,phase,pos,n_tokens,token,ms."""
    try:
        with open(path, newline="") as f:
            return [{"step": int(r["step"]), "phase": r["phase"], "pos": int(r["pos"]), "n_tokens": int(r["n_tokens"]),
                     "token": int(r["token"]), "ms": float(r["ms"])} for r in csv.DictReader(f)]
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise BenchError(f"cannot read the step log {rel(path)}: {type(e).__name__}: {e}")


def parse_check_kv(out):
    """The key=value fields of every `check-kv ...` line of ./run --check-kv."""
    return [dict(kv.split("=", 1) for kv in line[len("check-kv "):].split())
            for line in out.splitlines() if line.startswith("check-kv ")]


def engine_message(stderr):
    """The engine's own last word on a failure: the last line it wrote to stderr."""
    lines = [x for x in stderr.strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else "no message"


# ---------------------------------------------------------------- running the engine

def run_engine(args, what):
    p = subprocess.run([RUN] + [str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode == -signal.SIGINT:   # Ctrl-C in a terminal reaches the engine too
        raise Interrupted(signal.SIGINT)
    if p.returncode < 0:
        raise BenchError(f"{what}: ./run was killed by {signal.Signals(-p.returncode).name}: "
                         f"{engine_message(p.stderr)}")
    if p.returncode != 0:
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
    out = run_engine(cmd, "--check-kv").stdout
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


def decode_cost_kv(c, pos):
    """FLOPs and bytes of one cached decode step of the token at position pos (pos+1 keys).
    MLA: the absorbed form. Bytes: every weight once (file dtype) + the cache read (fp32)."""
    n = pos + 1
    kw, vw = attn_widths(c, absorbed=True)
    flops = c["layers"] * (2 * layer_macs_per_token(c, True) + c["heads"] * 2 * (kw + vw) * n)
    flops += 2 * c["vocab"] * c["dim"]                      # the tied head
    nbytes = c["weight_bytes"] + n * c["kv_bytes_per_token"]
    return flops, nbytes


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
    the full context as a dot."""
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, ck in enumerate(ck for ck in b.ckpts if ck.info):
        ctx, per_token = ck.info["context"], ck.info["kv_bytes_per_token"]
        ax.plot([0, ctx], [0, per_token * ctx / 2**20], color=f"C{i}", label=f"{ck.name}: {per_token:,} bytes/token")
        ax.plot([ctx], [ck.info["kv_alloc_bytes"] / 2**20], "o", color=f"C{i}")
    ax.set_xlabel("context length, tokens")
    ax.set_ylabel("KV cache, MiB (fp32)")
    ax.set_title("KV cache size against context length (dots: the allocation ./run --info reports)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_fig(plt, fig, path)


def plots(b):
    """{name: path} of the plots made; a plot that cannot be made costs the plots, not the report."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        out = {}
        for name, draw in (("per-step", plot_per_step), ("decode", plot_decode_bars), ("kv-cache", plot_kv_cache)):
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
    md += kv_section(b, cks, pngs)
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
    steps = [["impl", "variant", "mode", "step", "phase", "pos", "n_tokens", "token", "ms"]]
    for ck in cks:
        for impl in ("c", "pytorch"):
            for mode in MODES:
                r = representative(ck.runs[(impl, mode)])
                for x in r["rows"] if r else ():
                    steps.append([impl, ck.info["variant"], mode, x["step"], x["phase"], x["pos"], x["n_tokens"],
                                  x["token"], f"{x['ms']:.4f}"])
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
                flops, nbytes = decode_cost_kv(c, x["pos"])
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
    return md


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
    return args


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
             mem=mem_total(), l2=cache_line("L2"), l3=cache_line("L3"),
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
