"""End-to-end runs of ./run on small random checkpoints of every variant: generation with
and without the cache, bitwise cache and thread invariance, --check-kv, --info, --ppl,
and one clear error line for every bad input."""
import os
import re
import subprocess

import numpy as np
import pytest

from conftest import PROMPT, ROOT, RUN, VARIANTS, generate_json, json_one, read_logits, run

# the human summary line: only where it is the subject (that it reaches stderr)
SUMMARY = re.compile(r"summary: (\S+) (kv|no-kv) \| prefill (\d+) tokens ([\d.]+) ms \| decode (\d+) steps, "
                     r"([\d.]+) ms/token, ([\d.]+) tokens/s, median step ([\d.]+) ms, mean step ([\d.]+) ms \| "
                     r"KV cache (\d+) bytes")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kv", [False, True])
def test_generates_and_logs(small_checkpoints, variant, kv, tmp_path):
    path, model = small_checkpoints[variant]
    log = tmp_path / "steps.csv"
    args = [path, "-p", PROMPT, "-n", 20, "-s", 7, "--ignore-eos", "--log", log] + (["--kv"] if kv else [])
    p, [sequence], summary = generate_json(args)
    err = p.stderr.decode()
    assert summary["seed"] == sequence["seed"] == 7
    name = f"mla{model.cfg.kv_latent}" if variant.startswith("mla") else variant   # small MLA: latent 16/32
    assert summary["variant"] == name and summary["mode"] == ("kv" if kv else "no-kv")
    assert summary["prefill_tokens"] == sequence["prompt_tokens"] == 5   # BOS + 4 prompt tokens
    assert summary["decode_steps"] == 19           # 20 tokens: one from the prefill, 19 decode steps
    kv_bytes = summary["kv_cache_bytes"]
    cfg = model.cfg
    per_token = (cfg.n_layers * (cfg.kv_latent + cfg.rope_dim) * 4 if cfg.kv_latent
                 else 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4)
    assert kv_bytes == (per_token * cfg.max_seq_len if kv else 0)
    # stderr is a pipe here, not a terminal of its own: no step lines without -v
    assert "[step" not in err and "[prefill]" not in err
    verbose = run(args + ["-v"]).stderr.decode()
    assert len(re.findall(r"^\[step \d+\] pos \d+ token \d+ ms [\d.]+$", verbose, re.M)) == 19
    rows = log.read_text().strip().split("\n")
    assert rows[0] == "step,phase,sequences,n_tokens,pos,token,ms" and len(rows) == 21
    # the prefill runs the 5 prompt tokens; each later step one token with the cache, all of them without
    cells = [r.split(",") for r in rows[1:]]
    assert [c[1] for c in cells] == ["prefill"] + ["decode"] * 19
    assert [int(c[3]) for c in cells] == [5] + ([1] * 19 if kv else list(range(6, 25)))
    assert [int(c[4]) for c in cells] == list(range(4, 24)) and {c[2] for c in cells} == {"1"}
    assert sequence["text"].startswith(PROMPT) and len(sequence["tokens"]) == 20
    assert [int(c[5]) for c in cells] == sequence["tokens"]
    # -q keeps the summary and drops the step lines
    q = run(args + ["-q"])
    assert SUMMARY.search(q.stderr.decode()) and "[step" not in q.stderr.decode()
    assert q.stdout.decode().startswith(PROMPT)


def dump(path, tmp_path, name, *extra):
    out = tmp_path / name
    run([path, "-p", PROMPT, "-k", 1, "-n", 40, "--ignore-eos", "-q", "--dump-logits", out] + list(extra))
    return out.read_bytes()


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_and_uncached_logits_are_bitwise_identical(small_checkpoints, variant, tmp_path):
    path, _ = small_checkpoints[variant]
    forms = [["--mla", "absorb"], ["--mla", "expand"]] if variant.startswith("mla") else [[]]
    for form in forms:
        cached = dump(path, tmp_path, "a.bin", "--kv", *form)
        uncached = dump(path, tmp_path, "b.bin", *form)
        assert len(cached) == 40 * 4096 * 4
        assert cached == uncached, f"{variant} {form}: cached and uncached logits differ"


@pytest.mark.parametrize("variant", ["gqa", "mla64"])
def test_thread_count_does_not_change_results(small_checkpoints, variant, tmp_path):
    path, _ = small_checkpoints[variant]
    for kv in (["--kv"], []):
        one = dump(path, tmp_path, "t1.bin", "--threads", 1, *kv)
        two = dump(path, tmp_path, "t2.bin", "--threads", 2, *kv)
        three = dump(path, tmp_path, "t3.bin", "--threads", 3, *kv)
        assert one == two == three


def test_seeded_sampling_repeats(small_checkpoints):
    path, _ = small_checkpoints["mqa"]
    a = run([path, "-p", PROMPT, "-n", 30, "-s", 123, "-k", 40, "-q", "--ignore-eos"]).stdout
    b = run([path, "-p", PROMPT, "-n", 30, "-s", 123, "-k", 40, "-q", "--ignore-eos", "--kv"]).stdout
    c = run([path, "-p", PROMPT, "-n", 30, "-s", 124, "-k", 40, "-q", "--ignore-eos"]).stdout
    assert a == b
    assert a != c


