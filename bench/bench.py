#!/usr/bin/env python3
"""bench/bench.py: the latency tables of the KV-cache post, for the C engine and for the
PyTorch reference, with a roofline analysis, the throughput of batched decoding, the KV cache
sizes and capacities and the --check-kv determinism table.

    /usr/bin/python3 bench/bench.py [CHECKPOINT ...] [--threads N] [--reps R] [--pt-reps R] [--out DIR]
                                    [--batches 1,4,16,64,256] [--capacity-mib 64,1024]
    /usr/bin/python3 bench/bench.py --quick [CHECKPOINT ...]

`make bench` runs the full bench, `make bench-quick` the quick mode (bench/bench.mk; the
knobs are BENCH_CHECKPOINTS, BENCH_THREADS, BENCH_REPS, BENCH_PT_REPS, BENCH_OUT,
BENCH_BATCHES, BENCH_FLAGS). bench/README.md explains every number.

Every checkpoint generates from "Once upon a time" greedily (-k 1), ignoring EOS, so every
run does the same work: once without and once with the KV cache, a warm-up round and then
--reps timed rounds; every figure is the median over the timed runs with its spread. The
full bench generates to the full context and adds the PyTorch reference (train/model.py,
eager, in this process), the roofline probe and --check-kv. Then B copies of the prompt
decode together (--kv --batch B) for the throughput table, and pools of given sizes are
filled to count the full-context sequences they hold. --quick measures the C engine alone,
64 decode steps a run, 3 timed rounds, batches of 1 and 16, and prints one table.

Results go to DIR/<machine>.md, DIR/<machine>.csv, DIR/<machine>-steps.csv and four plots
(--quick: <machine>-quick.* in bench/results/tmp/quick), where <machine> is e.g.
amd-epyc-zen5-2c-2t-avx512 (CPU model, physical cores, threads used, the engine's kernels).

Nothing is lost to a failure or Ctrl-C: a checkpoint that fails is left out of the rest of
the bench, PyTorch that is missing or crashes leaves the C results, and an interrupt stops
the measuring; each writes the report of what was measured, headed PARTIAL REPORT with what
is missing and why, and exits non-zero (130 after Ctrl-C). Nothing is ever estimated in
place of a measurement. The engine is ./run, or $RUN_BINARY when set (make test-asan).
"""
import argparse
import glob
import os
import signal
import sys
import time

# run as a script (make bench), this file's folder is sys.path[0]: the repository root takes
# its place, so that the bench's modules import as the package bench/ (train/ has a report.py too)
if __package__ in (None, ""):
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.common import (BenchError, CAPACITY_MIB, Interrupted, LARGE_BATCH, MAX_BATCH, ROOFLINE, ROOT, RUN, log,
                          on_signal, rel, warn)
from bench.engine import PINNING
from bench.machine import logical_cpus, survey
from bench.measure import Bench, measure, read_checkpoints
from bench.report import latency_table, write_report

