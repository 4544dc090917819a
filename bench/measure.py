"""Measuring the C engine: what each checkpoint has measured so far (Checkpoint, Bench), the
latency runs in rounds, the batched-decoding runs, the capacity runs, and measure(), which
runs every part in turn."""
import math
import os

from bench.common import (BATCH_CONFIGS, BenchError, MAX_BATCH, MODES, MODE_LABEL, ORDER, PROMPT, batch_reps,
                          cell_mode, cell_stats, kind_values, label, log, log_rep, median, rel, summarize_run, warn)
from bench.engine import check_kv, engine_info, engine_json, parse_step_log, pool_of, run_engine
from bench.machine import cpu_numbers, machine_slug
from bench.pytorch_ref import pytorch_part
from bench.roofline import roofline, ws_probe_part


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
        self.pool = {}           # kind of batch run -> engine.pool_of
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
    """Each kind's pool figures, from ./run --info --kv --batch 1 --json with its flags."""
    for kind, flags, _, _ in BATCH_CONFIGS:
        ck.pool[kind] = pool_of(ck.info["checkpoint"], ["--batch", 1] + list(flags), "--info --kv")


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
    the pool's preemptions keep the rest waiting. The engine's block count is that of --info
    --json under the run's flags (the run's own summary does not give it)."""
    info, pool = ck.info, ck.pool[kind]
    ctx = info["context"]
    fits, blocks, per_seq = capacity_formula(pool, ctx, mib)
    out = {"formula": fits, "blocks": blocks, "per_seq": per_seq}
    if not 1 <= fits <= MAX_BATCH:
        return out   # the engine refuses a pool short of one sequence, and runs at most MAX_BATCH
    n = min(MAX_BATCH, fits + 2)
    what = f"capacity run ({mib:g} MiB, {n} sequences)"
    path = os.path.join(b.tmpdir, f"c-{info['variant']}-capacity-{mib:g}{'-' + kind if kind else ''}.csv")
    pool_flags = ["--batch", n, "--kv-mem", f"{mib:g}"] + list(flags)
    summary = engine_json([info["checkpoint"], "-p", PROMPT, "--kv", "-k", 40, "-s", 0, "--ignore-eos", "-q", "--log",
                           path, "--threads", b.args.threads] + pool_flags, what, "summary")[-1]
    engine_pool = {"preemptions": summary["preemptions"],
                   "n_blocks": pool_of(info["checkpoint"], pool_flags, what)["n_blocks"]}
    rows = parse_step_log(path)
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
    m["slug"] = f"{machine_slug(m['cpu'], m['cores'], args.threads, cpu_numbers())}-{ok[0].info['kernels']}"
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