def test_help_names_every_flag_in_lines_of_100():
    """-h: exit 0, every long flag cli.c parses named, no line over 100 characters (one was 101)."""
    p = run(["-h"])
    text = p.stdout.decode() + p.stderr.decode()
    table = open(os.path.join(ROOT, "serve", "cli.c")).read()
    flags = re.findall(r'\{"([a-z][a-z-]*)", (?:no|required|optional)_argument', table)
    assert len(flags) > 40, flags
    assert [f for f in flags if not re.search(rf"--{f}\b", text)] == []
    assert [line for line in text.splitlines() if len(line) > 100] == []


def test_every_printed_seed_is_one_s_takes(small_checkpoints):
    """A batch's sequence i samples with seed s+i: the largest seed at s+i is taken, one past it
    is refused (it was printed, then refused by -s when given back)."""
    import json
    path, _ = small_checkpoints["mqa"]
    top = 2**63 - 1
    p = run([path, "-p", PROMPT, "-n", 2, "--kv", "--batch", 3, "-s", top - 2, "-q", "--json"])
    assert [json.loads(line)["seed"] for line in p.stdout.decode().splitlines()[:3]] == [top - 2, top - 1, top]
    p = run([path, "-p", PROMPT, "-n", 2, "--kv", "--batch", 3, "-s", top - 1, "-q"], check=False)
    assert p.returncode == 2 and p.stdout == b"", p.stderr
    assert p.stderr.decode() == (f"run: -s {top - 1} with 3 sequences: the last one's seed, s+2, passes the largest "
                                 f"seed, {top}\n")


@pytest.mark.parametrize("variant", VARIANTS)
def test_check_kv(small_checkpoints, variant):
    path, _ = small_checkpoints[variant]
    code, check = json_one([path, "--check-kv", "-p", PROMPT, "-n", 30, "--ignore-eos"])
    assert code == 0 and check["type"] == "check-kv" and check["identical"] is True, check
    pairs = check["comparisons"]
    if variant.startswith("mla"):
        assert [(c["a"], c["b"]) for c in pairs] == [("kv-absorb", "no-kv-expand"), ("kv-absorb", "no-kv-absorb")]
        assert pairs[1]["bitwise_identical"] is True and pairs[1]["identical_tokens"] == 30
    else:
        assert [(c["a"], c["b"]) for c in pairs] == [("kv", "no-kv")]
        assert pairs[0]["bitwise_identical"] is True and pairs[0]["max_abs_logit_diff"] == 0
        assert pairs[0]["identical_tokens"] == 30 and pairs[0]["first_divergent_step"] is None


@pytest.mark.parametrize("variant", ["mla64", "mla128"])
def test_check_kv_checks_the_form_asked_for(small_checkpoints, variant):
    """--mla expand checks the expanded form with the cache (it was ignored: absorbed was checked)."""
    path, _ = small_checkpoints[variant]
    code, check = json_one([path, "--check-kv", "--mla", "expand", "-p", PROMPT, "-n", 30, "--ignore-eos"])
    assert code == 0 and check["identical"] is True, check
    pairs = check["comparisons"]
    assert [(c["a"], c["b"], c["same_form"]) for c in pairs] == [("kv-expand", "no-kv-expand", True),
                                                                  ("kv-expand", "no-kv-absorb", False)]
    assert pairs[0]["bitwise_identical"] is True and pairs[0]["identical_tokens"] == 30


def same_form(check):
    """The --check-kv comparisons of a run with and without the cache in the same form."""
    pairs = [c for c in check["comparisons"] if c["a"].replace("kv", "no-kv") == c["b"]]
    assert all(c["same_form"] is True for c in pairs), check
    return pairs


