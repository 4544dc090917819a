"""What the cache's levers cost in quality, from real runs of ./run (make quality).

For every checkpoint and cache dtype: the mean NLL of the first --nll-bytes of a
validation text (--ppl, the same windows as training scores), its difference from fp32,
and for how many leading greedy tokens from each of docs/prompts.txt's prompts the dtype
agrees with fp32. For every checkpoint and layer, the statistics that motivate KIVI's
int4/int2 (keys per channel, values per token): how far the largest channel's |K| stands
above the median channel's, against the same for tokens (from the PyTorch reference,
train/model.py, on the same weights). For every checkpoint and
window policy: the NLL of long texts made of consecutive validation stories, over the
tokens past the context, with the window sliding (ring, sinks) against restarting at the
context (the baseline). Writes Markdown and CSV to --out.

    /usr/bin/python3 bench/quality.py --valid ../shared/tinystories/valid.txt [CKPT ...]
"""
import argparse
import csv
import glob
import hashlib
import os
import sys
import tempfile

# run as a script (make quality), this file's folder is sys.path[0]: the repository root takes
# its place, so that bench/engine.py imports as bench.engine
if __package__ in (None, ""):
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.common import ROOT, BenchError, read_stories
from bench.engine import engine_json, run_engine

DTYPES = ["fp32", "bf16", "int8", "fp8", "int4", "int2"]
PROMPTS = os.path.join(ROOT, "docs", "prompts.txt")
POLICIES = [("restart", []), ("ring", ["--kv", "--window", "{ctx}"]),
            ("sinks", ["--kv", "--window", "{ctx}", "--window-policy", "sinks"])]
EVICT_POLICIES = ["ring", "sinks", "h2o", "block"]
EVICT_BUDGETS = [0.25, 0.5, 0.75]  # of the context


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def info(ckpt, *flags):
    """./run CKPT --info --json [flags]."""
    return engine_json([ckpt, "--info"] + list(flags), "--info", "info")[-1]


def ppl(ckpt, text, extra):
    r = engine_json([ckpt, "--ppl", text] + extra, "--ppl", "ppl")[-1]
    past = r["past_context"]
    return {"tokens": r["tokens"], "nll": r["mean_nll"],
            "past_tokens": past["tokens"] if past else 0, "past_nll": past["mean_nll"] if past else None}


def greedy_tokens(ckpt, dtype):
    """Each prompt's greedy tokens, to the full context (one batch: each as alone)."""
    with open(PROMPTS) as f:
        n = sum(1 for line in f if line.strip())
    objs = engine_json([ckpt, "--prompts", PROMPTS, "--batch", n, "-k", 1, "--ignore-eos", "--kv", "--kv-dtype", dtype,
                        "-q"], "greedy run", "summary")
    return [o["tokens"] for o in sorted(objs[:-1], key=lambda o: o["index"])]


def packs(i):
    """Whether int4 and int2 take this model: rows in slices of 16 elements."""
    return (i["kv_latent"] + i["rope_dim"] if i["kv_latent"] else i["head_dim"]) % 16 == 0


def slice_text(valid, n_bytes):
    """The stories of valid's first n_bytes (whole stories), as a file for --ppl."""
    with open(valid, encoding="utf-8") as f:
        text = f.read()
    cut = text.find("<|endoftext|>", n_bytes)
    fd, path = tempfile.mkstemp(suffix=".txt")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text if cut < 0 else text[:cut])
    return path


def ratio(absmax):
    """max / median of a vector of absolute maxima"""
    import torch
    med = float(torch.median(absmax))
    return float(absmax.max()) / med if med > 0 else float("inf")


