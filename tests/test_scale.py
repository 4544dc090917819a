"""bench/scale.py, the scale section of make bench, on a small shape's twins: every cell it
writes is there, the bytes and crossovers follow from ./run --info's figures, and its line fit
is right. No timing is checked."""
import csv
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, json_one

sys.path.insert(0, ROOT)
from bench.scale import fit_line  # noqa: E402

SHAPE = "gqa,layers=1"
TWINS = {"MHA": SHAPE + ",kv_heads=16", "GQA": SHAPE, "MQA": SHAPE + ",kv_heads=1", "MLA": SHAPE + ",latent=128"}


def test_fit_line():
    a, b = fit_line([1, 2, 3, 4], [3, 5, 7, 9])
    assert a == pytest.approx(1.0) and b == pytest.approx(2.0)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale")
    if not os.path.exists(os.path.join(ROOT, "build", "roofline")):
        subprocess.run(["make", "-s", "build/roofline"], cwd=ROOT, check=True)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "scale.py"), "--shape", SHAPE, "--contexts",
                        "64,300", "--steps", "2", "--reps", "2", "--batch", "2", "--out", str(out)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    assert p.returncode == 0, p.stderr + p.stdout
    [md] = [f for f in os.listdir(out) if f.endswith("-scale.md")]
    with open(out / md.replace(".md", ".csv")) as f:
        rows = list(csv.DictReader(f))
    return (out / md).read_text(), rows


def test_every_cell_is_measured(report):
    _, rows = report
    cells = {(r["variant"], int(r["batch"]), int(r["context"])) for r in rows}
    assert cells == {(v, b, c) for v in TWINS for b in (1, 2) for c in (64, 300)}


def test_bytes_and_crossovers_follow_from_info(report):
    text, rows = report
    for name, spec in TWINS.items():
        _, info = json_one(["--shape", spec, "-c", 303, "--info", "--kv", "--kv-dtype", "bf16"])
        per_token, weights = info["kv_bytes_per_token"], info["weight_bytes"]
        for r in rows:
            if r["variant"] != name:
                continue
            batch, ctx = int(r["batch"]), int(r["context"])
            assert int(r["weight_bytes"]) == weights
            assert int(r["cache_bytes"]) == per_token * batch * (ctx + 1 + 1)   # positions ctx + steps/2
        assert f"| {name} | {per_token:,} | {weights:,} | {weights / per_token:,.0f} |" in text


def test_floors_follow_from_bytes_flops_and_the_probe(report):
    """The step's floor is the larger of all its bytes over the bandwidth and all its FLOPs over
    the peak, and its share that over the step; the floor of the phases in turn is the matmuls' (weights or their FLOPs) plus attention's
    (cache or its FLOPs), at the probe's figures the report names: never below the step's floor
    (the larger of all bytes and all FLOPs), never above twice it."""
    text, rows = report
    m = re.search(r"bandwidth ([0-9.]+) GB/s and peak ([0-9]+) GFLOP/s", text)
    bandwidth, peak = float(m.group(1)) * 1e9, float(m.group(2)) * 1e9
    # the better of the probes before and after the runs
    p = re.search(r"runs: ([0-9.]+) and ([0-9.]+) GB/s, ([0-9]+) and ([0-9]+) GFLOP/s", text)
    assert bandwidth == max(float(p.group(1)), float(p.group(2))) * 1e9
    assert peak == max(float(p.group(3)), float(p.group(4))) * 1e9
    for name, spec in TWINS.items():
        _, info = json_one(["--shape", spec, "-c", 303, "--info", "--kv", "--kv-dtype", "bf16"])
        for r in rows:
            if r["variant"] != name:
                continue
            floor, phases = float(r["floor_ms"]), float(r["phases_floor_ms"])
            bytes_read = int(r["weight_bytes"]) + int(r["cache_bytes"])
            assert floor == pytest.approx(max(bytes_read / bandwidth, int(r["flops"]) / peak) * 1e3, rel=0.01)
            assert float(r["share"]) == pytest.approx(floor / float(r["step_ms"]), rel=1e-3)
            assert floor * (1 - 1e-4) <= phases <= 2 * floor * (1 + 1e-4)
            matmul_flops = 2 * info["parameters"] * int(r["batch"])
            attn_flops = int(r["flops"]) - matmul_flops
            assert attn_flops > 0
            expect = (max(int(r["weight_bytes"]) / bandwidth, matmul_flops / peak) +
                      max(int(r["cache_bytes"]) / bandwidth, attn_flops / peak)) * 1e3
            # the report rounds the probe's figures (0.1 GB/s, 1 GFLOP/s)
            assert phases == pytest.approx(expect, rel=0.01)
            assert float(r["phases_share"]) == pytest.approx(phases / float(r["step_ms"]), rel=1e-3)
