"""Batched decoding on the paged KV cache: every sequence of a batch equals, bit for bit,
the same prompt and seed run alone (--check-batch, and independently through --json);
the prompt is computed once and its blocks shared; preemption when the pool runs short
changes nothing; bad values are refused."""
import os
import re

import pytest

from conftest import PROMPT, ROOT, VARIANTS, generate_json, json_one, run



def check_batch(args):
    """(exit code, the --check-batch --json verdict): one object, its sequences in order."""
    code, verdict = json_one(args + ["--check-batch"], check=False)
    assert verdict["type"] == "check-batch", verdict
    assert [s["index"] for s in verdict["sequences"]] == list(range(verdict["batch"])), verdict
    return code, verdict


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kv", [["--kv"], []])
def test_check_batch_every_variant(small_checkpoints, variant, kv):
    path, _ = small_checkpoints[variant]
    code, verdict = check_batch([path, "-p", PROMPT, "-n", 12, "--ignore-eos", "-s", 3, "--batch", 4] + kv)
    assert code == 0, verdict
    assert verdict["batch"] == 4 and verdict["identical"] is True and verdict["sequences_identical"] == 4
    assert verdict["mode"] == ("kv" if kv else "no-kv")
    rows = verdict["sequences"]
    assert len(rows) == 4 and [r["seed"] for r in rows] == [3, 4, 5, 6]
    assert all(r["bitwise_identical"] is True and r["first_difference"] == -1 and r["steps"] == 12
               and r["identical_tokens"] == 12 for r in rows), rows


def test_check_batch_json_agrees_with_solo_runs(small_checkpoints):
    """--check-batch --json: one object, each sequence's verdict and seed, and its step count
    equal to what a plain --json run of that seed generates."""
    path, _ = small_checkpoints["mqa"]
    base = [path, "-p", PROMPT, "-n", 9, "--ignore-eos", "--kv", "-k", 5]
    code, verdict = check_batch(base + ["-s", 11, "--batch", 3])
    assert code == 0 and verdict["type"] == "check-batch" and verdict["identical"] is True
    assert verdict["batch"] == 3 and verdict["sequences_identical"] == 3
    assert [s["seed"] for s in verdict["sequences"]] == [11, 12, 13]
    for s in verdict["sequences"]:
        alone = sequences(base + ["-s", s["seed"]])
        assert s["bitwise_identical"] is True and s["first_difference"] == -1
        assert s["steps"] == s["identical_tokens"] == len(alone[0]["tokens"]) == 9


def sequences(args):
    """The --json lines of a run's sequences, parsed (generate_json checks the summary)."""
    return generate_json(args + ["-q"])[1]


@pytest.mark.parametrize("variant", ["gqa", "mla64"])
def test_batch_equals_solo_runs(small_checkpoints, variant):
    """Independent of --check-batch: each sequence of a sampled batch is what a solo run with
    its seed prints, and the thread count changes nothing."""
    path, _ = small_checkpoints[variant]
    base = [path, "-p", PROMPT, "-n", 15, "--ignore-eos", "--kv", "-k", 20]
    batch = sequences(base + ["-s", 40, "--batch", 3])
    assert [s["index"] for s in batch] == [0, 1, 2] and [s["seed"] for s in batch] == [40, 41, 42]
    for s in batch:
        alone = sequences(base + ["-s", s["seed"]])
        assert len(alone) == 1 and alone[0]["tokens"] == s["tokens"] and alone[0]["text"] == s["text"]
        assert s["text"].startswith(PROMPT) and len(s["tokens"]) == 15 and s["stop"] == "steps"
    same = lambda runs: [(s["index"], s["seed"], s["tokens"], s["text"], s["stop"]) for s in runs]  # not the timings
    assert same(sequences(base + ["-s", 40, "--batch", 3, "--threads", 1])) == same(batch)
    # seeds differ, so (with top-k sampling) the sequences do
    assert len({tuple(s["tokens"]) for s in batch}) > 1


def test_sequences_ending_at_different_steps():
    """The shipped MQA model: stories end with EOS at different steps; each still equals its solo run."""
    path = os.path.join(ROOT, "weights", "mqa.bin")
    if not os.path.exists(path):
        pytest.fail("weights/mqa.bin is missing")
    code, verdict = check_batch([path, "-p", PROMPT, "--kv", "--batch", 6, "-s", 11])
    assert code == 0, verdict
    rows = verdict["sequences"]
    assert len(rows) == 6 and all(r["bitwise_identical"] is True for r in rows)
    assert len({r["steps"] for r in rows}) > 1, "expected the stories to end at different steps"
    ends = [s["stop"] for s in sequences([path, "-p", PROMPT, "--kv", "--batch", 6, "-s", 11])]
    assert "eos" in ends


