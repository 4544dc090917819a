"""train/prepare.py and train/train.py as a user meets them: the committed tokenizer kept
unless --new-tokenizer, one line and a non-zero exit for every bad input, a second run
into an existing --out refused, a --resume of another run refused, Ctrl-C and SIGTERM
leaving a last.pt to resume from, the validation's progress bar, warmup as a fraction.
Tiny models (--small, --ctx 32, batches of 4) on token files made in tmp_path."""
import argparse
import csv
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import sentencepiece as spm
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "train"))
import train  # noqa: E402

TOKENIZER = os.path.join(ROOT, "tokenizer", "tokenizer.model")
TINY = ["--small", "--ctx", "32", "--batch-size", "4", "--threads", "1"]
WORDS = ("the cat dog sun tree little girl boy happy sad ran jumped played ball park home friend "
         "mom said one day once upon a time big red blue".split())


def run_py(script, *args, **kw):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train", script), *map(str, args)],
                          capture_output=True, text=True, timeout=300, **kw)


def assert_one_line_error(p, *words):
    """A refusal: non-zero exit, no traceback, and one line on stderr besides any progress bar,
    naming the problem and what to do."""
    assert p.returncode != 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    lines = [line for line in p.stderr.replace("\r", "\n").splitlines() if line.strip() and "|" not in line]
    assert len(lines) == 1, p.stderr  # progress bars (their lines hold '|') aside
    last = lines[0]
    assert last.startswith(("prepare.py: ", "train.py: ")), p.stderr
    for w in words:
        assert w in last, last
    return last


# ---------------------------------------------------------------- prepare.py

def write_stories(path, n, seed):
    rng = np.random.default_rng(seed)
    stories = [" ".join(rng.choice(WORDS, rng.integers(8, 30))).capitalize() + "." for _ in range(n)]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n<|endoftext|>\n".join(stories) + "\n")
    return stories


@pytest.fixture
def texts(tmp_path):
    train_txt, valid_txt = tmp_path / "train.txt", tmp_path / "valid.txt"
    return train_txt, valid_txt, write_stories(train_txt, 60, 0), write_stories(valid_txt, 10, 1)


@pytest.mark.parametrize("flags", [[], ["--reuse-tokenizer"]])
def test_prepare_keeps_the_tokenizer_by_default(tmp_path, texts, flags):
    """The default (and the old --reuse-tokenizer) encodes with the existing model and leaves it
    as it is; a copy of the committed tokenizer stands in for it so the repository's is never at risk."""
    train_txt, valid_txt, train_stories, _ = texts
    shutil.copy(TOKENIZER, tmp_path / "tok.model")
    p = run_py("prepare.py", "--train", train_txt, "--valid", valid_txt, "--tokenizer", tmp_path / "tok",
               "--out", tmp_path / "data", *flags)
    assert p.returncode == 0, p.stderr
    with open(TOKENIZER, "rb") as a, open(tmp_path / "tok.model", "rb") as b:
        assert a.read() == b.read()
    assert not (tmp_path / "tok.vocab").exists()
    sp = spm.SentencePieceProcessor(model_file=TOKENIZER)
    want = np.concatenate([[1] + sp.encode(s) + [2] for s in train_stories])
    assert np.array_equal(np.fromfile(tmp_path / "data" / "train.bin", dtype=np.uint16), want)
    assert (tmp_path / "data" / "valid.bin").stat().st_size > 0


def test_prepare_new_tokenizer(tmp_path, texts):
    train_txt, valid_txt, _, _ = texts
    shutil.copy(TOKENIZER, tmp_path / "tok.model")
    p = run_py("prepare.py", "--train", train_txt, "--valid", valid_txt, "--tokenizer", tmp_path / "tok",
               "--out", tmp_path / "data", "--new-tokenizer", "--vocab-size", "300")
    assert p.returncode == 0, p.stderr
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tok.model"))
    assert sp.get_piece_size() == 300 and (sp.bos_id(), sp.eos_id()) == (1, 2)
    assert np.fromfile(tmp_path / "data" / "train.bin", dtype=np.uint16).max() < 300


def test_prepare_bad_inputs(tmp_path, texts):
    train_txt, valid_txt, _, _ = texts
    data = tmp_path / "data"
    p = run_py("prepare.py", "--train", tmp_path / "nope.txt", "--valid", valid_txt, "--out", data)
    assert_one_line_error(p, "nope.txt", "does not exist")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    p = run_py("prepare.py", "--train", train_txt, "--valid", tmp_path / "latin1.txt", "--out", data)
    assert_one_line_error(p, "latin1.txt", "UTF-8")
    p = run_py("prepare.py", "--train", train_txt, "--valid", valid_txt, "--out", data,
               "--tokenizer", tmp_path / "missing")
    assert_one_line_error(p, "missing.model", "--new-tokenizer")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    p = run_py("prepare.py", "--train", train_txt, "--valid", valid_txt, "--out", data,
               "--tokenizer", tmp_path / "junk")
    assert_one_line_error(p, "junk.model", "not a SentencePiece model")
    assert not data.exists()


