#!/usr/bin/env bash
# The trainer and exporter on a current PyTorch (2.x), in one command:
#
#     PYTHON=/path/to/venv/bin/python tools/check_torch2.sh
#
# PYTHON (default python3) needs torch 2.x, numpy, sentencepiece, tqdm, matplotlib and
# pytest. Checks what only a 2.x exercises (issue 45): checkpoint.load takes the
# torch.load(weights_only=True) path; a checkpoint saved by train.py loads with torch's own
# weights_only=True and resumes; a damaged last.pt is one line; CPU autocast is asked
# through torch.is_autocast_enabled("cpu") with no deprecation warning; then
# tests/test_train.py and tests/test_export.py (./run is built first if missing).
# Exit status 0 only if everything passed. Writes only under a temporary folder.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

"$PY" - <<'EOF'
import sys
import torch
major = int(torch.__version__.split(".")[0])
print(f"check_torch2: torch {torch.__version__} from {torch.__file__}")
if major < 2:
    sys.exit(f"check_torch2: {sys.executable} has torch {torch.__version__}; give PYTHON= an interpreter with torch 2.x")
EOF

[ -x ./run ] || make -j2 run

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$PY" - "$tmp" <<'EOF'
import os, subprocess, sys, warnings
import numpy as np
import torch
tmp = sys.argv[1]
sys.path.insert(0, "train")
import checkpoint, model

mode = checkpoint.load_mode()
assert mode == "weights_only", f"checkpoint.load_mode() is {mode!r}: torch.load(weights_only=True) failed the probe"
print("weights_only load path: taken")

try:
    torch.is_autocast_enabled("cpu")
    new_api = True
except TypeError:
    new_api = False
print(f"is_autocast_enabled('cpu'): {'exists' if new_api else 'missing (torch < 2.4)'}; "
      f"model.py uses {getattr(model.cpu_autocast_enabled, '__name__', model.cpu_autocast_enabled)}")
assert new_api == (model.cpu_autocast_enabled is not torch.is_autocast_cpu_enabled)
q = torch.randn(1, 2, 4, 8)
with warnings.catch_warnings():
    warnings.simplefilter("error")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.causal_attention(q, q, q, 0.35, 0).dtype == torch.bfloat16
    assert model.causal_attention(q, q, q, 0.35, 0).dtype == torch.float32
print("autocast: no warning")

# a tiny run, then its checkpoints through torch's own weights_only loader, a resume and an export
rng = np.random.default_rng(0)
def stories(n):
    return np.concatenate([[1, *rng.integers(3, 4096, rng.integers(5, 60)), 2] for _ in range(n)]).astype(np.uint16)
os.makedirs(f"{tmp}/data")
stories(200).tofile(f"{tmp}/data/train.bin")
stories(40).tofile(f"{tmp}/data/valid.bin")
tiny = ["--variant", "mha", "--small", "--ctx", "32", "--batch-size", "4", "--threads", "1",
        "--data", f"{tmp}/data", "--out", f"{tmp}/run"]
def train(*extra):
    return subprocess.run([sys.executable, "train/train.py", *tiny, *extra], capture_output=True, text=True)
p = train("--steps", "3")
assert p.returncode == 0, p.stderr
for name in ("last.pt", "best.pt"):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck = torch.load(f"{tmp}/run/{name}", weights_only=True)
    assert ck["step"] == 3 and ck["config"]["variant"] == "mha", name
print("weights_only round trip: last.pt and best.pt load with torch.load(weights_only=True)")
p = train("--steps", "5", "--force")           # a new budget: start afresh, stop nothing
assert p.returncode == 0, p.stderr
p = train("--steps", "5", "--resume")          # nothing left to run: resumes, validates, ends
assert p.returncode == 0 and "resumed at step 5" in p.stdout, p.stdout + p.stderr
p = subprocess.run([sys.executable, "train/export.py", f"{tmp}/run/best.pt", f"{tmp}/out.bin"],
                   capture_output=True, text=True)
assert p.returncode == 0, p.stderr
print("resume and export: fine")
raw = open(f"{tmp}/run/last.pt", "rb").read()
for what, bad in (("random bytes", np.random.default_rng(1).bytes(4096)), ("truncated", raw[:len(raw) // 2]),
                  ("random behind a zip signature", raw[:4] + np.random.default_rng(2).bytes(4096))):
    open(f"{tmp}/run/last.pt", "wb").write(bad)
    p = train("--steps", "5", "--resume")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1 and "cannot be read" in lines[0], p.stderr
    print(f"damaged last.pt ({what}): {lines[0]}")
EOF

"$PY" -m pytest -q tests/test_train.py tests/test_export.py
echo "check_torch2: all passed"
