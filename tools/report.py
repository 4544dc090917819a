#!/usr/bin/env python3
"""One run of ./run as a single self-contained HTML page: per-step latency against
position, the time split per component, each step's roofline position, the KV pool over
time of a --prompts run, and attention heatmaps per head (several variants side by side).

    ./run weights/gqa.bin -p "Once upon a time" -n 100 --kv -q --json --profile \\
          --log steps.csv --dump-attn attn.bin > run.json
    python3 tools/report.py --json run.json --log steps.csv --attn attn.bin --out report.html

Every input is optional but one; the page shows what it is given. The plots are PNGs
drawn by matplotlib and inlined as base64: the page loads nothing from anywhere.
The formats: docs/JSON.md (the --json lines), docs/PROFILE.md (the --log columns with
--profile, and --dump-attn's records)."""
import argparse
import base64
import csv
import html
import io
import json
import struct
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

PARTS = ["attention", "projections", "ffn", "head", "sampling", "embedding"]
HEADER = struct.Struct("<8s6i")
RECORD = struct.Struct("<6i")


class ReportError(Exception):
    pass


def read_json(path):
    """The summary object and the sequence objects of a --json run."""
    objs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    objs.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ReportError(f"{path}:{n}: not a JSON line ({e.msg})")
    summary = [o for o in objs if o.get("type") == "summary"]
    if not summary:
        raise ReportError(f"{path}: no summary object: the --json output of a generation?")
    return summary[-1], [o for o in objs if o.get("type") == "sequence"]


def read_log(path):
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows or "ms" not in rows[0]:
        raise ReportError(f"{path}: no step rows: the --log CSV of a generation?")
    return rows


def read_dump(path):
    """(header, records): records are (step, sequence, layer, head, position, probabilities)."""
    data = open(path, "rb").read()
    if len(data) < HEADER.size or data[:8] != b"ATTNDUMP":
        raise ReportError(f"{path}: not a --dump-attn file (no ATTNDUMP header)")
    _, version, n_layers, n_heads, context, record_ints, _ = HEADER.unpack_from(data, 0)
    if version != 1 or record_ints != 6:
        raise ReportError(f"{path}: version {version} of the format, this reads version 1")
    records, off = [], HEADER.size
    while off < len(data):
        if off + RECORD.size > len(data):
            raise ReportError(f"{path}: cut short in a record at byte {off}")
        step, seq, layer, head, pos, n = RECORD.unpack_from(data, off)
        off += RECORD.size
        if n < 0 or off + 4 * n > len(data):
            raise ReportError(f"{path}: cut short in a record at byte {off}")
        records.append((step, seq, layer, head, pos, np.frombuffer(data, "<f4", n, off)))
        off += 4 * n
    return {"n_layers": n_layers, "n_heads": n_heads, "context": context}, records


def png(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def latency_plot(rows):
    """Each step's time against the position it decoded (the step's index in a batch)."""
    single = all(int(r["pos"]) >= 0 for r in rows)
    x = [int(r["pos"]) if single else int(r["step"]) for r in rows]
    y = [float(r["ms"]) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    decode = [(a, b) for a, b, r in zip(x, y, rows) if r["phase"] == "decode"]
    other = [(a, b) for a, b, r in zip(x, y, rows) if r["phase"] != "decode"]
    if decode:
        ax.plot(*zip(*decode), ".-", ms=3, lw=0.8, label="decode")
    if other:
        ax.plot(*zip(*other), "o", ms=5, label="prefill / mixed")
    ax.set_xlabel("position" if single else "step")
    ax.set_ylabel("step time, ms")
    ax.set_title("Per-step latency")
    ax.grid(alpha=0.3)
    ax.legend()
    return png(fig)


def parts_plot(rows):
    """The time of each part of each step, stacked (the --log columns of --profile)."""
    x = [int(r["step"]) for r in rows]
    parts = np.array([[float(r[f"{p}_ms"]) for r in rows] for p in PARTS])
    other = np.maximum(np.array([float(r["ms"]) for r in rows]) - parts.sum(axis=0), 0)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.stackplot(x, *parts, other, labels=PARTS + ["other"], colors=plt.get_cmap("tab10").colors[:len(PARTS) + 1])
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title("Time per component, each step")
    ax.legend(loc="upper left", fontsize=7, ncol=4)
    ax.grid(alpha=0.3)
    return png(fig)


def profile_table(profile):
    head = "<tr><th>phase</th><th>steps</th><th>step, ms</th>" + "".join(
        f"<th>{p}, ms</th>" for p in PARTS + ["other"]) + "<th>weights, MB</th><th>KV, MB</th><th>MFLOP</th>" \
        "<th>GB/s</th><th>GFLOP/s</th></tr>"
    body = []
    for phase in ("prefill", "decode"):
        d = profile.get(phase, {})
        if not d.get("steps"):
            continue
        cells = [phase, d["steps"], f"{d['step_ms_mean']:.3f}"] + \
            [f"{d[f'{p}_ms_mean']:.3f}" for p in PARTS] + [f"{d['other_ms_mean']:.3f}",
             f"{d['weight_bytes_mean'] / 1e6:.2f}", f"{d['kv_bytes_mean'] / 1e6:.3f}", f"{d['flops_mean'] / 1e6:.2f}",
             f"{d['GBps']:.1f}", f"{d['GFLOPs']:.1f}"]
        body.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return f"<table>{head}{''.join(body)}</table>"


def split_plot(profile):
    """The mean step of each phase, split into its parts (the summary's profile)."""
    phases = [ph for ph in ("prefill", "decode") if profile.get(ph, {}).get("steps")]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.6 * len(phases)))
    colors = plt.get_cmap("tab10").colors
    for i, ph in enumerate(phases):
        left = 0.0
        for k, p in enumerate(PARTS + ["other"]):
            v = max(profile[ph][f"{p}_ms_mean"], 0.0)
            ax.barh(i, v, left=left, color=colors[k], label=p if i == 0 else None)
            left += v
    ax.set_yticks(range(len(phases)), phases)
    ax.set_xlabel("ms, mean per step")
    ax.set_title("Time split per component")
    ax.legend(fontsize=7, ncol=7, loc="lower center", bbox_to_anchor=(0.5, 1.15))
    return png(fig)


