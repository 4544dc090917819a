"""--fill N: decoding from position N over generated cache entries, with no prefill. The
entries depend on the seed and the position only, so a batch's sequences are their runs alone,
and the fill takes no prompt budget or shared blocks; the flag is refused where it means
nothing."""
import pytest

from conftest import generate_json, run

CKPT = "weights/gqa.bin"


def test_batch_sequences_equal_their_runs_alone():
    args = [CKPT, "--kv", "--fill", "180", "-n", "12", "-k", "1", "--ignore-eos", "-s", "7", "-q"]
    _, batch, summary = generate_json(args + ["--batch", "3"])
    assert summary["prefill_tokens"] == 3              # BOS of each: nothing of the fill computed
    for s in batch:
        assert s["fill"] == 180
        assert s["prompt_tokens"] == 1            # BOS: the fill is not the prompt
        assert len(s["tokens"]) == 12
    # greedy: every sequence of the batch is the run alone, whose seed fills the same entries
    # only for sequence 0 (seed 7); the others fill from seeds 8 and 9
    for i, s in enumerate(batch):
        _, alone, _ = generate_json(args[:-3] + ["-s", str(7 + i), "-q"])
        assert alone[0]["tokens"] == s["tokens"], i


def test_the_fill_changes_what_is_generated():
    """The generated entries are attended to: a run over them differs from one over none."""
    base = [CKPT, "--kv", "-n", "20", "-k", "1", "--ignore-eos", "-s", "3", "-q"]
    _, plain, _ = generate_json(base)
    _, filled, _ = generate_json(base + ["--fill", "100"])
    _, again, _ = generate_json(base + ["--fill", "100"])
    assert filled[0]["tokens"] == again[0]["tokens"]
    assert filled[0]["tokens"] != plain[0]["tokens"]


@pytest.mark.parametrize("flags, says", [
    (["--fill", "10"], "--kv"),
    (["--kv", "--fill", "10", "--window", "32"], "--window"),
    (["--kv", "--fill", "10", "--check-kv"], "--check-kv"),
    (["--kv", "--fill", "0"], "out of range"),
    (["--kv", "--fill", "256"], "out of range"),
    (["--kv", "--fill", "x"], "integer"),
])
def test_refused(flags, says):
    p = run([CKPT, "-n", "2"] + flags, check=False)
    assert p.returncode == 2
    err = p.stderr.decode()
    assert says in err and err.count("\n") == 1, err
