"""Shared fixtures for the pytest side: the built ./run, the tokenizer, and small
random checkpoints of every variant written by train/export.py."""
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "train"))

RUN = os.environ.get("RUN_BINARY") or os.path.join(ROOT, "run")   # make test-asan runs the ASan build
TOKENIZER = os.path.join(ROOT, "tokenizer", "tokenizer.model")
VARIANTS = ["mha", "gqa", "mqa", "mla64", "mla128"]
PROMPT = "Once upon a time"


def sanitized():
    """The ASan build: its shadow memory needs the whole address space, its frames more stack."""
    with open(RUN, "rb") as f:
        return b"libasan" in f.read()


def run(args, check=True, timeout=300):
    """Runs ./run with args; returns the CompletedProcess (bytes)."""
    args = [a if isinstance(a, (str, bytes)) else os.fspath(a) if hasattr(a, "__fspath__") else str(a) for a in args]
    p = subprocess.run([RUN] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"./run {' '.join(map(str, args))} exited {p.returncode}: {p.stderr.decode()[-2000:]}")
    return p


def run_measured(args, env=None):
    """./run with args in a child of its own: (returncode, stderr, peak RSS in KB)."""
    probe = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True); "
             "sys.stdout.buffer.write(b'%d %d\\n' % (p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
             " + p.stderr)")
    p = subprocess.run([sys.executable, "-c", probe, RUN] + [str(a) for a in args], stdout=subprocess.PIPE, timeout=600,
                       env=env)
    head, _, err = p.stdout.partition(b"\n")
    code, rss = map(int, head.split())
    return code, err, rss


def run_json(args, check=True, timeout=300):
    """Runs ./run with args and --json; returns (CompletedProcess, the objects of its stdout,
    one a line, parsed)."""
    import json
    p = run(list(args) + ["--json"], check=check, timeout=timeout)
    return p, [json.loads(line) for line in p.stdout.decode().splitlines()]


def json_one(args, check=True):
    """(exit code, the one --json object) of a mode that prints one: --info, --ppl,
    --check-kv, --check-batch."""
    p, objs = run_json(args, check=check)
    assert len(objs) == 1, objs
    return p.returncode, objs[0]


def generate_json(args, check=True):
    """A generation's (CompletedProcess, sequence objects, summary object): every line but the
    last is a sequence, the last the summary, and the summary counts the sequences."""
    p, objs = run_json(args, check=check)
    assert objs and objs[-1]["type"] == "summary", objs
    sequences, summary = objs[:-1], objs[-1]
    assert all(s["type"] == "sequence" for s in sequences) and summary["sequences"] == len(sequences), objs
    return p, sequences, summary


def read_logits(path, vocab):
    a = np.fromfile(path, dtype=np.float32)
    assert a.size % vocab == 0
    return a.reshape(-1, vocab)


@pytest.fixture(scope="session")
def small_checkpoints(tmp_path_factory):
    """{variant: (path, model)}: small random models (bf16 values) exported with the real tokenizer."""
    import export
    d = tmp_path_factory.mktemp("small")
    out = {}
    for i, v in enumerate(VARIANTS):
        model = export.random_model(v, small=True, seed=100 + i)
        export.round_to_bf16_(model)
        path = str(d / f"{v}.bin")
        export.export(model, path, TOKENIZER, dtype="bf16")
        out[v] = (path, model)
    return out