def roofline_plot(rows, profile):
    """Each step as a point: its FLOPs per byte read (weights + KV cache) against its
    achieved GFLOP/s, under the machine's roofs when the run had --profile-peaks."""
    flops = np.array([float(r["flops"]) for r in rows])
    nbytes = np.array([float(r["weight_bytes"]) + float(r["kv_bytes"]) for r in rows])
    ms = np.array([float(r["ms"]) for r in rows])
    ok = (nbytes > 0) & (ms > 0)
    x, y = flops[ok] / nbytes[ok], flops[ok] / ms[ok] / 1e6
    decode = np.array([r["phase"] == "decode" for r in rows])[ok]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.loglog(x[decode], y[decode], ".", ms=4, alpha=0.6, label="decode steps")
    ax.loglog(x[~decode], y[~decode], "o", ms=6, label="prefill / mixed steps")
    bw, peak = (profile or {}).get("peak_GBps"), (profile or {}).get("peak_GFLOPs")
    if bw and peak:
        ai = np.logspace(np.log10(min(x.min(), peak / bw) / 2), np.log10(max(x.max(), peak / bw) * 2), 100)
        ax.loglog(ai, np.minimum(bw * ai, peak), "k-", lw=1, label=f"roofs: {bw:.1f} GB/s, {peak:.1f} GFLOP/s")
    else:
        ax.set_title("(no roofs: the run had no --profile-peaks)", fontsize=8, loc="right")
    ax.set_xlabel("FLOPs per byte read (weights + KV cache)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title("Roofline position of each step", loc="left")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return png(fig)


def pool_plot(rows):
    """The KV pool after each step: blocks in use, and those shared by a common prefix."""
    x = [int(r["step"]) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.step(x, [int(r["kv_blocks"]) for r in rows], where="post", label="blocks in use")
    ax.step(x, [int(r["kv_shared_blocks"]) for r in rows], where="post", label="blocks shared")
    ax2 = ax.twinx()
    ax2.step(x, [int(r["sequences"]) for r in rows], where="post", color="gray", lw=0.8, alpha=0.6,
             label="sequences in the step")
    ax2.set_ylabel("sequences")
    ax.set_xlabel("step")
    ax.set_ylabel("blocks")
    ax.set_title("KV pool over time")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    return png(fig)


def variants_side_by_side(dumps, layer, sequence):
    """The heads of layer `layer` for each variant's dump, one column a variant: the same
    prompt seen through each variant's attention. Rows are heads (as many as the widest)."""
    mats = []
    for name, (header, records) in dumps:
        mine = [r for r in records if r[2] == layer and r[1] == sequence]
        if not mine:
            raise ReportError(f"{name}: the dump has no records of layer {layer} and sequence {sequence}")
        heads = sorted({r[3] for r in mine})
        positions = sorted({r[4] for r in mine})
        width = max(len(r[5]) for r in mine)
        per_head = []
        for h in heads:
            m = np.full((len(positions), width), np.nan, dtype=np.float32)
            for r in mine:
                if r[3] == h:
                    m[positions.index(r[4]), :len(r[5])] = r[5]
            per_head.append((h, m))
        mats.append((name, per_head))
    n_rows = max(len(ph) for _, ph in mats)
    fig, axes = plt.subplots(n_rows, len(mats), figsize=(2.0 * len(mats), 1.4 * n_rows), squeeze=False)
    for col, (name, per_head) in enumerate(mats):
        axes[0][col].set_title(name, fontsize=10, fontweight="bold")
        for row in range(n_rows):
            ax = axes[row][col]
            if row >= len(per_head):
                ax.axis("off")
                continue
            h, m = per_head[row]
            ax.imshow(m, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=np.nanmax(m))
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_ylabel(f"head {h}", fontsize=7)
    fig.suptitle(f"Attention weights, layer {layer}, sequence {sequence}: query rows, key columns")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / n_rows))
    return png(fig)


