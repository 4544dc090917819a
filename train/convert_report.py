"""Measures the checkpoints of issue 39's conversion table (weights/README.md, "MHA to GQA,
MQA and MLA"), each by real runs of ./run:

    python3 train/convert_report.py out/convert/gqa.bin out/convert/up5-gqa/best.pt ...

For each checkpoint (an engine .bin, or a train.py .pt, exported to a .bin beside it first): the
validation NLL of `./run CKPT --ppl valid.txt --json`, the KV cache bytes per token of --info,
and greedy agreement with the MHA parent: for how many of 20 prompts (the first 6 words of the
first 20 validation stories) the first --tokens greedy tokens of `./run --kv -k 1` are the
parent's, and the mean number of leading tokens that agree. One line of JSON per checkpoint.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export  # noqa: E402
from prepare import read_stories  # noqa: E402
from report import ROOT, run  # noqa: E402

VALID = os.path.join(ROOT, "..", "shared", "tinystories", "valid.txt")


def engine_file(path):
    if path.endswith(".pt"):
        out = path[:-3] + ".bin"
        if not os.path.exists(out) or os.path.getmtime(out) < os.path.getmtime(path):
            export.export(export.load_checkpoint(path), out)
        return out
    return path


def greedy(path, prompts, n):
    return [json.loads(run([path, "-p", p, "-k", "1", "-n", str(n), "--ignore-eos", "--kv", "--json", "-q"])
                       .stdout.splitlines()[0])["tokens"] for p in prompts]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--parent", default=os.path.join(ROOT, "weights", "mha.bin"))
    ap.add_argument("--valid", default=VALID, help="validation text (default ../shared/tinystories/valid.txt)")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens compared per prompt")
    args = ap.parse_args()
    prompts = [" ".join(s.split()[:6]) for s in read_stories(args.valid)[:args.prompts]]
    ref = greedy(args.parent, prompts, args.tokens)
    for ck in args.checkpoints:
        path = engine_file(ck)
        ppl = json.loads(run([path, "--ppl", args.valid, "--json"]).stdout.splitlines()[-1])
        info = json.loads(run([path, "--info", "--json"]).stdout.splitlines()[0])
        got = greedy(path, prompts, args.tokens)
        lead = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), min(len(r), len(g))) for r, g in zip(ref, got)]
        print(json.dumps({"checkpoint": ck, "variant": info["variant"], "nll": ppl["mean_nll"],
                          "kv_bytes_per_token": info["kv_bytes_per_token"],
                          "same_prompts": sum(r == g for r, g in zip(ref, got)), "prompts": len(prompts),
                          "mean_leading_agree": sum(lead) / len(lead), "tokens": args.tokens}), flush=True)


if __name__ == "__main__":
    main()
