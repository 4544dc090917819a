#!/usr/bin/env python3
"""Checks our Hugging Face exports against transformers itself (not part of `make test`: the
project's machines have no transformers). docs/MODELS_IN_OUT.md says how to run it.

For each checkpoint (default: weights/*.bin), it
  1. exports it with `train/export.py CKPT --hf DIR` (LlamaForCausalLM or DeepseekV2ForCausalLM),
  2. loads DIR with transformers' AutoModelForCausalLM (fp32, eager attention, --device),
  3. decodes --steps greedy tokens after the prompt with transformers and with ./run -k 1 --json,
     and compares the tokens, and the logits of every step (./run --dump-logits against
     transformers' logits of the same sequence): max |d| / max(1, max |logit|) <= --tol,
  4. compares the prompt's ids from transformers' tokenizer with SentencePiece's (other ids
     fail; a tokenizer that does not load, for want of a package, is a note),
  5. saves the model with transformers' save_pretrained and imports that with
     train/import_model.py: the result must be our checkpoint again, bit for bit.
It prints the versions first, then one line per model; exit 0 when every model passed.

    python3 tools/check_hf_transformers.py [CKPT.bin ...] [--device cuda] [--steps 48]

MLA: transformers' DeepSeek-V2 fixes kv_a_layernorm's eps at 1e-6 where ours uses the model's
(1e-5), so its logits differ from ours by a little more than Llama's (still well within --tol).
"""
import argparse
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "Once upon a time"


def versions():
    out = [f"python {platform.python_version()}"]
    for mod in ("torch", "transformers", "numpy", "sentencepiece", "safetensors"):
        try:
            m = __import__(mod)
            out.append(f"{mod} {getattr(m, '__version__', '?')}")
        except Exception as e:  # noqa: BLE001 - report whatever keeps it from importing
            out.append(f"{mod} missing ({type(e).__name__})")
    try:
        commit = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True,
                                text=True, timeout=30).stdout.strip()
    except Exception:  # noqa: BLE001
        commit = "?"
    out.append(f"repo {commit}")
    try:
        import torch
        if torch.cuda.is_available():
            out.append(f"cuda {torch.version.cuda} on {torch.cuda.get_device_name(0)}")
    except Exception:  # noqa: BLE001
        pass
    return ", ".join(out)


def sh(args, **kw):
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=1800, **kw)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise RuntimeError(f"{os.path.basename(str(args[1] if args[0] == sys.executable else args[0]))} "
                           f"exited {p.returncode}: {last}")
    return p.stdout


def load_model(transformers, torch, d):
    """AutoModelForCausalLM in fp32 with eager attention, across transformers versions: `dtype`
    from 4.56 on (torch_dtype before), attn_implementation from 4.36 on."""
    try:
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    except ValueError:
        major, minor = 4, 0
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager",
                                                                 **{key: torch.float32})
    except TypeError:
        return transformers.AutoModelForCausalLM.from_pretrained(d, **{key: torch.float32})


