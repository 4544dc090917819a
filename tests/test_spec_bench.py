"""bench/spec.py's held-out acceptance, never its timings: the openings it drafts from, and the
acceptance its one --prompts run a cell reports against the same openings run one by one."""
import os
import sys

import pytest

from conftest import ROOT, generate_json

sys.path.insert(0, ROOT)
from bench import spec  # noqa: E402
from bench.common import BenchError  # noqa: E402

MHA = os.path.join(ROOT, "weights", "mha.bin")
DRAFT = os.path.join(ROOT, "weights", "draft", "gqa-2x256.bin")


def test_openings_take_three_to_eight_words(tmp_path):
    stories = [" ".join(f"w{i}_{j}" for j in range(12)) for i in range(8)]
    path = tmp_path / "valid.txt"
    path.write_text("\n<|endoftext|>\n".join(stories) + "\n<|endoftext|>\n", encoding="utf-8")
    got = spec.openings(str(path), 7)
    assert got == [" ".join(f"w{i}_{j}" for j in range(3 + i % 6)) for i in range(7)]
    with pytest.raises(BenchError, match="fewer than 9"):
        spec.openings(str(path), 9)
    with pytest.raises(BenchError, match="--valid"):
        spec.openings(str(tmp_path / "missing.txt"), 1)


def test_held_out_acceptance_is_every_opening_s(tmp_path):
    prompts = ["Tom had a", "The sun was", "Lily and her mom went"]
    path = tmp_path / "openings.txt"
    path.write_text("\n".join(prompts) + "\n", encoding="utf-8")
    [row] = spec.held_out_acceptance(["mha"], [("model", DRAFT, [])], [2], str(path), 24, 2)
    accepted = drafted = tokens = passes = 0
    for p in prompts:
        _, _, s = generate_json([MHA, "-p", p, "--kv", "-k", "1", "-n", "24", "--ignore-eos", "-q", "--draft", DRAFT,
                                 "--draft-k", "2", "--threads", "2"])
        accepted += s["acceptance_rate"] * s["draft_tokens"]
        drafted += s["draft_tokens"]
        n_passes = s["draft_tokens"] / 2
        tokens += s["tokens_per_verify_pass"] * n_passes
        passes += n_passes
    assert row[:4] == ["mha", "model", 2, 3]
    assert row[4] == f"{100 * accepted / drafted:.1f}%"
    assert row[5] == f"{tokens / passes:.2f}"
    assert len(row) == 9 and abs(float(row[8][:-1]) - float(row[7]) / float(row[6])) < 0.006  # the rates' ratio
