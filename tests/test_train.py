"""train/prepare.py and train/train.py as a user meets them: the committed tokenizer kept
unless --new-tokenizer, one line and a non-zero exit for every bad input, a second run
into an existing --out refused, a --resume of another run refused, Ctrl-C and SIGTERM
leaving a last.pt to resume from, the validation's progress bar, warmup as a fraction,
checkpoints that load without a general unpickler (train/checkpoint.py) and a damaged
last.pt refused in one line. Tiny models (--small, --ctx 32, batches of 4) on token files made in tmp_path."""
import argparse
import csv
import io
import os
import pickletools
import shutil
import signal
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
import sentencepiece as spm
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "train"))
import checkpoint  # noqa: E402
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


def test_resume_of_a_run_saved_before_newer_config_keys(finished, data, tmp_path):
    """A last.pt saved before Config gained a key (untied_head, window) holds that key's default:
    it resumes, as old checkpoints keep loading, instead of being called another run's."""
    out = tmp_path / "old"
    shutil.copytree(finished[0], out)
    ck = torch.load(out / "last.pt")
    for key in ("untied_head", "window"):
        del ck["config"][key]
    torch.save(ck, out / "last.pt")
    p = run_py("train.py", "--variant", "mha", *TINY, "--steps", "3", "--data", data, "--out", out, "--resume")
    assert p.returncode == 0, p.stderr
    assert "resumed at step 3" in p.stdout


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


# ---------------------------------------------------------------- checkpoints: safe loading

# The globals a checkpoint of tensors and plain values refers to. PyTorch 2.x's weights_only
# load allows these (and refuses e.g. numpy scalars, argparse.Namespace, anything callable).
TENSOR_GLOBALS = {"collections OrderedDict", "torch._utils _rebuild_tensor_v2"}


def pickled_globals(path):
    """The module.name of every GLOBAL in a torch.save zip's data.pkl, read with pickletools
    (nothing is unpickled)."""
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    found = set()
    for op, arg, _ in pickletools.genops(io.BytesIO(data)):
        if op.name == "GLOBAL":
            found.add(arg)
        assert op.name != "STACK_GLOBAL", "protocol 4 pickles are not expected from torch.save"
    return found


def plain_leaves(obj, where="ck"):
    """Every leaf's type is a tensor or a plain Python value; returns how many leaves."""
    if isinstance(obj, dict):
        return sum(plain_leaves(v, f"{where}[{k!r}]") for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return sum(plain_leaves(v, f"{where}[{i}]") for i, v in enumerate(obj))
    assert obj is None or type(obj) in (torch.Tensor, bool, int, float, str), (where, type(obj))
    return 1


@pytest.mark.parametrize("name", ["last.pt", "best.pt"])
def test_saved_checkpoints_hold_only_tensors_and_plain_values(finished, name):
    """What train.py saves needs no global beyond tensor rebuilding, so a weights_only load
    (PyTorch 2.6's default) takes it; checkpoint.load gives back what torch.load does."""
    out, _ = finished
    globals_ = pickled_globals(out / name)
    assert {g for g in globals_ if not g.startswith("torch ") or not g.endswith("Storage")} <= TENSOR_GLOBALS, \
        globals_
    ck = checkpoint.load(str(out / name))
    assert plain_leaves(ck) > 20
    ref = torch.load(out / name)  # 1.13: the general unpickler; 2.6+: weights_only by default
    assert ck.keys() == ref.keys() and ck["config"] == ref["config"] and ck["step"] == ref["step"] == 3
    assert all(torch.equal(ck["model"][k], ref["model"][k]) for k in ref["model"])
    if name == "last.pt":
        assert ck["rng"] == ref["rng"] and ck["rng"]["bit_generator"] == "PCG64"
        assert ck["optim"]["param_groups"] == ref["optim"]["param_groups"]
    if checkpoint.load_mode() == "weights_only":  # PyTorch 2.x: torch's own weights-only unpickler
        torch.load(out / name, weights_only=True)


def test_plain_converts_what_weights_only_would_refuse(tmp_path):
    """numpy scalars and arrays, Namespaces and dataclasses are saved as plain values; anything
    else is refused at save time rather than written as a checkpoint no safe load can read."""
    obj = {"a": np.float64(0.25), "n": np.int64(7), "arr": np.arange(3, dtype=np.uint32),
           "ns": argparse.Namespace(lr=1e-3, steps=np.int32(5)), "cfg": train.Config(variant="gqa"),
           "t": torch.arange(4), "nested": [(np.float32(1.5), None, True)]}
    checkpoint.save(obj, str(tmp_path / "x.pt"))
    back = checkpoint.load(str(tmp_path / "x.pt"))
    assert type(back["a"]) is float and back["a"] == 0.25
    assert type(back["n"]) is int and back["n"] == 7
    assert back["arr"] == [0, 1, 2] and back["ns"] == {"lr": 1e-3, "steps": 5}
    assert back["cfg"]["variant"] == "gqa" and back["cfg"]["n_kv_heads"] == 16 and back["cfg"]["dim"] == 512
    assert torch.equal(back["t"], torch.arange(4)) and back["nested"] == [(1.5, None, True)]
    assert pickled_globals(tmp_path / "x.pt") <= TENSOR_GLOBALS | {"torch LongStorage"}
    assert not (tmp_path / "x.pt.tmp").exists()
    with pytest.raises(TypeError, match=r"ck\['bad'\] is a builtins.object"):
        checkpoint.plain({"bad": object()}, "ck")


class _Mkdir:
    """Unpickles into a call of os.mkdir: what a malicious checkpoint would do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


@pytest.mark.parametrize("legacy", [False, True])
def test_load_runs_no_code_from_a_checkpoint(tmp_path, legacy):
    """A .pt whose pickle calls a function is refused in one line, and the call never happens,
    in torch.save's zip form and its older plain form."""
    marker = tmp_path / "made_by_unpickling"
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "config": _Mkdir(str(marker))}, path, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load(str(path))
    assert not marker.exists()
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg and "mkdir" in msg, msg


