#!/usr/bin/env python3
"""bench/scale.py: the posts' claim at their scale. One ~1B shape (tinyllama-1.1b) in its MHA,
GQA, MQA and MLA twins, generated weights (--shape), bf16 cache; the cached decode step at
contexts 512 to 32k reached through --fill (no prefill), at batch 1 and at a larger batch where
the cache fits in memory. For each cell: the median step over the timed runs, the bytes it reads
(the weights once, every sequence's cache once), its FLOPs, the floor (bytes / the bandwidth,
FLOPs / the peak, each the better of build/roofline's probes before and after the runs) and the
share of it reached, the same for the floor of the matmuls and attention in turn; and for each
variant the context where the cache's bytes pass the weights' (by the formula, and measured: the
intercept over the slope of the step time against the context).

    /usr/bin/python3 bench/scale.py [--threads N] [--reps R] [--contexts 512,2048,8192,32768]
                                    [--batch 4] [--steps 8] [--out DIR]

`make bench` runs it after the latency tables (bench/bench.mk: BENCH_SCALE=0 leaves it out);
`make bench-scale` runs it alone. Writes DIR/<machine>-scale.md, .csv and .png."""
import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.common import BenchError, ROOT, log, rel
from bench.engine import engine_json
from bench.machine import logical_cpus, machine_name_for_scale, mem_available
from bench.roofline import phases_bound

SHAPE = "tinyllama-1.1b"
VARIANTS = ("MHA", "GQA", "MQA", "MLA")
CONTEXTS = (512, 2048, 8192, 32768)
BATCH, STEPS, REPS = 4, 8, 3
SEED = 1


def twins(shape):
    """(name, --shape spec) of the shape's MHA, GQA (the shape itself), MQA and MLA twins: every
    query head its own KV head, one KV head, or a latent of 4 heads' width."""
    base = info(shape, 1024, 1)
    return (("MHA", f"{shape},kv_heads={base['heads']}"), ("GQA", shape), ("MQA", f"{shape},kv_heads=1"),
            ("MLA", f"{shape},latent={4 * base['head_dim']}"))


def info(shape, ctx, batch):
    """./run --info for the shape: parameters, weight bytes, cache bytes a token (bf16)."""
    return engine_json(["--shape", shape, "-c", ctx, "--info", "--kv", "--kv-dtype", "bf16", "--batch", batch],
                       f"--info of {shape}", "info")[-1]


def step_ms(shape, ctx, fill, batch, steps, threads):
    """The median decode step of one run: `batch` sequences at position `fill` on."""
    out = engine_json(["--shape", shape, "-c", ctx, "--kv", "--kv-dtype", "bf16", "--fill", fill, "-n", steps,
                       "-k", "1", "--ignore-eos", "--batch", batch, "--threads", threads, "-s", SEED, "-q"],
                      f"{shape} at {fill}", "summary")[-1]
    return out["step_ms_median"], out.get("disturbed", False)


def attention_flops(c, positions):
    """Multiply-adds of the attention at these positions, x2: scores and the weighted sum."""
    if c.get("kv_latent"):
        width = c["kv_latent"] + c["rope_dim"]
        per_key = c["heads"] * (width + c["kv_latent"])
    else:
        per_key = c["heads"] * 2 * c["head_dim"]
    return 2 * c["layers"] * per_key * sum(p + 1 for p in positions)


def fit_line(xs, ys):
    """Least squares y = a + b x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def measure(args):
    """Every cell's runs, variants alternating within a round: (infos, rows, disturbed)."""
    rows, disturbed = [], False
    max_ctx = max(args.contexts)
    TWINS = twins(args.shape)
    infos = {name: info(spec, max_ctx + args.steps + 1, 1) for name, spec in TWINS}
    avail = mem_available()
    for batch in (1, args.batch):
        for ctx in args.contexts:
            for rep in range(args.reps + 1):   # a warm-up round first; variants alternate within a round
                for name, twin_spec in TWINS:
                    i = infos[name]
                    need = i["weight_bytes"] + batch * i["kv_bytes_per_token"] * (ctx + args.steps + 16)
                    if need > 0.85 * avail:
                        if rep == 0:
                            log(f"scale: {name} batch {batch} at {ctx}: needs {need / 2**30:.1f} GiB of "
                                f"{avail / 2**30:.1f} available: left out")
                        continue
                    # the context just past the steps: the pool is sized (and touched) for it
                    ms, dist = step_ms(twin_spec, ctx + args.steps + 1, ctx, batch, args.steps, args.threads)
                    disturbed |= dist and rep > 0
                    if rep == 0:
                        continue
                    rows.append(dict(variant=name, batch=batch, context=ctx, rep=rep, step_ms=ms))
                    log(f"scale: {name} batch {batch} context {ctx}: median step {ms:.2f} ms")
    return infos, rows, disturbed


