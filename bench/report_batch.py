"""The report's batched-decoding sections: the throughput table with its roofline columns,
where a variant turns from weight-bound to cache-bound, the capacity table and the KV cache
precision table."""
import math

from bench.common import (BATCH_CONFIGS, DEFAULT_KIND, LARGE_BATCH, MAX_BATCH, PROMPT, cell_mode, fmt, fmt_spread,
                          image, kind_values, md_table)
from bench.roofline import batch_figures


LINEAR = 0.8   # a step time that grows by at least this share of B's factor grows "in proportion to B"


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
                            f"{f['share'] * 100:.0f}%" if "share" in f else "—", f.get("bound_by", "—"),
                            f"{f['phases_share'] * 100:.0f}%" if "phases_share" in f else "—"]
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
                    add("batch", v, mode, "phases_bound_ms", f"{f['phases_bound'] * 1e3:.6g}", "ms")
                    add("batch", v, mode, "phases_share", f"{f['phases_share']:.6g}", "")
    header = ["Attention Mechanism", "B", "timed runs", "step, ms", "tokens/s", "/ B=1", "pos", "KV read, MB",
              "bytes read, MB", "MFLOP", "FLOP/byte", "post's Θ(AI)"]
    if roof:
        header += ["bandwidth, GB/s", "roofline bound, tokens/s", "share of bound", "bound by",
                   "share of phases' bound"]
    align = ["---"] + ["---:"] * (len(header) - 1 - 2 * roof) + ["---", "---:"] * roof   # "bound by" is a word
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
               "fit measures DRAM's bandwidth anyway. **Share of phases' bound**: the matmuls' bound (the "
               "weights' bytes or their FLOPs, the larger) plus attention's (the cache rows' bytes or its FLOPs), "
               "over the median step; a layer's attention waits for its projections and the FFN for its "
               "attention, so a step that does not overlap them can reach this sum at most. "
               f"Machine balance {bal:.1f} FLOP/byte.", ""]
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
            "(`--info --json`'s `kv_pool_blocks` under the run's flags) equal the formula's.", "",
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