def heatmaps(header, records, layer, sequence):
    """One heatmap per head: the attention weights of every recorded query position (rows)
    over its keys (columns) in layer `layer` of sequence `sequence`."""
    mine = [r for r in records if r[2] == layer and r[1] == sequence]
    if not mine:
        raise ReportError(f"the dump has no records of layer {layer} and sequence {sequence}")
    heads = sorted({r[3] for r in mine})
    positions = sorted({r[4] for r in mine})
    width = max(len(r[5]) for r in mine)
    cols = min(4, len(heads))
    rows_n = (len(heads) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.2 * cols, 3.0 * rows_n), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, h in zip(axes.flat, heads):
        m = np.full((len(positions), width), np.nan, dtype=np.float32)
        for r in mine:
            if r[3] == h:
                m[positions.index(r[4]), :len(r[5])] = r[5]
        ax.axis("on")
        ax.imshow(m, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=np.nanmax(m))
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xlabel("key", fontsize=8)
        ax.set_ylabel(f"query (positions {positions[0]}-{positions[-1]})", fontsize=7)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"Attention weights, layer {layer}, sequence {sequence}")
    fig.tight_layout()
    return png(fig)


def page(title, sections):
    style = ("body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;"
             "text-align:right}img{max-width:100%}h2{margin-top:1.5em}")
    body = "".join(f"<h2>{html.escape(h)}</h2>{content}" for h, content in sections)
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>\n")


def img(b64, alt):
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


def build(args):
    sections, title = [], "./run"
    if args.json:
        summary, sequences = read_json(args.json)
        title = f"./run {summary['variant']} {summary['mode']} ({summary['checkpoint']})"
        facts = [("steps", summary["steps"]), ("prefill, ms", summary["prefill_ms"]),
                 ("median decode step, ms", summary["step_ms_median"]), ("tokens/s (mean)", summary["tokens_per_s_mean"]),
                 ("KV peak, bytes", summary["kv_peak_bytes"]), ("preemptions", summary["preemptions"])]
        table = "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                                    for k, v in facts) + "</table>"
        sections.append(("Summary", table))
        if "profile" in summary:
            sections.append(("Time split per component", img(split_plot(summary["profile"]), "time split")
                             + profile_table(summary["profile"])))
    if args.log:
        rows = read_log(args.log)
        sections.append(("Per-step latency", img(latency_plot(rows), "per-step latency")))
        if all(f"{p}_ms" in rows[0] for p in PARTS):
            sections.append(("Time per component, each step", img(parts_plot(rows), "parts per step")))
            sections.append(("Roofline position of each step",
                             img(roofline_plot(rows, summary.get("profile") if args.json else None), "roofline")))
    if args.pool_log:
        rows = read_log(args.pool_log)
        if "kv_blocks" not in rows[0]:
            raise ReportError(f"{args.pool_log}: no kv_blocks column: the --log of a --prompts run with --profile?")
        sections.append(("KV pool over time" + (f" ({args.pool_title})" if args.pool_title else ""),
                         img(pool_plot(rows), "pool over time")))
    dumps = [(a.split("=", 1) if "=" in a else (a, a)) for a in args.attn]
    if len(dumps) == 1:
        header, records = read_dump(dumps[0][1])
        layers = [args.layer] if args.layer is not None else sorted({r[2] for r in records})
        for layer in layers:
            sections.append((f"Attention weights, layer {layer}",
                             img(heatmaps(header, records, layer, args.sequence), f"attention layer {layer}")))
    elif dumps:
        loaded = [(name, read_dump(path)) for name, path in dumps]
        layers = [args.layer] if args.layer is not None else sorted({r[2] for r in loaded[0][1][1]})
        for layer in layers:
            sections.append((f"Attention weights per head, the variants side by side, layer {layer}",
                             img(variants_side_by_side(loaded, layer, args.sequence), f"variants layer {layer}")))
    if not sections:
        raise ReportError("nothing to report: give --json, --log, --pool-log or --attn")
    return page(title, sections)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="the run's --json output (one object a line)")
    ap.add_argument("--log", help="the run's --log CSV (with --profile: the parts of each step)")
    ap.add_argument("--attn", action="append", default=[],
                    help="a --dump-attn file, or NAME=FILE; given several times, the variants side by side")
    ap.add_argument("--pool-log", help="the --log CSV (with --profile) of a --prompts run: the pool over time")
    ap.add_argument("--pool-title", help="what the --pool-log run was, for its heading")
    ap.add_argument("--layer", type=int, help="the layer whose heads to draw (default: every layer recorded)")
    ap.add_argument("--sequence", type=int, default=0, help="the sequence whose weights to draw (default 0)")
    ap.add_argument("--out", required=True, help="the HTML file to write")
    args = ap.parse_args(argv)
    try:
        text = build(args)
    except (OSError, ReportError, KeyError) as e:
        print(f"report: {e}", file=sys.stderr)
        return 1
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
