"""make bench's script (bench/bench.py), never its timings: the report's sections and figures
(medians of the per-step logs with their spread, ratios of medians, the roofline's bytes and
FLOPs from the model's shape, the KV cache sizes, the determinism table), the quick mode, and
the partial report that a Ctrl-C, a corrupt checkpoint or a broken PyTorch leave."""
import csv
import os
import re
import signal
import statistics
import subprocess
import sys
import time

from conftest import ROOT, RUN, json_one

BENCH = os.path.join(ROOT, "bench", "bench.py")
MHA = os.path.join(ROOT, "weights", "mha.bin")
GQA = os.path.join(ROOT, "weights", "gqa.bin")
MLA64 = os.path.join(ROOT, "weights", "mla64.bin")
STEPS = 3   # decode steps per run
FULL_SHORT = ["--steps", str(STEPS), "--reps", "2", "--pt-reps", "2", "--roofline-mib", "16", "--roofline-reps", "1",
              "--batches", "none", "--capacity-mib", "none"]   # the batch sections: tests/test_bench_batch.py
QUANTITIES = ("prefill_ms", "step_ms", "tokens_per_s", "mean_step_ms")
SPREAD = re.compile(r"^\d[\d,.]* ± \d[\d,.]*$")   # a cell: median ± spread


def bench_cmd(out, *args):
    # the tests run beside each other: the load check is tested on its own (test_busy_machine_refused)
    return [sys.executable, BENCH, "--out", str(out), "--load-seconds", "0.2", "--allow-disturbed"] + [str(a) for a in args]


def bench_env(**extra):
    return dict(os.environ, RUN_BINARY=RUN, **extra)


def bench(out, *args, **env):
    return subprocess.run(bench_cmd(out, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=600, env=bench_env(**env))


def report(out):
    """The report in out: (slug, markdown, {(section, variant, mode, quantity): [values]}, step rows, PNGs)."""
    mds = [f for f in os.listdir(out) if f.endswith(".md")]
    assert len(mds) == 1, os.listdir(out)
    slug = mds[0][:-3]
    md = (out / f"{slug}.md").read_text()
    vals = {}
    with open(out / f"{slug}.csv") as f:
        for r in csv.DictReader(f):
            vals.setdefault((r["section"], r["variant"], r["mode"], r["quantity"]), []).append(r["value"])
    with open(out / f"{slug}-steps.csv") as f:
        steps = list(csv.DictReader(f))
    pngs = sorted(f for f in os.listdir(out) if f.endswith(".png"))
    return slug, md, vals, steps, pngs


def val(vals, *key):
    (v,) = vals[key]
    return v


def table_rows(md, heading):
    """The rows of the first table after a heading, as lists of cells."""
    lines = md.split(heading, 1)[1].splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("| "))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("| ")), len(lines))
    return [[c.strip() for c in x.strip("|").split("|")] for x in lines[start + 2:end]]


def shape(ckpt):
    """The model's shape from ./run --info --json (not from the bench's own reading of it)."""
    _, info = json_one([ckpt, "--info"])
    keys = dict(D="dim", L="layers", H="heads", hd="head_dim", Hkv="kv_heads", F="hidden", V="vocab",
                weight_bytes="weight_bytes", kv_per_token="kv_bytes_per_token")
    return {k: info[v] for k, v in keys.items()}