def key_statistics(ckpt, text, n_stories=8):
    """Per layer: the |K| outlier ratios KIVI's premise is about. For every KV head (MLA: the
    cached row [c ; k_R]), each channel's largest |K| over the tokens of a story, and each
    token's over the channels; the ratio of the largest to the median, channels against
    tokens, and the same for the values (MLA caches no values: c is read as both). Means
    over heads and stories. Keys after RoPE, as cached."""
    import torch
    sys.path.insert(0, os.path.join(ROOT, "train"))
    import export
    import model as model_py
    import sentencepiece as spm
    m = export.load_engine_checkpoint(ckpt)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(ROOT, "tokenizer", "tokenizer.model"))
    stories = read_stories(text)[:n_stories]
    cfg = m.cfg
    sums = [[0.0] * 4 for _ in range(cfg.n_layers)]
    counts = [0] * cfg.n_layers
    for story in stories:
        ids = ([sp.bos_id()] + sp.encode(story))[:cfg.max_seq_len]
        if len(ids) < 16:
            continue
        caches = [model_py.KVCache() for _ in range(cfg.n_layers)]
        with torch.no_grad():
            m(torch.tensor([ids]), caches=caches)
        for l, c in enumerate(caches):
            if cfg.kv_latent:
                heads = [(torch.cat([c.a[0], c.b[0]], dim=-1), None)]        # (T, dc + rd)
            else:
                heads = [(c.a[0, h], c.b[0, h]) for h in range(cfg.n_kv_heads)]  # (T, hd) each
            for k, v in heads:
                for i, x in enumerate((k, v)):
                    if x is None:
                        continue
                    sums[l][2 * i] += ratio(x.abs().amax(dim=0)) / len(heads)      # channels
                    sums[l][2 * i + 1] += ratio(x.abs().amax(dim=1)) / len(heads)  # tokens
            counts[l] += 1
    return [{"layer": l, "key_channel": s[0] / counts[l], "key_token": s[1] / counts[l],
             "value_channel": s[2] / counts[l] if not cfg.kv_latent else None,
             "value_token": s[3] / counts[l] if not cfg.kv_latent else None} for l, s in enumerate(sums)]


def leading_agreement(a, b):
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def bytes_per_token(ckpt, dtype):
    return info(ckpt, "--kv", "--kv-dtype", dtype)["kv_bytes_per_token"]


def long_texts(valid, n_texts, per_text):
    """Texts of per_text consecutive validation stories each, in the --ppl layout."""
    stories = read_stories(valid)
    texts = ["\n".join(stories[i * per_text:(i + 1) * per_text]) for i in range(n_texts)]
    if len(texts[-1]) == 0:
        raise BenchError(f"{valid} has fewer than {n_texts * per_text} stories")
    fd, path = tempfile.mkstemp(suffix=".txt")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n<|endoftext|>\n".join(texts) + "\n")
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="*")
    ap.add_argument("--valid", default=os.path.join(ROOT, "..", "shared", "tinystories", "valid.txt"))
    ap.add_argument("--nll-bytes", type=int, default=60000, help="bytes of --valid the dtype table scores")
    ap.add_argument("--long-texts", type=int, default=20, help="long texts for the window table")
    ap.add_argument("--stories-per-text", type=int, default=6)
    ap.add_argument("--evict-stories", type=int, default=100, help="validation stories for the eviction table")
    ap.add_argument("--evict-stories-per-text", type=int, default=1, help="stories a text of the eviction table")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--name", default="quality")
    args = ap.parse_args(argv)
    ckpts = args.checkpoints or sorted(glob.glob(os.path.join(ROOT, "weights", "*.bin")))
    if not ckpts:
        sys.exit("quality: no checkpoint in weights/")
    if not os.path.isfile(args.valid):
        sys.exit(f"quality: {args.valid} is missing")
    try:
        long_path = long_texts(args.valid, args.long_texts, args.stories_per_text)
        evict_path = long_texts(args.valid, args.evict_stories, args.evict_stories_per_text)
        nll_path = slice_text(args.valid, args.nll_bytes)
        dtype_rows, window_rows, evict_rows, stat_rows = [], [], [], []
        for ckpt in ckpts:
            i = info(ckpt)
            variant, ctx = i["variant"], i["context"]
            base_tokens = None
            for dt in DTYPES:
                if dt in ("int4", "int2") and not packs(i):
                    log(f"{variant} {dt}: skipped, rows not in slices of 16")
                    continue
                log(f"{variant} {dt}: --ppl on {args.nll_bytes} bytes of {args.valid}")
                r = ppl(ckpt, nll_path, ["--kv-dtype", dt])
                toks = greedy_tokens(ckpt, dt)
                if dt == "fp32":
                    base, base_tokens = r["nll"], toks
                dtype_rows.append({"variant": variant, "dtype": dt, "bytes_per_token": bytes_per_token(ckpt, dt),
                                   "nll": r["nll"], "delta": r["nll"] - base, "tokens": r["tokens"],
                                   "greedy_agree": sum(leading_agreement(a, b) for a, b in zip(toks, base_tokens)),
                                   "greedy_of": sum(len(b) for b in base_tokens)})
            log(f"{variant}: key statistics (PyTorch reference)")
            stat_rows += [dict(r, variant=variant) for r in key_statistics(ckpt, nll_path)]
            for name, extra in POLICIES:
                log(f"{variant} {name}: --ppl on {args.long_texts} long texts")
                r = ppl(ckpt, long_path, [e.format(ctx=ctx) for e in extra])
                window_rows.append({"variant": variant, "policy": name, "window": ctx if extra else "",
                                    "tokens": r["tokens"], "nll": r["nll"], "past_tokens": r["past_tokens"],
                                    "past_nll": r["past_nll"]})
            for share in EVICT_BUDGETS:
                budget = int(ctx * share)
                for policy in EVICT_POLICIES:
                    if policy == "block" and (budget < 32 or budget % 16):  # whole blocks of 16, two at least
                        evict_rows.append({"variant": variant, "budget": budget, "share": share, "policy": policy,
                                           "past_tokens": None, "past_nll": None})
                        continue
                    log(f"{variant} --kv-budget {budget} --evict {policy}: --ppl on {args.evict_stories} stories")
                    r = engine_json([ckpt, "--ppl", evict_path, "--kv", "--kv-budget", budget, "--evict", policy],
                                    "--ppl", "ppl")[-1]
                    past = r["past_budget"]
                    evict_rows.append({"variant": variant, "budget": budget, "share": share, "policy": policy,
                                       "past_tokens": past["tokens"], "past_nll": past["mean_nll"]})
        os.unlink(long_path)
        os.unlink(evict_path)
        os.unlink(nll_path)
        measured_on = provenance(ckpts)
    except BenchError as e:
        sys.exit(f"quality: {e}")
    write(args, dtype_rows, window_rows, evict_rows, stat_rows, measured_on)


