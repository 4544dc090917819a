#!/usr/bin/env python3
"""bench/bench.py: the latency tables of the KV-cache post, for the C engine and for the
PyTorch reference, with a roofline analysis and the --check-kv determinism table.

    /usr/bin/python3 bench/bench.py [CHECKPOINT ...] [--threads N] [--reps R] [--pt-reps R] [--out DIR]

`make bench` runs it (bench/bench.mk; the knobs are BENCH_CHECKPOINTS, BENCH_THREADS,
BENCH_REPS, BENCH_PT_REPS, BENCH_OUT, BENCH_FLAGS). bench/README.md explains every number.

Every checkpoint generates from "Once upon a time" to the full context, greedily (-k 1),
ignoring EOS, so every run does the same work: once without and once with the KV cache,
one untimed warm-up run and then --reps timed runs each; the tables report medians over
the timed runs. The PyTorch reference (train/model.py, eager) runs the same generation in
this process. Results go to DIR/<machine>.md, DIR/<machine>.csv, DIR/<machine>-steps.csv
and two plots, where <machine> is e.g. amd-epyc-2c-2t-avx512 (CPU model, physical cores,
threads used, the engine's kernels).

The engine is ./run, or $RUN_BINARY when set (tests/test_bench.py under make test-asan).
Nothing is ever estimated in place of a measurement: with no checkpoint the script says so
and exits 1; a failing run stops the bench with the engine's message.
"""
import argparse
import csv
import datetime
import glob
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.environ.get("RUN_BINARY") or os.path.join(ROOT, "run")   # make test-asan: the ASan build
ROOFLINE = os.path.join(ROOT, "build", "roofline")
PROMPT = "Once upon a time"
ORDER = ["mha", "gqa", "mqa", "mla64", "mla128"]
PT_TOLERANCE = 1e-4        # max |logit difference| allowed for the oneDNN Linear path
TARGET_KV_MHA_MS = 0.45    # issue 9 targets
TARGET_NOKV_MS = 12.0
TARGET_PREFILL_MS = 1.0
TARGET_SPEEDUP_KV = 10.0
TARGET_SPEEDUP_NOKV = 3.0


class BenchError(Exception):
    pass


def rel(path):
    r = os.path.relpath(path, ROOT)
    return path if r.startswith("..") else r


def log(msg):
    print(msg, flush=True)


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


# ---------------------------------------------------------------- the engine