def test_prompt_computed_once_and_shared(small_checkpoints, tmp_path):
    """B copies of a prompt of 2-3 blocks: the first step computes the prompt, the next runs
    one token a sequence. The prompt's two full blocks stay shared; its partly filled block
    is copied by each sequence on its first write, so at the peak the pool holds 2 + B
    blocks, where B contiguous caches of these positions would take 3 B."""
    path, _ = small_checkpoints["gqa"]
    prompt = " ".join(["once"] * 36)
    log = tmp_path / "steps.csv"
    p, _, summary = generate_json([path, "-p", prompt, "--kv", "--batch", 4, "-n", 6, "--ignore-eos", "-s", 1, "-q",
                                   "--log", log])
    rows = [r.split(",") for r in log.read_text().strip().split("\n")[1:]]
    n_prompt = int(rows[0][3])
    assert 32 < n_prompt and n_prompt + 6 - 2 < 48   # every position written lies in the first three blocks
    assert rows[0][1] == "prefill" and rows[0][2] == "1"
    assert rows[1][1] == "mixed" and rows[1][2] == "4" and rows[1][3] == "4"
    # the first sequence got its first token a step before the others, and ends a step before them
    assert all(r[1] == "decode" and r[3] == "4" for r in rows[2:-1]) and rows[-1][2:4] == ["3", "3"]
    assert len(rows) == 7
    assert summary["preemptions"] == 0
    assert summary["kv_peak_blocks"] == 2 + 4 and summary["kv_block_tokens"] == 16
    assert summary["kv_peak_bytes"] == summary["kv_peak_blocks"] * summary["kv_block_bytes"]


def test_preemption_changes_nothing(small_checkpoints):
    """A pool of one full context for 4 sequences: sequences are preempted and recomputed,
    and every one is still bitwise its solo run."""
    path, model = small_checkpoints["mla64"]
    _, info = json_one([path, "--info", "--kv"])
    assert info["kv_block_tokens"] == 16
    block = info["kv_block_bytes"]
    blocks = model.cfg.max_seq_len // 16
    mb = f"{(blocks * block + block // 2) / 2**20:.6f}"
    args = [path, "-p", PROMPT, "--kv", "--batch", 4, "--kv-mem", mb, "-n", 40, "--ignore-eos", "-s", 9]
    p, _, summary = generate_json(args + ["-q"])
    assert summary["preemptions"] > 0, summary
    assert summary["kv_pool_blocks"] == blocks and summary["kv_block_bytes"] == block, summary
    code, verdict = check_batch(args)
    rows = verdict["sequences"]
    assert code == 0 and len(rows) == 4 and all(r["bitwise_identical"] is True for r in rows), verdict


def test_text_blocks_in_order(small_checkpoints):
    path, _ = small_checkpoints["mqa"]
    out = run([path, "-p", PROMPT, "--kv", "--batch", 3, "-n", 5, "--ignore-eos", "-s", 2, "-q"]).stdout.decode()
    heads = re.findall(r"^\[sequence (\d+) seed (\d+) stop (\w+)\]$", out, re.M)
    assert heads == [("0", "2", "steps"), ("1", "3", "steps"), ("2", "4", "steps")]
    assert out.count(PROMPT) == 3


def test_info_reports_the_pool(small_checkpoints):
    path, model = small_checkpoints["gqa"]
    _, info = json_one([path, "--info", "--kv", "--batch", 8])
    cfg = model.cfg
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    assert info["kv_block_tokens"] == 16
    assert info["kv_pool_blocks"] == 8 * cfg.max_seq_len // 16 and info["kv_block_bytes"] == 16 * per_token
    assert info["kv_pool_bytes"] == info["kv_pool_blocks"] * info["kv_block_bytes"]
    assert info["batch"] == 8 and info["kv_bytes_contiguous"] == 8 * cfg.max_seq_len * per_token


@pytest.mark.parametrize("args, message", [
    (["--batch", "0"], "--batch 0 is out of range (1..256)"),
    (["--batch", "257"], "--batch 257 is out of range (1..256)"),
    (["--check-batch"], "--check-batch needs --batch B"),
    (["--kv-mem", "0"], "--kv-mem needs a size above 0 MB"),
    (["--batch", "2", "--dump-logits", "x.bin"],
     "--dump-logits writes one sequence's logits: it takes no --batch or --prompts"),
    (["--batch", "2", "--check-kv"], "--check-kv compares one sequence; --check-batch compares a batch"),
])
def test_bad_batch_flags(small_checkpoints, args, message):
    path, _ = small_checkpoints["gqa"]
    p = run([path, "--kv"] + args, check=False)
    assert p.returncode == 2 and p.stderr.decode() == f"run: {message}\n" and p.stdout == b""


def test_kv_mem_too_small(small_checkpoints):
    path, _ = small_checkpoints["gqa"]
    p = run([path, "--kv", "--batch", "4", "--kv-mem", "0.001"], check=False)
    assert p.returncode == 2 and p.stdout == b""
    assert re.fullmatch(r"run: --kv-mem 0\.001 MB holds 0 blocks of \d+ bytes; one sequence of the full context "
                        r"\(64 tokens\) needs 4\n", p.stderr.decode())
    # one block is one block
    block = int(re.search(r"blocks of (\d+) bytes", p.stderr.decode()).group(1))
    p = run([path, "--kv", "--kv-mem", f"{1.5 * block / 1048576:.6f}"], check=False)
    assert p.returncode == 2 and re.match(r"run: --kv-mem \S+ MB holds 1 block of \d+ bytes;", p.stderr.decode())
