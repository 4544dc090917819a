#!/usr/bin/env python3
"""bench/offload.py: what the KV cache's disk tier (--kv-offload) costs against recompute.

For each checkpoint, 4 sequences decode over a pool of one full context (and half a block), so
the scheduler preempts; once with --preempt swap (blocks to the tier and back) and once with
--preempt recompute. Reported, medians over the reps: the tier's time per block written and
read, scaled to one full context (context / 16 blocks out and in); the recompute of one full
context (the prefill of a context-long prompt, timed alone); the whole run's wall time in
both modes; and the rule for --preempt's default that follows. The page cache is not
bypassed: the tier is written and read through it, and the blocks a swap writes are read
back before the kernel writes them out, so these are memory-speed figures; the report says so.

    /usr/bin/python3 bench/offload.py [--reps R] [--steps N] [--out DIR] [CHECKPOINT ...]

`make bench-offload` runs it on every weights/*.bin; writes DIR/offload.md."""
import argparse
import glob
import os
import statistics
import sys
import tempfile

if __package__ in (None, ""):
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.common import BenchError, ROOT, log, rel
from bench.engine import engine_json

BATCH, SEED = 4, 9
STORY = ("Once upon a time there was a little girl named Lily. She liked to play in the park with her "
         "dog. One day the sun was hot and the dog ran away. ")


def info(ckpt):
    return engine_json([ckpt, "--info", "--kv"], f"{ckpt} --info", "info")[-1]


def forced_run(ckpt, inf, steps, mode, tier):
    block, blocks = inf["kv_block_bytes"], inf["context"] // inf["kv_block_tokens"]
    mb = f"{(blocks * block + block // 2) / 2**20:.6f}"
    args = [ckpt, "-p", "Once upon a time", "--kv", "--batch", str(BATCH), "--kv-mem", mb, "-n", str(steps),
            "--ignore-eos", "-s", str(SEED), "-q", "--preempt", mode, "--kv-offload", tier]
    return engine_json(args, f"{rel(ckpt)} --preempt {mode}", "summary")[-1]


def recompute_ms(ckpt, inf):
    """The prefill of a prompt of about one full context, alone."""
    text = (STORY * inf["context"])[:inf["context"] * 5 // 2]  # about 0.6 tokens a character: under the context
    objs = engine_json([ckpt, "-p", text, "--kv", "-n", "1", "-q", "-s", str(SEED)], f"{rel(ckpt)} prefill", "summary")
    seq = objs[0]
    return seq["prefill_ms"], seq["prompt_tokens"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200, help="tokens each sequence generates")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("checkpoints", nargs="*")
    a = ap.parse_args()
    ckpts = a.checkpoints or sorted(glob.glob(os.path.join(ROOT, "weights", "*.bin")))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as d:
        for ck in ckpts:
            inf = info(ck)
            ctx_blocks = inf["context"] // inf["kv_block_tokens"]
            swap, rec, per_block, pre = [], [], [], []
            for rep in range(a.reps):
                s = forced_run(ck, inf, a.steps, "swap", os.path.join(d, f"t{rep}"))
                r = forced_run(ck, inf, a.steps, "recompute", os.path.join(d, f"u{rep}"))
                if s["tier_blocks_written"] == 0:
                    raise BenchError(f"{rel(ck)}: the run swapped nothing; the pool did not force a preemption")
                swap.append(s["total_ms"])
                rec.append(r["total_ms"])
                per_block.append(s["tier_wait_ms_total"] / (s["tier_blocks_written"] + s["tier_blocks_read"]))
                ms, n = recompute_ms(ck, inf)
                pre.append(ms * inf["context"] / n)
            swap_ctx = statistics.median(per_block) * 2 * ctx_blocks
            rows.append((rel(ck), inf["kv_block_bytes"], ctx_blocks, s["preemptions"], s["tier_blocks_written"],
                         swap_ctx, statistics.median(pre), statistics.median(swap), statistics.median(rec)))
            log(f"{rel(ck)}: swap out+in of a context {swap_ctx:.3f} ms, recompute {statistics.median(pre):.3f} ms")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "offload.md")
    with open(path, "w") as f:
        f.write("# KV tier: swap against recompute\n\n")
        f.write(f"{BATCH} sequences, {a.steps} tokens each, over a pool of one full context; medians of "
                f"{a.reps} reps. The page cache is not bypassed (no O_DIRECT, no fadvise): the tier's blocks "
                "are read back from it, so the swap figures are memory-speed, the best a disk tier gets.\n\n")
        f.write("| checkpoint | block bytes | blocks a context | preemptions | blocks swapped | swap out+in of a "
                "context, ms | recompute of a context, ms | run with swap, ms | run with recompute, ms |\n")
        f.write("|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.3f} | {r[6]:.3f} | {r[7]:.1f} | "
                    f"{r[8]:.1f} |\n")
        f.write("\nThe rule for --preempt's default: swap when 2 x bytes of the context / the tier's bandwidth "
                "is below the prefill time of the context (the two columns above).\n")
    log(f"wrote {rel(path)}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        print(f"bench: {e}", file=sys.stderr)
        sys.exit(1)