@pytest.mark.parametrize("variant", ["gqa", "mla64"])
def test_check_kv_fails_when_a_window_changes_the_logits(small_checkpoints, variant, tmp_path):
    """A window of 16 keeps the cached run's keys and values of 16 positions; the uncached
    run recomputes all of them. BOS + 4 prompt tokens: step s computes position 4 + s, and
    position 16 is the first that sees one position less, so the logits first differ at
    step 12 (also in --dump-logits, below), and --check-kv exits 1. A window the run never
    fills changes nothing: exit 0."""
    import sentencepiece as spm
    from conftest import TOKENIZER
    path, _ = small_checkpoints[variant]
    n_prompt = 1 + len(spm.SentencePieceProcessor(model_file=TOKENIZER).encode(PROMPT))
    window, first = 16, 16 - (n_prompt - 1)
    args = [path, "--check-kv", "-p", PROMPT, "-n", 40, "--ignore-eos"]
    code, check = json_one(args + ["--window", window], check=False)
    assert code == 1 and check["identical"] is False and check["window"] == window, check
    [pair] = same_form(check)
    assert pair["first_bitwise_difference"] == first and pair["bitwise_identical"] is False
    form = ["--mla", "absorb"] if variant.startswith("mla") else []
    run([path, "-p", PROMPT, "-k", 1, "-n", 40, "--ignore-eos", "-q", "--kv", "--window", window, "--dump-logits",
         tmp_path / "w.bin"] + form)
    run([path, "-p", PROMPT, "-k", 1, "-n", 40, "--ignore-eos", "-q", "--dump-logits", tmp_path / "n.bin"] + form)
    w, n = read_logits(tmp_path / "w.bin", 4096), read_logits(tmp_path / "n.bin", 4096)
    rows = min(len(w), len(n))
    assert [i for i in range(rows) if not np.array_equal(w[i], n[i])][0] == first
    # stopped before the tokens part, the runs differ in their logits alone: a failure all the same
    diverged = pair["first_divergent_step"]
    assert diverged is not None and diverged > first, pair   # so this checkpoint shows the case
    code, check = json_one([path, "--check-kv", "-p", PROMPT, "-n", diverged, "--ignore-eos", "--window", window],
                           check=False)
    [line] = same_form(check)
    assert line["identical_tokens"] == diverged and line["bitwise_identical"] is False and code == 1
    assert line["first_divergent_step"] is None
    code, check = json_one(args + ["--window", 64], check=False)   # 5 + 40 positions: the window never slides
    assert code == 0 and check["identical"] is True and same_form(check)
    assert all(c["bitwise_identical"] is True for c in same_form(check))


def test_info(small_checkpoints):
    path, model = small_checkpoints["mla64"]
    _, info = json_one([path, "--info"])
    n_params = sum(p.numel() for p in model.parameters())
    assert info["type"] == "info" and info["parameters"] == n_params
    per_token = model.cfg.n_layers * (model.cfg.kv_latent + model.cfg.rope_dim) * 4
    assert info["kv_bytes_per_token"] == per_token and info["kv_bytes_full"] == per_token * model.cfg.max_seq_len
    assert info["kv_bytes_per_token_allocated"] == per_token and info["kv_dtype"] == "fp32"


def test_ppl_matches_pytorch(small_checkpoints, tmp_path):
    import torch
    import sentencepiece as spm
    from conftest import TOKENIZER
    from model import story_windows
    path, model = small_checkpoints["gqa"]
    stories = ["Once upon a time there was a cat. The cat liked milk.",
               "Tom had a red ball.\nHe played with it every day! " * 12,   # longer than the 64-token context
               "Lily saw a bird."]
    text = tmp_path / "stories.txt"
    text.write_text("\n<|endoftext|>\n".join(stories) + "\n<|endoftext|>\n")
    _, ppl = json_one([path, "--ppl", text])
    assert ppl["type"] == "ppl" and ppl["path"] == str(text)
    sp = spm.SentencePieceProcessor(model_file=TOKENIZER)
    story_nll, story_count = [], []
    model.eval()
    with torch.no_grad():
        for s in stories:
            ids = [1] + sp.encode(s.strip()) + [2]
            story_nll.append(0.0)
            story_count.append(0)
            for x, y in story_windows(ids, model.cfg.max_seq_len):
                logits = model(torch.tensor([x]))[0].double()
                story_nll[-1] += float(torch.nn.functional.cross_entropy(logits, torch.tensor(y), reduction="sum"))
                story_count[-1] += len(y)
    total, count = sum(story_nll), sum(story_count)
    assert ppl["stories"] == 3 and ppl["tokens"] == count
    assert abs(ppl["mean_nll"] - total / count) < 1e-4
    # the standard error of the ratio sum(NLL) / sum(tokens) over the 3 stories
    mean, k = total / count, len(stories)
    se = (k / (k - 1) * sum((s - mean * n) ** 2 for s, n in zip(story_nll, story_count))) ** 0.5 / count
    assert abs(ppl["perplexity"] - np.exp(mean)) < 2e-3 and abs(ppl["perplexity_stderr"] - np.exp(mean) * se) < 2e-3
    assert abs(ppl["mean_nll_stderr"] - se) < 2e-4
    # one story has no standard error
    (tmp_path / "one.txt").write_text(stories[0] + "\n")
    _, one = json_one([path, "--ppl", tmp_path / "one.txt"])
    assert one["stories"] == 1 and one["mean_nll_stderr"] is None and one["perplexity_stderr"] is None
    assert one["perplexity"] == pytest.approx(np.exp(one["mean_nll"]))


def test_ppl_progress_only_on_a_terminal(small_checkpoints, tmp_path):
    path, _ = small_checkpoints["mqa"]
    text = tmp_path / "stories.txt"
    text.write_text("".join(f"Story {i}: the cat sat.\n<|endoftext|>\n" for i in range(5)))
    piped = run([path, "--ppl", text])
    assert piped.stderr == b"" and piped.stdout.startswith(b"ppl: ")
    screen, out, _ = on_terminal([path, "--ppl", text], stdout_on_terminal=False)
    assert "ppl: story 5 of 5, " in screen and "PPL = " in screen and screen.endswith("\r\x1b[K")
    assert out == piped.stdout
    assert run([path, "--ppl", text, "-q"]).stderr == b""


