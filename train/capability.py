"""Writes the capability table that opens weights/README.md, from real runs only: the
variants trained under one protocol, side by side.

    /usr/bin/python3 train/capability.py --valid ../shared/tinystories/valid.txt \\
        --bench bench/results/intel-xeon-icelake-2c-2t-avx512.csv weights/mha.bin weights/gqa.bin ...

For each checkpoint: ./run --info (KV cache bytes per token, parameters), ./run --ppl
(validation NLL and perplexity, C engine), the validation loss every 2M tokens from the
checkpoint's section of weights/README.md (report.py's table of the run's log.csv, which
stays on the machine that trained it), greedy agreement of ./run with the PyTorch reference
on the first words of validation stories, decode ms at batch 1 and tokens/s at batch 64
from a make bench report (the speed depends on the shapes, not on the trained values), and one
short sample. Prints Markdown to stdout."""
import argparse
import csv
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export  # noqa: E402
from prepare import read_stories  # noqa: E402
from report import ROOT, run  # noqa: E402

AGREEMENT_WORDS = 6   # a prompt: the first words of a validation story


def info(path):
    text = run([path, "--info"]).stdout
    kv = int(re.search(r"^KV cache .*= (\d+) bytes/token", text, re.M).group(1))
    params = int(re.search(r"^parameters\s+(\d+)", text, re.M).group(1))
    return kv, params


def c_nll(path, valid):
    """(mean NLL, perplexity) as ./run --ppl prints them"""
    m = re.search(r"mean NLL ([\d.]+) nats/token \| perplexity ([\d.]+)", run([path, "--ppl", valid]).stdout)
    return m.group(1), m.group(2)


def equal_token_losses(readme, variant):
    """{tokens in millions, rounded: validation loss} from the table report.py wrote in the
    checkpoint's section of the README ("## VARIANT.bin")"""
    with open(readme) as f:
        text = f.read()
    section = re.search(rf"^## {re.escape(variant)}\.bin\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if section is None:
        sys.exit(f"capability: {readme} has no section \"## {variant}.bin\" (train/report.py writes it)")
    rows = re.findall(r"^\| [\d.]+ \| ([\d,]+) \| ([\d.]+) \|$", section.group(1), re.M)
    if not rows:
        sys.exit(f"capability: the section \"## {variant}.bin\" of {readme} has no validation table")
    return {round(int(tokens.replace(",", "")) / 1e6): float(loss) for tokens, loss in rows}


@torch.no_grad()
def greedy_agreement(path, prompts):
    """Markdown: for how many prompts every greedy token of ./run (to EOS or the full context)
    is the PyTorch reference's argmax after the same tokens, over how many tokens, and where
    the first difference is if there is one. Equal at every step is the same as equal free
    runs, and the last token (sampled at a full context) is checked too."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=os.path.join(ROOT, "tokenizer", "tokenizer.model"))
    model = export.load_engine_checkpoint(path).eval()
    model.set_absorb(True)   # MLA: the form ./run uses with the cache
    same, compared, first_difference = 0, 0, None
    for p in prompts:
        c = json.loads(run([path, "-p", p, "-k", "1", "--kv", "--json", "-q"]).stdout.splitlines()[0])["tokens"]
        prompt = [sp.bos_id()] + sp.encode(p)
        pt = model(torch.tensor([prompt + c[:-1]]))[0, len(prompt) - 1:].argmax(dim=-1).tolist()
        compared += len(c)
        if c == pt:
            same += 1
        elif first_difference is None:
            at = next(i for i, (a, b) in enumerate(zip(c, pt)) if a != b)
            first_difference = f"; prompt \"{p}\" differs at token {at}"
    return f"{same}/{len(prompts)}, {compared:,} tokens{first_difference or ''}"


def bench_figures(bench_csv, variant):
    """(decode ms a step at batch 1 with the cache, tokens/s at batch 64), medians of the report"""
    vals = {}
    with open(bench_csv) as f:
        for row in csv.DictReader(f):
            if row["variant"] == variant:
                vals[(row["section"], row["mode"], row["quantity"])] = row["value"]
    return (float(vals[("c", "kv", "step_ms_median")]),
            float(vals[("batch", "B=64", "tokens_per_s_median")]))


def sample(path):
    return run([path, "-p", "Once upon a time", "-k", "40", "-s", "1", "-n", "40", "--kv", "-q"]).stdout.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--valid", required=True, help="validation text (TinyStoriesV2 layout)")
    ap.add_argument("--bench", required=True, help="a make bench report's .csv, from an idle machine")
    ap.add_argument("--prompts", type=int, default=20, help="validation stories whose first words prompt the greedy comparison")
    ap.add_argument("--readme", default=os.path.join(ROOT, "weights", "README.md"),
                    help="the README whose checkpoint sections hold the validation tables")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count())
    prompts = [" ".join(s.split()[:AGREEMENT_WORDS]) for s in read_stories(args.valid)[:args.prompts]]

    rows, curves, samples = [], {}, {}
    for path in args.checkpoints:
        variant = os.path.basename(path)[:-4]   # as the run's folder and the bench report name it
        kv, params = info(path)
        nll, ppl = c_nll(path, args.valid)
        agreement = greedy_agreement(path, prompts)
        ms, tps = bench_figures(args.bench, variant)
        rows.append(f"| {variant} | {kv:,} | {params / 1e6:.2f} M | {nll} | {ppl} | "
                    f"{agreement} | {ms:.3f} | {tps:,.0f} |")
        curves[variant] = equal_token_losses(args.readme, variant)
        samples[variant] = sample(path)

    out = ["| variant | KV cache bytes/token (fp32) | parameters | validation NLL (C) | perplexity | "
           "greedy tokens = PyTorch's (prompts) | decode ms, batch 1 | tokens/s, batch 64 |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"] + rows
    grid = sorted(set().union(*curves.values()))
    out += ["", "Validation loss (PyTorch, during training) at equal tokens:", "",
            "| variant | " + " | ".join(f"{m}M" for m in grid) + " |",
            "|---|" + "---:|" * len(grid)]
    for variant, curve in curves.items():
        out.append(f"| {variant} | " + " | ".join(f"{curve[m]:.4f}" if m in curve else "n/a" for m in grid) + " |")
    out += ["", "One sample each (`-p \"Once upon a time\" -k 40 -s 1 -n 40 --kv`):", ""]
    for variant, text in samples.items():
        out.append(f"- {variant}: {text}")
    print("\n".join(out))


if __name__ == "__main__":
    main()