def provenance(ckpts):
    """What the tables were measured on: the engine's --version and each checkpoint's sha256."""
    sums = []
    for ckpt in ckpts:
        with open(ckpt, "rb") as f:
            sums.append(f"`{os.path.basename(ckpt)}` {hashlib.sha256(f.read()).hexdigest()[:12]}")
    return (f"Engine: `{run_engine(['--version'], '--version').stdout.strip()}`. Checkpoints (sha256, first 12 hex digits): "
            + ", ".join(sums) + ".")


def write(args, dtype_rows, window_rows, evict_rows, stat_rows, measured_on):
    os.makedirs(args.out, exist_ok=True)
    md = ["# Quality of the cache's levers", "",
          f"Real runs of `./run` on `{os.path.relpath(args.valid, ROOT)}` (bench/quality.py).", "", measured_on, "",
          "## Cache precision", "",
          f"Mean NLL (nats/token) of `--ppl` with `--kv-dtype` on the first {args.nll_bytes:,} bytes (whole stories) "
          "of the text, each story scored in windows of the context; greedy agreement: leading tokens equal to "
          "fp32's, summed over the prompts of docs/prompts.txt (greedy, to the full context). int4 and int2 "
          "(KIVI, docs/KVCACHE.md) only where the rows come in slices of 16.", "",
          "| variant | dtype | KV bytes/token | mean NLL | vs fp32 | greedy tokens equal to fp32 |",
          "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in dtype_rows:
        md.append(f"| {r['variant']} | {r['dtype']} | {r['bytes_per_token']:,} | {r['nll']:.4f} | {r['delta']:+.4f} | "
                  f"{r['greedy_agree']} of {r['greedy_of']} |")
    md.append("")
    for dt in DTYPES[1:]:
        rows = [r for r in dtype_rows if r["dtype"] == dt]
        if rows:
            worst = max(rows, key=lambda r: r["delta"])
            md.append(f"{dt} costs at most {worst['delta']:+.4f} nats/token ({worst['variant']}).")
    md += ["", "## Keys per channel, values per token (KIVI's premise)", "",
           "For each KV head (MLA: the cached row [c ; k_R], read as keys and, c, as values), on the stories of the "
           "NLL slice: each channel's largest |x| over a story's tokens, and each token's over the channels; the "
           "largest of those over the median, for channels and for tokens; means over heads and stories. Keys after "
           "RoPE, as cached. KIVI's premise: keys have outlier channels (a large channel ratio) and values do not.", "",
           "| variant | layer | K: channels max/median | K: tokens max/median | V: channels max/median | "
           "V: tokens max/median |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in stat_rows:
        v = (f"{r['value_channel']:.2f} | {r['value_token']:.2f}" if r["value_channel"] is not None else "— | —")
        md.append(f"| {r['variant']} | {r['layer']} | {r['key_channel']:.2f} | {r['key_token']:.2f} | {v} |")
    md += ["",
           "## Past the context", "",
           f"{args.long_texts} texts of {args.stories_per_text} consecutive validation stories each. *restart*: "
           "scored in windows of the context, each from an empty cache (the models never saw more); *ring*: a "
           "window of the context sliding one token at a time, oldest position overwritten; *sinks*: the first 4 "
           "positions kept, the rest sliding. NLL over all tokens, and over the tokens at positions past the context.", "",
           "| variant | policy | tokens | mean NLL | tokens past the context | their mean NLL |",
           "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in window_rows:
        past = f"{r['past_nll']:.4f}" if r["past_nll"] is not None else "—"
        md.append(f"| {r['variant']} | {r['policy']} | {r['tokens']:,} | {r['nll']:.4f} | {r['past_tokens']:,} | {past} |")
    md += ["", "## Eviction at a fixed budget", "",
           f"The first {args.evict_stories} validation stories, each scored from its start through "
           "a cache of `--kv-budget N` positions (25%, 50% and 75% of the context) with `--evict`: *ring* overwrites "
           "the oldest position, *sinks* keeps the first 4 and slides the rest, *h2o* gives up the least attended "
           "position older than the budget's recent half (H2O), *block* the least attended whole block of 16 "
           "older than the recent half (block-wise). Attention is summed over every layer and head, since a "
           "cache block holds every layer's rows of its positions; h2o and block keep each position's own rotation "
           "(as H2O), ring and sinks rotate keys by their place in the window. Mean NLL over the tokens from the "
           "budget to the context (the ones eviction changes, and every policy scores: ring slides on past the "
           "context, h2o and block restart there); in brackets, the difference from ring.", "",
           "| variant | budget | ring | sinks | h2o | block | tokens scored |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for variant in dict.fromkeys(r["variant"] for r in evict_rows):
        for budget in dict.fromkeys(r["budget"] for r in evict_rows if r["variant"] == variant):
            cell = {r["policy"]: r for r in evict_rows if r["variant"] == variant and r["budget"] == budget}
            ring = cell["ring"]["past_nll"]
            cols = [f"{ring:.4f}"] + [f"{cell[p]['past_nll']:.4f} ({cell[p]['past_nll'] - ring:+.4f})"
                                      if cell[p]["past_nll"] is not None else "—" for p in EVICT_POLICIES[1:]]
            md.append(f"| {variant} | {budget} | " + " | ".join(cols) + f" | {cell['ring']['past_tokens']:,} |")
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(args.out, f"{args.name}.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["table", "variant", "setting", "quantity", "value"])
        for r in dtype_rows:
            for q in ("bytes_per_token", "nll", "delta", "greedy_agree", "greedy_of"):
                w.writerow(["dtype", r["variant"], r["dtype"], q, r[q]])
        for r in window_rows:
            for q in ("tokens", "nll", "past_tokens", "past_nll"):
                w.writerow(["window", r["variant"], r["policy"], q, r[q]])
        for r in evict_rows:
            for q in ("past_tokens", "past_nll"):
                w.writerow(["evict", r["variant"], f"{r['policy']}@{r['budget']}", q, r[q]])
        for r in stat_rows:
            for q in ("key_channel", "key_token", "value_channel", "value_token"):
                w.writerow(["key_statistics", r["variant"], f"layer {r['layer']}", q, r[q]])
    print("\n".join(md))


if __name__ == "__main__":
    main()
