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


def test_a_fill_past_a_shapes_context_grows_it(tmp_path):
    """A shape's context is a default: --fill past it without -c sets the context to the fill
    plus the shape's own (the mha preset's 256), and the run is the one asked for with -c."""
    base = ["--shape", "mha", "--kv", "--fill", "300", "-n", "4", "-k", "1", "--ignore-eos", "-s", "5", "-q"]
    grown, seqs, summary = generate_json(base + ["--dump-logits", tmp_path / "grown.f32"])
    assert summary["context"] == 300 + 256
    assert seqs[0]["fill"] == 300 and len(seqs[0]["tokens"]) == 4 and seqs[0]["stop"] == "steps"
    assert "the context is 556 positions" in grown.stderr.decode()
    _, same, given = generate_json(base + ["-c", "556", "--dump-logits", tmp_path / "given.f32"])
    assert given["context"] == 556 and same[0]["tokens"] == seqs[0]["tokens"]
    assert (tmp_path / "grown.f32").read_bytes() == (tmp_path / "given.f32").read_bytes()


@pytest.mark.parametrize("args, says", [
    (["--shape", "mha", "-c", "256", "--fill", "300"], "out of range (1..255"),  # -c is kept
    (["--shape", "mha", "--fill", "131072"], "out of range (1..131071"),          # past the largest context
    ([CKPT, "--fill", "300"], "out of range (1..255"),                            # a checkpoint's is its own
])
def test_a_fill_past_the_context_refused(args, says):
    p = run(args + ["--kv", "-n", "2"], check=False)
    err = p.stderr.decode()
    assert p.returncode == 2 and says in err and err.count("\n") == 1, err


def test_a_prompt_past_the_context_after_the_fill_refused():
    """The prompt starts at --fill: BOS and "Once" (2 tokens) from 255 on would need position
    256 of a 256-token context; from 254 on they end at the last position, whose logits give
    the one token there is room for (as BOS alone at --fill 255 does)."""
    p = run([CKPT, "--kv", "-p", "Once", "--fill", "255", "-n", "2", "-q"], check=False)
    err = p.stderr.decode()
    assert p.returncode == 1 and err == ("run: the prompt is 2 tokens: from --fill 255 on it runs past the "
                                         "256-token context (to position 256)\n"), err
    for prompt, fill in (("Once", 254), ("", 255)):
        _, seqs, _ = generate_json([CKPT, "--kv", "-p", prompt, "--fill", fill, "-n", 5, "-k", 1, "--ignore-eos",
                                    "-q"])
        assert len(seqs[0]["tokens"]) == 1 and seqs[0]["stop"] == "context full", seqs
