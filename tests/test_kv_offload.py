"""The KV cache's disk tier (--kv-offload) with swap preemption: a pool of one context for
four sequences forces preemptions, and the tokens and logits are the same with the tier,
with recompute and with a pool that never preempts; the tier is never left behind, an
existing path is refused, and a file size limit (a full disk's stand-in) warns and falls
back to recompute. The tier's own bookkeeping and failures are tests/test_kvtier.c's."""
import os
import re
import resource

import pytest

from conftest import PROMPT, VARIANTS, generate_json, json_one, run


def small_pool_args(path):
    """A generation of 4 sequences over a pool of one full context and half a block."""
    _, info = json_one([path, "--info", "--kv"])
    block, blocks = info["kv_block_bytes"], info["context"] // info["kv_block_tokens"]
    mb = f"{(blocks * block + block // 2) / 2**20:.6f}"
    return [path, "-p", PROMPT, "--kv", "--batch", 4, "--kv-mem", mb, "-n", 40, "--ignore-eos", "-s", 9]


def tokens(sequences):
    return [(s["index"], s["tokens"]) for s in sequences]


@pytest.mark.parametrize("variant", VARIANTS)
def test_swap_equals_recompute_and_no_preemption(small_checkpoints, variant, tmp_path):
    path, _ = small_checkpoints[variant]
    args = small_pool_args(path)
    tier = tmp_path / "tier"
    _, swapped, s = generate_json(args + ["--kv-offload", tier, "--preempt", "swap", "-q"])
    assert not tier.exists()
    assert s["tier_rule_recomputes"] == 0, s
    assert s["preemptions"] > 0 and s["tier_swaps"] == s["preemptions"] and s["tier_swap_failures"] == 0, s
    assert s["tier_blocks_written"] == s["tier_blocks_read"] > 0, s
    assert s["tier_peak_bytes"] > 0 and s["tier_peak_bytes"] % s["kv_block_bytes"] == 0, s
    _, recomputed, r = generate_json(args + ["--kv-offload", tmp_path / "unused", "--preempt", "recompute", "-q"])
    assert r["preemptions"] > 0 and r["tier_swaps"] == r["tier_blocks_written"] == 0, r
    big = [a for a in args]
    del big[big.index("--kv-mem"):big.index("--kv-mem") + 2]
    _, alone, b = generate_json(big + ["-q"])
    assert b["preemptions"] == 0
    _, ruled, d = generate_json(args + ["--kv-offload", tmp_path / "rule", "-q"])  # --preempt's default
    assert d["preemptions"] > 0 and d["tier_swaps"] > 0, d  # the first swap measures the tier
    assert d["tier_swaps"] + d["tier_rule_recomputes"] + d["tier_swap_failures"] == d["preemptions"], d
    assert tokens(swapped) == tokens(recomputed) == tokens(alone) == tokens(ruled)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("variant", ["mha", "mla64"])
def test_check_batch_with_swaps_is_bitwise(small_checkpoints, variant, tmp_path):
    path, _ = small_checkpoints[variant]
    args = small_pool_args(path) + ["--kv-offload", tmp_path / "tier", "--preempt", "swap"]
    code, verdict = json_one(args + ["--check-batch"], check=False)
    assert code == 0 and verdict["identical"] is True, verdict
    assert all(r["bitwise_identical"] is True for r in verdict["sequences"]), verdict
    assert not (tmp_path / "tier").exists()
    _, _, s = generate_json(args + ["-q"])  # the batch the check ran: its preemptions went to the tier
    assert s["preemptions"] > 0 and s["tier_swaps"] == s["preemptions"], s


def test_existing_path_is_refused(small_checkpoints, tmp_path):
    """An existing path is left as it was; a path the tier cannot be created at is named as every
    message names a path: a long one by its tail, control characters masked."""
    path, _ = small_checkpoints["mqa"]
    tier = tmp_path / "tier"
    tier.write_bytes(b"keep me")
    p = run(small_pool_args(path) + ["--kv-offload", tier, "-q"], check=False)
    assert p.returncode == 2 and p.stdout == b""
    err = p.stderr.decode().strip().splitlines()
    assert err == [f"run: --kv-offload {tier}: cannot create the tier file: File exists"], err
    assert tier.read_bytes() == b"keep me"
    evil = tmp_path / ("d" * 200) / "a\x1b[2Jb\x07"  # in a directory that does not exist
    p = run(small_pool_args(path) + ["--kv-offload", evil, "-q"], check=False)
    err = p.stderr.decode()
    assert p.returncode == 2 and "\x1b" not in err and "\x07" not in err, err
    shown = "..." + str(evil)[-157:].replace("\x1b", "?").replace("\x07", "?")  # a long path's tail: the reason stays
    assert err == f"run: --kv-offload {shown}: cannot create the tier file: No such file or directory\n", err


