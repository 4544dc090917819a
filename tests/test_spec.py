"""Speculative decoding (--draft ngram): greedy output, tokens and the logits of every
emitted position, bit for bit what plain cached decoding gives, on every trained target,
alone and in a batch of prompts where each sequence accepts its own count; the summary's
speculation figures add up; bad combinations are refused in one line, exit 2."""
import os

import numpy as np
import pytest

from conftest import PROMPT, ROOT, VARIANTS, generate_json, read_logits, run

# a prompt that repeats itself, so that prompt lookup finds drafts the target accepts
REPEATING = "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog"


def weights(variant):
    return os.path.join(ROOT, "weights", f"{variant}.bin")


def greedy(variant, prompt, extra, dump):
    p, seqs, summary = generate_json([weights(variant), "-p", prompt, "-k", 1, "-n", 48, "--kv", "-q",
                                      "--dump-logits", dump] + extra)
    return seqs[0]["tokens"], np.fromfile(dump, dtype=np.float32), summary


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("prompt", [PROMPT, REPEATING])
def test_speculation_is_bitwise_plain_decoding(tmp_path, variant, prompt):
    plain_tokens, plain_logits, plain = greedy(variant, prompt, [], tmp_path / "plain.bin")
    spec_tokens, spec_logits, spec = greedy(variant, prompt, ["--draft", "ngram", "--draft-k", 5],
                                            tmp_path / "spec.bin")
    assert spec_tokens == plain_tokens
    assert spec_logits.tobytes() == plain_logits.tobytes()  # every emitted position, bitwise
    assert plain["draft"] is None and plain["draft_tokens"] == 0
    assert spec["draft"] == "ngram" and spec["draft_k"] == 5
    assert 0 <= spec["draft_accepted"] <= spec["draft_tokens"]
    if prompt == REPEATING:
        assert spec["draft_accepted"] > 0, spec  # the repeated sentence is found and kept
        # each accepted draft saves a step: fewer decode steps than tokens
        assert spec["decode_steps"] < plain["decode_steps"], (spec["decode_steps"], plain["decode_steps"])


@pytest.mark.parametrize("k", [1, 3, 16])
def test_speculation_in_a_batch_of_prompts(tmp_path, k):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join([PROMPT, REPEATING, "Lily had a red ball. Lily had a", PROMPT, "Tom ran and ran and"]) + "\n")
    base = [weights("mqa"), "--prompts", prompts, "--batch", 3, "-k", 1, "-n", 40, "--kv", "-q"]
    _, plain, _ = generate_json(base)
    _, spec, summary = generate_json(base + ["--draft", "ngram", "--draft-k", k])
    assert [s["tokens"] for s in spec] == [s["tokens"] for s in plain]
    assert summary["draft_accepted"] > 0 and summary["draft_tokens"] >= summary["draft_accepted"]
    assert summary["tokens_per_verify_pass"] >= 1.0


def test_a_tight_pool_rolls_back_and_still_matches(tmp_path):
    """A pool of few blocks: drafts that find no room decode plainly, preemption and the
    rollback leave the tokens as they were."""
    base = [weights("gqa"), "-p", REPEATING, "--batch", 4, "-k", 1, "-n", 60, "--kv", "-q", "--kv-mem", "1.1"]
    _, plain, _ = generate_json(base)
    _, spec, _ = generate_json(base + ["--draft", "ngram", "--draft-k", 8])
    assert [s["tokens"] for s in spec] == [s["tokens"] for s in plain]


@pytest.mark.parametrize("args", [
    ["--draft", "ngram"],                                          # without --kv
    ["--kv", "--draft", "weights/draft/gqa-2x256.bin"],           # a model: not yet
    ["--kv", "--draft", "ngram", "--draft-k", 0],
    ["--kv", "--draft", "ngram", "--draft-k", 17],
    ["--kv", "--draft-k", 4],                                      # -k without --draft
    ["--kv", "--draft", "ngram", "--window", 64],                  # a ring cannot roll back
    ["--kv", "--draft", "ngram", "-k", 40, "-t", 0.8],             # sampling: greedy only for now
])
def test_bad_draft_flags(args):
    extra = [] if "-k" in args else ["-k", 1]
    p = run([weights("mqa"), "-p", PROMPT, "-n", 4] + extra + args, check=False)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "draft" in lines[0], lines
