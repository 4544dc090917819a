"""make bench's batched-decoding sections (bench/bench.py), never their timings: the throughput
table's figures recomputed from the raw step logs and from the shape ./run --info prints, the
post's intensity formula, the roofline's bandwidth choice, the capacity formula against the
pool's measured count, the per-step rows, the weight-/cache-bound paragraph, and bad flags."""
import csv
import math
import os
import statistics
import subprocess
import sys

import pytest

from conftest import ROOT, RUN, json_one
from test_bench import bench, report, table_rows, val

BATCHES = (1, 2)
STEPS = 3
SMALL_POOL = 0.0625   # MiB: 4 full contexts of the small MQA, 5 of the small MLA (16 + 8 wide, 2 layers)
BIG_POOL = 16         # MiB: over 256 full contexts of either, the engine's batch limit
VARIANTS = ("mqa", "mla64")
MQA = os.path.join(ROOT, "weights", "mqa.bin")


@pytest.fixture(scope="module")
def batch_report(small_checkpoints, tmp_path_factory):
    """One full bench of two small checkpoints, C only, 1 and 2 sequences, two pool sizes."""
    out = tmp_path_factory.mktemp("batch") / "results"
    paths = [small_checkpoints[v][0] for v in VARIANTS]
    p = bench(out, "--skip-pytorch", "--steps", STEPS, "--reps", 2, "--batches", ",".join(map(str, BATCHES)),
              "--capacity-mib", f"{SMALL_POOL},{BIG_POOL}", "--roofline-mib", 16, "--roofline-reps", 1, *paths)
    assert p.returncode == 0, p.stderr[-3000:]
    slug, md, vals, steps, pngs = report(out)
    names = {}
    for path in paths:   # the engine's name of each (the small MLA's latent is 16 wide)
        names[json_one([path, "--info"])[1]["variant"]] = path
    return dict(out=out, slug=slug, md=md, vals=vals, steps=steps, pngs=pngs, names=names)


def shape(ckpt):
    """The model's shape and pool from ./run --info --json (not from the bench's reading of it)."""
    _, info = json_one([ckpt, "--info", "--kv", "--batch", 1])
    keys = dict(D="dim", L="layers", H="heads", hd="head_dim", Hkv="kv_heads", dc="kv_latent", rd="rope_dim",
                F="hidden", V="vocab", ctx="context", W="weight_bytes", block_tokens="kv_block_tokens",
                block_bytes="kv_block_bytes")
    s = {k: info[v] for k, v in keys.items()}
    s["per_token"] = s["block_bytes"] // s["block_tokens"]
    return s


def step_cost(s, B, pos):
    """FLOPs and bytes of a full step of B sequences, the first at pos + 1 and the others at pos:
    2 per weight MAC of each token and its head, attention 2 x (key + value width) per head and
    key; bytes = the weights once + every key's cache row. MLA absorbed: keys d_c + d_R wide,
    values d_c, and the per-head W_UK/W_UV products."""
    D, H, hd, F = s["D"], s["H"], s["hd"], s["F"]
    if s["dc"]:
        macs = H * (hd + s["rd"]) * D + (s["dc"] + s["rd"]) * D + 2 * H * hd * s["dc"]
        kw, vw = s["dc"] + s["rd"], s["dc"]
    else:
        macs = H * hd * D + 2 * s["Hkv"] * hd * D
        kw = vw = hd
    macs += H * hd * D + 3 * D * F
    keys = B * (pos + 1) + (B > 1)
    matmul_flops = B * (s["L"] * 2 * macs + 2 * s["V"] * D)
    flops = matmul_flops + s["L"] * H * 2 * (kw + vw) * keys
    return flops, s["W"] + keys * s["per_token"], keys * s["per_token"], matmul_flops


def full_steps(rows, B):
    """The log rows in which every one of the B sequences decodes a token."""
    return [r for r in rows if r["phase"] == "decode" and int(r["sequences"]) == B]


def close(got, want, rel=1e-5):
    return abs(float(got) - want) <= rel * abs(want) + 1e-12


def test_sections_and_plots(batch_report):
    r = batch_report
    md, slug = r["md"], r["slug"]
    assert val(r["vals"], "report", "", "", "status") == "complete"
    heads = [x for x in md.splitlines() if x.startswith("## ")]
    assert heads == ["## Machine", "## Method", "## C engine", "## Roofline", "## Batched decoding: throughput",
                     "## KV cache size", "## KV cache capacity", "## KV cache precision: speed and memory",
                     "## Determinism: with and without the cache",
                     "## Per-step latency"]
    assert "### From weight-bound to cache-bound" in md
    assert f"{slug}-throughput.png" in r["pngs"] and f"]({slug}-throughput.png)" in md
    assert (r["out"] / f"{slug}-kv-cache.png").read_bytes()[:4] == b"\x89PNG"
    rows = table_rows(md, "## Batched decoding: throughput")
    assert [(x[0], x[1], x[2]) for x in rows] == [(n, str(B), "2") for n in ("MQA", "MLA d_latent=16")
                                                   for B in BATCHES]


