"""The report's figures (matplotlib, Agg): per-step latency, median decode step per variant,
KV cache bytes against context, and batched throughput."""
import math
import os

from bench.common import CAPACITY_MIB, MAX_BATCH, MODES, fmt, median, warn
from bench.roofline import batch_figures


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