# ---------------------------------------------------------------- train.py

def token_stories(n, seed):
    """n stories of random ids, each BOS ... EOS, as prepare.py writes them."""
    rng = np.random.default_rng(seed)
    return np.concatenate([[1, *rng.integers(3, 4096, rng.integers(5, 60)), 2] for _ in range(n)]).astype(np.uint16)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    token_stories(200, 0).tofile(d / "train.bin")
    token_stories(40, 1).tofile(d / "valid.bin")
    return d


@pytest.fixture(scope="module")
def finished(data, tmp_path_factory):
    """A finished 3-step mha run: (its --out, the CompletedProcess)."""
    out = tmp_path_factory.mktemp("runs") / "mha"
    p = run_py("train.py", "--variant", "mha", *TINY, "--steps", "3", "--data", data, "--out", out)
    assert p.returncode == 0, p.stderr
    return out, p


def test_final_validation_shows_progress(finished, data):
    """The final validation's bar stays on stderr with every batch counted."""
    _, p = finished
    valid = np.fromfile(data / "valid.bin", dtype=np.uint16)
    n = len(list(train.validation_batches(valid, 32, 32)))
    assert n >= 2
    bar = p.stderr[p.stderr.rindex("validation:"):]
    assert f" {n}/{n} " in bar, p.stderr
    assert "final validation ..." in p.stdout and "done: 3 steps" in p.stdout


def test_second_run_into_out_is_refused(finished, data):
    out, _ = finished
    before = {f: (out / f).read_bytes() for f in ("log.csv", "last.pt")}
    p = run_py("train.py", "--variant", "mha", *TINY, "--steps", "3", "--data", data, "--out", out)
    assert_one_line_error(p, str(out), "--resume", "--force")
    assert {f: (out / f).read_bytes() for f in before} == before


def test_force_starts_afresh(finished, data, tmp_path):
    out = tmp_path / "mha"
    shutil.copytree(finished[0], out)
    (out / "log.csv").write_text("step,minutes,tokens,lr,train_loss,val_loss\n999,0,0,0,,\n")
    p = run_py("train.py", "--variant", "mha", *TINY, "--steps", "2", "--data", data, "--out", out, "--force")
    assert p.returncode == 0, p.stderr
    assert "999," not in (out / "log.csv").read_text()
    assert torch.load(out / "last.pt")["step"] == 2


@pytest.mark.parametrize("change, words", [
    (["--variant", "gqa"], ["mha run, not gqa", "--variant mha"]),
    (["--variant", "mha", "--small", "--ctx", "64"], ["max_seq_len 32 (last.pt) vs 64", "--ctx"]),
    (["--variant", "mha", "--ctx", "32"], ["dim 64 (last.pt) vs 512", "--small"]),
    (["--variant", "mha", "--small", "--ctx", "32", "--batch-size", "8"], ["128 tokens", "--batch-size"]),
    (["--variant", "mha", "--small", "--ctx", "32", "--batch-size", "4", "--steps", "5"], ["budget is 3 steps"]),
])
def test_resume_of_another_run_is_refused(finished, data, change, words):
    out, _ = finished
    before = {f: (out / f).read_bytes() for f in ("log.csv", "last.pt")}
    args = change + ["--threads", "1"] + ([] if "--steps" in change else ["--steps", "3"])
    p = run_py("train.py", *args, "--data", data, "--out", out, "--resume")
    assert_one_line_error(p, "--resume", *words)
    assert {f: (out / f).read_bytes() for f in before} == before


def test_missing_inputs_say_what_to_run(data, tmp_path):
    p = run_py("train.py", "--variant", "mha", *TINY, "--data", tmp_path / "nodata", "--out", tmp_path / "o")
    assert_one_line_error(p, "train.bin is missing", "train/prepare.py")
    p = run_py("train.py", "--variant", "mha", *TINY, "--data", data, "--out", tmp_path / "o", "--resume")
    assert_one_line_error(p, "last.pt is missing", "without --resume")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "last.pt").write_bytes(b"not a checkpoint")
    p = run_py("train.py", "--variant", "mha", *TINY, "--data", data, "--out", tmp_path / "o", "--resume")
    assert_one_line_error(p, "last.pt cannot be read", "--force")
    short = tmp_path / "short"
    short.mkdir()
    token_stories(1, 0)[:20].tofile(short / "train.bin")
    shutil.copy(data / "valid.bin", short / "valid.bin")
    p = run_py("train.py", "--variant", "mha", *TINY, "--data", short, "--out", tmp_path / "o2")
    assert_one_line_error(p, "20 tokens", "train/prepare.py")
    assert not (tmp_path / "nodata").exists() and not (tmp_path / "o2").exists()