@pytest.fixture(scope="module")
def last_pt_bytes(finished):
    return (finished[0] / "last.pt").read_bytes()


@pytest.mark.parametrize("damage, words", [
    ("random", ["not a PyTorch file"]),
    ("random-zip", ["truncated or damaged"]),
    ("half", ["truncated or damaged"]),
    ("head", ["truncated or damaged"]),
    ("empty", ["empty"]),
])
def test_damaged_last_pt_is_one_line(finished, data, last_pt_bytes, tmp_path, damage, words):
    """--resume on a last.pt of random bytes (with and without a zip signature), or a real one
    cut short (to half, to its first 1,000 bytes) or empty: exactly one line on stderr naming
    the file and what to run, exit 1, and the run's files as they were."""
    out = tmp_path / "mha"
    shutil.copytree(finished[0], out)
    rng = np.random.default_rng(45)
    bad = {"random": rng.bytes(65536), "random-zip": b"PK\x03\x04" + rng.bytes(65536),
           "half": last_pt_bytes[:len(last_pt_bytes) // 2], "head": last_pt_bytes[:1000], "empty": b""}[damage]
    (out / "last.pt").write_bytes(bad)
    before = {f: (out / f).read_bytes() for f in ("log.csv", "last.pt", "best.pt")}
    p = run_py("train.py", "--variant", "mha", *TINY, "--steps", "3", "--data", data, "--out", out, "--resume")
    assert p.returncode == 1, p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.endswith("\n"), p.stderr  # no bar: nothing ran
    assert_one_line_error(p, str(out / "last.pt"), "cannot be read", "--force", *words)
    assert {f: (out / f).read_bytes() for f in before} == before


# PyTorch 2.x's weights-only failures, laid out as its torch.load words them (advice, then
# "WeightsUnpickler error: CAUSE", then a pointer to the docs; bold terminal escapes in one).
TORCH2_ERRORS = [
    ("Weights only load failed. Re-running `torch.load` with `weights_only` set to `False` will likely "
     "succeed, but it can result in arbitrary code execution. Do it only if you got the file from a trusted "
     "source.\n Please file an issue with the following so that we can make `weights_only=True` compatible "
     "with your use case: WeightsUnpickler error: Unsupported operand 149\n\nCheck the documentation of "
     "torch.load to learn more about types accepted by default with weights_only https://pytorch.org/docs.",
     ["truncated or damaged", "Unsupported operand 149"]),
    ("Weights only load failed. This file can still be loaded, to do so you have two options, \x1b[1mdo those "
     "steps only if you trust the source of the checkpoint\x1b[0m. \n\t(1) Re-running `torch.load` with "
     "`weights_only` set to `False` will likely succeed.\n\t(2) Alternatively, to load with `weights_only=True` "
     "please check the recommended steps in the following error message.\n\tWeightsUnpickler error: "
     "Unsupported global: GLOBAL numpy.core.multiarray.scalar was not an allowed global by default. Please use "
     "`torch.serialization.add_safe_globals([scalar])` to allowlist this global.\n\nCheck the documentation.",
     ["numpy.core.multiarray.scalar", "not loaded for safety"]),
]


@pytest.mark.parametrize("message, words", TORCH2_ERRORS)
def test_torch2_weights_only_errors_become_one_line(finished, monkeypatch, message, words):
    """The weights_only branch of checkpoint.load (the one PyTorch 2.x takes), with torch.load
    failing as 2.x does: one line naming the file and the cause, none of torch's advice."""
    import pickle
    path = str(finished[0] / "best.pt")

    def failing_load(f, map_location=None, weights_only=None, **kw):
        assert weights_only is True and map_location == "cpu"
        raise pickle.UnpicklingError(message)
    monkeypatch.setattr(checkpoint, "load_mode", lambda: "weights_only")
    monkeypatch.setattr(torch, "load", failing_load)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load(path)
    msg = str(e.value)
    assert msg.startswith(path + ": ") and msg.isprintable(), repr(msg)
    assert "weights_only" not in msg and "Re-running" not in msg and len(msg) < len(path) + 140, msg
    for w in words:
        assert w in msg, msg


def test_load_mode_follows_what_torch_load_can_read(monkeypatch):
    """weights_only only where torch.load takes the argument and reads floats and big ints back
    with it (1.13's weights-only unpickler has no float opcode); the restricted unpickler else."""
    real = torch.load
    checkpoint.load_mode.cache_clear()
    try:
        expected = "weights_only" if not torch.__version__.startswith("1.") else "restricted"
        assert checkpoint.load_mode() == expected
        checkpoint.load_mode.cache_clear()

        def works(f, map_location=None, weights_only=False):
            return real(f, map_location=map_location)   # a torch whose weights_only load reads everything
        monkeypatch.setattr(torch, "load", works)
        assert checkpoint.load_mode() == "weights_only"
        checkpoint.load_mode.cache_clear()

        def no_argument(f, map_location=None):
            return real(f, map_location=map_location)   # a torch from before the argument
        monkeypatch.setattr(torch, "load", no_argument)
        assert checkpoint.load_mode() == "restricted"
    finally:
        monkeypatch.undo()
        checkpoint.load_mode.cache_clear()


# ---------------------------------------------------------------- the model on PyTorch 1.13 and 2.x

def test_attention_follows_cpu_autocast_without_deprecated_calls():
    """bf16 attention products under CPU autocast, fp32 outside it, asked through
    torch.is_autocast_enabled("cpu") where torch has it (2.4 on) and with no warning raised
    (is_autocast_cpu_enabled is deprecated in 2.x)."""
    import warnings

    import model
    try:
        torch.is_autocast_enabled("cpu")
        new_api = True
    except TypeError:   # 1.13: is_autocast_enabled() takes no argument
        new_api = False
    assert (model.cpu_autocast_enabled is torch.is_autocast_cpu_enabled) == (not new_api)
    q = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model.cpu_autocast_enabled()
            mixed = model.causal_attention(q, q, q, 8 ** -0.5, 0)
        assert not model.cpu_autocast_enabled()
        full = model.causal_attention(q, q, q, 8 ** -0.5, 0)
    assert mixed.dtype == torch.bfloat16 and full.dtype == torch.float32
    assert torch.allclose(mixed.float(), full, atol=0.05)
    assert torch.allclose(full[..., 0, :], q[..., 0, :])  # the first query sees only itself


# ---------------------------------------------------------------- the progress bar

def test_progress_text_names_its_figures():
    """"-" for a validation loss not measured yet, never nan or inf; the moving average named."""
    before = train.progress_text(8.3456, float("nan"), float("inf"), 1234.4, 1e-3)
    assert before.startswith(f"train loss 8.346 (EMA of {train.EMA_STEPS} steps), val -, ")
    assert "nan" not in before and "inf" not in before and "1234 tok/s" in before
    resumed = train.progress_text(4.0, float("nan"), 3.25, 10, 1e-4)
    assert "val - (best 3.250)" in resumed
    after = train.progress_text(4.0, 3.5, 3.25, 10, 1e-4)
    assert "val 3.500 (best 3.250)" in after and "lr 1.0e-04" in after


def test_progress_bar_before_the_first_validation(finished):
    """The 3-step run validates only at its end: its training bar shows "val -", the
    moving average under its name, and neither nan nor inf."""
    _, p = finished
    lines = [line for line in p.stderr.replace("\r", "\n").splitlines() if "step/s" in line or "s/step" in line]
    assert lines, p.stderr
    assert "train loss " in lines[-1] and f"(EMA of {train.EMA_STEPS} steps), val -," in lines[-1], lines[-1]
    assert not any("nan" in line or "inf" in line for line in lines), lines



def test_report_refuses_a_damaged_or_missing_best_pt(finished, last_pt_bytes, tmp_path):
    """train/report.py on a run folder whose best.pt is cut short, or missing: one line on stderr
    naming the file, exit 1, before ./run is ever started."""
    run = tmp_path / "run"
    shutil.copytree(finished[0], run)
    (run / "best.pt").write_bytes(last_pt_bytes[:5000])
    args = [os.path.join(ROOT, "weights", "gqa.bin"), "--run", run, "--valid", tmp_path / "unused.txt"]
    p = run_py("report.py", *args)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith(f"report: {run / 'best.pt'}: it is truncated or damaged"), p.stderr
    (run / "best.pt").unlink()
    p = run_py("report.py", *args)
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"report: {run / 'best.pt'} is missing; ") and "train/train.py" in p.stderr, p.stderr


@pytest.mark.parametrize("flags, words", [
    (["--layers", "0"], ("--layers must be at least 1",)),
    (["--heads", "6", "--kv-heads", "4"], ("6 query heads", "4 KV heads")),
])
def test_shape_flags_refuse_what_cannot_be_built(data, tmp_path, flags, words):
    p = run_py("train.py", "--variant", "gqa", *TINY, *flags, "--data", data, "--out", tmp_path / "o")
    assert_one_line_error(p, *words)
    assert not (tmp_path / "o").exists()


def test_shape_flags_build_the_model_they_name(data, tmp_path):
    """A 1-layer model of width 32 with 2 heads of 16 and one KV head (GQA flags, MQA-shaped):
    its last.pt holds exactly that config."""
    out = tmp_path / "o"
    p = run_py("train.py", "--variant", "gqa", "--steps", "1", "--batch-size", "2", "--ctx", "32",
               "--layers", "1", "--dim", "32", "--heads", "2", "--head-dim", "16", "--kv-heads", "1",
               "--hidden", "48", "--data", data, "--out", out)
    assert p.returncode == 0, p.stderr
    sys.path.insert(0, os.path.join(ROOT, "train"))
    import checkpoint
    cfg = checkpoint.load(str(out / "last.pt"))["config"]
    assert (cfg["n_layers"], cfg["dim"], cfg["n_heads"], cfg["head_dim"], cfg["n_kv_heads"], cfg["hidden_dim"]) == \
        (1, 32, 2, 16, 1, 48)


def test_init_starts_from_a_converted_checkpoint(finished, data, tmp_path):
    """--init loads the weights (train/convert.py's output here): at learning rate 0 the run's
    weights stay exactly those of the file."""
    import export
    conv = tmp_path / "gqa.bin"
    p = run_py("convert.py", finished[0] / "best.pt", "gqa", conv, "--dtype", "fp32")
    assert p.returncode == 0, p.stderr
    out = tmp_path / "up"
    p = run_py("train.py", "--variant", "gqa", *TINY, "--steps", "1", "--lr", "0", "--min-lr", "0",
               "--data", data, "--out", out, "--init", conv)
    assert p.returncode == 0, p.stderr
    want = export.load_engine_checkpoint(str(conv)).state_dict()
    got = torch.load(out / "last.pt")["model"]
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_init_of_another_variant_is_refused(finished, data, tmp_path):
    p = run_py("train.py", "--variant", "gqa", *TINY, "--steps", "1", "--data", data, "--out", tmp_path / "x",
               "--init", finished[0] / "best.pt")
    assert_one_line_error(p, "--init", "mha model, not gqa")