@pytest.mark.parametrize("flags,says", [
    (["--preempt", "often"], "--preempt takes swap or recompute, got 'often'"),
    (["--preempt", "swap"], "--preempt swap needs a tier to swap to: give --kv-offload PATH"),
    (["--kv-offload", "{tier}", "--no-kv"], "--kv-offload swaps a sequence's cache: it needs --kv and takes no --window"),
    (["--kv-offload", "{tier}", "--window", "32"],
     "--kv-offload swaps a sequence's cache: it needs --kv and takes no --window")])
def test_bad_flags(small_checkpoints, tmp_path, flags, says):
    path, _ = small_checkpoints["mqa"]
    tier = str(tmp_path / "tier")
    args = [path, "-p", PROMPT, "-n", 2, "-q"]
    flags = [f.replace("{tier}", tier) for f in flags]
    if "--no-kv" in flags:
        flags.remove("--no-kv")
    else:
        args.append("--kv")
    p = run(args + flags, check=False)
    assert p.returncode == 2 and p.stderr.decode() == f"run: {says}\n", p.stderr
    assert not os.path.exists(tier)


def test_file_size_limit_falls_back_to_recompute(small_checkpoints, tmp_path):
    """RLIMIT_FSIZE of a block and a half (./run ignores SIGXFSZ): the tier's writes fail as on
    a full disk; one warning, the swaps recomputed, the same tokens. --preempt swap: the
    default's rule weighs measured times, and on a loaded machine it may recompute every
    preemption after the first swap, so that no write ever reaches the limit."""
    path, _ = small_checkpoints["gqa"]
    args = small_pool_args(path)
    _, info = json_one([path, "--info", "--kv"])
    limit = info["kv_block_bytes"] * 3 // 2

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    import json
    import subprocess
    from conftest import RUN
    cmd = [RUN] + [str(a) for a in args] + ["--kv-offload", str(tmp_path / "tier"), "--preempt", "swap", "-q", "--json"]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limited, timeout=300)
    assert p.returncode == 0, p.stderr
    warnings = [l for l in p.stderr.decode().splitlines() if "warning" in l]
    assert len(warnings) == 1 and "KV tier" in warnings[0], p.stderr
    objs = [json.loads(l) for l in p.stdout.decode().splitlines()]
    summary = objs[-1]
    assert summary["tier_swap_failures"] > 0, summary
    _, recomputed, _ = generate_json(args + ["--preempt", "recompute", "-q"])
    assert tokens(objs[:-1]) == tokens(recomputed)
    assert not any(tmp_path.iterdir())


# ---- streaming: one sequence whose cache outgrows the pool (--batch 1) ----

def stream_mb(model):
    """--kv-mem for the staging area (two layers of a context's blocks) and 2 blocks and a half beside it."""
    _, info = json_one(model + ["--info", "--kv"])
    block, blocks = info["kv_block_bytes"], info["context"] // info["kv_block_tokens"]
    return f"{(2 * blocks * block / info['layers'] + 2.5 * block) / 2**20:.6f}", info


def assert_streaming_is_bitwise(model, args, tmp_path):
    """A generation streamed from a tier over a pool of 2 blocks has the logits it has alone."""
    mb, _ = stream_mb(model)
    tier = tmp_path / "tier"
    _, _, s = generate_json(model + args + ["--kv-mem", mb, "--kv-offload", tier, "--dump-logits", tmp_path / "s"])
    _, _, a = generate_json(model + args + ["--dump-logits", tmp_path / "a"])
    assert not tier.exists()
    assert s["kv_pool_blocks"] == 2 and a["kv_pool_blocks"] > 2, (s, a)
    assert s["tier_stream_blocks"] > 0 and s["tier_stream_bytes_read"] > 0, s
    assert s["tier_stream_peak_blocks"] * s["kv_block_bytes"] == s["tier_peak_bytes"], s
    assert a["tier_stream_blocks"] == 0, a
    streamed, alone = (tmp_path / "s").read_bytes(), (tmp_path / "a").read_bytes()
    assert len(streamed) > 0 and streamed == alone


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_streaming_is_bitwise(small_checkpoints, variant, dtype, tmp_path):
    path, _ = small_checkpoints[variant]
    args = ["-p", PROMPT, "--kv", "-k", 1, "-n", 60, "--ignore-eos", "-s", 3, "-q"]
    assert_streaming_is_bitwise([path, "--kv-dtype", dtype], args, tmp_path)


