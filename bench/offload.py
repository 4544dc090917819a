#!/usr/bin/env python3
"""bench/offload.py: what the KV cache's disk tier (--kv-offload) costs: swap against recompute,
and the decode step of a cache streamed from disk against its floor.

For each checkpoint, 4 sequences decode over a pool of one full context (and half a block), so
the scheduler preempts; once with --preempt swap (blocks to the tier and back) and once with
--preempt recompute. Reported, medians over the reps: the tier's time per block written and
read, scaled to one full context (context / 16 blocks out and in); the recompute of one full
context (the prefill of a context-long prompt, timed alone); the whole run's wall time in
both modes; and the rule for --preempt's default that follows. The page cache is not
bypassed: the tier is written and read through it, and the blocks a swap writes are read
back before the kernel writes them out, so these are memory-speed figures; the report says so.

Streaming (one sequence at --batch 1 whose cache the pool cannot hold): a generated MHA shape
(STREAM_SHAPE) decodes --stream-steps tokens after --fill F positions, with 0%, 50% and 90% of
its cache's blocks on the tier (the pool sized to hold the rest), in a tier directory on a
disk (--tier-dir, default build/). Each step's median time is set against the floor
RAM bytes / RAM bandwidth + disk bytes / disk bandwidth: RAM bytes are the weights and the
cache's blocks in the pool, disk bytes those on the tier (tier_stream_peak_blocks);
the RAM bandwidth is build/roofline's streaming-read median, the disk's a sequential read of a
probe file in the tier directory, written, synced and dropped from the page cache first
(posix_fadvise DONTNEED). The engine bypasses the page cache the same way: it syncs and drops
what it spills, and drops each layer's pages once read, so every streamed byte comes from the
device (on tmpfs there is no device: the report names the directory's filesystem).

    /usr/bin/python3 bench/offload.py [--reps R] [--steps N] [--stream-fill F] [--stream-steps S]
                                      [--tier-dir DIR] [--out DIR] [CHECKPOINT ...]

`make bench-offload` runs it on every weights/*.bin; writes DIR/offload.md."""
import argparse
import glob
import os
import statistics
import sys
import tempfile

if __package__ in (None, ""):
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import time

from bench.common import BenchError, ROOFLINE, ROOT, log, rel
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


# MHA with wide KV heads and a small FFN and vocabulary: the cache, not the weights, is the step's traffic
STREAM_SHAPE = "layers=8,dim=512,heads=8,kv_heads=8,ffn=512,vocab=512"
STREAM_FRACTIONS = (0.0, 0.5, 0.9)


def filesystem(path):
    """The type of the filesystem path lies on (/proc/mounts' longest prefix)."""
    best, kind = "", "unknown"
    path = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, parts[2]
    return kind


def disk_read_gbps(directory, nbytes, reps):
    """Sequential reads of a probe file of nbytes, written, synced and out of the page cache."""
    chunk = 8 << 20
    path = os.path.join(directory, "disk-probe")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(path)
        buf = os.urandom(chunk)
        for off in range(0, nbytes, chunk):
            os.pwrite(fd, buf, off)
        os.fdatasync(fd)
        rates = []
        for _ in range(reps):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            for off in range(0, nbytes, chunk):
                os.pread(fd, chunk, off)
            rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return statistics.median(rates)
    finally:
        os.close(fd)


