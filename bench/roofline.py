"""The roofline: the probe (build/roofline, from bench/roofline.c) that measures this
machine's streaming bandwidth and peak FLOP rate, the cost model of one decode step (FLOPs
and bytes from the model's shape), and the figures of one throughput cell against them."""
import math
import subprocess

from bench.common import BenchError, ROOFLINE, engine_message, log, rel, representative, spread, warn


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


def step_positions(pos, batch):
    """The positions one full step of a --batch run decodes: the first sequence is one ahead of
    the others (see batch_steps)."""
    return [pos] if batch == 1 else [pos + 1] + [pos] * (batch - 1)


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


def token_flops(c):
    """FLOPs of one token through every weight matrix, the tied head included (MLA absorbed)."""
    return c["layers"] * 2 * layer_macs_per_token(c, True) + 2 * c["vocab"] * c["dim"]


def phases_bound(weight_bytes, cache_bytes, matmul_flops, attention_flops, bandwidth, peak):
    """The bound of a step's phases in turn (same units as the figures over the rates): a
    layer's attention waits for its projections and the FFN for its attention, so without
    overlap the matmuls' bound (weights or their FLOPs) and attention's (cache or its FLOPs)
    add up."""
    return max(weight_bytes / bandwidth, matmul_flops / peak) + max(cache_bytes / bandwidth, attention_flops / peak)


def decode_cost_kv(c, positions, kv_bytes_per_token=None):
    """FLOPs and bytes of one cached decode step in which each sequence decodes one token at its
    position (pos+1 keys each): a batch shares one read of the weights, and each sequence reads
    its own cache. MLA: the absorbed form. Bytes: every weight once (file dtype) + the cache rows
    read (default: --info's bytes per token)."""
    keys = sum(p + 1 for p in positions)
    kw, vw = attn_widths(c, absorbed=True)
    flops = len(positions) * token_flops(c) + c["layers"] * c["heads"] * 2 * (kw + vw) * keys
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
            matmul_flops = batch * token_flops(ck.info)
            phases = phases_bound(ck.info["weight_bytes"], kv, matmul_flops, flops - matmul_flops, bw, peak)
            f.update(bound=max(mem, cpu), share=max(mem, cpu) / t, phases_bound=phases, phases_share=phases / t,
                     bound_by="compute" if cpu > mem else "cache" if kv > ck.info["weight_bytes"] else "weights")
    return f