def run_engine(args, what):
    p = subprocess.run([RUN] + [str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise BenchError(f"{what}: ./run {' '.join(shlex.quote(str(a)) for a in args)} exited {p.returncode}:\n"
                         f"{p.stderr.strip()[-2000:]}")
    return p


def engine_info(ckpt):
    """Configuration, parameter count and KV bytes/token from ./run CKPT --info."""
    out = run_engine([ckpt, "--info"], f"{ckpt} --info").stdout
    info = {"checkpoint": ckpt, "info_text": out}
    m = re.search(r"^variant\s+(\S+)", out, re.M)
    info["variant"] = m.group(1)
    info["dtype"] = re.search(r"^dtype\s+(\S+)", out, re.M).group(1)
    m = re.search(r"dim (\d+), layers (\d+), heads (\d+) x (\d+), kv heads (\d+), latent (\d+), rope dim (\d+), "
                  r"hidden (\d+), vocab (\d+), context (\d+)", out)
    if not m:
        raise BenchError(f"{ckpt}: cannot parse the configuration line of --info:\n{out}")
    keys = ["dim", "layers", "heads", "head_dim", "kv_heads", "latent", "rope_dim", "hidden", "vocab", "context"]
    info.update(zip(keys, map(int, m.groups())))
    info["is_mla"] = info["latent"] > 0
    m = re.search(r"^parameters\s+(\d+) .*?, (\d+) bytes of weights", out, re.M)
    info["params"], info["weight_bytes"] = int(m.group(1)), int(m.group(2))
    info["kv_bytes_per_token"] = int(re.search(r"= (\d+) bytes/token", out).group(1))
    m = re.search(r"^kernels\s+(\S+)", out, re.M)
    info["kernels"] = m.group(1) if m else "?"
    return info


def read_step_log(path):
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            rows.append({"step": int(r["step"]), "phase": r["phase"], "pos": int(r["pos"]),
                         "n_tokens": int(r["n_tokens"]), "token": int(r["token"]), "ms": float(r["ms"])})
    return rows


def log_rep(engine, name, mode, rep, reps, s):
    """One progress line per run; rep 0 is the warm-up."""
    label = "warm-up" if rep == 0 else f"run {rep}/{reps}"
    log(f"  [{engine}] {name:6s} {mode:5s} {label:9s} prefill {s['prefill_ms']:8.3f} ms | "
        f"decode {s['gen_ms']:8.3f} ms/token")


def summarize_run(rows, expect_decode, what):
    pre = [r for r in rows if r["phase"] == "prefill"]
    dec = [r for r in rows if r["phase"] == "decode"]
    if len(pre) != 1 or len(dec) != expect_decode:
        raise BenchError(f"{what}: the step log has {len(pre)} prefill and {len(dec)} decode rows, "
                         f"expected 1 and {expect_decode}")
    dec_ms = [r["ms"] for r in dec]
    return {"prefill_ms": pre[0]["ms"], "gen_ms": sum(dec_ms) / len(dec_ms) if dec_ms else float("nan"),
            "total_ms": pre[0]["ms"] + sum(dec_ms), "rows": rows, "prompt_tokens": pre[0]["n_tokens"],
            "tokens": [r["token"] for r in pre + dec]}


def c_run(info, kv, args, tmpdir, n_steps, rep):
    """One run of the engine (rep 0 is the warm-up); returns its summary."""
    name = info["variant"]
    mode = "kv" if kv else "no-kv"
    path = os.path.join(tmpdir, f"c-{name}-{mode}-{rep}.csv")
    cmd = [info["checkpoint"], "-p", PROMPT, "-n", n_steps, "-k", 1, "-s", 0, "--ignore-eos", "-q",
           "--log", path, "--threads", args.threads] + (["--kv"] if kv else [])
    run_engine(cmd, f"{name} {mode}")
    rows = read_step_log(path)
    n_prompt = rows[0]["n_tokens"]
    expect = min(n_steps - 1, info["context"] - n_prompt)
    s = summarize_run(rows, expect, f"{name} {mode}")
    log_rep("C", name, mode, rep, args.reps, s)
    return s


def c_rounds(infos, args, tmpdir, steps_of):
    """The engine's runs in rounds: one warm-up round, then args.reps timed rounds, each
    one run of every checkpoint and mode in turn. A VM's speed can drift by 10-30% for
    minutes at a time (other tenants on the same cores); in rounds a slow minute lands on
    one run of every cell instead of on every run of one cell. Returns the timed runs per
    (checkpoint, kv)."""
    cells = [(i, info, kv) for i, info in enumerate(infos) for kv in (False, True)]
    runs = {(i, kv): [] for i, _, kv in cells}
    for rep in range(args.reps + 1):
        log(f"bench: C engine, {'warm-up round' if rep == 0 else f'round {rep}/{args.reps}'}")
        for i, info, kv in cells:
            s = c_run(info, kv, args, tmpdir, steps_of(info), rep)
            if rep:
                runs[(i, kv)].append(s)
    for i, info, kv in cells:
        if len({tuple(r["tokens"]) for r in runs[(i, kv)]}) != 1:
            raise BenchError(f"{info['variant']} {'kv' if kv else 'no-kv'}: greedy runs generated different "
                             "tokens from run to run")
    return runs


def representative(runs):
    """The run whose total time is the median one (the lower middle for an even count)."""
    order = sorted(range(len(runs)), key=lambda i: runs[i]["total_ms"])
    return runs[order[(len(runs) - 1) // 2]]


def cell_stats(runs):
    out = {}
    for key in ("prefill_ms", "gen_ms"):
        v = [r[key] for r in runs]
        out[key] = {"median": median(v), "min": min(v), "max": max(v), "n": len(v)}
    return out


def check_kv(info, args, n_steps):
    cmd = [info["checkpoint"], "--check-kv", "--ignore-eos", "-p", PROMPT, "--threads", args.threads]
    if n_steps < info["context"]:
        cmd += ["-n", n_steps]
    out = run_engine(cmd, f"{info['variant']} --check-kv").stdout
    lines = []
    for line in out.splitlines():
        if line.startswith("check-kv "):
            lines.append(dict(kv.split("=", 1) for kv in line[len("check-kv "):].split()))
    if not lines:
        raise BenchError(f"{info['variant']}: --check-kv printed no check-kv line:\n{out[-1000:]}")
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
        raise BenchError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()}")
    vals = {}
    for line in p.stdout.splitlines():
        k, _, v = line.partition(" ")
        vals[k] = v.strip()
    return vals


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
        """The tied head as Transformer.forward computes it (F.linear on all T positions)."""
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
                ts.append(time.perf_counter() - t0)
        return median(ts) * 1e3

    def runs(self, model, prompt, n_total, kv, reps, variant, tag=""):
        mode = "kv" if kv else "no-kv"
        out = []
        expect = n_total - len(prompt)
        for rep in range(reps + 1):
            rows = self.timed_generate(model, prompt, n_total, kv)
            s = summarize_run(rows, expect, f"PyTorch {variant} {mode}")
            log_rep(f"PyTorch{tag}", variant, mode, rep, reps, s)
            if rep:
                out.append(s)
        return out


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


CELLS = [("no-kv", "prefill_ms", "Prefill (no KV), ms"), ("no-kv", "gen_ms", "Avg. Gen (no KV), ms"),
         ("kv", "prefill_ms", "Prefill (KV), ms"), ("kv", "gen_ms", "Avg. Gen (KV), ms")]


def latency_table(results, impl):
    rows = []
    for r in results:
        cells = []
        for mode, key, _ in CELLS:
            st = r.get(impl, {}).get(mode)
            cells.append(fmt(st["stats"][key]["median"]) if st else "—")
        rows.append([label(r["info"])] + cells + [f"{r['info']['kv_bytes_per_token']:,}"])
    return md_table(["Attention Mechanism"] + [c[2] for c in CELLS] + ["KV cache, bytes/token"], rows)


def ratio(results, r, mode, key):
    c, p = r.get("c", {}).get(mode), r.get("pytorch", {}).get(mode)
    if not c or not p:
        return None
    return c["stats"][key]["median"] / p["stats"][key]["median"]


def margin_text(measured, target, lower_is_better=True, unit=""):
    if measured is None:
        return "not measured", "—"
    if lower_is_better:
        ok = measured <= target
        diff = target - measured if ok else measured - target
        rel = diff / target * 100
        return ("met" if ok else "MISSED"), (f"{fmt(diff)}{unit} under ({rel:.0f}% below the target)" if ok else
                                              f"{fmt(diff)}{unit} over ({measured / target:.2f}x the target)")
    ok = measured >= target
    return ("met" if ok else "MISSED"), (f"{measured / target:.2f}x the target" if ok else
                                         f"needs {target / measured:.2f}x more speed-up to reach it")


def plot(results, slug, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    mha = next((r for r in results if r["info"]["variant"] == "mha"), None)
    def per_step_plot(series, title, name):
        """series: (label, rows of one run); plots decode latency against position."""
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for lab, rows in series:
            dec = [x for x in rows if x["phase"] == "decode"]
            ax.plot([x["pos"] for x in dec], [x["ms"] for x in dec], lw=1, label=lab)
        ax.set_xlabel("position of the decoded token")
        ax.set_ylabel("step latency, ms")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        p = os.path.join(out_dir, f"{slug}-{name}.png")
        fig.tight_layout()
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)

    if mha:
        per_step_plot([(f"{'without' if mode == 'no-kv' else 'with'} KV cache", mha["c"][mode]["representative"]["rows"])
                       for mode in ("no-kv", "kv")],
                      f"C engine, MHA: per-step decode latency ({slug}; median-total run)", "mha-per-step")
    per_step_plot([(label(r["info"]), r["c"]["kv"]["representative"]["rows"]) for r in results],
                  f"C engine with the KV cache: per-step decode latency ({slug})", "kv-per-step")
    return paths


def write_report(ctx):
    args, results, mach, roof = ctx["args"], ctx["results"], ctx["machine"], ctx["roofline"]
    slug, out_dir = mach["slug"], args.out
    csv_rows = []   # section, variant, mode, quantity, value, unit

    def add(section, variant, mode, quantity, value, unit):
        csv_rows.append([section, variant, mode, quantity, "" if value is None else value, unit])

    md = [f"# Latency benchmark: {slug}", ""]
    if args.steps:
        md += [f"> **TEST RUN, NOT A BENCHMARK**: generation was cut to {args.steps} steps (`--steps`); "
               "these numbers are not comparable with the post's tables.", ""]
    pre, during = mach.get("bg_before"), mach.get("bg_during")
    if (pre and pre["other_frac"] > 0.1) or (during and during["other_frac"] > 0.05):
        md += [f"> **The machine was not idle**: other processes kept "
               f"{pre['other_frac'] * 100 if pre else float('nan'):.0f}% of one CPU busy just before the bench "
               f"and {during['other_frac'] * 100 if during else float('nan'):.0f}% on average during it. "
               "Timings are disturbed.", ""]
    r0 = results[0]
    n_prompt = r0["c"]["kv"]["representative"]["prompt_tokens"]
    n_dec = len([x for x in r0["c"]["kv"]["representative"]["rows"] if x["phase"] == "decode"])
    md += ["## Machine", "", md_table(["", ""], [
        ["CPU", mach["cpu"] + (f" ({mach['cpu_detail']})" if mach["cpu_detail"] else "")],
        ["cores", f"{mach['cores']} physical, {mach['logical']} logical CPUs"],
        ["threads used", f"{args.threads} (engine `--threads`, `torch.set_num_threads`, roofline probe); "
                         f"OMP_PROC_BIND={os.environ.get('OMP_PROC_BIND', '')}, OMP_PLACES={os.environ.get('OMP_PLACES', '')}"],
        ["caches", f"L2 {mach['l2']}; L3 {mach['l3']}"],
        ["memory", f"{mach['mem'] / 2**30:.1f} GiB" if mach["mem"] else "?"],
        ["compiler", mach["compiler"]],
        ["engine", f"git {mach['git']}; kernels {r0['info']['kernels']}"],
        ["PyTorch", mach.get("torch", "not run (--skip-pytorch)")],
        ["date", mach["date"]],
        ["other load", (f"load average {mach['load_start']:.2f} at the start; other processes used "
                        + (f"{pre['other_frac'] * 100:.0f}% of one CPU in the {pre['wall_s']:.0f} s before the bench"
                           if pre else "?")
                        + (f" and {during['other_cpu_s']:.1f} CPU-seconds during its {during['wall_s']:.0f} s "
                           f"({during['other_frac'] * 100:.1f}% of one CPU); hypervisor steal {during['steal_s']:.1f} s"
                           if during else ""))],
    ], ["---", "---"]), ""]
    md += ["## Method", "",
           f"Prompt \"{PROMPT}\" ({n_prompt} tokens with BOS), greedy (`-k 1`), EOS ignored, generated to "
           f"the full {r0['info']['context']}-token context"
           + (f" (cut to {args.steps} steps)" if args.steps else "")
           + f": one prefill of {n_prompt} tokens, then {n_dec} decode steps, each timed on its own. "
           f"Per run: the prefill ms, and Avg. Gen = the mean ms of the decode steps. Each checkpoint and mode: "
           f"1 untimed warm-up run, then {args.reps} timed runs (C) / {args.pt_reps} (PyTorch); every cell is "
           "the median over the timed runs. The C runs go in rounds: a warm-up round, then each timed round one "
           "run of every checkpoint and mode in turn, so a minute in which the machine runs slow (other tenants "
           "of a VM) lands on one run of every cell rather than on all the runs of one. Within each C run, `./run` itself does one untimed forward of the "
           "prompt before the timed prefill (its `[warm-up]` line), as llama.cpp does after loading: a "
           "process's first forward runs cold, 2-3 ms slower than the same forward again; PyTorch's runs happen in "
           "one warm process. MLA uses the absorbed form with the cache and the expanded form "
           "without (the engine's and train/model.py's default). Checkpoints: "
           + ", ".join(f"`{rel(r['info']['checkpoint'])}`" for r in results) + ".", ""]

    # ---- C
    md += ["## C engine", "", latency_table(results, "c"), ""]
    worst = None
    for r in results:
        v = r["info"]["variant"]
        add("info", v, "", "params", r["info"]["params"], "")
        add("info", v, "", "weight_bytes", r["info"]["weight_bytes"], "bytes")
        add("info", v, "", "kv_bytes_per_token", r["info"]["kv_bytes_per_token"], "bytes")
        for impl in ("c", "pytorch"):
            for mode in ("no-kv", "kv"):
                st = r.get(impl, {}).get(mode)
                if not st:
                    continue
                for key in ("prefill_ms", "gen_ms"):
                    s = st["stats"][key]
                    q = "prefill" if key == "prefill_ms" else "avg_gen"
                    add(impl, v, mode, f"{q}_median", f"{s['median']:.4f}", "ms")
                    add(impl, v, mode, f"{q}_min", f"{s['min']:.4f}", "ms")
                    add(impl, v, mode, f"{q}_max", f"{s['max']:.4f}", "ms")
                    add(impl, v, mode, f"{q}_runs", s["n"], "")
                    if impl == "c":
                        spread = (s["max"] - s["min"]) / s["median"] if s["median"] else 0
                        if worst is None or spread > worst[0]:
                            worst = (spread, label(r["info"]), f"{q.replace('_', ' ')} ({mode})")
    if worst:
        md += [f"Run-to-run spread, (max - min) / median over the {args.reps} timed runs: worst cell "
               f"{worst[0] * 100:.1f}% ({worst[1]}, {worst[2]}). Per-run minima and maxima are in `{slug}.csv`.", ""]

    # ---- PyTorch
    have_pt = any("pytorch" in r for r in results)
    md += ["## PyTorch reference (train/model.py, eager)", ""]
    if have_pt:
        md += [latency_table(results, "pytorch"), ""]
        prow, whys = [], []
        for r in results:
            ch = r["pt_choice"]
            est = ch["est_eager_s"]
            prow.append([label(r["info"]), ch["path"]["no-kv"], ch["path"]["kv"],
                         f"{est['no-kv']:.0f} / {est['kv']:.0f}",
                         f"{ch['max_logit_diff']:.1e}" if "max_logit_diff" in ch else "not tried",
                         fmt(r.get("pt_head_ms")), r.get("pt_agree", "—")])
            whys.append(f"{label(r['info'])}: without the cache, {ch['why']['no-kv']}; with it, {ch['why']['kv']}.")
            for m in ("no-kv", "kv"):
                add("pytorch_path", r["info"]["variant"], m, "path", ch["path"][m], "")
                add("pytorch_path", r["info"]["variant"], m, "plain_eager_run_estimate", f"{est[m]:.1f}", "s")
            if "max_logit_diff" in ch:
                add("pytorch_path", r["info"]["variant"], "", "onednn_max_abs_logit_diff", f"{ch['max_logit_diff']:.3g}", "")
        md += ["Which PyTorch path each column timed. `eager` is `Transformer.forward` exactly as written "
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
               "positions on the BLAS: its time at the average uncached T is shown. 'C tokens agree' "
               "counts the greedy tokens PyTorch generated identically to the engine before the first "
               "difference (fp32 rounding orders differ).", "",
               md_table(["Attention Mechanism", "path (no KV)", "path (KV)", "plain eager run, est. s (no KV / KV)",
                         "oneDNN max logit diff vs eager", "tied head at avg T, ms", "C tokens agree (no KV / KV)"],
                        prow, ["---", "---", "---", "---:", "---:", "---:", "---:"]), ""]
        md += ["- " + w for w in whys] + [""]
        # ---- ratios
        rows = []
        for r in results:
            cells = []
            for mode, key, _ in CELLS:
                x = ratio(results, r, mode, key)
                cells.append("—" if x is None else f"{x:.3f} ({1 / x:.1f}x)")
                if x is not None:
                    add("ratio_c_over_pytorch", r["info"]["variant"], mode,
                        "prefill" if key == "prefill_ms" else "avg_gen", f"{x:.5f}", "")
            rows.append([label(r["info"])] + cells)
        md += ["## C / PyTorch", "", "C median / PyTorch median per cell (below 1: C is faster); in brackets "
               "the speed-up, PyTorch / C.", "",
               md_table(["Attention Mechanism"] + [c[2].replace(", ms", "") for c in CELLS], rows), ""]
    else:
        md += ["Not measured (`--skip-pytorch`).", ""]

    # ---- roofline
    bw = float(roof["bandwidth_best_GBps"]) * 1e9
    peak = float(roof["peak_best_GFLOPs"]) * 1e9
    bal = peak / bw
    ws = ctx["roofline_ws"]
    ws_bw = float(ws["bandwidth_best_GBps"]) * 1e9
    md += ["## Roofline", "",
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
           "whose bytes stay in cache between steps need not stream them from DRAM; the last column gives its memory floor at that bandwidth, and that floor as a share of the measured time.", "",
           "Per decode step (the average one of the median runs): bytes = every weight once in the file's dtype "
           "(bf16: parameters x 2; the tied head reads the whole embedding table) plus, with the cache, the "
           "fp32 cache rows of the (position + 1) keys attended to; FLOPs = 2 per weight multiply-accumulate "
           "(all layers' matrices and the 4096 x 512 head; MLA with the cache adds the per-head W_UK,h^T and "
           "W_UV,h products; MLA without it expands W_UK c and W_UV c for every position) plus attention, "
           "per head 2 x key width x keys for the scores and 2 x value width x keys for the weighted sum "
           "(key/value widths: head_dim; MLA absorbed d_c+d_R / d_c; MLA expanded head_dim+d_R / head_dim). "
           "Without the cache a step is the forward of all T tokens (causal attention) with the logits of the "
           "last one, averaged over the steps. Norms, RoPE, softmax and SiLU are left out (well under 1%). "
           "Floors: bytes / bandwidth and FLOPs / peak; the larger is the roofline bound.", ""]
    rows = []
    for r in results:
        c, v = r["info"], r["info"]["variant"]
        for mode in ("kv", "no-kv"):
            rep = r["c"][mode]["representative"]
            dec = [x for x in rep["rows"] if x["phase"] == "decode"]
            if not dec:
                continue
            if mode == "kv":
                costs = [decode_cost_kv(c, x["pos"]) for x in dec]
                where = f"pos {statistics.fmean(x['pos'] for x in dec):.1f}"
            else:
                costs = [decode_cost_nokv(c, x["n_tokens"]) for x in dec]
                where = f"T {statistics.fmean(x['n_tokens'] for x in dec):.1f}"
            flops = statistics.fmean(f for f, _ in costs)
            nbytes = statistics.fmean(b for _, b in costs)
            t = r["c"][mode]["stats"]["gen_ms"]["median"] / 1e3
            mem_floor, cpu_floor = nbytes / bw, flops / peak
            bound = max(mem_floor, cpu_floor)
            ai = flops / nbytes
            rows.append([label(c), "KV" if mode == "kv" else "no KV", where, f"{nbytes / 1e6:.2f}",
                         f"{flops / 1e6:.1f}", f"{ai:.2f}", "memory" if ai < bal else "compute",
                         fmt(t * 1e3), f"{nbytes / t / 1e9:.1f}", f"{flops / t / 1e9:.1f}",
                         fmt(mem_floor * 1e3), fmt(cpu_floor * 1e3), f"{bound / t * 100:.0f}%",
                         f"{fmt(nbytes / ws_bw * 1e3)} ({nbytes / ws_bw / t * 100:.0f}%)"])
            add("roofline", v, mode, "cache_resident_memory_floor_ms", f"{nbytes / ws_bw * 1e3:.6g}", "ms")
            for q, val, unit in (("step_bytes", nbytes, "bytes"), ("step_flops", flops, "FLOP"),
                                 ("arithmetic_intensity", ai, "FLOP/byte"), ("achieved_GBps", nbytes / t / 1e9, "GB/s"),
                                 ("achieved_GFLOPs", flops / t / 1e9, "GFLOP/s"), ("memory_floor_ms", mem_floor * 1e3, "ms"),
                                 ("compute_floor_ms", cpu_floor * 1e3, "ms")):
                add("roofline", v, mode, q, f"{val:.6g}", unit)
    md += [md_table(["Attention Mechanism", "mode", "average step", "MB read", "MFLOP", "FLOP/byte", "bound by",
                     "measured ms", "achieved GB/s", "achieved GFLOP/s", "memory floor ms", "compute floor ms",
                     "bound / measured", "memory floor at working-set bandwidth, ms (/ measured)"],
                    rows, ["---", "---", "---"] + ["---:"] * 11), "",
           f"Machine balance: {bal:.1f} FLOP/byte. A step whose arithmetic intensity is below it is bound by "
           "memory bandwidth, above it by the FMA rate. 'bound / measured' is how close the step comes to the "
           "roofline (100% = at the roofline; above 100% the step ran faster than the DRAM floor allows, so its "
           "bytes came from cache).", ""]
    add("machine", "", "", "bandwidth_GBps", f"{bw / 1e9:.3f}", "GB/s")
    add("machine", "", "", "peak_GFLOPs", f"{peak / 1e9:.3f}", "GFLOP/s")
    add("machine", "", "", "balance", f"{bal:.3f}", "FLOP/byte")
    add("machine", "", "", "bandwidth_working_set_GBps", ws["bandwidth_best_GBps"], "GB/s")
    add("machine", "", "", "bandwidth_working_set_bytes", ws["bandwidth_bytes"], "bytes")

    # ---- determinism
    rows = []
    for r in results:
        for ck in r["check_kv"]:
            rows.append([label(r["info"]), ck["a"], ck["b"], ck["steps"], ck["identical_tokens"],
                         "none" if ck["first_divergent_step"] == "-1" else ck["first_divergent_step"],
                         "yes" if ck["bitwise_identical"] == "1" else
                         f"no (from step {ck['first_bitwise_difference']})", ck["max_abs_logit_diff"]])
            for k in ("steps", "identical_tokens", "first_divergent_step", "bitwise_identical",
                      "first_bitwise_difference", "max_abs_logit_diff"):
                add("check_kv", ck["variant"], f"{ck['a']} vs {ck['b']}", k, ck[k], "")
    md += ["## Determinism: with and without the cache", "",
           f"`./run CKPT --check-kv --ignore-eos -p \"{PROMPT}\" --threads {args.threads}"
           + (f" -n {args.steps}" if args.steps else "") + "`: greedy generation with the cache against "
           "greedy generation without it, the logits of every step compared.", "",
           md_table(["Attention Mechanism", "with cache", "without cache", "steps", "identical tokens",
                     "first divergent step", "logits bitwise identical", "max |logit diff|"], rows,
                    ["---", "---", "---"] + ["---:"] * 5), ""]

    # ---- targets
    rows = []

    def target(name, variant, measured, tgt, unit, lower=True):
        status, how = margin_text(measured, tgt, lower, unit)
        rows.append([name, variant, "—" if measured is None else f"{fmt(measured)}{unit}",
                     f"{'≤' if lower else '≥'} {fmt(tgt)}{unit}", f"**{status}**", how])
        add("target", variant, name, "status", status, "")
        if measured is not None:
            add("target", variant, name, "measured", f"{measured:.5g}", unit.strip())

    for r in results:
        if r["info"]["variant"] == "mha":
            target("Avg. Gen (KV)", "MHA", r["c"]["kv"]["stats"]["gen_ms"]["median"], TARGET_KV_MHA_MS, " ms")
    for r in results:
        target("Avg. Gen (no KV)", label(r["info"]), r["c"]["no-kv"]["stats"]["gen_ms"]["median"], TARGET_NOKV_MS,
               " ms")
    for r in results:
        for mode in ("no-kv", "kv"):
            target(f"Prefill ({'KV' if mode == 'kv' else 'no KV'})", label(r["info"]),
                   r["c"][mode]["stats"]["prefill_ms"]["median"], TARGET_PREFILL_MS, " ms")
    for r in results:
        for mode, tgt in (("kv", TARGET_SPEEDUP_KV), ("no-kv", TARGET_SPEEDUP_NOKV)):
            x = ratio(results, r, mode, "gen_ms")
            target(f"C speed-up over PyTorch, Avg. Gen ({'KV' if mode == 'kv' else 'no KV'})", label(r["info"]),
                   None if x is None else 1 / x, tgt, "x", lower=False)
    md += ["## Targets (issue 9)", "",
           "The C engine's medians. The speed-up targets compare Avg. Gen (PyTorch / C); the prefill "
           "speed-ups are in the ratio table.", "",
           md_table(["target", "variant", "measured", "target", "status", "margin"], rows,
                    ["---", "---", "---:", "---:", "---", "---"]), ""]

    # ---- plots
    pngs = plot(results, slug, out_dir)
    md += ["## Per-step latency", "",
           "The C engine's median-total run of each mode (prefill left out). Every step of those runs is in "
           f"`{slug}-steps.csv`.", ""]
    md += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs] + [""]

    with open(os.path.join(out_dir, f"{slug}.md"), "w") as f:
        f.write("\n".join(md))
    with open(os.path.join(out_dir, f"{slug}.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["section", "variant", "mode", "quantity", "value", "unit"])
        w.writerows(csv_rows)
    with open(os.path.join(out_dir, f"{slug}-steps.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["impl", "variant", "mode", "step", "phase", "pos", "n_tokens", "token", "ms"])
        for r in results:
            for impl in ("c", "pytorch"):
                for mode in ("no-kv", "kv"):
                    st = r.get(impl, {}).get(mode)
                    if st:
                        for x in st["representative"]["rows"]:
                            w.writerow([impl, r["info"]["variant"], mode, x["step"], x["phase"], x["pos"],
                                        x["n_tokens"], x["token"], f"{x['ms']:.4f}"])
    return [os.path.join(out_dir, f"{slug}.md"), os.path.join(out_dir, f"{slug}.csv"),
            os.path.join(out_dir, f"{slug}-steps.csv")] + pngs


# ---------------------------------------------------------------- main

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="*", help="engine checkpoints (default: every weights/*.bin)")
    ap.add_argument("--threads", type=int, default=logical_cpus(), help="threads (default: all cores, %(default)s)")
    ap.add_argument("--reps", type=int, default=5, help="timed C runs per checkpoint and mode (default 5)")
    ap.add_argument("--pt-reps", type=int, default=3, help="timed PyTorch runs per checkpoint and mode (default 3)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"), help="output directory")
    ap.add_argument("--pt-path", choices=["auto", "eager", "mkldnn"], default="auto",
                    help="PyTorch path per mode: auto (plain eager, unless a run of that mode would take over "
                         "--pt-budget seconds: then oneDNN Linear layers if their logits match and they are "
                         "faster), eager, or mkldnn (default auto)")
    ap.add_argument("--pt-budget", type=float, default=120.0,
                    help="seconds a plain eager PyTorch run may take before auto switches (default 120)")
    ap.add_argument("--skip-pytorch", action="store_true", help="measure the C engine only")
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"), help="the compiler, for the report")
    # for testing the script itself: shorter runs (the report is marked as a test run)
    ap.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--roofline-mib", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--roofline-reps", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("threads", "reps", "pt_reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.steps and args.steps < 2:
        ap.error("--steps must be at least 2 (a prefill and one decode step)")
    return args


# OpenMP threads pinned one per core, for the engine, the roofline probe and PyTorch (set
# before torch loads libgomp). Unpinned, a thread woken from sleep can land on the CPU of
# the thread that woke it: on this project's 2-core VM, 5 of 12 two-thread prefills then
# took 9-23 ms instead of 1.6-1.9 ms; pinned, 12 of 12 took 1.6-2.1 ms. A user's own
# OMP_PROC_BIND / OMP_PLACES win.
PINNING = {"OMP_PROC_BIND": "true", "OMP_PLACES": "cores"}


def main(argv=None):
    args = parse_args(argv)
    for k, v in PINNING.items():
        os.environ.setdefault(k, v)
    args.out = os.path.abspath(args.out)
    if args.checkpoints:
        ckpts = args.checkpoints
        missing = [c for c in ckpts if not os.path.isfile(c)]
        if missing:
            print(f"bench: no such checkpoint: {', '.join(missing)}", file=sys.stderr)
            return 1
    else:
        ckpts = sorted(glob.glob(os.path.join(ROOT, "weights", "*.bin")))
        if not ckpts:
            print("bench: weights/ holds no checkpoint (*.bin), so there is nothing to measure; "
                  "train and export one first (weights/README.md), or name checkpoints: "
                  "make bench BENCH_CHECKPOINTS=\"path/a.bin ...\"", file=sys.stderr)
            return 1
    for exe in (RUN, ROOFLINE):
        if not os.access(exe, os.X_OK):
            print(f"bench: {os.path.relpath(exe, ROOT)} is not built (make run build/roofline)", file=sys.stderr)
            return 1
    try:
        return bench(args, [os.path.abspath(c) for c in ckpts])
    except BenchError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1


def bench(args, ckpts):
    t_start = time.time()
    load_start = os.getloadavg()[0]
    cpu = cpu_model()
    cores = physical_cores()
    mach = {"cpu": cpu, "cpu_detail": cpu_detail(), "cores": cores, "logical": logical_cpus(),
            "mem": mem_total(),
            "l2": cache_line("L2"), "l3": cache_line("L3"),
            "compiler": (sh([args.cc, "--version"]).splitlines() or ["?"])[0], "git": git_describe(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "load_start": load_start}
    bg = Background()
    time.sleep(2.0)
    mach["bg_before"] = bg.since()
    busy = mach["bg_before"]["other_frac"] if mach["bg_before"] else 0.0
    log(f"bench: {cpu}, {cores} cores, {args.threads} threads; load average {load_start:.2f}; "
        f"other processes busy {busy * 100:.0f}% of one CPU")
    if busy > 0.1:
        log(f"bench: WARNING: other processes keep {busy * 100:.0f}% of one CPU busy: timings will be disturbed")
    bg = Background()

    infos = [engine_info(c) for c in ckpts]
    seen = {}
    for i in infos:
        if i["variant"] in seen:
            raise BenchError(f"two checkpoints of variant {i['variant']}: {seen[i['variant']]} and {i['checkpoint']}")
        seen[i["variant"]] = i["checkpoint"]
    infos.sort(key=lambda i: (ORDER.index(i["variant"]) if i["variant"] in ORDER else len(ORDER), i["variant"]))
    # the same CPU model can come with or without AVX-512 (virtual machines mask it), so the
    # engine's kernels are part of the name
    mach["slug"] = f"{machine_slug(cpu, cores, args.threads)}-{infos[0]['kernels']}"
    os.makedirs(args.out, exist_ok=True)
    tmpdir = os.path.join(args.out, "tmp", mach["slug"])
    os.makedirs(tmpdir, exist_ok=True)

    log("bench: roofline probe")
    roof = roofline(args, mib=args.roofline_mib, reps=args.roofline_reps)
    log(f"  bandwidth {float(roof['bandwidth_best_GBps']):.1f} GB/s, peak {float(roof['peak_best_GFLOPs']):.1f} "
        f"GFLOP/s ({roof['roofline_simd']})")
    biggest = max(i["weight_bytes"] + i["context"] * i["kv_bytes_per_token"] for i in infos)
    ws = roofline(args, mib=max(1, math.ceil(biggest / 2**20)), no_peak=True, reps=50)
    log(f"  bandwidth over {ws['bandwidth_bytes']} bytes (a decode step's working set): "
        f"{float(ws['bandwidth_best_GBps']):.1f} GB/s")

    def steps_of(info):
        return min(args.steps, info["context"]) if args.steps else info["context"]

    c_all = c_rounds(infos, args, tmpdir, steps_of)
    results = []
    for i, info in enumerate(infos):
        r = {"info": info, "c": {}, "n_steps": steps_of(info)}
        for kv in (False, True):
            runs = c_all[(i, kv)]
            r["c"]["kv" if kv else "no-kv"] = {"runs": runs, "stats": cell_stats(runs),
                                              "representative": representative(runs)}
        results.append(r)
    for r in results:
        log(f"bench: --check-kv, {r['info']['variant']}")
        r["check_kv"] = check_kv(r["info"], args, r["n_steps"])

    if not args.skip_pytorch:
        pt = PyTorchBench(args.threads)
        mach["torch"] = (f"torch {pt.torch.__version__}, {pt.threads} thread{'s' if pt.threads > 1 else ''}, "
                         f"fp32 products on {blas_in_use()}; "
                         "path per mode and checkpoint below")
        for r in results:
            info = r["info"]
            v = info["variant"]
            log(f"bench: PyTorch, {v}")
            model, prompt = pt.load(info["checkpoint"])
            c_rep = r["c"]["kv"]["representative"]
            if len(prompt) != c_rep["prompt_tokens"]:
                raise BenchError(f"{v}: PyTorch's prompt is {len(prompt)} tokens, the engine's "
                                 f"{c_rep['prompt_tokens']}")
            n_total = min(info["context"], len(prompt) + r["n_steps"] - 1)
            # the engine's greedy sequence: the tokens every timed run feeds back
            seq = (prompt + c_rep["tokens"])[:n_total]
            paths, choice = pt.choose_paths(model, prompt, seq, n_total, args, v)
            r["pt_choice"] = choice
            r["pytorch"] = {}
            agree = []
            for kv in (False, True):
                mode = "kv" if kv else "no-kv"
                tag = " oneDNN" if choice["path"][mode] != "eager" else ""
                runs = pt.runs(paths[mode], prompt, n_total, kv, args.pt_reps, v, tag=tag)
                r["pytorch"][mode] = {"runs": runs, "stats": cell_stats(runs), "representative": representative(runs)}
                agree.append(common_prefix(runs[0]["tokens"], r["c"][mode]["representative"]["tokens"]))
            r["pt_agree"] = " / ".join(map(str, agree))
            avg_T = round(statistics.fmean(x["n_tokens"] for x in r["c"]["no-kv"]["representative"]["rows"]
                                           if x["phase"] == "decode") or len(prompt))
            r["pt_head_ms"] = pt.head_ms(model, avg_T)
            del model, paths

    mach["bg_during"] = bg.since()
    files = write_report({"args": args, "results": results, "machine": mach, "roofline": roof, "roofline_ws": ws})
    log(f"bench: done in {time.time() - t_start:.0f} s; wrote " + ", ".join(rel(p) for p in files))
    print(open(files[0]).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
