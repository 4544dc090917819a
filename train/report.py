"""Writes the weights/README.md section of a trained checkpoint, from real runs only:
the training record (out/VARIANT/log.csv and best.pt), ./run --ppl next to the PyTorch
reference on the same windows, and greedy and top-k samples of ./run.

    /usr/bin/python3 train/report.py weights/mha.bin --run out/mha --valid ../shared/tinystories/valid.txt

Prints Markdown to stdout and copies the loss curve to weights/VARIANT_loss.png."""
import argparse
import csv
import os
import platform
import re
import shutil
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint  # noqa: E402
import export  # noqa: E402
from model import onednn_copy, story_windows  # noqa: E402
from prepare import read_stories  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.environ.get("RUN_BINARY") or os.path.join(ROOT, "run")   # make test-asan: the ASan build
PROMPT = "Once upon a time"


def run(args):
    p = subprocess.run([RUN] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"report: ./run {' '.join(args)} failed: {p.stderr.strip()}")
    return p


@torch.no_grad()
def pytorch_nll(model, stories, sp):
    """Mean NLL per token (nats) of the stories, in the windows ./run --ppl uses, fp32."""
    fast, _ = onednn_copy(model)
    total, count = 0.0, 0
    for s in stories:
        ids = [sp.bos_id()] + sp.encode(s) + [sp.eos_id()]
        for x, y in story_windows(ids, model.cfg.max_seq_len):
            logits = fast(torch.tensor([x]))[0].double()
            total += float(torch.nn.functional.cross_entropy(logits, torch.tensor(y), reduction="sum"))
            count += len(y)
    return total / count, count


