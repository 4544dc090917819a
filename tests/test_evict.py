"""Eviction by attention at a fixed budget (--kv-budget N --evict h2o|block): within the
budget nothing is evicted and the run is bitwise the plain one; past it the policies keep
different positions; a sequence evicts the same in a batch as alone (--check-batch); --ppl
reports the tokens past the budget; and the refusals. The choices themselves, on hand-made
attention, are in tests/test_kvcache.c."""
import numpy as np
import pytest

from conftest import PROMPT, VARIANTS, generate_json, json_one, read_logits, run


def dump_logits(path, tmp_path, name, *args):
    out = tmp_path / f"{name}.bin"
    run([path, "-p", PROMPT, "-k", 1, "--ignore-eos", "-q", "--kv", "--dump-logits", out] + list(args))
    return read_logits(out, 4096)


@pytest.mark.parametrize("variant", VARIANTS)
def test_within_the_budget_then_past_it(small_checkpoints, tmp_path, variant):
    """Context 64, budget 32: the first 32 positions are the plain run's bits for every
    policy; past them h2o, block and ring keep different positions, so the logits part; h2o
    and block keep each position's own rotation, so they end at the context."""
    path, _ = small_checkpoints[variant]
    plain = dump_logits(path, tmp_path, "plain", "-n", 25)
    runs = {p: dump_logits(path, tmp_path, p, "-n", 64, "--kv-budget", 32, "--evict", p) for p in ("ring", "h2o", "block")}
    assert len(runs["ring"]) == 64
    for policy, logits in runs.items():
        assert np.array_equal(logits[:25], plain), policy
    assert len(runs["h2o"]) == len(runs["block"]) == 64 - len(PROMPT.split()), {p: len(r) for p, r in runs.items()}
    assert not np.array_equal(runs["h2o"][40:], runs["ring"][40:])
    assert not np.array_equal(runs["block"][40:], runs["ring"][40:])
    assert not np.array_equal(runs["block"][40:], runs["h2o"][40:])


@pytest.mark.parametrize("variant", ["mha", "gqa", "mla64"])
@pytest.mark.parametrize("policy", ["h2o", "block"])
def test_a_sequence_evicts_the_same_in_a_batch(small_checkpoints, variant, policy):
    """Sampled, so the four sequences differ and evict differently; each is bitwise its
    solo run, through 25 or more evictions (h2o) or 2 (block)."""
    path, _ = small_checkpoints[variant]
    args = [path, "-p", PROMPT, "--kv", "--kv-budget", 32, "--evict", policy, "--batch", 4, "-s", 5, "-n", 58,
            "--ignore-eos"]
    code, verdict = json_one(args + ["--check-batch"])
    assert code == 0 and verdict["batch"] == 4 and verdict["sequences_identical"] == 4, verdict
    _, sequences, _ = generate_json(args + ["-q"])
    assert len({tuple(s["tokens"]) for s in sequences}) == 4  # four different texts, so four different evictions
    assert all(s["prompt_tokens"] + s["generated"] > 32 + 25 for s in sequences)


def test_ppl_reports_the_tokens_past_the_budget(small_checkpoints, tmp_path):
    path, _ = small_checkpoints["gqa"]
    story = " ".join(["The little dog ran to the park and played with a red ball all day."] * 12)
    f = tmp_path / "long.txt"
    f.write_text(story + "\n")
    rows = {p: json_one([path, "--ppl", f, "--kv", "--kv-budget", 32, "--evict", p])[1] for p in ("ring", "h2o", "block")}
    for policy, r in rows.items():
        assert r["evict"] == policy and r["window"] == 32, r
        # targets 32 .. 63, up to the context, whether the policy slides on (ring) or restarts there
        assert r["past_budget"]["from_position"] == 32 and r["past_budget"]["tokens"] == 32, r
    assert len({f"{r['past_budget']['mean_nll']:.4f}" for r in rows.values()}) == 3, rows
    _, plain = json_one([path, "--ppl", f])
    assert plain["past_budget"] is None and plain["evict"] is None


@pytest.mark.parametrize("args, message", [
    (["--kv", "--evict", "h2o"], "--evict needs a budget: --kv-budget N"),
    (["--kv", "--kv-budget", 32, "--evict", "lru"], "--evict takes ring, sinks, h2o or block, got 'lru'"),
    (["--kv", "--kv-budget", 40, "--evict", "block"], "--kv-budget 40 does not suit --evict block"),
    (["--kv", "--kv-budget", 16, "--evict", "block"], "--kv-budget 16 does not suit --evict block"),
    (["--kv", "--kv-budget", 1, "--evict", "h2o"], "--kv-budget 1 is too small for --evict h2o"),
    (["--kv", "--kv-budget", 65, "--evict", "h2o"], "--kv-budget 65 is out of range (1..64, the context)"),
    (["--kv", "--kv-budget", 32, "--evict", "h2o", "--check-kv"], "--evict h2o cannot agree with --check-kv"),
    (["--kv", "--kv-budget", 32, "--evict", "h2o", "-n", 65], "-n 65 is out of range (1..64, the context; --evict h2o"),
    (["--kv", "--kv-budget", 32, "--evict", "block", "--dump-attn", "x.bin"], "--evict block records the attention"),
])
def test_bad_budgets_and_policies(small_checkpoints, tmp_path, args, message):
    path, _ = small_checkpoints["gqa"]
    p = run([path, "-p", PROMPT, "-n", 5] + [str(a).replace("x.bin", str(tmp_path / "x.bin")) for a in args], check=False)
    err = p.stderr.decode()
    assert p.returncode == 2 and err.startswith("run: ") and err.count("\n") == 1 and message in err, err
    assert p.stdout == b"" and not (tmp_path / "x.bin").exists()
