"""tools/report.py: one run's --json, --log and --dump-attn as one self-contained HTML
page, with its plots inlined (nothing loaded from anywhere)."""
import os
import re
import subprocess
import sys

import pytest

from conftest import PROMPT, ROOT, run

REPORT = os.path.join(ROOT, "tools", "report.py")


def report(args):
    return subprocess.run([sys.executable, REPORT] + [str(a) for a in args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=300)


@pytest.fixture(scope="module")
def one_run(small_checkpoints, tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    p = run([small_checkpoints["gqa"][0], "-p", PROMPT, "-n", 12, "-s", 1, "--kv", "-q", "--json", "--profile",
             "--log", d / "steps.csv", "--dump-attn", d / "attn.bin", "--dump-attn-layers", "1"])
    (d / "run.json").write_bytes(p.stdout)
    return d


def images(text):
    return re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)


def test_page_has_every_plot(one_run):
    out = one_run / "report.html"
    p = report(["--json", one_run / "run.json", "--log", one_run / "steps.csv", "--attn", one_run / "attn.bin",
                "--out", out])
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    alts = [alt for alt, _ in images(text)]
    assert alts == ["time split", "per-step latency", "parts per step", "attention layer 1"], alts
    assert all(b64.startswith("iVBORw0KGgo") for _, b64 in images(text))   # PNG's signature, base64
    assert not re.search(r'(src|href)="(?!data:)', text) and "http" not in text   # nothing to fetch
    assert "<th>decode</th>" not in text and "<td>decode</td>" in text        # the profile's table


def test_parts_alone(one_run):
    out = one_run / "log_only.html"
    assert report(["--log", one_run / "steps.csv", "--out", out]).returncode == 0
    assert [alt for alt, _ in images(out.read_text())] == ["per-step latency", "parts per step"]


@pytest.mark.parametrize("args,message", [
    ([], "nothing to report"),
    (["--attn", "steps.csv"], "not a --dump-attn file"),
    (["--json", "steps.csv"], "not a JSON line"),
    (["--attn", "attn.bin", "--layer", 0], "no records of layer 0"),
])
def test_bad_inputs_refused(one_run, args, message):
    args = [one_run / a if isinstance(a, str) and not a.startswith("--") else a for a in args]
    p = report(args + ["--out", one_run / "bad.html"])
    assert p.returncode == 1 and message in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert not (one_run / "bad.html").exists()