def machine():
    cpu, flags = "unknown CPU", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and cpu == "unknown CPU":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    simd = "AVX-512" if "avx512f" in flags else "AVX2, no AVX-512" if "avx2" in flags else "no AVX2"
    return f"{cpu}, {os.cpu_count()} cores ({platform.machine()}, {simd})"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--run", required=True, help="the training run's folder (log.csv, best.pt)")
    ap.add_argument("--valid", required=True, help="validation text (TinyStoriesV2 layout)")
    ap.add_argument("--train-tokens", type=int, help="tokens in data/train.bin (for epochs)")
    ap.add_argument("--precision", default="bf16 autocast",
                    help="the run's arithmetic, when its checkpoint does not record it (runs before it did)")
    args = ap.parse_args()
    import sentencepiece as spm

    name = os.path.basename(args.checkpoint)[:-4]
    for f in ("best.pt", "log.csv", "loss.png"):
        if not os.path.isfile(os.path.join(args.run, f)):
            sys.exit(f"report: {os.path.join(args.run, f)} is missing; --run takes the folder of a run of "
                     "train/train.py (out/VARIANT)")
    try:
        best = checkpoint.load(os.path.join(args.run, "best.pt"))  # weights_only where torch has it
    except checkpoint.CheckpointError as e:
        sys.exit(f"report: {e}; --run takes the folder of a finished run of train/train.py (resume it with "
                 "--resume, or train it again)")
    if not isinstance(best, dict) or not {"best_val", "step", "tokens", "elapsed"} <= set(best):
        sys.exit(f"report: {os.path.join(args.run, 'best.pt')} is not a best.pt saved by train/train.py")
    rows = list(csv.DictReader(open(os.path.join(args.run, "log.csv"))))
    if not rows:
        sys.exit(f"report: {os.path.join(args.run, 'log.csv')} holds no step yet; run train/train.py to the end first")
    last = rows[-1]
    train_tokens = args.train_tokens or os.path.getsize(os.path.join(ROOT, "data", "train.bin")) // 2
    vals = [(float(r["minutes"]), int(r["tokens"]), float(r["val_loss"])) for r in rows if r["val_loss"]]
    png = os.path.join(os.path.dirname(args.checkpoint), f"{name}_loss.png")
    shutil.copyfile(os.path.join(args.run, "loss.png"), png)

    ppl_cmd = [args.checkpoint, "--ppl", args.valid]
    c_ppl = run(ppl_cmd).stdout.strip()
    c_nll = float(re.search(r"mean NLL ([\d.]+)", c_ppl).group(1))
    sp = spm.SentencePieceProcessor(model_file=os.path.join(ROOT, "tokenizer", "tokenizer.model"))
    pt_nll, pt_count = pytorch_nll(export.load_engine_checkpoint(args.checkpoint), read_stories(args.valid), sp)

    greedy_cmds = [["-k", "1", "--kv"], ["-k", "1"], ["-k", "1", "--kv", "--threads", "1"]]
    greedy = [run([args.checkpoint, "-p", PROMPT, "-q"] + g).stdout.strip() for g in greedy_cmds]
    topk_cmds = [["-k", "40", "-t", "1.0", "-s", str(s), "--kv"] for s in (1, 2, 3)]
    topk = [run([args.checkpoint, "-p", PROMPT, "-q"] + t).stdout.strip() for t in topk_cmds]
    ntok = [len(sp.encode(t)) for t in greedy[:1] + topk]

    out = []
    out.append(f"## {name}.bin\n")
    out.append("| | |\n|---|---|")
    out.append(f"| machine | {machine()} |")
    budget = best.get("budget_steps")
    sittings = len(best.get("sittings", [])) or 1
    out.append(f"| training | {int(last['step']):,} steps of 16x256 tokens"
               + (f" (a budget of {budget:,} steps)" if budget else "")
               + f", {float(last['minutes']):.1f} minutes in {sittings} sitting{'s' if sittings > 1 else ''} |")
    out.append(f"| tokens seen | {int(last['tokens']):,} ({int(last['tokens']) / train_tokens:.2f} epochs of {train_tokens:,}) |")
    out.append(f"| best validation loss | {best['best_val']:.4f} nats/token (PyTorch, {best.get('precision', args.precision)}), at step {best['step']:,} "
               f"({best['tokens']:,} tokens, {best['elapsed'] / 60:.1f} min) |")
    out.append(f"| `./run {name}.bin --ppl valid.txt` (C, fp32) | {c_nll:.4f} nats/token |")
    out.append(f"| PyTorch reference, fp32, same windows | {pt_nll:.4f} nats/token over {pt_count:,} tokens "
               f"(difference {abs(c_nll - pt_nll):.1e}) |")
    out.append("")
    out.append("Validation loss during the run (nats/token):\n")
    out.append("| minutes | tokens | validation loss |\n|---:|---:|---:|")
    for m, t, v in vals:
        out.append(f"| {m:.1f} | {t:,} | {v:.4f} |")
    out.append(f"\n![{name} loss curve]({os.path.basename(png)})\n")
    out.append(f"```\n$ ./run weights/{name}.bin --ppl ../shared/tinystories/valid.txt\n{c_ppl}\n```\n")
    same = len(set(greedy)) == 1
    out.append(f"Greedy (`-k 1`) from \"{PROMPT}\", three runs: "
               + ", ".join(f"`{' '.join(g)}`" for g in greedy_cmds)
               + (": the three outputs are byte-identical, so the text is shown once." if same else ":") + "\n")
    for g in (greedy[:1] if same else greedy):
        out.append("> " + g.replace("\n", "\n> ") + "\n")
    out.append("Top-k (`-k 40 -t 1.0`), seeds 1, 2, 3:\n")
    for cmd, t in zip(topk_cmds, topk):
        out.append(f"`./run weights/{name}.bin -p \"{PROMPT}\" {' '.join(cmd)}`\n")
        out.append("> " + t.replace("\n", "\n> ") + "\n")
    out.append(f"(Sample lengths in tokens: greedy {ntok[0]}, top-k {', '.join(map(str, ntok[1:]))}.)\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