def test_throughput_from_the_step_logs(batch_report):
    """step ms = median over the timed runs of each run's median full step; tokens/s = B x 1000 /
    that; the speed-up is over B=1's tokens/s."""
    r = batch_report
    for v in r["names"]:
        tps = {}
        for B in BATCHES:
            per_run = []
            for rep in (1, 2):
                with open(r["out"] / "tmp" / r["slug"] / f"c-{v}-batch{B}-{rep}.csv") as f:
                    full = full_steps(list(csv.DictReader(f)), B)
                assert len(full) == STEPS - (B > 1)   # the first sequence ends a step early
                per_run.append(statistics.median(float(x["ms"]) for x in full))
            mode = f"B={B}"
            got = [float(val(r["vals"], "batch", v, mode, f"step_ms_{k}")) for k in ("median", "min", "max")]
            want = [statistics.median(per_run), min(per_run), max(per_run)]
            assert all(close(g, w) for g, w in zip(got, want)), (v, B, got, want)
            tps[B] = float(val(r["vals"], "batch", v, mode, "tokens_per_s_median"))
            assert close(tps[B], B * 1000 / want[0]), (v, B)
            assert close(val(r["vals"], "batch", v, mode, "speedup_vs_b1"), tps[B] / tps[1])


def test_bytes_flops_and_intensity_from_the_shape(batch_report):
    r = batch_report
    vals = r["vals"]
    for v, path in r["names"].items():
        s = shape(path)
        for B in BATCHES:
            mode = f"B={B}"
            rows = [x for x in r["steps"] if x["variant"] == v and x["mode"] == "batch" and x["batch"] == str(B)
                        and x["flags"] == ""]
            assert rows[0]["phase"] == "prefill" and int(rows[0]["sequences"]) == 1
            n_prompt = int(rows[0]["n_tokens"])
            mid = full_steps(rows, B)[(STEPS - (B > 1) - 1) // 2]   # the full step in the middle
            pos = int(mid["pos"]) if B == 1 else n_prompt + int(mid["step"]) - 2
            assert int(val(vals, "batch", v, mode, "step_pos")) == pos
            flops, nbytes, kv, _ = step_cost(s, B, pos)
            assert close(val(vals, "batch", v, mode, "step_flops"), flops), (v, B)
            assert close(val(vals, "batch", v, mode, "step_bytes"), nbytes), (v, B)
            assert close(val(vals, "batch", v, mode, "kv_bytes"), kv), (v, B)
            assert close(val(vals, "batch", v, mode, "arithmetic_intensity"), flops / nbytes)
            # the post's formula over a whole decode: d_kv = H_kv x head_dim, or MLA's d_c + d_R
            n, d = s["ctx"], s["D"]
            dkv = s["dc"] + s["rd"] if s["dc"] else s["Hkv"] * s["hd"]
            post = (B * n * n * d + B * n * d * d) / (B * n * n * dkv + n * d * d)
            assert close(val(vals, "batch", v, mode, "post_intensity_formula"), post), (v, B)


def test_roofline_bound_and_bandwidth_choice(batch_report):
    """bound = max(FLOPs / peak, bytes / bandwidth), the bandwidth DRAM's when the step's working
    set exceeds the last-level cache, else the probe over its size; share = bound / step. The
    phases' bound adds the matmuls' (weights, their FLOPs) and attention's (cache, its FLOPs)."""
    vals = batch_report["vals"]
    peak = float(val(vals, "machine", "", "", "peak_GFLOPs")) * 1e9
    dram = float(val(vals, "machine", "", "", "bandwidth_GBps"))
    llc = val(vals, "machine", "", "", "last_level_cache_bytes")
    for v in batch_report["names"]:
        for B in BATCHES:
            mode = f"B={B}"
            nbytes = float(val(vals, "batch", v, mode, "step_bytes"))
            flops = float(val(vals, "batch", v, mode, "step_flops"))
            source = val(vals, "batch", v, mode, "bandwidth_source")
            bw = float(val(vals, "batch", v, mode, "bandwidth_GBps"))
            if llc and nbytes > int(llc):
                assert source == "DRAM" and close(bw, dram, 1e-3)
            else:
                assert source == f"{max(1, math.ceil(nbytes / 2**20))} MiB probe"
            bound = max(flops / peak, nbytes / (bw * 1e9))
            assert close(val(vals, "batch", v, mode, "roofline_bound_ms"), bound * 1e3, 1e-4)
            step = float(val(vals, "batch", v, mode, "step_ms_median")) / 1e3
            assert close(val(vals, "batch", v, mode, "roofline_share"), bound / step, 1e-4)
            assert val(vals, "batch", v, mode, "bound_by") == ("compute" if flops / peak > nbytes / (bw * 1e9)
                                                                 else "weights")
            s = shape(batch_report["names"][v])
            _, _, kv, matmul = step_cost(s, B, int(val(vals, "batch", v, mode, "step_pos")))
            phases = (max(s["W"] / (bw * 1e9), matmul / peak) +
                      max(kv / (bw * 1e9), (flops - matmul) / peak))
            assert close(val(vals, "batch", v, mode, "phases_bound_ms"), phases * 1e3, 1e-4)
            assert close(val(vals, "batch", v, mode, "phases_share"), phases / step, 1e-4)


def test_dtype_table(batch_report):
    """Bytes per token for each --kv-dtype from the shape alone (int8: a 4-byte scale beside every
    cached vector), and tokens/s at B=1 (the only batch size of this run the dtypes share) from
    runs made with the dtype's flag; fp32's are the throughput table's own."""
    r = batch_report
    rows = table_rows(r["md"], "## KV cache precision: speed and memory")
    assert [x[1] for x in rows] == ["fp32", "bf16", "int8"] * len(VARIANTS)
    for name, path in r["names"].items():
        s = shape(path)
        for dtype, size in (("fp32", 4), ("bf16", 2), ("int8", 1)):
            scale = 4 if dtype == "int8" else 0
            want = s["L"] * ((s["dc"] + s["rd"]) * size + 2 * scale) if s["dc"] else \
                2 * s["L"] * s["Hkv"] * (s["hd"] * size + scale)
            assert int(val(r["vals"], "dtype", name, dtype, "kv_bytes_per_token")) == want, (name, dtype)
            flags = "" if dtype == "fp32" else f"--kv-dtype {dtype}"
            steps = [float(x["ms"]) for x in r["steps"] if x["variant"] == name and x["mode"] == "batch"
                     and x["batch"] == "1" and x["flags"] == flags and x["phase"] == "decode"]
            assert steps
            tps = val(r["vals"], "dtype", name, f"B=1 {dtype}", "tokens_per_s_median")
            per_run = []
            for rep in (1, 2):  # the dtype's own step logs: 1000 / the median over runs of each run's median
                suffix = "" if dtype == "fp32" else f"-{dtype}"
                with open(r["out"] / "tmp" / r["slug"] / f"c-{name}-batch1{suffix}-{rep}.csv") as f:
                    per_run.append(statistics.median(float(x["ms"]) for x in full_steps(list(csv.DictReader(f)), 1)))
            assert close(tps, 1000 / statistics.median(per_run)), (name, dtype, tps, per_run)
            if dtype == "fp32":   # the same runs as the throughput table's
                assert tps == val(r["vals"], "batch", name, "B=1", "tokens_per_s_median")


def test_capacity_formula_and_measurement(batch_report):
    """Full-context sequences in a pool: floor(MiB x 2^20 / (16 x bytes/token)) blocks, ceil(context
    / 16) a sequence; in the small pool the engine's preemptions leave exactly that many running at
    the end of the context; above the batch limit nothing is run."""
    r = batch_report
    rows = {x[0]: x for x in table_rows(r["md"], "## KV cache capacity")}
    for v, path in r["names"].items():
        s = shape(path)
        per_seq = -(-s["ctx"] // 16)
        fits = {mib: math.floor(mib * 2**20 / (16 * s["per_token"])) // per_seq for mib in (SMALL_POOL, BIG_POOL)}
        assert 1 < fits[SMALL_POOL] < 8 and fits[BIG_POOL] > 256
        small, big = f"{SMALL_POOL:g} MiB", f"{BIG_POOL:g} MiB"
        assert int(val(r["vals"], "capacity", v, small, "formula")) == fits[SMALL_POOL]
        assert int(val(r["vals"], "capacity", v, small, "requested")) == fits[SMALL_POOL] + 2
        assert int(val(r["vals"], "capacity", v, small, "measured")) == fits[SMALL_POOL]
        assert int(val(r["vals"], "capacity", v, small, "preemptions")) > 0
        assert val(r["vals"], "capacity", v, small, "agree") == "1"
        assert int(val(r["vals"], "capacity", v, big, "formula")) == fits[BIG_POOL]
        assert ("capacity", v, big, "measured") not in r["vals"]
        # the measured run: all N start together, and the pool's preemptions bring them down to the formula's
        with open(r["out"] / "tmp" / r["slug"] / f"c-{v}-capacity-{SMALL_POOL:g}.csv") as f:
            counts = [int(x["sequences"]) for x in csv.DictReader(f)]
        assert counts[1] == fits[SMALL_POOL] + 2 and fits[SMALL_POOL] in counts
        if v == "mqa":
            preempted = val(r["vals"], "capacity", v, small, "preemptions")
            assert rows["MQA"][4:10] == [str(fits[SMALL_POOL]), f"{fits[SMALL_POOL]} of {fits[SMALL_POOL] + 2} "
                                         f"({preempted} preemptions)", "yes", f"{fits[BIG_POOL]:,}",
                                         "≥ 256 (the batch limit; not run)", "—"]


def test_step_rows_and_paragraph(batch_report):
    r = batch_report
    for v, path in r["names"].items():
        for B in BATCHES:
            rows = [x for x in r["steps"] if x["variant"] == v and x["mode"] == "batch" and x["batch"] == str(B)
                        and x["flags"] == ""]
            want = ["prefill"] + (["decode"] * STEPS if B == 1 else ["mixed"] + ["decode"] * STEPS)
            assert [x["phase"] for x in rows] == want
            assert [int(x["sequences"]) for x in rows[1:]] == ([1] * STEPS if B == 1 else [B] * STEPS + [B - 1])
        # the paragraph: the cache's bytes stay under the weights' for these B; where they would pass them
        s = shape(path)
        kv2 = float(val(r["vals"], "batch", v, "B=2", "kv_bytes"))
        name = "MQA" if v == "mqa" else "MLA d_latent=16"
        line = next(x for x in r["md"].splitlines() if x.startswith(f"- **{name}**"))
        assert f"stay below its weight bytes ({s['W'] / 1e6:.1f} MB) up to B=2" in line
        assert f"from about B={math.ceil(s['W'] / (kv2 / 2))}" in line
        assert "Measured, the step time" in line and "from B=1 to 2 (x2 sequences)" in line


def test_a_failing_batch_run_leaves_the_rest(tmp_path):
    """A batch run that fails costs the batch cells, named in the PARTIAL REPORT; the latency table stays."""
    fake = tmp_path / "run"
    fake.write_text(f"#!/bin/sh\ncase \" $* \" in *' --batch 2 '*) echo 'simulated batch failure' >&2; exit 1;; esac\n"
                    f"exec {RUN} \"$@\"\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench.py"), "--out", str(out), "--allow-disturbed", "--load-seconds",
                        "0.1", "--quick", "--steps", "2", "--reps", "2", "--batches", "1,2", MQA],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300,
                       env=dict(os.environ, RUN_BINARY=str(fake)))
    assert p.returncode == 1, p.stderr[-3000:]
    slug, md, vals, steps, pngs = report(out)
    assert "> **PARTIAL REPORT**" in md
    missing = vals[("report", "", "", "missing")]
    assert any(m.startswith("MQA, B=2: 0 of 2 timed batch runs: --batch 2 run: ./run exited 1: simulated batch "
                            "failure") for m in missing), missing
    assert [x[:3] for x in table_rows(md, "## C engine")] == [["MQA", "no KV", "2"], ["MQA", "KV", "2"]]
    assert val(vals, "batch", "mqa", "B=1", "runs") == "2" and ("batch", "mqa", "B=2", "runs") not in vals


@pytest.mark.parametrize("args, words", [
    (["--batches", "0"], "--batches takes a whole number from 1 to 256"),
    (["--batches", "1,x"], "--batches takes a whole number from 1 to 256"),
    (["--batches", "257"], "--batches takes a whole number from 1 to 256"),
    (["--capacity-mib", "0"], "--capacity-mib takes a size in MiB above 0"),
    (["--capacity-mib", "64,nan"], "--capacity-mib takes a size in MiB above 0"),
    (["--large-batch-reps", "0"], "--large-batch-reps must be at least 1"),
    (["--steps", "1", "--batches", "1,4"], "--steps must be at least 2 with a batch above 1"),
])
def test_bad_batch_flags_one_line(tmp_path, args, words):
    p = bench(tmp_path / "out", "--quick", *args, MQA)
    assert p.returncode == 2, p.stderr
    err = [x for x in p.stderr.splitlines() if x and not x.startswith("usage:") and not x.startswith("  ")]
    assert len(err) == 1 and words in err[0], p.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.md"))