# ---- --json: one object a line, parsed with the json module ----

def version_and_commit():
    m = re.fullmatch(r"run (\S+) \(commit (\S+)\)\n", run(["--version"]).stdout.decode())
    return m.group(1), m.group(2)


def test_json_summary(small_checkpoints, tmp_path):
    import sentencepiece as spm
    from conftest import TOKENIZER
    path, _ = small_checkpoints["mqa"]
    log = tmp_path / "steps.csv"
    _, [sequence], summary = generate_json([path, "-p", PROMPT, "-n", 20, "-s", 17, "--top-p", 0.9, "--ignore-eos",
                                            "--kv", "--log", log])
    assert sequence["type"] == "sequence" and len(sequence["tokens"]) == 20 and sequence["seed"] == 17
    version, commit = version_and_commit()
    assert summary["type"] == "summary" and (summary["version"], summary["commit"]) == (version, commit)
    assert summary["variant"] == "mqa" and summary["mode"] == "kv" and summary["seed"] == 17
    assert summary["checkpoint"] == path and summary["top_p"] == pytest.approx(0.9)
    assert summary["prefill_tokens"] == 1 + len(spm.SentencePieceProcessor(model_file=TOKENIZER).encode(PROMPT))
    assert summary["decode_steps"] == summary["decode_tokens"] == 19 and summary["stops"]["steps"] == 1
    # the figures against the step log, computed here
    rows = [r.split(",") for r in log.read_text().strip().split("\n")[1:]]
    decode = sorted(float(r[6]) for r in rows if r[1] == "decode")
    assert summary["step_ms_median"] == pytest.approx((decode[9]), abs=1e-3)
    assert summary["step_ms_mean"] == pytest.approx(sum(decode) / 19, abs=1e-3)
    assert summary["ms_per_token_mean"] == pytest.approx(sum(decode) / 19, abs=1e-3)
    assert summary["prefill_ms"] == pytest.approx(float(rows[0][6]), abs=1e-3)
    assert summary["decode_ms_total"] == pytest.approx(sum(decode), abs=1e-2)
    # tokens/s: the mean is the decode tokens over their time, the median that of each decode
    # step's tokens over its time; a step decodes one token here, so its rate is 1000 / its ms
    # (compared as ms: the log's have 4 decimals)
    assert all(int(r[3]) == 1 for r in rows if r[1] == "decode")
    assert 1000.0 * 19 / summary["tokens_per_s_mean"] == pytest.approx(sum(decode), abs=2e-3)
    assert 1000.0 / summary["tokens_per_s_median"] == pytest.approx(decode[9], abs=1e-3)
    assert summary["tokens_per_s_median"] == pytest.approx(1000.0 / summary["step_ms_median"], rel=1e-6)


# Timing figures that are one measurement or a sum, not a statistic over steps or sequences.
SINGLE_TIMINGS = {"prefill_ms", "decode_ms_total", "fill_ms_total", "tier_wait_ms_total", "tier_stream_read_ms_total",
                  "tier_stream_wait_ms_total", "draft_ms_total", "total_ms", "first_token_ms"}


def timing_keys_without_statistic(obj):
    """The keys of obj that hold a time or a rate (ms, per_s) and name no statistic (mean,
    median, p95), beyond the single measurements and sums."""
    return [k for k in obj if re.search(r"(^|_)(ms|per_s)(_|$)", k) and not re.search(r"_(mean|median|p95)$", k)
            and k not in SINGLE_TIMINGS]


