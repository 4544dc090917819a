"""Running ./run and reading what it writes for machines: the one --json object of --info and
--check-kv, the summary object of a generation, and the --log step CSV. Nothing here reads the
human text; a change of the JSON's fields is mended here."""
import csv
import json
import os
import signal
import subprocess

from bench.common import BenchError, Interrupted, PROMPT, RUN, engine_message, rel


# The engine's team bound one thread a CPU (kernels/threads.c, libgomp's variables): unbound, the
# kernel may stack two of its threads on one CPU for milliseconds (docs/PERFORMANCE.md). A
# user's own settings win.
PINNING = {"OMP_PROC_BIND": "true", "OMP_PLACES": "cores"}


def run_engine(args, what, ok=(0,)):
    """ok: the exit codes that are results (--check-kv exits 1 when the runs differ)."""
    p = subprocess.run([RUN] + [str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       env={**PINNING, **os.environ})
    if p.returncode in (-signal.SIGINT, 128 + signal.SIGINT):   # Ctrl-C in a terminal reaches the engine too
        raise Interrupted(signal.SIGINT)
    if p.returncode < 0:
        raise BenchError(f"{what}: ./run was killed by {signal.Signals(-p.returncode).name}: "
                         f"{engine_message(p.stderr)}")
    if p.returncode not in ok:
        raise BenchError(f"{what}: ./run exited {p.returncode}: {engine_message(p.stderr)}")
    return p


def engine_json(args, what, kind, ok=(0,)):
    """The objects ./run args --json prints, one a line; the last must be of type kind."""
    out = run_engine(list(args) + ["--json"], what, ok).stdout
    try:
        objs = [json.loads(line) for line in out.splitlines() if line.strip()]
    except ValueError as e:
        raise BenchError(f"{what}: ./run --json printed a line that is not JSON: {e}")
    if not objs or objs[-1].get("type") != kind:
        raise BenchError(f"{what}: ./run --json printed no {kind} object: {out.strip()[-300:]}")
    return objs


def field(obj, key, what):
    if key not in obj:
        raise BenchError(f"{what}: ./run --json has no field {key!r}")
    return obj[key]


def info_of(obj, ckpt):
    """The bench's view of ./run CKPT --info --json: the configuration, the parameter count and
    the KV cache bytes. The bytes per token of the cache's formula must agree with the
    allocation it reports."""
    info = {"checkpoint": ckpt}
    for mine, key in (("variant", "variant"), ("dtype", "dtype"), ("dim", "dim"), ("layers", "layers"),
                      ("heads", "heads"), ("head_dim", "head_dim"), ("kv_heads", "kv_heads"), ("latent", "kv_latent"),
                      ("rope_dim", "rope_dim"), ("hidden", "hidden"), ("vocab", "vocab"), ("context", "context"),
                      ("params", "parameters"), ("weight_bytes", "weight_bytes"),
                      ("kv_bytes_per_token", "kv_bytes_per_token"), ("kv_full_bytes", "kv_bytes_full"),
                      ("kv_alloc_per_token", "kv_bytes_per_token_allocated"), ("kv_alloc_bytes", "kv_pool_bytes")):
        info[mine] = field(obj, key, "--info")
    info["is_mla"] = info["latent"] > 0
    info["kernels"] = obj.get("kernels") or "?"
    info["matmul_tiles"] = obj.get("matmul_tiles") or "?"
    per_token, ctx = info["kv_bytes_per_token"], info["context"]
    if not (per_token == info["kv_alloc_per_token"] and per_token * ctx == info["kv_full_bytes"]
            == info["kv_alloc_bytes"]):
        raise BenchError(f"./run --info's KV cache figures disagree: {per_token} bytes/token x {ctx} tokens, "
                         f"{info['kv_full_bytes']} bytes at full context, but {info['kv_alloc_per_token']} "
                         f"bytes/token and {info['kv_alloc_bytes']} bytes allocated")
    return info


def engine_info(ckpt):
    return info_of(engine_json([ckpt, "--info"], "--info", "info")[-1], ckpt)


def pool_of(ckpt, flags, what):
    """The paged pool of ./run CKPT --info --kv [flags] --json: its blocks, their size in tokens
    and bytes, and so the cache's bytes per token under those flags (a cache dtype changes
    them). The blocks must hold whole tokens of the bytes per token it reports."""
    obj = engine_json([ckpt, "--info", "--kv"] + list(flags), what, "info")[-1]
    n_blocks, block_tokens, block_bytes, per_token, pool_bytes = (
        field(obj, k, what) for k in ("kv_pool_blocks", "kv_block_tokens", "kv_block_bytes",
                                      "kv_bytes_per_token_allocated", "kv_pool_bytes"))
    if per_token * block_tokens != block_bytes or n_blocks * block_bytes != pool_bytes:
        raise BenchError(f"./run --info's KV pool figures disagree: {n_blocks} blocks of {block_tokens} tokens and "
                         f"{block_bytes} bytes, {per_token} bytes/token, {pool_bytes} bytes in all")
    return {"block_tokens": block_tokens, "block_bytes": block_bytes, "bytes_per_token": per_token,
            "n_blocks": n_blocks}


def parse_step_log(path):
    """The rows of a --log CSV: step,phase,sequences,n_tokens,pos,token,ms (pos and token are -1
    when more than one sequence is active)."""
    try:
        with open(path, newline="") as f:
            return [{"step": int(r["step"]), "phase": r["phase"], "sequences": int(r["sequences"]),
                     "pos": int(r["pos"]), "n_tokens": int(r["n_tokens"]), "token": int(r["token"]),
                     "ms": float(r["ms"])} for r in csv.DictReader(f)]
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise BenchError(f"cannot read the step log {rel(path)}: {type(e).__name__}: {e}")


def check_kv(info, args, n_gen):
    """./run --check-kv --json's comparisons, each with the check's variant and window, in the
    report's terms: a step or token that does not exist is -1, a verdict 1 or 0, the largest
    logit difference to 6 significant digits."""
    cmd = [info["checkpoint"], "--check-kv", "--ignore-eos", "-p", PROMPT, "--threads", args.threads]
    if n_gen < info["context"]:
        cmd += ["-n", n_gen]
    check = engine_json(cmd, "--check-kv", "check-kv", ok=(0, 1))[-1]
    pairs = field(check, "comparisons", "--check-kv")
    if not pairs:
        raise BenchError("--check-kv --json compared nothing")

    def number(x):
        return -1 if x is None else int(x)
    return [{"variant": check["variant"], "window": check["window"], "a": c["a"], "b": c["b"], "steps": c["steps"],
             "identical_tokens": c["identical_tokens"], "first_divergent_step": number(c["first_divergent_step"]),
             "token_a": number(c["token_a"]), "token_b": number(c["token_b"]),
             "bitwise_identical": int(c["bitwise_identical"]),
             "first_bitwise_difference": number(c["first_bitwise_difference"]),
             "max_abs_logit_diff": f"{c['max_abs_logit_diff']:.6g}"} for c in pairs]