def floors(args, infos, rows, bandwidth, peak_flops):
    """Each cell's median step against its floor and the floor of its phases in turn."""
    cells = []
    for batch in (1, args.batch):
        for ctx in args.contexts:
            for name in VARIANTS:
                got = [r["step_ms"] for r in rows if (r["variant"], r["batch"], r["context"]) == (name, batch, ctx)]
                if not got:
                    continue
                i = infos[name]
                positions = [ctx + args.steps // 2] * batch
                cache_bytes = i["kv_bytes_per_token"] * sum(p + 1 for p in positions)
                nbytes = i["weight_bytes"] + cache_bytes
                matmul_flops, attn_flops = 2 * i["parameters"] * batch, attention_flops(i, positions)
                flops = matmul_flops + attn_flops
                ms = statistics.median(got)
                floor_ms = max(nbytes / bandwidth, flops / peak_flops) * 1e3
                phases_ms = phases_bound(i["weight_bytes"], cache_bytes, matmul_flops, attn_flops, bandwidth,
                                         peak_flops) * 1e3
                cells.append(dict(variant=name, batch=batch, context=ctx, step_ms=ms, spread=max(got) - min(got),
                                  weight_bytes=i["weight_bytes"], cache_bytes=cache_bytes, flops=flops,
                                  floor_ms=floor_ms, share=floor_ms / ms, phases_ms=phases_ms,
                                  phases_share=phases_ms / ms))
    return cells


def crossovers(infos, cells):
    """Per variant: the context where a token's cache bytes times the context equal the weights'
    (formula), and where the measured batch-1 step's context term equals its constant term."""
    out = {}
    for name in VARIANTS:
        i = infos[name]
        formula = i["weight_bytes"] / i["kv_bytes_per_token"]
        pts = [(c["context"], c["step_ms"]) for c in cells if c["variant"] == name and c["batch"] == 1]
        measured = None
        if len(pts) >= 2:
            a, b = fit_line([p[0] for p in pts], [p[1] for p in pts])
            measured = a / b if b > 0 else None
        out[name] = (formula, measured)
    return out


def write(args, machine, probes, infos, cells, cross, disturbed):
    bandwidth, peak_flops = best_of(probes)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"{machine}-scale")
    lines = [f"# The posts' scale: {args.shape} twins, cached decode step against the context", "",
             f"Machine: {machine}; {args.threads} threads; bandwidth {bandwidth / 1e9:.1f} GB/s and peak "
             f"{peak_flops / 1e9:.0f} GFLOP/s (build/roofline, the better of its probes before and after the "
             f"runs: {probes[0][0] / 1e9:.1f} and {probes[1][0] / 1e9:.1f} GB/s, {probes[0][1] / 1e9:.0f} and "
             f"{probes[1][1] / 1e9:.0f} GFLOP/s); bf16 weights (generated, `--shape`) and bf16 cache; "
             f"{args.reps} timed runs a cell after a warm-up, each the median of {args.steps} decode steps after "
             f"`--fill`; figures are medians over the runs.", ""]
    if disturbed:
        lines += ["**Disturbed:** some runs saw steps over 3x their median (another process wanted the cores).", ""]
    lines += ["| variant | KV bytes/token | weights, bytes | cache passes weights at (formula) | measured |",
              "|---|---:|---:|---:|---:|"]
    for name in VARIANTS:
        f, m = cross[name]
        lines.append(f"| {name} | {infos[name]['kv_bytes_per_token']:,} | {infos[name]['weight_bytes']:,} | "
                     f"{f:,.0f} | {'-' if m is None else f'{m:,.0f}'} |")
    lines += ["", "The floor is the larger of the step's bytes over the bandwidth and its FLOPs over the peak. "
              "Phases in turn: the matmuls' floor (weights, or their FLOPs) plus attention's (cache, or its FLOPs), "
              "as a step without overlap between them can reach at best.", "",
              "| variant | batch | context | step, ms | spread | weights, MB | cache, MB | floor, ms | "
              "share of floor | phases in turn, ms | share |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        lines.append(f"| {c['variant']} | {c['batch']} | {c['context']:,} | {c['step_ms']:.2f} | {c['spread']:.2f} | "
                     f"{c['weight_bytes'] / 1e6:,.0f} | {c['cache_bytes'] / 1e6:,.0f} | {c['floor_ms']:.2f} | "
                     f"{c['share'] * 100:.0f}% | {c['phases_ms']:.2f} | {c['phases_share'] * 100:.0f}% |")
    ratio = {}
    for ctx in args.contexts:
        by = {c["variant"]: c["step_ms"] for c in cells if c["batch"] == 1 and c["context"] == ctx}
        if "MHA" in by and "GQA" in by:
            ratio[ctx] = by["MHA"] / by["GQA"]
    if ratio:
        lines += ["", "MHA step / GQA step at batch 1: " +
                  ", ".join(f"{r:.2f}x at {ctx:,}" for ctx, r in ratio.items()) + "."]
    lines += ["", f"![cached step against the context]({os.path.basename(base)}.png)"]
    with open(base + ".md.tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(base + ".md.tmp", base + ".md")
    with open(base + ".csv.tmp", "w") as f:
        f.write("variant,batch,context,step_ms,spread_ms,weight_bytes,cache_bytes,flops,floor_ms,share,"
                "phases_floor_ms,phases_share\n")
        for c in cells:
            f.write(f"{c['variant']},{c['batch']},{c['context']},{c['step_ms']:.6g},{c['spread']:.6g},"
                    f"{c['weight_bytes']},{c['cache_bytes']},{c['flops']},{c['floor_ms']:.6g},{c['share']:.6g},"
                    f"{c['phases_ms']:.6g},{c['phases_share']:.6g}\n")
    os.replace(base + ".csv.tmp", base + ".csv")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("scale: no matplotlib: no plot")
        return base
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in VARIANTS:
        pts = [(c["context"], c["step_ms"]) for c in cells if c["variant"] == name and c["batch"] == 1]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (positions in the cache)")
    ax.set_ylabel("cached decode step, ms (batch 1)")
    ax.set_title(f"{args.shape} twins, bf16 cache, {machine}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=110)
    plt.close(fig)
    return base


def probe(args):
    """(bytes/s, FLOP/s): build/roofline's streaming bandwidth and FMA peak, best of its reps."""
    from bench.roofline import roofline
    roof = roofline(args)
    return float(roof["bandwidth_best_GBps"]) * 1e9, float(roof["peak_best_GFLOPs"]) * 1e9


def best_of(probes):
    """The floor takes the machine at its best: a probe that another tenant of a VM's host
    slowed would lower the floor and flatter every share."""
    return max(p[0] for p in probes), max(p[1] for p in probes)


def number_list(text):
    return tuple(int(x) for x in text.split(","))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=logical_cpus())
    ap.add_argument("--reps", type=int, default=REPS)
    ap.add_argument("--contexts", type=number_list, default=CONTEXTS)
    ap.add_argument("--batch", type=int, default=BATCH, help="the larger batch (default %(default)s)")
    ap.add_argument("--steps", type=int, default=STEPS, help="decode steps a run (default %(default)s)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--shape", default=SHAPE, help="the GQA shape whose twins run (default %(default)s)")
    args = ap.parse_args(argv)
    if not os.path.exists(os.path.join(ROOT, "build", "roofline")):
        raise SystemExit("bench/scale.py: build/roofline is missing: run make build/roofline")
    t0 = time.time()
    try:
        before = probe(args)
        infos, rows, disturbed = measure(args)
        probes = (before, probe(args))
    except BenchError as e:
        raise SystemExit(f"bench/scale.py: {e}")
    cells = floors(args, infos, rows, *best_of(probes))
    machine = machine_name_for_scale(args.threads)
    base = write(args, machine, probes, infos, cells, crossovers(infos, cells), disturbed)
    log(f"scale: {rel(base)}.md in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