QUICK_STEPS = 64           # --quick: decode steps per run and timed rounds; five checkpoints
QUICK_REPS = 3             # then take well under a minute on 2 idle cores
FULL_REPS, PT_REPS = 5, 3
BATCHES = (1, 4, 16, 64, 256)
QUICK_BATCHES = (1, 16)
LARGE_BATCH_REPS = 1


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="*", help="engine checkpoints (default: every weights/*.bin)")
    ap.add_argument("--quick", action="store_true",
                    help=f"a quick comparison: the C engine only, {QUICK_STEPS} decode steps a run, {QUICK_REPS} "
                         "timed rounds after a warm-up round, no PyTorch, roofline probe or determinism check; "
                         "prints one table (make bench-quick)")
    ap.add_argument("--threads", type=int, default=logical_cpus(), help="threads (default: all cores, %(default)s)")
    ap.add_argument("--reps", type=int, default=None,
                    help=f"timed C runs per checkpoint and mode (default {FULL_REPS}; --quick: {QUICK_REPS})")
    ap.add_argument("--pt-reps", type=int, default=PT_REPS,
                    help=f"timed PyTorch runs per checkpoint and mode (default {PT_REPS})")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"decode steps per run (default: to the full context; --quick: {QUICK_STEPS}); a full "
                         "bench with fewer is headed 'Short runs'")
    ap.add_argument("--out", default=None,
                    help="output directory (default bench/results; --quick: bench/results/tmp/quick, git-ignored)")
    ap.add_argument("--pt-path", choices=["auto", "eager", "mkldnn"], default="auto",
                    help="PyTorch path per mode: auto (plain eager, unless a run of that mode would take over "
                         "--pt-budget seconds: then oneDNN Linear layers if their logits match and they are "
                         "faster), eager, or mkldnn (default auto)")
    ap.add_argument("--pt-budget", type=float, default=120.0,
                    help="seconds a plain eager PyTorch run may take before auto switches (default 120)")
    ap.add_argument("--skip-pytorch", action="store_true", help="measure the C engine only")
    ap.add_argument("--torch-device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="where the PyTorch reference runs: auto (a CUDA device when torch sees one, else the "
                         "CPU), cpu or cuda (default auto)")
    ap.add_argument("--allow-disturbed", action="store_true",
                    help="measure even when other processes keep the machine busy (the report says so)")
    ap.add_argument("--batches", default=None, metavar="B,B,...",
                    help="batch sizes of the throughput table, 1..256, or none (default "
                         f"{','.join(map(str, BATCHES))}; --quick: {','.join(map(str, QUICK_BATCHES))})")
    ap.add_argument("--large-batch-reps", type=int, default=LARGE_BATCH_REPS,
                    help=f"timed runs of a batch size from {LARGE_BATCH} on, after a warm-up (default "
                         f"{LARGE_BATCH_REPS}: such a run takes seconds); smaller ones get --reps")
    ap.add_argument("--capacity-mib", default=None, metavar="M,M,...",
                    help="KV pool sizes of the capacity table, MiB, or none (default "
                         f"{','.join(f'{m:g}' for m in CAPACITY_MIB)}; --quick: none)")
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"), help="the compiler, for the report")
    # for testing the script itself: a cheaper roofline probe, a shorter look at the load before
    ap.add_argument("--roofline-mib", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--roofline-reps", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--load-seconds", type=float, default=2.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.full = not args.quick
    args.pytorch = args.full and not args.skip_pytorch
    if args.reps is None:
        args.reps = QUICK_REPS if args.quick else FULL_REPS
    if args.steps is None and args.quick:
        args.steps = QUICK_STEPS
    if args.out is None:
        args.out = os.path.join(ROOT, "bench", "results", *(("tmp", "quick") if args.quick else ()))
    args.out = os.path.abspath(args.out)
    if args.threads < 1:
        ap.error("--threads must be at least 1")
    for name in ("reps", "pt_reps"):
        if getattr(args, name) < 2:
            ap.error(f"--{name.replace('_', '-')} must be at least 2: a spread needs two timed runs")
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be at least 1")
    args.batches = number_list(ap, "--batches", args.batches, QUICK_BATCHES if args.quick else BATCHES, int,
                               lambda x: 1 <= x <= MAX_BATCH, f"a whole number from 1 to {MAX_BATCH}")
    args.capacity_mib = number_list(ap, "--capacity-mib", args.capacity_mib, () if args.quick else CAPACITY_MIB,
                                    float, lambda x: 0 < x <= 1048576, "a size in MiB above 0, at most 1048576")
    if args.large_batch_reps < 1:
        ap.error("--large-batch-reps must be at least 1")
    if args.steps == 1 and any(B > 1 for B in args.batches):
        ap.error("--steps must be at least 2 with a batch above 1: its first decode step is the mixed one")
    return args


def number_list(ap, flag, text, default, kind, ok, what):
    """A flag's comma-separated numbers, sorted and without repeats ("none": no numbers)."""
    if text is None:
        return tuple(default)
    if text.strip().lower() == "none":
        return ()
    try:
        vals = sorted({kind(x) for x in text.split(",")})
    except ValueError:
        vals = None
    if not vals or not all(ok(v) for v in vals):
        ap.error(f"{flag} takes {what}, comma-separated, or none: {text!r}")
    return tuple(vals)


# Threads pinned one per core, for the engine (bench/engine.py), the roofline probe and PyTorch
# (set before torch loads libgomp). A user's own OMP_PROC_BIND / OMP_PLACES win.


def checkpoint_paths(args):
    """The checkpoints named, or every weights/*.bin; None (after one line on stderr) if there are none."""
    if args.checkpoints:
        missing = [c for c in args.checkpoints if not os.path.isfile(c)]
        if missing:
            warn(f"no such checkpoint: {', '.join(missing)}")
            return None
        return [os.path.abspath(c) for c in args.checkpoints]
    found = sorted(glob.glob(os.path.join(ROOT, "weights", "*.bin")))
    if not found:
        warn("weights/ holds no checkpoint (*.bin), so there is nothing to measure; train and export one first "
             "(weights/README.md), or name checkpoints: make bench BENCH_CHECKPOINTS=\"path/a.bin ...\"")
    return found or None


def main(argv=None):
    args = parse_args(argv)
    paths = checkpoint_paths(args)
    if paths is None:
        return 1
    for exe in (RUN,) + ((ROOFLINE,) if args.full else ()):
        if not os.access(exe, os.X_OK):
            warn(f"{rel(exe)} is not built (make run build/roofline)")
            return 1
    for k, v in PINNING.items():
        os.environ.setdefault(k, v)
    os.makedirs(args.out, exist_ok=True)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    t_start = time.time()
    b = Bench(args, paths)
    code = 0
    try:
        read_checkpoints(b)
        survey(b)
        measure(b)
    except BenchError as e:
        warn(str(e))
        return 1
    except Interrupted as e:
        b.interrupted = f"{e} during {b.phase}"
        code = 128 + e.signum
        warn(f"interrupted ({b.interrupted}); writing the report of what was measured (interrupt again to "
             "abandon it)")
    if getattr(b, "bg", None):
        b.machine["bg_during"] = b.bg.since()
    if not b.measured():
        warn("nothing was measured, so no report was written")
        return code or 1
    try:
        files = write_report(b)
    except Interrupted as e:
        warn("interrupted again: the report was not written")
        return 128 + e.signum
    log(f"bench: done in {time.time() - t_start:.0f} s; wrote " + ", ".join(rel(p) for p in files))
    print("\n" + latency_table(b, "c"))
    miss = b.missing()
    if miss or b.interrupted:
        warn(f"PARTIAL REPORT ({len(miss)} part{'s' if len(miss) != 1 else ''} not measured): {rel(files[0])}")
        return code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