@pytest.mark.parametrize("shape", ["layers=2,dim=64,heads=4,kv_heads=2,vocab=256,ctx=512",
                                   "layers=3,dim=64,heads=4,latent=32,vocab=256,ctx=512"])
def test_streaming_shape_with_fill_is_bitwise(shape, tmp_path):
    args = ["-p", "1 2 3", "--kv", "--fill", 400, "-k", 1, "-n", 8, "-s", 5, "-q"]
    assert_streaming_is_bitwise(["--shape", shape], args, tmp_path)


def test_streaming_full_disk_ends_the_run(small_checkpoints, tmp_path):
    """A file size limit below the tier's first write: one line, exit 1, nothing left behind."""
    path, _ = small_checkpoints["mha"]
    mb, info = stream_mb([path])
    limit = info["kv_block_bytes"] // 4

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    import subprocess
    from conftest import RUN
    cmd = [RUN, path, "-p", PROMPT, "--kv", "-n", "60", "--ignore-eos", "--kv-mem", mb, "--kv-offload",
           str(tmp_path / "tier"), "-q", "--json"]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limited, timeout=300)
    err = [l for l in p.stderr.decode().strip().splitlines() if l.startswith("run:")]  # after the settings line
    assert p.returncode == 1 and len(err) == 1 and "--kv-offload" in err[0] and "cannot go on" in err[0], p.stderr
    assert b"summary" not in p.stdout
    assert not any(tmp_path.iterdir())


def test_streaming_needs_one_slot(small_checkpoints, tmp_path):
    """A pool below a context streams at --batch 1 alone; at --batch 2 it is refused in one line."""
    path, _ = small_checkpoints["mqa"]
    _, info = stream_mb([path])
    mb = f"{2.5 * info['kv_block_bytes'] / 2**20:.6f}"
    p = run([path, "-p", PROMPT, "--kv", "-n", 2, "-q", "--kv-mem", mb, "--kv-offload", tmp_path / "tier",
             "--batch", 2], check=False)
    err = p.stderr.decode().strip().splitlines()
    assert p.returncode == 2 and len(err) == 1 and "--kv-mem" in err[0] and "--batch 1" in err[0], p.stderr
    assert not any(tmp_path.iterdir())



def test_streaming_pool_smaller_than_its_staging(small_checkpoints, tmp_path):
    """A --kv-mem under the staging area alone counts no blocks beside it, not fewer than none."""
    path, _ = small_checkpoints["mqa"]
    p = run([path, "-p", PROMPT, "--kv", "-n", 2, "-q", "--kv-mem", "0.001", "--kv-offload", tmp_path / "tier"],
            check=False)
    err = p.stderr.decode().strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr
    assert re.fullmatch(r"run: --kv-mem 0\.001 MB holds 0 blocks of \d+ bytes beside the tier's staging area "
                        r"\(\d+ bytes\); streaming needs 2 at least", err[0]), err[0]
    assert not any(tmp_path.iterdir())

def test_shared_prefix_is_swapped_once(small_checkpoints, tmp_path):
    """Sequences sharing a long prompt's blocks: a preempted one holds the shared blocks in the
    pool instead of writing them, and every sequence has the tokens of a run that recomputes."""
    path, _ = small_checkpoints["gqa"]
    args = small_pool_args(path)
    prompt = "Once upon a time there was a little girl named Lily. She liked to play in the park with her dog."
    args[args.index(PROMPT)] = prompt
    args[args.index("-n") + 1] = 16
    _, swapped, s = generate_json(args + ["--kv-offload", tmp_path / "tier", "--preempt", "swap", "-q"])
    assert s["tier_swaps"] > 0 and s["tier_blocks_kept"] > 0, s
    assert s["tier_blocks_written"] == s["tier_blocks_read"], s
    _, recomputed, _ = generate_json(args + ["--preempt", "recompute", "-q"])
    assert tokens(swapped) == tokens(recomputed)
    assert not any(tmp_path.iterdir())
