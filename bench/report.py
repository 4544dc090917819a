"""The markdown report and its CSVs: the machine, the method, the latency tables, C against
PyTorch, the roofline, the KV cache sizes and the determinism check; the batched-decoding
sections are in report_batch.py."""
import csv
import os

from bench.common import (BATCH_CONFIGS, MODES, MODE_LABEL, PROMPT, QUANTITIES, fmt, fmt_spread, image, kind_values,
                          md_table, rel, representative)
from bench.plots import plots
from bench.pytorch_ref import PT_TOLERANCE
from bench.report_batch import capacity_section, dtype_section, throughput_section
from bench.roofline import decode_cost_kv, decode_cost_nokv


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
        ["engine", f"git {mach['git']}; kernels {cks[0].info['kernels']}, "
                   f"tiles of {cks[0].info['matmul_tiles']} past 6 tokens"],
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
            "From `./run CKPT --info --json`: the cache's bytes per token from the model's shape (fp32 cache) and the "
            "bytes the engine allocates. For every checkpoint here they agree (bytes per token x context = the "
            "allocation); the bench stops measuring a checkpoint where they do not.", "",
            md_table(["Attention Mechanism", "KV cache, bytes/token", f"allocated for {ctx} tokens, bytes", "MiB",
                      "/ MHA's"], rows), ""] + image(pngs, "kv-cache", "KV cache bytes against context length")


def determinism_section(b, cks, add):
    rows = []
    for ck in cks:
        for c in ck.check_kv or ():
            rows.append([ck.name, c["a"], c["b"], c["steps"], c["identical_tokens"],
                         "none" if c["first_divergent_step"] == -1 else c["first_divergent_step"],
                         "yes" if c["bitwise_identical"] == 1 else
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
