"""More threads than free cores: the team's members are descheduled mid-step, for
milliseconds at a time, by other processes. Whatever the interleaving, the logits are
the bits of a one-thread run (docs/ROBUSTNESS.md, row 8). A race in the team or in what a step
leaves for the next shows here as a different text from one run to the next."""
import hashlib
import os
import subprocess
import sys

import pytest

from conftest import PROMPT, run

RUNS = 6


@pytest.fixture(scope="module")
def busy_cores():
    """One spinning process per core, for the module's lifetime."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    yield len(spinners)
    for p in spinners:
        p.kill()
        p.wait()


def logits_md5(ckpt, tmp_path, threads, extra):
    out = tmp_path / f"logits-{threads}"
    run([ckpt, "-p", PROMPT, "-k", 1, "-n", 40, "--ignore-eos", "-q", "-s", 1, "--threads", threads,
         "--dump-logits", out] + extra, timeout=120)
    return hashlib.md5(out.read_bytes()).hexdigest()


@pytest.mark.parametrize("variant,extra", [("gqa", []), ("gqa", ["--kv"]), ("mla64", ["--kv"])],
                         ids=["gqa", "gqa-kv", "mla64-kv"])
def test_oversubscribed_team_gives_the_one_thread_bits(small_checkpoints, tmp_path, busy_cores, variant, extra):
    ckpt = small_checkpoints[variant][0]
    reference = logits_md5(ckpt, tmp_path, 1, extra)
    threads = busy_cores + 1
    seen = [logits_md5(ckpt, tmp_path, threads, extra) for _ in range(RUNS)]
    assert seen == [reference] * RUNS, f"--threads {threads} beside {busy_cores} busy processes"