def check_one(ckpt, args, work):
    import numpy as np
    import sentencepiece as spm
    import torch
    import transformers

    name = os.path.splitext(os.path.basename(ckpt))[0]
    d = os.path.join(work, name)
    sh([sys.executable, os.path.join(ROOT, "train", "export.py"), ckpt, "--hf", d, "--force"])
    with open(os.path.join(d, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    if not hasattr(transformers, arch):
        return name, "SKIP", f"{arch}: this transformers ({transformers.__version__}) does not have it"
    model = load_model(transformers, torch, d)
    model.to(args.device).eval()

    sp = spm.SentencePieceProcessor(model_file=os.path.join(d, "tokenizer.model"))
    prompt = [sp.bos_id()] + sp.encode(PROMPT)
    notes, same_ids = [], True
    try:
        hf_tok = transformers.AutoTokenizer.from_pretrained(d)
        hf_ids = hf_tok(PROMPT)["input_ids"]
        if hf_ids != prompt:
            same_ids = False
            notes.append(f"HF tokenizer ids {hf_ids} != SentencePiece {prompt}")
    except Exception as e:  # noqa: BLE001 - a note, not a failure
        notes.append(f"HF tokenizer did not load ({type(e).__name__}: {str(e).splitlines()[0][:80]})")

    steps = min(args.steps, model.config.max_position_embeddings - len(prompt))
    ids, hf_tokens = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids], device=args.device)).logits[0, -1]
            t = int(torch.argmax(logits))
            hf_tokens.append(t)
            ids.append(t)
        hf_logits = model(torch.tensor([ids[:-1]], device=args.device)).logits[0, len(prompt) - 1:].float().cpu().numpy()

    dump = os.path.join(work, f"{name}.logits")
    out = sh([args.run, ckpt, "-p", PROMPT, "-k", 1, "-n", steps, "--ignore-eos", "-q", "--kv", "-s", 1, "--json",
              "--dump-logits", dump])
    seqs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    our_tokens = next(o for o in seqs if o.get("type") == "sequence")["tokens"]
    our_logits = np.fromfile(dump, dtype=np.float32).reshape(steps, -1)
    same = sum(a == b for a, b in zip(our_tokens, hf_tokens))
    first_diff = next((i for i, (a, b) in enumerate(zip(our_tokens, hf_tokens)) if a != b), None)
    # logits of the same sequence: up to the first differing token
    upto = steps if first_diff is None else first_diff + 1
    diff = float(np.abs(our_logits[:upto] - hf_logits[:upto]).max())
    rel = diff / max(1.0, float(np.abs(hf_logits[:upto]).max()))

    back_note = "save_pretrained -> import_model.py: "
    try:
        saved = os.path.join(work, f"{name}-saved")
        hdr_dtype = int.from_bytes(open(ckpt, "rb").read(16)[12:16], "little")
        model.to("cpu").to(torch.bfloat16 if hdr_dtype == 1 else torch.float32)  # the checkpoint's own dtype
        model.save_pretrained(saved, safe_serialization=True)
        # save_pretrained writes the model alone; a user saves the tokenizer beside it
        shutil.copy(os.path.join(d, "tokenizer.model"), saved)
        again = os.path.join(work, f"{name}-again.bin")
        sh([sys.executable, os.path.join(ROOT, "train", "import_model.py"), saved, again])
        same_bits = open(again, "rb").read() == open(ckpt, "rb").read()
        back_note += "same bits" if same_bits else "DIFFERENT bits"
    except Exception as e:  # noqa: BLE001
        same_bits = False
        back_note += f"failed ({' '.join(str(e).split())[:160]})"

    ok = same == steps and len(our_tokens) == steps and rel <= args.tol and same_bits and same_ids
    line = (f"{arch}: greedy tokens {same}/{steps} equal"
            f"{'' if first_diff is None else f' (first difference at step {first_diff})'}, "
            f"max|d logit| {diff:.3g} (relative {rel:.3g}, tol {args.tol:g}), {back_note}")
    if notes:
        line += "; note: " + "; ".join(notes)
    return name, "OK" if ok else "FAIL", line


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpts", nargs="*", help="engine checkpoints (default: weights/*.bin)")
    ap.add_argument("--run", default=os.path.join(ROOT, "run"), help="the ./run binary (make run)")
    ap.add_argument("--device", default="cpu", help="torch device for transformers (cpu, cuda)")
    ap.add_argument("--steps", type=int, default=48, help="greedy tokens to compare (default 48)")
    ap.add_argument("--tol", type=float, default=2e-3, help="max |d logit| / max(1, max |logit|) (default 2e-3)")
    ap.add_argument("--workdir", help="keep the exported directories here (default: a temporary directory)")
    args = ap.parse_args()
    print("versions:", versions(), flush=True)
    ckpts = args.ckpts or sorted(glob.glob(os.path.join(ROOT, "weights", "*.bin")))
    if not ckpts:
        print("no checkpoints given and none in weights/")
        return 1
    if not os.access(args.run, os.X_OK):
        print(f"{args.run} is not built: run `make run` first")
        return 1
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers is not installed: pip install transformers (with torch 2.x)")
        return 1
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or tmp
        os.makedirs(work, exist_ok=True)
        for c in ckpts:
            try:
                results.append(check_one(c, args, work))
            except Exception as e:  # noqa: BLE001 - one line per model, whatever happened
                if os.environ.get("CHECK_HF_TRACEBACK"):
                    traceback.print_exc()
                results.append((os.path.basename(c), "FAIL", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"))
            name, status, line = results[-1]
            print(f"{status:4} {name}: {line}", flush=True)
    failed = [r for r in results if r[1] == "FAIL"]
    print(f"summary: {len(results) - len(failed)} of {len(results)} passed or skipped"
          f"{'' if not failed else ', failed: ' + ', '.join(r[0] for r in failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
