"""Serving a file of prompts with continuous batching (--prompts): every prompt's output
equals its solo run with the same seed whatever the slots and the order of admission, the
slots stay full, and a bad file is refused, naming the line, before anything runs."""
import re

import pytest

from conftest import generate_json, json_one, run

PROMPTS = [
    "Once upon a time",
    "Tom had a red ball. He liked to throw it high in the sky and catch it again and again with his",
    "Lily",
    "The cat sat on the mat and looked at the bird outside",
    "One day, a little girl named Sue went to the park with her mom. They saw a big tree",
    "Ben and Mia",
    "Once upon a time, there was a dog",
    "Once upon a time, there was a cat",
]


@pytest.fixture
def prompt_file(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(PROMPTS[:3]) + "\n\n" + "\n".join(PROMPTS[3:]) + "\n")  # a blank line is skipped
    return f


def served(args):
    """The sequences' JSON lines and the summary's, checked against the sequences."""
    _, sequences, summary = generate_json(args)
    assert summary["serving"] == ("--prompts" in map(str, args))
    assert summary["tokens_generated"] == sum(s["generated"] for s in sequences)
    return sequences, summary


@pytest.mark.parametrize("variant", ["mqa", "mla128"])
def test_each_prompt_equals_its_solo_run(small_checkpoints, prompt_file, variant):
    path, _ = small_checkpoints[variant]
    common = ["-n", 20, "-k", 10, "--kv"]
    out, summary = served([path, "--prompts", prompt_file, "--batch", 3, "-s", 100, "-q"] + common)
    assert [o["index"] for o in out] == list(range(len(PROMPTS)))
    assert [o["prompt"] for o in out] == PROMPTS and [o["seed"] for o in out] == list(range(100, 108))
    for o in out:
        alone, _ = served([path, "-p", o["prompt"], "-s", o["seed"], "-q"] + common)
        assert alone[0]["tokens"] == o["tokens"] and alone[0]["text"] == o["text"], o["prompt"]
        assert o["text"].startswith(o["prompt"]) and o["first_token_ms"] > 0
    assert summary["mode"] == "kv" and summary["sequences"] == 8 and summary["slots"] == 3 and summary["steps"] > 0
    assert summary["tokens_generated"] == sum(o["generated"] for o in out)
    ttft = sorted(o["first_token_ms"] for o in out)
    assert summary["first_token_ms_median"] == pytest.approx((ttft[3] + ttft[4]) / 2, abs=1e-3), (summary, ttft)
    assert 0 < summary["token_ms_median"] <= summary["token_ms_p95"] and summary["tokens_per_s_mean"] > 0
    assert summary["tokens_per_s_median"] > 0


def test_check_batch_with_prompts(small_checkpoints, prompt_file):
    path, _ = small_checkpoints["gqa"]
    for kv in (["--kv"], []):
        code, verdict = json_one([path, "--prompts", prompt_file, "--batch", 4, "-n", 12, "-s", 5, "--check-batch"] + kv)
        assert code == 0 and verdict["identical"] is True and verdict["batch"] == 8 and verdict["slots"] == 4
        assert verdict["sequences_identical"] == 8 and [s["bitwise_identical"] for s in verdict["sequences"]] == [True] * 8


def test_slots_refill_as_sequences_end(small_checkpoints, prompt_file, tmp_path):
    """With 3 slots and 8 requests, a slot freed at the end of a sequence is filled at the
    next step: the slots stay full until the queue runs dry."""
    path, _ = small_checkpoints["gqa"]
    log = tmp_path / "steps.csv"
    out, _ = served([path, "--prompts", prompt_file, "--batch", 3, "-n", 9, "--kv", "-s", 1, "-q", "--log", log])
    rows = [r.split(",") for r in log.read_text().strip().split("\n")[1:]]
    active = [int(r[2]) for r in rows]
    assert max(active) == 3 and all(a >= 1 for a in active)
    total_steps = sum(o["generated"] for o in out)          # one token a sequence a step
    assert len(rows) < total_steps                          # batched
    last_full = max(i for i, a in enumerate(active) if a == 3)
    assert all(a == 3 for a in active[1:last_full + 1] if a), active  # no idle slot while requests wait
    assert any(r[1] == "mixed" for r in rows[2:])           # a prompt admitted beside running sequences


def bad(path, lines, message_re, tmp_path, raw=None):
    f = tmp_path / "p.txt"
    if raw is not None:
        f.write_bytes(raw)
    else:
        f.write_text(lines)
    p = run([path, "--prompts", f, "--kv", "--batch", 2, "-n", 3], check=False)
    assert p.returncode == 1 and p.stdout == b"", p.stderr.decode()
    err = p.stderr.decode()
    assert re.fullmatch("run: " + message_re.replace("FILE", re.escape(str(f))) + "\n", err), err