def start(args):
    """train.py in the background, SIGINT at its default (Python's KeyboardInterrupt) even where
    the test runner was started with SIGINT ignored, as a background job is; returns once the
    run has announced itself, the point from which a stop must leave a last.pt."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train", "train.py"), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = proc.stdout.readline()
    return proc, first


def stop(proc, signum):
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_ctrl_c_and_sigterm_save_last_pt(data, tmp_path):
    """A stop saves last.pt at the step it names; --resume continues from that step. The budget is
    far more than the test lets it run, and no periodic save or validation falls in the run
    (--save-minutes, --eval-tokens), so last.pt can only come from the stop."""
    out = tmp_path / "mha"
    args = ["--variant", "mha", *TINY, "--steps", 10 ** 6, "--save-minutes", 10 ** 6, "--eval-tokens", 10 ** 12,
            "--data", data, "--out", out]
    proc, first = start(args)
    assert "from scratch" in first, first + proc.stderr.read()
    p = stop(proc, signal.SIGINT)
    last = assert_one_line_error(p, "stopped at step", "last.pt saved", "--resume")
    step = int(last.split("stopped at step ")[1].split(" of")[0].replace(",", ""))
    ck = torch.load(out / "last.pt")
    assert ck["step"] == step and ck["tokens"] == step * 4 * 32

    proc, first = start(args + ["--resume"])
    assert f"resumed at step {step:,}" in first, first + proc.stderr.read()
    p = stop(proc, signal.SIGTERM)
    assert_one_line_error(p, "stopped at step", "last.pt saved")
    ck = torch.load(out / "last.pt")
    assert ck["step"] >= step and len(ck["sittings"]) == 2 and ck["sittings"][1]["first_step"] == step


def test_a_validation_cut_short_runs_on_resume(data, tmp_path):
    """A stop that lands during a validation loses it; --resume runs it before the next step,
    so the loss curve keeps a point at every eval_tokens. The stop is staged: last.pt is
    edited to say the validation at its step never finished."""
    out = tmp_path / "mha"
    args = ["--variant", "mha", *TINY, "--steps", 10 ** 6, "--save-minutes", 10 ** 6, "--data", data, "--out", out]
    proc, _ = start(args + ["--eval-tokens", 10 ** 12])
    stop(proc, signal.SIGINT)
    ck = torch.load(out / "last.pt")
    step = ck["step"]
    assert ck["evals_done"] == 0
    ck["evals_done"] = -1   # the validation at token 0 on a grid of one step: cut short
    torch.save(ck, out / "last.pt")
    proc, first = start(args + ["--eval-tokens", 10 ** 12, "--resume"])
    assert f"resumed at step {step:,}" in first, first + proc.stderr.read()
    deadline = time.time() + 240
    rows = []
    while time.time() < deadline and not rows:
        with open(out / "log.csv") as f:
            rows = [r for r in csv.DictReader(f) if r["val_loss"]]
        time.sleep(0.2)
    stop(proc, signal.SIGTERM)
    assert len(rows) == 1 and int(rows[0]["step"]) == step, rows
    assert torch.load(out / "last.pt")["evals_done"] == 0


def test_warmup_is_a_fraction_of_the_run(data, tmp_path):
    """Linear warmup over round(warmup x steps) steps, then the cosine down to min_lr at the end."""
    for steps, warm in ((1000, 20), (100, 2)):
        a = argparse.Namespace(steps=steps, warmup=0.02, lr=1e-3, min_lr=1e-4)
        lrs = [train.lr_at(s, a) for s in range(steps)]
        assert lrs[0] == pytest.approx(1e-3 / warm)
        assert lrs[warm - 1] == pytest.approx(1e-3) and lrs[warm] == pytest.approx(1e-3)
        assert all(x < y for x, y in zip(lrs[:warm], lrs[1:warm]))
        assert all(x >= y for x, y in zip(lrs[warm:], lrs[warm + 1:]))
        assert lrs[-1] == pytest.approx(1e-4, abs=1e-6)
    p = run_py("train.py", "--variant", "mha", *TINY, "--warmup", "100", "--data", data, "--out", tmp_path / "o")
    assert_one_line_error(p, "--warmup is a fraction", "not 100")
