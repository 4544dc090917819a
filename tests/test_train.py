"""train/prepare.py as a user meets it: the committed tokenizer kept unless --new-tokenizer,
one line and a non-zero exit for every bad input."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOKENIZER = os.path.join(ROOT, "tokenizer", "tokenizer.model")
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
