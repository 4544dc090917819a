"""make bench's report (bench/bench.py), in its short test mode (--steps): every section is
written, the roofline's bytes and FLOPs follow from the model's shape, the ratios from the
medians, and the determinism table holds the engine's guarantee. Timings are never checked."""
import csv
import os
import re
import statistics
import subprocess
import sys

from conftest import ROOT, RUN, run

BENCH = os.path.join(ROOT, "bench", "bench.py")
STEPS = 4   # a prefill and 3 decode steps


def shape(ckpt):
    """The model's shape from ./run --info (not from bench.py's own parsing)."""
    info = run([ckpt, "--info"]).stdout.decode()
    m = re.search(r"dim (\d+), layers (\d+), heads (\d+) x (\d+), kv heads (\d+), .* hidden (\d+), vocab (\d+)", info)
    D, L, H, hd, Hkv, F, V = map(int, m.groups())
    wbytes = int(re.search(r"(\d+) bytes of weights", info).group(1))
    kv_per_token = int(re.search(r"(\d+) bytes/token", info).group(1))
    return dict(D=D, L=L, H=H, hd=hd, Hkv=Hkv, F=F, V=V, weight_bytes=wbytes, kv_per_token=kv_per_token)


def report(tmp_path, *ckpts):
    out = tmp_path / "results"
    p = subprocess.run([sys.executable, BENCH, "--steps", str(STEPS), "--reps", "1", "--pt-reps", "1",
                        "--roofline-mib", "16", "--roofline-reps", "1", "--out", str(out)] + list(ckpts),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600,
                       env=dict(os.environ, RUN_BINARY=RUN))
    assert p.returncode == 0, p.stderr[-3000:]
    mds = [f for f in os.listdir(out) if f.endswith(".md")]
    assert len(mds) == 1, os.listdir(out)
    slug = mds[0][:-3]
    md = (out / f"{slug}.md").read_text()
    vals = {}
    with open(out / f"{slug}.csv") as f:
        for r in csv.DictReader(f):
            vals[(r["section"], r["variant"], r["mode"], r["quantity"])] = r["value"]
    with open(out / f"{slug}-steps.csv") as f:
        steps = list(csv.DictReader(f))
    pngs = [out / f for f in os.listdir(out) if f.endswith(".png")]
    return md, vals, steps, pngs


def test_bench_report(tmp_path):
    md, vals, steps, pngs = report(tmp_path, os.path.join(ROOT, "weights", "mha.bin"),
                                   os.path.join(ROOT, "weights", "mla64.bin"))
    assert "TEST RUN, NOT A BENCHMARK" in md
    for section in ("## Machine", "## C engine", "## PyTorch reference", "## C / PyTorch", "## Roofline",
                    "## Determinism", "## Targets", "## Per-step latency"):
        assert section in md, section
    assert len(pngs) == 2  # MHA with and without the cache; all variants with it
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # every cell measured, for both implementations; each ratio is C median / PyTorch median
    for v in ("mha", "mla64"):
        for mode in ("kv", "no-kv"):
            for cell in ("prefill", "avg_gen"):
                c = float(vals[("c", v, mode, f"{cell}_median")])
                pt = float(vals[("pytorch", v, mode, f"{cell}_median")])
                assert c > 0 and pt > 0
                assert abs(float(vals[("ratio_c_over_pytorch", v, mode, cell)]) - c / pt) <= 1e-3 * c / pt
            rows = [r for r in steps if r["impl"] == "c" and r["variant"] == v and r["mode"] == mode]
            assert [r["phase"] for r in rows] == ["prefill"] + ["decode"] * (STEPS - 1)

    # the roofline's cost model, for MHA, from the shape: bytes are the weights (plus the cache
    # rows read); FLOPs 2 per weight MAC, plus 2 x (key + value width) per head and key
    s = shape(os.path.join(ROOT, "weights", "mha.bin"))
    D, L, H, hd, F, V = s["D"], s["L"], s["H"], s["hd"], s["F"], s["V"]
    weight_macs = 2 * D * H * hd + 2 * D * s["Hkv"] * hd + 3 * F * D  # W_Q, W_O; W_K, W_V; FFN
    dec = {mode: [r for r in steps if r["impl"] == "c" and r["variant"] == "mha" and r["mode"] == mode
                  and r["phase"] == "decode"] for mode in ("kv", "no-kv")}
    keys = [int(r["pos"]) + 1 for r in dec["kv"]]
    flops_kv = statistics.fmean(L * (2 * weight_macs + H * 2 * 2 * hd * n) + 2 * V * D for n in keys)
    bytes_kv = statistics.fmean(s["weight_bytes"] + n * s["kv_per_token"] for n in keys)
    tokens = [int(r["n_tokens"]) for r in dec["no-kv"]]
    flops_nokv = statistics.fmean(L * (2 * T * weight_macs + H * 2 * 2 * hd * T * (T + 1) // 2) + 2 * V * D
                                  for T in tokens)
    for mode, flops, nbytes in (("kv", flops_kv, bytes_kv), ("no-kv", flops_nokv, s["weight_bytes"])):
        assert abs(float(vals[("roofline", "mha", mode, "step_flops")]) - flops) <= 1e-5 * flops, mode
        assert abs(float(vals[("roofline", "mha", mode, "step_bytes")]) - nbytes) <= 1e-5 * nbytes, mode
    # the working-set probe covers the largest step's weights and full cache
    assert int(vals[("machine", "", "", "bandwidth_working_set_bytes")]) >= s["weight_bytes"] + 256 * s["kv_per_token"]
    assert float(vals[("machine", "", "", "bandwidth_working_set_GBps")]) > 0

    # determinism: MHA bitwise with and without the cache; MLA bitwise when both use the absorbed
    # form, and the same tokens against the expanded form
    def check(v, pair, q):
        return vals[("check_kv", v, pair, q)]
    assert check("mha", "kv vs no-kv", "bitwise_identical") == "1"
    assert check("mla64", "kv-absorb vs no-kv-absorb", "bitwise_identical") == "1"
    for v, pair in (("mha", "kv vs no-kv"), ("mla64", "kv-absorb vs no-kv-absorb"), ("mla64", "kv-absorb vs no-kv-expand")):
        assert check(v, pair, "identical_tokens") == check(v, pair, "steps") == str(STEPS)
