"""--profile (docs/PROFILE.md): the parts of a step add up to the step (an accounting
check, not a timing threshold), the bytes and FLOPs are those of the shapes and positions,
figures computed here from the model, and the profile costs nothing it does not print."""
import csv

import pytest

from conftest import PROMPT, generate_json, run

PARTS = ["attention", "projections", "ffn", "head", "sampling", "embedding"]


def matrices(model):
    """(elements of every layer's matrices a token runs through, those of the tied head)"""
    layer = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("layers."))
    return layer, model.tok_embeddings.weight.numel() if hasattr(model, "tok_embeddings") else None


def check_parts(profile, whole):
    for phase in ("prefill", "decode"):
        d = profile[phase]
        parts = sum(d[f"{p}_ms_mean"] for p in PARTS)
        # the team's waits at a part's barriers are inside the part; alone there are none
        for p in PARTS:
            wait = d[f"{p}_wait_ms_mean"]
            assert 0 <= wait <= d[f"{p}_ms_mean"] * (1 + 1e-9) + 1e-6, (phase, p, d)
            if whole:
                assert wait == 0, (phase, p, d)
        assert parts == pytest.approx(d["parts_ms_mean"], rel=1e-6, abs=1e-6)
        # the parts are stages inside the step, each ended at a barrier: never more than it
        assert parts <= d["step_ms_mean"] * (1 + 1e-9) + 1e-6, (phase, d)
        assert d["other_ms_mean"] == pytest.approx(d["step_ms_mean"] - parts, abs=1e-6)
        for layer_parts in d["layers"]:
            assert all(v >= 0 for v in layer_parts.values())
        assert sum(l["attention_ms_mean"] for l in d["layers"]) == pytest.approx(d["attention_ms_mean"], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("variant,args", [("gqa", ["--kv"]), ("gqa", []), ("mla64", ["--kv"]),
                                          ("mla64", ["--mla", "expand"]), ("mha", ["--kv", "--batch", 3])])
def test_parts_add_up_to_the_step(small_checkpoints, variant, args, threads):
    path, _ = small_checkpoints[variant]
    _, _, summary = generate_json([path, "-p", PROMPT, "-n", 20, "-s", 1, "-q", "--profile=layers",
                                   "--threads", threads] + args)
    check_parts(summary["profile"], whole=threads == 1)


def expected_cost(model, cfg, keys, tokens, logit_rows, absorbed, dtype_bytes=2):
    """Weight bytes, KV bytes and FLOPs of a pass of `tokens` tokens whose attention reads
    `keys` keys in all, from the model's shapes (docs/PROFILE.md's rules)."""
    layer = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("layers."))
    head = cfg.vocab_size * cfg.dim
    weight_bytes = (layer + head) * dtype_bytes + tokens * cfg.dim * dtype_bytes
    if cfg.kv_latent:
        kv_per_token = cfg.n_layers * (cfg.kv_latent + cfg.rope_dim) * 4
        layer_token = layer - 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * cfg.kv_latent   # W_UK, W_UV apart
        layer_token += 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * cfg.kv_latent if absorbed else 0
        per_key = cfg.n_layers * cfg.n_heads * (2 * cfg.kv_latent + cfg.rope_dim)
    else:
        kv_per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
        layer_token = layer
        per_key = cfg.n_layers * cfg.n_heads * 2 * cfg.head_dim
    flops = 2 * (tokens * layer_token + keys * per_key + logit_rows * head)
    return weight_bytes, keys * kv_per_token, flops


@pytest.mark.parametrize("variant", ["gqa", "mla64"])
def test_bytes_and_flops_follow_the_shapes(small_checkpoints, variant, tmp_path):
    path, model = small_checkpoints[variant]
    cfg = model.cfg
    log = tmp_path / "steps.csv"
    _, (seq,), _ = generate_json([path, "-p", PROMPT, "-n", 12, "-s", 1, "-q", "--kv", "--profile", "--log", log])
    rows = list(csv.DictReader(open(log)))
    assert len(rows) == seq["generated"]
    n_prompt = seq["prompt_tokens"]
    for r in rows:
        step = int(r["step"])
        if step == 0:   # the prompt: token t attends to t + 1 keys
            tokens, keys = n_prompt, sum(range(1, n_prompt + 1))
        else:           # one token, at position n_prompt + step - 1
            tokens, keys = 1, n_prompt + step
        w, kv, flops = expected_cost(model, cfg, keys, tokens, 1, absorbed=True)
        assert int(r["weight_bytes"]) == w, (step, r)
        assert int(r["kv_bytes"]) == kv, (step, r)
        assert float(r["flops"]) == pytest.approx(flops, rel=1e-9), (step, r)
        parts = sum(float(r[f"{p}_ms"]) for p in PARTS)
        assert parts <= float(r["ms"]) + 1e-3, r   # the CSV rounds each to 0.1 us


def test_profile_off_prints_nothing(small_checkpoints, tmp_path):
    path, _ = small_checkpoints["gqa"]
    p, _, summary = generate_json([path, "-p", PROMPT, "-n", 5, "-s", 1, "-q", "--kv", "--log", tmp_path / "s.csv"])
    assert "profile" not in summary and "profile:" not in p.stderr.decode()
    assert open(tmp_path / "s.csv").readline().strip() == "step,phase,sequences,n_tokens,pos,token,ms"
    p = run([path, "-p", PROMPT, "-n", 5, "-s", 1, "-q", "--kv", "--profile=layers"])
    err = p.stderr.decode()
    assert "profile:" in err and "layer 1:" in err and "no peaks" in err


def test_peaks_from_a_roofline_file(small_checkpoints, tmp_path):
    path, _ = small_checkpoints["gqa"]
    peaks = tmp_path / "roofline.txt"
    peaks.write_text("roofline_threads 2\nbandwidth_best_GBps 50.0\npeak_best_GFLOPs 400.0\n")
    _, _, summary = generate_json([path, "-p", PROMPT, "-n", 5, "-s", 1, "-q", "--kv", "--profile",
                                   "--profile-peaks", peaks])
    prof = summary["profile"]
    assert prof["peaks_source"] == "roofline_file" and prof["peak_GBps"] == 50.0 and prof["peak_GFLOPs"] == 400.0
    d = prof["decode"]
    assert d["bandwidth_share_of_peak"] == pytest.approx(d["GBps"] / 50.0, rel=1e-6)
    assert d["flops_share_of_peak"] == pytest.approx(d["GFLOPs"] / 400.0, rel=1e-6)
    gb = (d["weight_bytes_mean"] + d["kv_bytes_mean"]) / (d["step_ms_mean"] * 1e6)
    assert d["GBps"] == pytest.approx(gb, rel=1e-6)
    bad = tmp_path / "bad.txt"
    bad.write_text("nothing here\n")
    p = run([path, "-n", 2, "-q", "--profile", "--profile-peaks", bad], check=False)
    assert p.returncode == 1 and p.stderr.decode().count("\n") == 1 and "bandwidth_best_GBps" in p.stderr.decode()


@pytest.mark.parametrize("args,message", [
    (["--profile=everything"], "--profile takes no value or =layers"),
    (["--profile-peaks", "x"], "--profile-peaks needs --profile"),
    (["--profile", "--check-kv"], "--profile records a generation"),
])
def test_profile_flags_refused(small_checkpoints, args, message):
    p = run([small_checkpoints["gqa"][0], "-n", 2] + args, check=False)
    assert p.returncode == 2 and message in p.stderr.decode(), p.stderr.decode()