def test_bad_prompt_files(small_checkpoints, tmp_path):
    path, _ = small_checkpoints["gqa"]
    bad(path, "", r"FILE holds no prompt \(one prompt a line\)", tmp_path)
    bad(path, "\n  \n", r"FILE holds no prompt \(one prompt a line\)", tmp_path)
    bad(path, None, r"FILE:2: the prompt is not valid UTF-8 text", tmp_path, raw=b"fine\nbad \xff byte\nfine\n")
    bad(path, "ok\nok\n" + "word " * 80 + "\n", r"FILE:3: the prompt is \d+ tokens, longer than the context \(64 tokens\)",
        tmp_path)
    p = run([path, "--prompts", tmp_path / "missing.txt"], check=False)
    assert p.returncode == 1 and p.stderr.decode().startswith("run: cannot open ") and p.stdout == b""
    p = run([path, "--prompts", tmp_path / "p.txt", "-p", "x"], check=False)
    assert p.returncode == 2 and p.stderr.decode() == "run: -p and --prompts cannot be combined\n"


def test_one_token_requests_keep_the_slots_full(small_checkpoints, tmp_path):
    """512 requests of one word that each end in their prefill step (-n 1), through 256
    slots: none waits for a prompt computed in the same step, since that one is gone after
    it (and BOS alone is no shared prefix). The step's prompt budget (the context's worth of
    prompt tokens) is all that spreads them over steps."""
    path, model = small_checkpoints["gqa"]
    f = tmp_path / "hi.txt"
    f.write_text("Hi\n" * 512)
    sequences, summary = served([path, "--prompts", f, "--kv", "--batch", 256, "-n", 1, "-q"])
    assert summary["requests_served"] == 512 and all(s["generated"] == 1 for s in sequences)
    n_prompt = sequences[0]["prompt_tokens"]   # BOS and "Hi"
    assert all(s["prompt_tokens"] == n_prompt for s in sequences)
    per_step = model.cfg.max_seq_len // n_prompt
    assert summary["steps"] == -(-512 // per_step), (summary["steps"], per_step)


def test_queued_prompts_hold_their_tokens_only(tmp_path):
    """A queue of short prompts costs a few hundred bytes a line, whatever the context: a
    request's sampler and block tables exist only from its admission to its end. The peak
    RSS of 200,000 two-token prompts against 20,000, through 64 slots of a tiny generated
    model (so that the steps cost nothing), over the 180,000 lines between them."""
    import os
    from conftest import run_measured, sanitized
    shape = "layers=1,dim=32,heads=2,kv_heads=2,head_dim=16,ffn=64,vocab=64,ctx=16"
    env = dict(os.environ)
    if sanitized():  # ASan keeps freed blocks in a quarantine: the retired requests would count as held
        env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":quarantine_size_mb=0"
    peaks = []
    for n in (20_000, 200_000):
        f = tmp_path / f"ids{n}.txt"
        f.write_text("5 6\n" * n)
        args = ["--shape", shape, "--prompts", f, "--kv", "--batch", 64, "-n", 1, "-q"]
        code, err, rss_kb = run_measured(args, env)
        assert code == 0, err
        peaks.append(rss_kb)
    per_line = (peaks[1] - peaks[0]) * 1024 / 180_000
    assert per_line < 256, (per_line, peaks)  # a Request with its sampler and caches inside took 413


def test_interrupted_summary_counts_what_ran(small_checkpoints, tmp_path):
    """SIGINT in the middle of 300 requests through 2 slots: the summary counts the requests
    served, cut short and never started (together 300), and its latencies come from the
    requests that got a token."""
    import json
    import signal
    import subprocess
    import time
    from conftest import RUN
    path, _ = small_checkpoints["mqa"]
    f = tmp_path / "many.txt"
    f.write_text("".join(f"Story {i} begins\n" for i in range(300)))
    log, out = tmp_path / "steps.csv", tmp_path / "out.jsonl"
    with open(out, "wb") as sink:
        p = subprocess.Popen([RUN, path, "--prompts", str(f), "--kv", "--batch", "2", "-n", "20", "--ignore-eos", "-q",
                              "--json", "--log", str(log)], stdout=sink, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while (not log.exists() or log.read_text().count("\n") < 40) and time.monotonic() < deadline:
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 130, err
    objs = [json.loads(line) for line in out.read_text().splitlines()]
    sequences, summary = objs[:-1], objs[-1]
    ended = [s for s in sequences if s["stop"] != "interrupted"]
    cut = [s for s in sequences if s["stop"] == "interrupted" and s["generated"] > 0]
    never = [s for s in sequences if s["generated"] == 0]
    assert len(sequences) == summary["sequences"] == 300
    assert summary["requests_served"] == len(ended) > 0 and summary["requests_cut"] == len(cut)
    assert summary["requests_not_started"] == len(never) > 100
    assert len(ended) + len(cut) + len(never) == 300 and summary["stops"]["interrupted"] == len(cut)
    assert summary["tokens_generated"] == sum(s["generated"] for s in sequences)
    assert all(s["first_token_ms"] is None for s in never)  # no token, no time to it (it printed 0.0)
    firsts = sorted(s["first_token_ms"] for s in ended + cut)
    assert summary["first_token_ms_median"] > 0 and firsts[0] <= summary["first_token_ms_median"] <= firsts[-1]
