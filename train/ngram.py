"""Builds a corpus n-gram table, the drafter of `./run --draft TABLE` (docs/FORMAT.md, "N-gram
table"): for each context of 1 to --orders tokens seen in the training stories, the token
that most often followed it. llama.cpp's lookup decoding takes such a static table
(`llama-lookup-create`) beside prompt lookup; here it drafts alone.

    python3 train/ngram.py --train ../shared/tinystories/train.txt --out weights/draft/tinystories-6gram.ngram

Each story is encoded as in train/prepare.py (BOS ... EOS, the committed tokenizer). A
context is kept when its most frequent next token followed it at least --min-count times
(ties: the one that most often follows the context's
shorter suffix, then the lowest id), and only where it changes the draft: a context whose next token is
what its longest kept shorter suffix would draft is left out, so the table drafts exactly
what the whole one would, in fewer bytes. Deterministic: the same text gives the same file.
"""
import argparse
import collections
import os
import struct
import sys

import sentencepiece as spm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prepare import BOS_ID, EOS_ID, ROOT, read_stories  # noqa: E402

MAGIC = b"RUNNGRAM"
VERSION = 1
MAX_ORDERS = 8


def pieces_hash(sp):
    """FNV-1a (64 bits) over every piece's UTF-8 bytes and a 0 byte, ids in order: the
    tokenizer's identity, which ./run checks against the target's pieces."""
    h = 0xcbf29ce484222325
    for i in range(sp.get_piece_size()):
        for b in sp.id_to_piece(i).encode("utf-8") + b"\0":
            h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def count(sequences, orders):
    """{context tuple: Counter of next tokens} for contexts of 1 .. orders tokens."""
    counts = collections.defaultdict(collections.Counter)
    for s in sequences:
        for i in range(1, len(s)):
            for n in range(1, min(orders, i) + 1):
                counts[tuple(s[i - n:i])][s[i]] += 1
    return counts


def table(counts, orders, min_count):
    """[{context: next}] for orders 1 .. orders, pruned as the module says."""
    unigrams = collections.Counter()
    for ctx, nexts in counts.items():
        if len(ctx) == 1:
            unigrams.update(nexts)
    kept = [dict() for _ in range(orders + 1)]
    for ctx, nexts in counts.items():
        shorter = counts[ctx[1:]] if len(ctx) > 1 else unigrams
        best, c = min(nexts.items(), key=lambda kv: (-kv[1], -shorter[kv[0]], kv[0]))
        if c >= min_count:
            kept[len(ctx)][ctx] = best
    out = [dict() for _ in range(orders + 1)]
    for n in range(1, orders + 1):
        for ctx in sorted(kept[n]):
            backoff = next((out[m][ctx[-m:]] for m in range(n - 1, 0, -1) if ctx[-m:] in out[m]), None)
            if kept[n][ctx] != backoff:
                out[n][ctx] = kept[n][ctx]
    return out


def write(path, sp, tables, orders):
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<IIII", VERSION, sp.get_piece_size(), orders, 0))
        f.write(struct.pack("<Q", pieces_hash(sp)))
        f.write(struct.pack(f"<{orders}I", *(len(tables[n]) for n in range(1, orders + 1))))
        for n in range(1, orders + 1):
            for ctx in sorted(tables[n]):
                f.write(struct.pack(f"<{n + 1}H", *ctx, tables[n][ctx]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", required=True, help="stories in the TinyStoriesV2 layout")
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "tokenizer", "tokenizer.model"))
    ap.add_argument("--orders", type=int, default=6, help=f"longest context, 1..{MAX_ORDERS}")
    ap.add_argument("--min-count", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if not 1 <= a.orders <= MAX_ORDERS:
        sys.exit(f"ngram.py: --orders {a.orders}: from 1 to {MAX_ORDERS}")
    if a.min_count < 1:
        sys.exit(f"ngram.py: --min-count {a.min_count}: at least 1")
    try:
        sp = spm.SentencePieceProcessor(model_file=a.tokenizer)
        stories = read_stories(a.train)
    except (OSError, RuntimeError, UnicodeDecodeError) as e:
        sys.exit(f"ngram.py: {e}")
    if sp.get_piece_size() > 65536:
        sys.exit(f"ngram.py: {sp.get_piece_size()} pieces: the table stores ids in 16 bits")
    sequences = [[BOS_ID] + ids + [EOS_ID] for ids in sp.encode(stories)]
    tables = table(count(sequences, a.orders), a.orders, a.min_count)
    write(a.out, sp, tables, a.orders)
    sizes = [len(tables[n]) for n in range(1, a.orders + 1)]
    print(f"{sum(map(len, sequences))} tokens of {len(stories)} stories; contexts kept by order {sizes}; "
          f"{os.path.getsize(a.out)} bytes -> {a.out}")


if __name__ == "__main__":
    main()