def ram_read_gbps(mib):
    import subprocess
    p = subprocess.run([ROOFLINE, "--mib", str(mib), "--reps", "5", "--no-peak"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise BenchError(f"{rel(ROOFLINE)} exited {p.returncode}: {p.stderr.strip()[-300:]}")
    vals = dict(line.partition(" ")[::2] for line in p.stdout.splitlines())
    return float(vals["bandwidth_median_GBps"])


def streaming_rows(a, tier_dir):
    fill, steps = a.stream_fill, a.stream_steps
    shape = f"{STREAM_SHAPE},ctx={fill + 16 + steps + 16}"
    inf = engine_json(["--shape", shape, "--info", "--kv"], "stream --info", "info")[-1]
    block, layers = inf["kv_block_bytes"], inf["layers"]
    ctx_blocks = -(-inf["context"] // inf["kv_block_tokens"])
    blocks = -(-(fill + 4 + steps) // inf["kv_block_tokens"])  # the sequence's at its last step
    stage = 2 * ctx_blocks * (block // layers)
    rows = []
    for frac in STREAM_FRACTIONS:
        args = ["--shape", shape, "-p", "1 2 3", "--kv", "--fill", str(fill), "-n", str(steps), "--ignore-eos",
                "-k", "1", "-s", str(SEED), "-q"]
        if frac > 0:
            pool = blocks - int(frac * blocks) + 1
            args += ["--kv-mem", f"{(stage + pool * block + block / 2) / 2**20:.6f}"]
        ms, disk, waited = [], [], []
        for rep in range(a.reps):
            tier = ["--kv-offload", os.path.join(tier_dir, f"stream-{frac}-{rep}")] if frac > 0 else []
            s = engine_json(args + tier, f"stream {frac:.0%} on disk", "summary")[-1]
            if frac > 0 and s["tier_stream_blocks"] == 0:
                raise BenchError(f"stream {frac:.0%}: nothing was spilled to the tier")
            ms.append(s["step_ms_median"])
            disk.append(s["tier_stream_peak_blocks"] * block)  # what the last steps read, each
            waited.append(s["tier_stream_wait_ms_total"] / (s["decode_steps"] + 1))  # the prefill's pass too
        disk_bytes = statistics.median(disk)
        cache_bytes = inf["kv_bytes_per_token"] * (fill + 4 + steps // 2)
        ram_bytes = inf["model_bytes"] + max(cache_bytes - disk_bytes, 0)
        rows.append((frac, disk_bytes, ram_bytes, statistics.median(ms), statistics.median(waited)))
        log(f"stream {frac:.0%} on disk: step {statistics.median(ms):.2f} ms, {disk_bytes / 1e6:.1f} MB from disk a step")
    return shape, inf, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200, help="tokens each sequence generates")
    ap.add_argument("--stream-fill", type=int, default=16384, help="positions the streamed sequence starts after")
    ap.add_argument("--stream-steps", type=int, default=12, help="tokens the streamed sequence decodes")
    ap.add_argument("--tier-dir", default=os.path.join(ROOT, "build"), help="where the tier files and the disk probe go")
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
    os.makedirs(a.tier_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-offload-", dir=a.tier_dir) as d:
        shape, sinf, srows = streaming_rows(a, d)
        probe = max(int(max(r[1] for r in srows)), 64 << 20)
        disk_gbps = disk_read_gbps(d, probe, 3)
    ram_gbps = ram_read_gbps(max(256, int(max(r[2] for r in srows)) >> 20))
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
                "is below the prefill time of the context (the two columns above), with the tier's time a block "
                "measured as the run swaps (the first swap measures it) and the prefill's time a token from the "
                "run's prefill steps; see docs/OFFLOAD.md.\n")
        f.write("\n## Streaming a cache larger than the pool\n\n")
        f.write(f"`--shape {shape}` (MHA, {sinf['kv_bytes_per_token']} KV bytes a token, fp32), --fill "
                f"{a.stream_fill}, {a.stream_steps} greedy steps at --batch 1, medians of {a.reps} reps; the "
                f"tier in a directory on {filesystem(d)}. RAM bandwidth {ram_gbps:.2f} GB/s (build/roofline, "
                f"streaming read, median); disk bandwidth {disk_gbps:.2f} GB/s (a sequential read of a "
                f"{probe >> 20} MiB probe file, synced and dropped from the page cache first). The engine keeps "
                "the tier out of the page cache (fdatasync and POSIX_FADV_DONTNEED after spilling, DONTNEED after "
                "each layer read), so streamed bytes come from the device.\n\n")
        f.write("| on disk | disk MB a step | RAM MB a step | step ms (median) | floor ms | step / floor | "
                "attention waiting for the disk, mean ms a pass |\n|---|---|---|---|---|---|---|\n")
        for frac, disk, ram, ms, waited in srows:
            floor = ram / (ram_gbps * 1e6) + disk / (disk_gbps * 1e6)
            f.write(f"| {frac:.0%} | {disk / 1e6:.1f} | {ram / 1e6:.1f} | {ms:.2f} | {floor:.2f} | "
                    f"{ms / floor:.2f} | {waited:.2f} |\n")
        f.write("\nfloor = RAM bytes / RAM bandwidth + disk bytes / disk bandwidth: RAM bytes are the weights "
                "and the cache's blocks in the pool, disk bytes the blocks on the tier at the "
                "end (tier_stream_peak_blocks), which every pass reads once. A step reads each layer of the tier's blocks "
                "while the last layer computes, so it can come under the sum only as far as the two overlap.\n")
    log(f"wrote {rel(path)}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        print(f"bench: {e}", file=sys.stderr)
        sys.exit(1)
