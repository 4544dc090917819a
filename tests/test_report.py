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
    run([small_checkpoints["mqa"][0], "-p", PROMPT, "-n", 12, "-s", 1, "--kv", "-q", "--dump-attn", d / "mqa.bin",
         "--dump-attn-layers", "1"])
    (d / "prompts.txt").write_text(f"{PROMPT}\n{PROMPT} and\nOnce\n")
    run([small_checkpoints["gqa"][0], "--prompts", d / "prompts.txt", "--batch", 2, "-n", 8, "-s", 1, "--kv", "-q",
         "--profile", "--log", d / "pool.csv"])
    return d


def full_page(d):
    """The page with every section: one run, a --prompts run's pool, two variants' heads."""
    out = d / "full.html"
    p = report(["--json", d / "run.json", "--log", d / "steps.csv", "--pool-log", d / "pool.csv",
                "--attn", f"gqa={d / 'attn.bin'}", "--attn", f"mqa={d / 'mqa.bin'}", "--out", out])
    assert p.returncode == 0, p.stderr
    return out


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
    assert alts == ["time split", "per-step latency", "parts per step", "roofline", "attention layer 1"], alts
    assert all(b64.startswith("iVBORw0KGgo") for _, b64 in images(text))   # PNG's signature, base64
    bare = re.sub(r'base64,[A-Za-z0-9+/=]+', "base64,", text)   # "http" may occur by chance inside a PNG
    assert not re.search(r'(src|href)="(?!data:)', bare) and "http" not in bare   # nothing to fetch
    assert "<th>decode</th>" not in text and "<td>decode</td>" in text        # the profile's table


def test_parts_alone(one_run):
    out = one_run / "log_only.html"
    assert report(["--log", one_run / "steps.csv", "--out", out]).returncode == 0
    assert [alt for alt, _ in images(out.read_text())] == ["per-step latency", "parts per step", "roofline"]


def test_pool_and_variants_side_by_side(one_run):
    text = full_page(one_run).read_text()
    alts = [alt for alt, _ in images(text)]
    assert alts == ["time split", "per-step latency", "parts per step", "roofline", "pool over time",
                    "variants layer 1"], alts
    assert "KV pool over time" in text and "the variants side by side, layer 1" in text


def test_pool_columns_follow_the_pool(one_run):
    """With --profile the log ends in the pool after each step: 3 prompts through 2 slots
    hold blocks while they run, and none once all have finished."""
    import csv
    rows = list(csv.DictReader(open(one_run / "pool.csv")))
    blocks = [int(r["kv_blocks"]) for r in rows]
    assert min(blocks[:-1]) > 0 and max(int(r["sequences"]) for r in rows) == 2, blocks
    assert all(0 <= int(r["kv_shared_blocks"]) <= int(r["kv_blocks"]) for r in rows)


CHECK = """<script>
window.addEventListener("load", () => {
  const imgs = [...document.images];
  const bad = imgs.filter(i => !i.complete || i.naturalWidth === 0).map(i => i.alt);
  const v = document.createElement("pre");
  v.id = "verdict";
  v.textContent = `images ${imgs.length} undecoded [${bad.join(",")}]`;
  document.body.appendChild(v);
});
</script>"""


def test_page_renders_in_chromium(one_run):
    """Headless Chromium opens a copy of the page with a check appended: every image decoded,
    and no script errors on the console. About 10 s on a busy 2-core machine."""
    import shutil
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "chromium is not installed: scripts/install-deps.sh installs it (Debian's chromium)"
    page = full_page(one_run).read_text()
    checked = one_run / "checked.html"
    checked.write_text(page.replace("</body>", CHECK + "</body>"))
    p = subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                        "--user-data-dir=" + str(one_run / "chromium"), "--virtual-time-budget=5000", "--dump-dom",
                        checked.as_uri()], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    m = re.search(r'<pre id="verdict">images (\d+) undecoded \[([^\]]*)\]</pre>', p.stdout)
    assert m, "the check did not run: " + p.stdout[-500:] + p.stderr[-1000:]
    assert int(m.group(1)) == len(images(page)) == 6 and m.group(2) == "", m.group(0)
    errors = [line for line in p.stderr.splitlines() if "Uncaught" in line or "ERROR:CONSOLE" in line]
    assert not errors, errors


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
