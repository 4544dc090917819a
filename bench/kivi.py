#!/usr/bin/env python3
"""bench/kivi.py: the cache dtypes side by side (issue 40): capacity and decode speed.

For each trained checkpoint and --kv-dtype: the bytes a token's cache takes (--info --json's
formula, int4/int2's fp32 tail spread over the context included), how many full-context
sequences a 64 MiB pool holds (its blocks, ceil(context / 16) a sequence, plus each
sequence's tail; checked against the engine's own pool for that many sequences and one
more), and decode tokens/s at batch 1 and 64 over a cache filled to --fill positions
(--fill: generated entries, so each step reads a long cache), medians of --reps timed runs
after a warm-up. The MHA row at batch 64 is where the cache dominates the step.

    /usr/bin/python3 bench/kivi.py [--reps 3] [--n 32] [--fill 192] [--batches 1,64]
                                   [--dtypes fp32,int8,fp8,int4,int2] [--targets mha,...]

`make bench-kivi` runs it and writes DIR/<machine>-kivi.md."""
import argparse
import math
import os
import statistics
import sys

if __package__ in (None, ""):
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.common import BenchError, ORDER, PROMPT, ROOT, log, md_table, rel
from bench.engine import engine_json
from bench.machine import write_machine_report

MIB = 64


def info(ckpt, *flags):
    return engine_json([ckpt, "--info", "--kv"] + [str(f) for f in flags], "--info", "info")[-1]


def capacity(ckpt, dtype):
    """(bytes per token, full-context sequences in MIB MiB): N sequences take N x (blocks of a
    context x block bytes + tail); the engine's pool for --kv-mem MIB and --batch N must hold
    N full contexts, and for N + 1 sequences fewer than N + 1."""
    i = info(ckpt, "--kv-dtype", dtype)
    per_seq = -(-i["context"] // i["kv_block_tokens"])
    fits = math.floor(MIB * 2**20 / (per_seq * i["kv_block_bytes"] + i["kv_tail_bytes"]))
    def blocks(n):  # the engine's pool for n sequences (--batch takes at most 256)
        return info(ckpt, "--kv-dtype", dtype, "--kv-mem", MIB, "--batch", n)["kv_pool_blocks"] if 1 <= n <= 256 else None
    pool, more = blocks(fits), blocks(fits + 1)
    if (pool is not None and pool < fits * per_seq) or (more is not None and more >= (fits + 1) * per_seq):
        raise BenchError(f"{ckpt} {dtype}: the engine's pool ({pool}, {more} blocks) disagrees with the formula's "
                         f"{fits} sequences of {per_seq} blocks")
    return i["kv_bytes_per_token"], fits


def decode(ckpt, dtype, batch, a):
    """Median decode tokens/s (tokens_per_s_mean: a step's tokens over its time, over the steps)."""
    args = [ckpt, "-p", PROMPT, "--kv", "--kv-dtype", dtype, "--batch", batch, "-k", 40, "-s", 0, "--ignore-eos",
            "-n", a.n, "--fill", a.fill, "-q", "--threads", a.threads]
    what = f"{os.path.basename(ckpt)} {dtype} B={batch}"
    runs = [engine_json(args, what, "summary")[-1] for _ in range(a.reps + 1)][1:]
    return statistics.median(r["tokens_per_s_mean"] for r in runs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n", type=int, default=32, help="tokens generated a run")
    ap.add_argument("--fill", type=int, default=192, help="generated cache positions before the prompt")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--dtypes", default="fp32,int8,fp8,int4,int2")
    ap.add_argument("--targets", default=",".join(ORDER))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",") if x]
    dtypes = [x for x in a.dtypes.split(",") if x]
    rows = []
    for t in [x for x in a.targets.split(",") if x]:
        ckpt = os.path.join(ROOT, "weights", f"{t}.bin")
        for dt in dtypes:
            per_token, fits = capacity(ckpt, dt)
            tps = []
            for b in batches:
                log(f"{t} {dt} B={b}")
                tps.append(decode(ckpt, dt, b, a))
            rows.append([t, dt, f"{per_token:,}", f"{fits:,}"] + [f"{x:,.0f}" for x in tps])
    lines = ["# The cache's dtypes: capacity and decode speed", "",
             f"`bench/kivi.py`: bytes per token (int4/int2: codes, bf16 scales and minimums, and the 16-row fp32 tail "
             f"of a sequence spread over its context), full-context sequences in a {MIB} MiB pool, and decode tokens/s "
             f"(median of {a.reps} runs after a warm-up; {a.n} tokens a sequence after --fill {a.fill}, top-k 40, "
             f"{a.threads} threads). What each dtype costs in quality: `make quality`.", "",
             md_table(["variant", "--kv-dtype", "KV bytes/token", f"full contexts in {MIB} MiB"]
                      + [f"tokens/s at B={b}" for b in batches], rows), ""]
    print("\n".join(lines))
    log(f"wrote {rel(write_machine_report(a.out, a.threads, 'kivi', lines))}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        print(f"bench/kivi.py: {e}", file=sys.stderr)
        sys.exit(1)