def test_full_report(tmp_path):
    out = tmp_path / "results"
    p = bench(out, *FULL_SHORT, MHA, MLA64)
    assert p.returncode == 0, p.stderr[-3000:]
    slug, md, vals, steps, pngs = report(out)
    assert val(vals, "report", "", "", "status") == "complete"
    assert "PARTIAL" not in md and "Targets" not in md and "MISSED" not in md
    assert f"cut to {STEPS} decode steps" in md   # a short full bench says so at the top
    heads = [x for x in md.splitlines() if x.startswith("## ")]
    assert heads == ["## Machine", "## Method", "## C engine", "## PyTorch reference (train/model.py, eager)",
                     "## C / PyTorch", "## Roofline", "## KV cache size", "## Determinism: with and without the cache",
                     "## Per-step latency"]
    assert pngs == [f"{slug}-decode.png", f"{slug}-kv-cache.png", f"{slug}-per-step.png"]
    for png in pngs:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in md

    # every latency cell is a median with its spread, and the spread is that of the runs
    for heading in ("## C engine", "## PyTorch reference"):
        rows = table_rows(md, heading)
        assert [r[:3] for r in rows] == [[v, m, "2"] for v in ("MHA", "MLA d_latent=64") for m in ("no KV", "KV")]
        assert all(SPREAD.match(c) for r in rows for c in r[3:]), rows

    for v in ("mha", "mla64"):
        for mode in ("no-kv", "kv"):
            # the C figures come from the per-step logs of the timed runs: the median step, not the mean
            logs = [out / "tmp" / slug / f"c-{v}-{mode}-{rep}.csv" for rep in (1, 2)]
            runs = []
            for path in logs:
                with open(path) as f:
                    dec = [float(r["ms"]) for r in csv.DictReader(f) if r["phase"] == "decode"]
                assert len(dec) == STEPS
                runs.append({"step_ms": statistics.median(dec), "mean_step_ms": statistics.fmean(dec)})
            for q in ("step_ms", "mean_step_ms"):
                got = [float(val(vals, "c", v, mode, f"{q}_{k}")) for k in ("median", "min", "max")]
                xs = [r[q] for r in runs]
                want = [statistics.median(xs), min(xs), max(xs)]
                assert all(abs(g - w) <= 1e-4 * w for g, w in zip(got, want)), (v, mode, q, got, want)
            tps = float(val(vals, "c", v, mode, "tokens_per_s_median"))
            assert abs(tps - statistics.median(1e3 / r["step_ms"] for r in runs)) <= 1e-3 * tps
            # each ratio is C median / PyTorch median
            for q, name in (("prefill_ms", "prefill"), ("step_ms", "decode")):
                c = float(val(vals, "c", v, mode, f"{q}_median"))
                pt = float(val(vals, "pytorch", v, mode, f"{q}_median"))
                assert abs(float(val(vals, "ratio_c_over_pytorch", v, mode, name)) - c / pt) <= 1e-3 * c / pt
            rows = [r for r in steps if r["impl"] == "c" and r["variant"] == v and r["mode"] == mode]
            assert [r["phase"] for r in rows] == ["prefill"] + ["decode"] * STEPS

    # the roofline's cost model, for MHA's step at the median position, from the shape: bytes are
    # the weights (plus the cache rows read); FLOPs 2 per weight MAC, plus 2 x (key + value
    # width) per head and key
    s = shape(MHA)
    D, L, H, hd, F, V = s["D"], s["L"], s["H"], s["hd"], s["F"], s["V"]
    weight_macs = 2 * D * H * hd + 2 * D * s["Hkv"] * hd + 3 * F * D  # W_Q, W_O; W_K, W_V; FFN
    dec = {mode: [r for r in steps if r["impl"] == "c" and r["variant"] == "mha" and r["mode"] == mode
                  and r["phase"] == "decode"] for mode in ("kv", "no-kv")}
    n = int(dec["kv"][(STEPS - 1) // 2]["pos"]) + 1
    T = int(dec["no-kv"][(STEPS - 1) // 2]["n_tokens"])
    flops_kv = L * (2 * weight_macs + H * 2 * 2 * hd * n) + 2 * V * D
    flops_nokv = L * (2 * T * weight_macs + H * 2 * 2 * hd * T * (T + 1) // 2) + 2 * V * D
    for mode, flops, nbytes in (("kv", flops_kv, s["weight_bytes"] + n * s["kv_per_token"]),
                                ("no-kv", flops_nokv, s["weight_bytes"])):
        assert abs(float(val(vals, "roofline", "mha", mode, "step_flops")) - flops) <= 1e-5 * flops, mode
        assert abs(float(val(vals, "roofline", "mha", mode, "step_bytes")) - nbytes) <= 1e-5 * nbytes, mode
    # the working-set probe covers the largest step's weights and full cache
    assert int(val(vals, "machine", "", "", "bandwidth_working_set_bytes")) >= s["weight_bytes"] + 256 * s["kv_per_token"]

    # the KV cache table: --info's bytes per token, and the allocation at the full context
    kv = {r[0]: r[1:] for r in table_rows(md, "## KV cache size")}
    assert kv["MHA"][:2] == [f"{s['kv_per_token']:,}", f"{s['kv_per_token'] * 256:,}"]
    assert kv["MLA d_latent=64"][:2] == [f"{shape(MLA64)['kv_per_token']:,}", f"{shape(MLA64)['kv_per_token'] * 256:,}"]
    assert "they agree" in md

    # determinism: MHA bitwise with and without the cache; MLA bitwise when both use the absorbed
    # form, and the same tokens against the expanded form
    def check(v, pair, q):
        return val(vals, "check_kv", v, pair, q)
    assert check("mha", "kv vs no-kv", "bitwise_identical") == "1"
    assert check("mla64", "kv-absorb vs no-kv-absorb", "bitwise_identical") == "1"
    for v, pair in (("mha", "kv vs no-kv"), ("mla64", "kv-absorb vs no-kv-absorb"), ("mla64", "kv-absorb vs no-kv-expand")):
        assert check(v, pair, "identical_tokens") == check(v, pair, "steps") == str(STEPS + 1)


def test_quick_mode(tmp_path):
    out = tmp_path / "quick"
    p = bench(out, "--quick", "--steps", STEPS, "--reps", 2, MHA, GQA)
    assert p.returncode == 0, p.stderr[-3000:]
    slug, md, vals, steps, pngs = report(out)
    assert slug.endswith("-quick") and md.startswith("# Quick latency comparison")
    assert val(vals, "report", "", "", "status") == "complete"
    # the C engine alone: no section of a part that did not run, not even a row of the machine table
    heads = [x for x in md.splitlines() if x.startswith("## ")]
    assert heads == ["## Machine", "## Method", "## C engine", "## Batched decoding: throughput", "## KV cache size",
                     "## KV cache precision: speed and memory",
                     "## Per-step latency"]
    assert "PyTorch |" not in md and "roofline probe)" not in md and "share of bound" not in md
    assert not any(r["impl"] == "pytorch" for r in steps)
    assert {r["batch"] for r in steps if r["mode"] == "batch"} == {"1", "16"}
    assert len(pngs) == 4
    # one table on stdout: variant, mode, timed runs, every figure a median with its spread
    table = [x for x in p.stdout.splitlines() if x.startswith("| ")]
    assert table[0].split("|")[1:5] == [" Attention Mechanism ", " mode ", " timed runs ", " Prefill, ms "]
    rows = [[c.strip() for c in x.strip("|").split("|")] for x in table[2:]]
    assert [r[:3] for r in rows] == [[v, m, "2"] for v in ("MHA", "GQA (G=4)") for m in ("no KV", "KV")]
    assert all(SPREAD.match(c) for r in rows for c in r[3:]), rows


def test_quick_mode_defaults():
    """--quick's work: 64 decode steps, 3 timed rounds after a warm-up, the C engine alone, the
    report out of the committed results."""
    sys.path.insert(0, ROOT)
    from bench import bench as b
    q = b.parse_args(["--quick"])
    assert (q.steps, q.reps, q.pytorch, q.full) == (64, 3, False, False)
    assert (q.batches, q.capacity_mib) == ((1, 16), ())   # a small throughput table, no capacity runs
    assert q.out == os.path.join(ROOT, "bench", "results", "tmp", "quick")
    f = b.parse_args([])
    assert (f.steps, f.reps, f.pt_reps, f.pytorch, f.full) == (None, 5, 3, True, True)
    assert (f.batches, f.large_batch_reps, f.capacity_mib) == ((1, 4, 16, 64, 256), 1, (64.0, 1024.0))
    assert f.out == os.path.join(ROOT, "bench", "results")


def assert_partial(md, vals, stderr):
    assert "> **PARTIAL REPORT**" in md
    assert val(vals, "report", "", "", "status") == "partial"
    assert "Traceback" not in stderr
    assert "PARTIAL REPORT" in stderr.strip().splitlines()[-1]


def test_interrupt_leaves_a_partial_report(tmp_path):
    out = tmp_path / "out"
    p = subprocess.Popen(bench_cmd(out, "--quick", "--steps", 2, "--reps", 50, MHA), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=bench_env())
    try:
        for line in p.stdout:   # every cell has its first timed run once round 2 starts
            if "round 2/50" in line:
                break
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err[-3000:]
    slug, md, vals, steps, pngs = report(out)
    assert_partial(md, vals, err)
    assert re.search(r"interrupted \(SIGINT during the C engine's round \d+/50 \(MHA, (no )?KV\)\)", md)
    assert val(vals, "report", "", "", "interrupted").startswith("SIGINT during")
    assert any("of 50 timed C runs" in m for m in vals[("report", "", "", "missing")])
    for mode in ("no-kv", "kv"):
        assert 1 <= int(val(vals, "c", "mha", mode, "runs")) < 50
        assert [r["phase"] for r in steps if r["mode"] == mode] == ["prefill", "decode", "decode"]
    rows = table_rows(md, "## C engine")
    assert [r[:2] for r in rows] == [["MHA", "no KV"], ["MHA", "KV"]]
    assert len(pngs) == 3


def test_corrupt_checkpoint_leaves_the_others(tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a checkpoint\n" * 100)
    out = tmp_path / "out"
    p = bench(out, "--quick", "--steps", 2, "--reps", 2, MHA, bad)
    assert p.returncode == 1
    slug, md, vals, steps, pngs = report(out)
    assert_partial(md, vals, p.stderr)
    (missing,) = vals[("report", "", "", "missing")]
    assert missing.startswith(f"`{bad}`, everything: --info: ./run exited 1: ")   # the engine's own message
    assert [r[:3] for r in table_rows(md, "## C engine")] == [["MHA", "no KV", "2"], ["MHA", "KV", "2"]]


def test_broken_pytorch_leaves_the_c_engine(tmp_path):
    """A torch that fails to import (missing, or crashing) costs the PyTorch sections only."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('simulated broken torch')\n")
    out = tmp_path / "out"
    # two small batches, no capacity runs: those take full contexts, minutes under ASan
    p = bench(out, "--steps", 2, "--reps", 2, "--pt-reps", 2, "--roofline-mib", 16, "--roofline-reps", 1,
              "--batches", "1,4", "--capacity-mib", "none", MHA, PYTHONPATH=str(tmp_path / "fake"))
    assert p.returncode == 1
    slug, md, vals, steps, pngs = report(out)
    assert_partial(md, vals, p.stderr)
    assert vals[("report", "", "", "missing")] == [
        "the PyTorch reference, every checkpoint: cannot load PyTorch: RuntimeError: simulated broken torch"]
    heads = [x for x in md.splitlines() if x.startswith("## ")]
    assert "## C engine" in heads and "## Roofline" in heads and "## Determinism: with and without the cache" in heads
    assert not any("PyTorch" in h for h in heads)


def test_bad_input_one_line(tmp_path):
    """Bad input: one clear line on stderr, a non-zero exit and no report."""
    for args, code, words in (([tmp_path / "nope.bin"], 1, "no such checkpoint"),
                              (["--reps", 1, MHA], 2, "a spread needs two timed runs"),
                              (["--quick", MHA, MHA], 1, "two checkpoints of variant mha")):
        p = bench(tmp_path / "out", *args)
        assert p.returncode == code, (args, p.stderr)
        err = [x for x in p.stderr.splitlines() if x and not x.startswith("usage:") and not x.startswith("  ")]
        assert len(err) == 1 and words in err[0], (args, p.stderr)
        assert not list((tmp_path / "out").glob("*.md"))


def test_busy_machine_refused(tmp_path):
    """Another process keeping a CPU busy while the bench looks at the load: no report, one line
    that says why and how to go on anyway."""
    out = tmp_path / "busy"
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        p = subprocess.run([sys.executable, BENCH, "--out", str(out), "--load-seconds", "1", "--quick", MHA],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300, env=bench_env())
    finally:
        spin.kill()
        spin.wait()
    assert p.returncode == 1, p.stderr[-2000:]
    assert re.search(r"bench: other processes keep \d+% of one CPU busy, so the timings would be disturbed: stop them, "
                     r"or pass --allow-disturbed", p.stderr), p.stderr[-2000:]
    assert not out.exists() or not any(f.endswith(".md") for f in os.listdir(out))


def test_machine_names_tell_generations_apart():
    """A VM's CPU model name without a number ("AMD EPYC") gets the core generation from
    lscpu's family and model, so a Zen 4 and a Zen 5 never write one report; a model name
    with its number is the name alone."""
    sys.path.insert(0, ROOT)
    from bench.machine import machine_slug
    assert machine_slug("AMD EPYC", 2, 2, (25, 17)) == "amd-epyc-zen4-2c-2t"
    assert machine_slug("AMD EPYC", 2, 2, (26, 2)) == "amd-epyc-zen5-2c-2t"
    assert machine_slug("AMD EPYC", 2, 2, (25, 1)) == "amd-epyc-zen3-2c-2t"
    assert machine_slug("Intel(R) Xeon(R) Processor @ 2.80GHz", 2, 2, (6, 106)) == "intel-xeon-icelake-2c-2t"
    assert machine_slug("Intel Xeon", 16, 16, (6, 999)) == "intel-xeon-f6m999-16c-16t"
    assert machine_slug("AMD EPYC 9654 96-Core Processor", 96, 4, (25, 17)) == "amd-epyc-9654-96c-4t"
    assert machine_slug("AMD EPYC", 2, 2, None) == "amd-epyc-2c-2t"
