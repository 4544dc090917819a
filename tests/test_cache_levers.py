"""The cache's other levers: bf16 and int8 cached elements (bitwise the same with and
without the cache, and across a batch), and windows that let generation run past the
context (ring and sinks), with --ppl scoring through them."""
import numpy as np
import pytest

from conftest import PROMPT, VARIANTS, generate_json, json_one, read_logits, run


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", ["bf16", "int8", "fp8"])
def test_check_kv_bitwise_for_every_dtype(small_checkpoints, variant, dtype):
    path, _ = small_checkpoints[variant]
    code, check = json_one([path, "-p", PROMPT, "--kv", "--kv-dtype", dtype, "--check-kv", "-n", 30, "--ignore-eos"])
    pairs = check["comparisons"]
    same_form = [c for c in pairs if "expand" not in c["b"]] if variant.startswith("mla") else pairs
    assert code == 0 and check["kv_dtype"] == dtype, check
    assert same_form and all(c["bitwise_identical"] is True and c["identical_tokens"] == 30 for c in same_form), pairs


def dump_logits(path, tmp_path, *args):
    out = tmp_path / "logits.bin"
    run([path, "-p", PROMPT, "-k", 1, "--ignore-eos", "-q", "--kv", "--dump-logits", out] + list(args))
    return read_logits(out, 4096)


def test_dtypes_change_the_numbers_a_little(small_checkpoints, tmp_path):
    """The prompt's logits (the same context for every dtype): a little off fp32's, int8
    more than bf16; fp8 (3 mantissa bits) more than bf16 (7)."""
    path, _ = small_checkpoints["gqa"]
    fp32 = dump_logits(path, tmp_path, "-n", 1)
    diffs = {}
    for dtype in ("bf16", "int8", "fp8"):
        diffs[dtype] = float(np.abs(fp32 - dump_logits(path, tmp_path, "-n", 1, "--kv-dtype", dtype)).max())
    assert 0 < diffs["bf16"] < diffs["int8"] < 0.1 * float(np.abs(fp32).max()), diffs
    assert diffs["bf16"] < diffs["fp8"] < 0.1 * float(np.abs(fp32).max()), diffs


def test_batch_invariance_with_int8_and_windows(small_checkpoints):
    path, _ = small_checkpoints["mla64"]
    for extra in (["--kv-dtype", "int8"], ["--window", 24, "-n", 90], ["--window", 24, "--window-policy", "sinks",
                                                                        "--kv-dtype", "bf16", "-n", 90]):
        args = [path, "-p", PROMPT, "--kv", "--batch", 3, "-s", 8, "--ignore-eos", "--check-batch"] + extra
        if "-n" not in extra:
            args += ["-n", 30]
        code, verdict = json_one(args)
        assert code == 0 and verdict["batch"] == 3 and verdict["sequences_identical"] == 3, (extra, verdict)


@pytest.mark.parametrize("variant", ["gqa", "mla128"])
def test_window_runs_past_the_context(small_checkpoints, tmp_path, variant):
    """Context 64: with a window of 64 the run goes on to 200 tokens. Until the window is
    full, both policies give the bits of the run without a window; after, they differ from
    each other (they keep different positions)."""
    path, _ = small_checkpoints[variant]
    plain = dump_logits(path, tmp_path, "-n", 60)
    ring = dump_logits(path, tmp_path, "-n", 200, "--window", 64)
    sinks = dump_logits(path, tmp_path, "-n", 200, "--window", 64, "--window-policy", "sinks")
    assert len(ring) == 200 and len(sinks) == 200
    assert np.array_equal(ring[:60], plain) and np.array_equal(sinks[:60], plain)
    assert not np.array_equal(ring[70:], sinks[70:])
    _, [sequence], summary = generate_json([path, "-p", PROMPT, "--kv", "--window", 64, "-n", 150, "--ignore-eos", "-q"])
    assert summary["decode_steps"] == 149 and summary["stops"]["steps"] == 1 and sequence["stop"] == "steps"
    assert len(sequence["tokens"]) == 150