def test_json_timings_name_their_statistic(small_checkpoints, tmp_path):
    """Every timing figure of the summary and the sequences says whether it is a mean or a
    median (or a p95), so that a reader never takes one for the other (bench reports medians)."""
    assert timing_keys_without_statistic({"tokens_per_s": 1, "step_ms_median": 1, "ms_per_token": 1,
                                          "decode_ms_total": 1, "kv_cache_bytes": 1}) == ["tokens_per_s", "ms_per_token"]
    path, _ = small_checkpoints["gqa"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe cat\nA dog ran\n")
    for extra in (["-p", PROMPT], ["-p", PROMPT, "--batch", 2], ["--prompts", prompts, "--batch", 2]):
        _, sequences, summary = generate_json([path, "-n", 6, "--kv", "-q", "-s", 3] + extra)
        assert {"tokens_per_s_mean", "tokens_per_s_median", "per_sequence_ms_per_token_mean"} <= set(summary)
        assert timing_keys_without_statistic(summary) == [], (extra, summary)
        for s in sequences:
            assert "decode_ms_per_token_mean" in s and timing_keys_without_statistic(s) == [], (extra, s)


def test_json_info_ppl_and_check_kv(small_checkpoints, tmp_path):
    path, model = small_checkpoints["gqa"]
    cfg = model.cfg
    version, commit = version_and_commit()
    _, info = json_one([path, "--info", "--kv-dtype", "bf16"])
    assert info["type"] == "info" and (info["version"], info["commit"]) == (version, commit)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2
    assert info["kv_bytes_per_token"] == per_token and info["kv_bytes_full"] == per_token * cfg.max_seq_len
    assert info["kv_dtype"] == "bf16" and info["context"] == cfg.max_seq_len and info["variant"] == "gqa"
    text = tmp_path / "stories.txt"
    text.write_text("The cat sat.\n<|endoftext|>\nTom had a ball and a kite.\n<|endoftext|>\n")
    _, ppl = json_one([path, "--ppl", text, "-s", 3])
    # BOS, the story's pieces and EOS: every token but BOS is scored (both stories fit the context)
    import sentencepiece as spm
    from conftest import TOKENIZER
    sp = spm.SentencePieceProcessor(model_file=TOKENIZER)
    want_tokens = sum(len(sp.encode(s)) + 1 for s in ("The cat sat.", "Tom had a ball and a kite."))
    assert ppl["type"] == "ppl" and ppl["seed"] == 3 and ppl["stories"] == 2 and ppl["tokens"] == want_tokens
    assert ppl["perplexity"] == pytest.approx(np.exp(ppl["mean_nll"]))
    assert ppl["perplexity_stderr"] == pytest.approx(ppl["perplexity"] * ppl["mean_nll_stderr"])
    assert ppl["mean_nll_stderr"] > 0 and ppl["past_context"] is None
    args = [path, "--check-kv", "-p", PROMPT, "-n", 30, "--ignore-eos"]
    code, check = json_one(args)
    assert check["type"] == "check-kv" and check["identical"] is True and code == 0
    [c] = check["comparisons"]
    assert (c["a"], c["b"], c["same_form"], c["steps"], c["identical_tokens"]) == ("kv", "no-kv", True, 30, 30)
    assert c["bitwise_identical"] is True and c["first_bitwise_difference"] is None and c["max_abs_logit_diff"] == 0
    code, check = json_one(args + ["--window", 16], check=False)
    assert code == 1 and check["identical"] is False and check["window"] == 16
    assert check["comparisons"][0]["first_bitwise_difference"] == 12   # position 16: see the test above


# ---- the screen: on one terminal the story reads as text; step lines elsewhere or with -v ----

def on_terminal(args, stderr_on_terminal=True, stdout_on_terminal=True):
    """Runs ./run with stdout and/or stderr on a pseudo-terminal; returns (terminal text,
    stdout pipe, stderr pipe), the terminal's \\r\\n as \\n."""
    import pty
    master, slave = pty.openpty()
    p = subprocess.Popen([RUN] + [str(a) for a in args], stdin=subprocess.DEVNULL,
                         stdout=slave if stdout_on_terminal else subprocess.PIPE,
                         stderr=slave if stderr_on_terminal else subprocess.PIPE)
    os.close(slave)
    screen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:             # EIO: the terminal's last writer has gone
            break
        if not chunk:
            break
        screen += chunk
    out, err = p.communicate(timeout=120)
    os.close(master)
    assert p.returncode == 0, (screen, err)
    return screen.decode().replace("\r\n", "\n"), out, err


def test_one_terminal_shows_the_story_then_the_summary(small_checkpoints):
    path, _ = small_checkpoints["gqa"]
    args = [path, "-p", PROMPT, "-n", 12, "-s", 5, "--ignore-eos", "--kv"]
    story = run(args + ["-q"]).stdout.decode()      # stdout in a pipe: the story alone
    screen, _, _ = on_terminal(args)
    assert "[step" not in screen and "[prefill]" not in screen and "[warm-up]" not in screen
    seed_line, rest = screen.split("\n", 1)
    assert seed_line.startswith("seed 5 | ")
    assert rest.startswith(story + "\nsummary: ")     # the story, a blank line, the summary
    summary = rest[len(story) + 1:].split("\n")
    # on a terminal each part of the summary line starts a line of its own
    assert summary[0] == "summary: gqa kv" and summary[1].startswith("  prefill 5 tokens ")
    assert summary[2].startswith("  decode 11 steps, ") and "median step" in summary[2]


def test_step_lines_elsewhere_or_when_asked(small_checkpoints):
    import sentencepiece as spm
    from conftest import TOKENIZER
    sp = spm.SentencePieceProcessor(model_file=TOKENIZER)
    path, _ = small_checkpoints["gqa"]
    args = [path, "-p", PROMPT, "-n", 12, "-k", 1, "--ignore-eos", "--kv"]
    # stderr a file or pipe (make demo > log 2>&1): no step lines to interleave with the story
    _, _, err = on_terminal(args, stderr_on_terminal=False)
    assert b"[step" not in err and b"summary: " in err
    # stderr a terminal of its own (stdout piped): the step lines go there
    screen, out, _ = on_terminal(args, stdout_on_terminal=False)
    assert out.startswith(PROMPT.encode())
    assert len(re.findall(r"^\[step \d+\]", screen, re.M)) == 11
    # -v on one terminal: each step line on a line of its own, after its token's text
    screen, _, _ = on_terminal(args + ["-v"])
    lines = screen.split("\n")
    steps = [i for i, l in enumerate(lines) if re.match(r"\[(prefill|step \d+)\] ", l)]
    assert len(steps) == 12
    checked = 0
    for i in steps:
        token = int(re.search(r"(?:token|next) (\d+) ms", lines[i]).group(1))
        piece = sp.id_to_piece(token)
        if sp.is_byte(token) or sp.is_control(token):
            continue
        assert lines[i - 1].endswith(piece.replace("\u2581", " ")), (lines[i - 1], piece)
        checked += 1
    assert checked >= 6


# ---- the command line: long names, --flag=value, the prompt from a file or stdin, --version ----

def test_long_flags_mean_the_short_ones(small_checkpoints):
    path, _ = small_checkpoints["gqa"]
    short = run([path, "-p", PROMPT, "-n", 9, "-k", 5, "-t", 0.7, "-s", 11, "-q", "--ignore-eos"])
    long = run(["--prompt=" + PROMPT, "--n-predict", 9, "--top-k=5", "--temp=0.7", "--seed", 11, "--quiet",
                "--ignore-eos", "--", path])
    assert short.stdout == long.stdout and short.stdout.startswith(PROMPT.encode())
    _, [sequence], summary = generate_json(["--prompt=" + PROMPT, "--n-predict", 9, "--top-k=5", "--temp=0.7",
                                            "--seed", 11, "--quiet", "--ignore-eos", path])
    assert (summary["top_k"], summary["top_p"], summary["seed"]) == (5, 1, 11)
    assert summary["temperature"] == pytest.approx(0.7) and summary["decode_steps"] == 8
    assert sequence["text"].encode() == short.stdout.rstrip(b"\n"), (sequence["text"], short.stdout)
    # top-p narrows what is drawn: 0 keeps the most likely token only, as greedy does
    greedy = run([path, "-p", PROMPT, "-n", 9, "-k", 1, "-q", "--ignore-eos"]).stdout
    nucleus = run([path, "-p", PROMPT, "-n", 9, "--top-p", 0, "-t", 1.5, "-s", 4, "-q", "--ignore-eos"]).stdout
    assert nucleus == greedy


def test_prompt_from_a_file_and_from_stdin(small_checkpoints, tmp_path):
    path, _ = small_checkpoints["mqa"]
    args = ["-n", 6, "-k", 1, "-q", "--ignore-eos"]
    want = run([path, "-p", PROMPT] + args).stdout
    text = tmp_path / "prompt.txt"
    text.write_text(PROMPT + "\n\n")                     # trailing line breaks are dropped
    assert run([path, "-f", text] + args).stdout == want
    assert run([path, "--file=" + str(text)] + args).stdout == want
    p = subprocess.run([RUN, path, "-p", "-"] + [str(a) for a in args], input=(PROMPT + "\r\n").encode(),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    assert p.returncode == 0 and p.stdout == want, p.stderr
    # a text of two lines: CRLF breaks read as LF, as --prompts reads them (the CR went to the model)
    unix, dos = tmp_path / "unix.txt", tmp_path / "dos.txt"
    unix.write_bytes(PROMPT.encode() + b"\nand then\n")
    dos.write_bytes(PROMPT.encode() + b"\r\nand then\r\n")
    lf, crlf = (generate_json([path, "-f", f] + args)[1][0] for f in (unix, dos))
    assert (crlf["prompt_tokens"], crlf["tokens"]) == (lf["prompt_tokens"], lf["tokens"]), (lf, crlf)
    (tmp_path / "bad.txt").write_bytes(b"Once \xff upon")
    expect_error([path, "-f", tmp_path / "bad.txt"], 1, f"{tmp_path / 'bad.txt'} is not valid UTF-8 text")
    (tmp_path / "nul.txt").write_bytes(b"Once\0upon")
    expect_error([path, "-f", tmp_path / "nul.txt"], 1, "holds a NUL byte")
    expect_error([path, "-f", tmp_path / "missing.txt"], 1, "cannot open")
    expect_error([path, "-f", text, "-p", "x"], 2, "-p and -f cannot be combined")


def test_version_names_the_commit():
    p = run(["--version"])
    m = re.fullmatch(r"run (\d+\.\d+\.\d+) \(commit (\S+)\)\n", p.stdout.decode())
    assert m, p.stdout
    git = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL)
    head = git.stdout.decode().strip() if git.returncode == 0 else "unknown"
    assert m.group(2) in (head, head + "-dirty"), (m.group(2), head)


# ---- bad input: one line on stderr, a non-zero exit, nothing on stdout ----

def expect_error(args, code, needle):
    p = run(args, check=False)
    err = p.stderr.decode()
    assert p.returncode == code, (args, p.returncode, err)
    assert err.count("\n") == 1 or (code == 2 and "no checkpoint" in err), err
    assert needle in err, err
    assert p.stdout == b"" or code == 2 and b"Usage" not in p.stdout
    return err


def test_bad_flags(small_checkpoints):
    path, _ = small_checkpoints["mha"]
    expect_error([path, "--bogus"], 2, "unknown flag --bogus")
    expect_error([path, "-n"], 2, "-n needs a value")
    expect_error([path, "-n", "0"], 2, "-n 0 is out of range")
    expect_error([path, "-n", "65"], 2, "-n 65 is out of range (1..64")   # beyond the small context
    expect_error([path, "-n", "ten"], 2, "-n needs an integer")
    expect_error([path, "-k", "0"], 2, "-k 0 is out of range")
    expect_error([path, "-k", "4097"], 2, "-k 4097 is out of range (1..4096")
    expect_error([path, "-t", "-1"], 2, "-t -1 is out of range")
    expect_error([path, "-t", "nan"], 2, "-t needs a number")
    expect_error([path, "--threads", "0"], 2, "--threads 0 is out of range")
    expect_error([path, "--threads", "10000"], 2, "--threads 10000 is out of range")
    expect_error([path, "--mla", "fold"], 2, "--mla takes absorb or expand")
    expect_error([path, path], 2, "unexpected argument")
    # every mode at once: the first two are named (the list of them once overflowed its array)
    expect_error([path, "--info", "--check-kv", "--ppl", path, "--check-batch", "--batch", 2, "--check-spec",
                  "--draft", "ngram", "--kv"], 2, "--info and --check-kv cannot be combined: one mode a run")
    expect_error([path, "--ppl", path, "-p", "Once"], 2, "--ppl scores the text of its file whole: it takes no -p or -f")
    expect_error([path, "--ppl", path, "-n", 5], 2, "--ppl scores the text of its file whole: it takes no -n")


def test_bad_prompts(small_checkpoints):
    path, _ = small_checkpoints["mha"]
    expect_error([path, "-p", "word " * 100], 1, "longer than the context (64 tokens)")
    expect_error([path, "-p", b"bad \xff\xfe utf8"], 1, "not valid UTF-8")
    expect_error([path, "-p", b"cut \xe2\x82"], 1, "not valid UTF-8")


def test_bad_files(small_checkpoints, tmp_path):
    path, _ = small_checkpoints["mha"]
    expect_error([tmp_path / "missing.bin"], 1, "cannot open checkpoint")
    data = open(path, "rb").read()
    (tmp_path / "trunc.bin").write_bytes(data[: len(data) // 2])
    expect_error([tmp_path / "trunc.bin"], 1, "truncated")
    (tmp_path / "magic.bin").write_bytes(b"GGUF" + data[4:])
    expect_error([tmp_path / "magic.bin"], 1, "bad magic")
    expect_error([path, "--ppl", tmp_path / "nothing.txt"], 1, "cannot open")
    (tmp_path / "empty.txt").write_text("\n<|endoftext|>\n")
    expect_error([path, "--ppl", tmp_path / "empty.txt"], 1, "no story found")
    expect_error([path, "--log", tmp_path / "no" / "dir.csv"], 1, "cannot write")


def test_messages_of_issue_45(small_checkpoints):
    """A size far out of range is quoted as typed, not as 1.04858e+06; -t above 2 (llama.cpp's
    thread flag) is the temperature here, and one line says so; --temp and a small -t say
    nothing."""
    path, _ = small_checkpoints["mqa"]
    p = run([path, "--kv-mem", "1048577"], check=False)
    assert p.returncode == 2 and p.stderr.decode() == "run: --kv-mem 1048577 is out of range (0..1048576)\n"
    note = "run: note: -t 4 is the temperature (as in llama2.c); the thread count is --threads\n"
    assert run([path, "-t", 4, "-n", 2, "-q"]).stderr.decode().startswith(note)
    for args in (["--temp", 4], ["-t", "0.8"], ["-t", 2]):
        assert "note:" not in run([path, "-n", 2, "-q"] + args).stderr.decode(), args


def test_disturbed_steps_counted_from_the_steps(small_checkpoints, tmp_path):
    """The summary's steps_over_3x_median is the count of decode steps in the --log over 3x
    their median, and `disturbed` says whether they are over 2% of them (20 steps at least)."""
    import csv
    import json
    import statistics
    path, _ = small_checkpoints["gqa"]
    log = tmp_path / "steps.csv"
    out = run([path, "-p", "Once", "--kv", "-n", 60, "--ignore-eos", "-q", "--json", "--log", log]).stdout.decode()
    summary = json.loads(out.strip().splitlines()[-1])
    with open(log) as f:
        ms = [float(r["ms"]) for r in csv.DictReader(f)][1:]
    median = statistics.median(ms)
    slow = sum(1 for m in ms if m > 3 * median)
    assert summary["decode_steps"] == len(ms) == 59
    assert abs(summary["step_ms_median"] - median) < 1e-3
    assert summary["steps_over_3x_median"] == slow
    assert summary["disturbed"] is (slow * 50 > len(ms))


def test_closed_stdin_and_paths_that_drive_a_terminal(small_checkpoints, tmp_path):
    """--prompts - with standard input closed says so (as -p - does); a path holding an
    escape sequence is echoed with its control characters as '?', never raw."""
    import os
    path, _ = small_checkpoints["mqa"]
    for flag, what in (("-p", "the prompt"), ("--prompts", "the --prompts file")):
        p = subprocess.run([RUN, path, flag, "-", "-n", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           timeout=60, preexec_fn=lambda: os.close(0))
        assert p.returncode == 1 and p.stderr.decode() == f"run: cannot read {what}: standard input is closed\n", \
            p.stderr
    evil = tmp_path / "a\x1b[2Jb\x07.txt"
    p = run([path, "-f", evil, "-n", 2], check=False)
    err = p.stderr.decode()
    assert p.returncode == 1 and "\x1b" not in err and "\x07" not in err, err
    assert f"cannot open {tmp_path}/a?[2Jb?.txt" in err, err


def test_flags_that_would_do_nothing(small_checkpoints, tmp_path):
    """--mla on a model without latent attention is refused; --batch without --kv runs, with
    one note that every step recomputes; the README's prompts file ships."""
    gqa, _ = small_checkpoints["gqa"]
    p = run([gqa, "--mla", "absorb", "-n", 2], check=False)
    assert p.returncode == 2 and p.stderr.decode() == "run: --mla chooses an MLA model's form: gqa has no latent attention\n"
    note = "run: note: without --kv every step recomputes each sequence whole; --kv keeps a cache\n"
    assert run([gqa, "--batch", 2, "-n", 2]).stderr.decode().startswith(note)
    assert note not in run([gqa, "--batch", 2, "-n", 2, "--kv"]).stderr.decode()
    mla, _ = small_checkpoints["mla64"]
    assert run([mla, "--mla", "expand", "-n", 2, "-q"]).returncode == 0
    lines = [line for line in open(os.path.join(ROOT, "docs", "prompts.txt")).read().splitlines() if line.strip()]
    assert len(lines) == 6


def test_json_escapes_every_control_character(small_checkpoints):
    """A prompt holding every C0 control but NUL, DEL, a quote and a backslash comes back in
    --json as the same string; the text beside it stays valid JSON."""
    import json
    path, _ = small_checkpoints["mqa"]
    prompt = "a" + "".join(chr(c) for c in range(1, 32)) + "\x7f\"\\b"
    out = run([path, "-p", prompt, "-n", 3, "-q", "--json"]).stdout.decode()
    sequence = json.loads(out.splitlines()[0])
    assert sequence["prompt"] == prompt
    assert all(ord(ch) >= 0x20 or ch in "\n\t" for ch in sequence["text"])



@pytest.mark.parametrize("args, says", [
    (["-n", "5\nx"], "-n needs an integer, got '5?x'"),
    (["--bogus\x1b[31m"], "unknown flag --bogus?[31m (see -h)"),
    (["--shape", "gqa,lay\x1bers=2", "--info"], "--shape: unknown key 'lay?ers'"),
    (["-n", "5\u009b2J"], "-n needs an integer, got '5?2J'"),
])
def test_control_characters_in_a_message_show_as_question_marks(small_checkpoints, args, says):
    """A flag's value quoted in a message keeps the message one line and cannot drive a terminal:
    a newline, an escape sequence's ESC or a C1 CSI (U+009B) shows as '?'."""
    base = [] if "--shape" in args else [small_checkpoints["gqa"][0]]
    p = run(base + args, check=False)
    err = p.stderr.decode()
    assert p.returncode == 2 and err.count("\n") == 1 and err.startswith("run: " + says), err
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in err[:-1]), err


def test_messages_name_the_flag_given(small_checkpoints):
    """--kv-budget and --window are one flag: a refusal names the one written."""
    ckpt = small_checkpoints["gqa"][0]
    for flag in ("--kv-budget", "--window"):
        p = run([ckpt, flag, 32, "-n", 3], check=False)
        assert p.returncode == 2 and p.stderr.decode() == \
            f"run: {flag} needs --kv: without the cache every step recomputes the whole sequence\n", p.stderr
        p = run([ckpt, "--kv", flag, 32, "--kv-offload", "/nonexistent/tier", "-n", 3], check=False)
        assert p.returncode == 2 and p.stderr.decode() == \
            f"run: --kv-offload swaps a sequence's cache: it needs --kv and takes no {flag}\n", p.stderr


def test_default_top_k_over_a_small_vocabulary():
    """-k not given over a vocabulary under 40: every token is kept (the settings say so); a
    -k given over it is still refused."""
    _, info = json_one(["--shape", "gqa,layers=1,vocab=16", "--info"])
    assert info["vocab"] == 16
    p, _, summary = generate_json(["--shape", "gqa,layers=1,vocab=16", "-p", "1 2", "-n", 3, "-q", "--ignore-eos"])
    assert summary["top_k"] == 16 and summary["tokens_generated"] == 3
    p = run(["--shape", "gqa,layers=1,vocab=16", "-p", "1 2", "-n", 3, "-k", 40], check=False)
    assert p.returncode == 2 and p.stderr.decode().endswith("-k 40 is out of range (1..16, the vocabulary)\n")