def test_prompt_longer_than_the_window(small_checkpoints):
    """A 40-token prompt through a window of 16: computed in pieces the window can take,
    and still bitwise the run that feeds it token by token (batch invariance)."""
    path, _ = small_checkpoints["gqa"]
    prompt = " ".join(["once"] * 39)
    args = [path, "-p", prompt, "--kv", "--window", 16, "-n", 20, "--ignore-eos", "-s", 1, "--batch", 2, "--check-batch"]
    code, verdict = json_one(args)
    assert code == 0 and verdict["batch"] == 2 and verdict["sequences_identical"] == 2, verdict


def test_info_reports_dtype_and_window(small_checkpoints):
    path, model = small_checkpoints["gqa"]
    cfg = model.cfg
    for dtype, per_token in (("fp32", 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4),
                             ("bf16", 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2),
                             ("int8", 2 * cfg.n_layers * cfg.n_kv_heads * (cfg.head_dim + 4))):
        _, info = json_one([path, "--info", "--kv", "--kv-dtype", dtype, "--window", 32])
        assert info["kv_bytes_per_token"] == per_token and info["kv_dtype"] == dtype, info
        assert info["kv_bytes_full"] == 32 * per_token and info["kv_bytes_per_token_allocated"] == per_token, info
        assert info["window"] == 32 and info["window_sinks"] == 0, info


def test_ppl_through_windows(small_checkpoints, tmp_path):
    """Long texts: the baseline restarts at the context, the windows slide; both report
    the tokens scored past the context, the same count."""
    path, _ = small_checkpoints["mqa"]
    story = " ".join(["The little dog ran to the park and played with a red ball all day."] * 12)
    f = tmp_path / "long.txt"
    f.write_text(story + "\n<|endoftext|>\n" + story[:200] + "\n")
    rows = {}
    for name, extra in (("restart", []), ("ring", ["--kv", "--window", 64]),
                        ("sinks", ["--kv", "--window", 64, "--window-policy", "sinks"]),
                        ("int8", ["--kv-dtype", "int8"])):
        _, rows[name] = json_one([path, "--ppl", f] + extra)
    assert len({r["tokens"] for r in rows.values()}) == 1
    past = {name: r["past_context"] for name, r in rows.items()}
    assert all(past[n] and past[n]["from_position"] == 64 for n in ("restart", "ring", "sinks")), past
    assert past["restart"]["tokens"] > 0 and past["restart"]["tokens"] == past["ring"]["tokens"] == past["sinks"]["tokens"]
    # the mean NLLs to the 4 decimals a reader compares
    nll = {name: f"{r['mean_nll']:.4f}" for name, r in rows.items()}
    assert nll["ring"] != nll["sinks"] and nll["int8"] != nll["restart"], nll


@pytest.mark.parametrize("args, message", [
    (["--kv", "--kv-dtype", "fp16"], "--kv-dtype takes fp32, bf16, int8, fp8, int4 or int2, got 'fp16'"),
    (["--kv", "--window", "0"], "--window 0 is out of range (1..1048576)"),
    (["--kv", "--window", "65"], "--window 65 is out of range (1..64, the context)"),
    (["--window", "32"], "--window needs --kv: without the cache every step recomputes the whole sequence"),
    (["--window", "32", "--check-kv", "-n", "65"], "-n 65 is out of range (1..64, the context)"),
    (["--kv", "--window-policy", "sinks"], "--evict needs a budget: --kv-budget N"),
    (["--kv", "--window", "8", "--window-policy", "tail"], "--window-policy takes ring, sinks, h2o or block, got 'tail'"),
    (["--kv", "--window", "4", "--window-policy", "sinks"], "--window 4 leaves no room beside the 4 sink positions"),
    (["--kv", "-n", "65"], "-n 65 is out of range (1..64, the context; more with --window)"),
])
def test_bad_lever_flags(small_checkpoints, args, message):
    path, _ = small_checkpoints["gqa"]
    p = run([path] + args, check=False)
    assert p.returncode == 2 and p.stderr.decode() == f"run: {message}\n" and p.stdout == b""
