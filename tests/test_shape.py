"""--shape, -c and --info end to end: the posts' KV cache figures read from --info --json,
--info sizing models far larger than the machine without allocating them, generated
weights that run (deterministic from the seed, the same bits with and without the cache),
token-id prompts and output, the model's own sliding window, and every bad input refused
in one line with its exit code. The expected figures are the posts' arithmetic, worked out
here, never copied from the program."""
import os
import resource
import subprocess

import pytest

from conftest import RUN, json_one, generate_json, run, run_json, read_logits, sanitized

GIB = 1 << 30


def one_line_error(args, code, needle):
    """Exit code `code`, one line `run: ...` on stderr holding needle, nothing on stdout."""
    p = run(args, check=False)
    err = p.stderr.decode()
    assert p.returncode == code, (args, p.returncode, err)
    assert err.startswith("run: ") and err.count("\n") == 1, err
    assert needle in err, err
    assert p.stdout == b""
    return err


def llama_params(layers, dim, heads, kv_heads, head_dim, ffn, vocab):
    """Parameters of our tied-embedding llama block (docs/FORMAT.md's tensor list)."""
    attn = dim * heads * head_dim * 2 + dim * kv_heads * head_dim * 2
    return vocab * dim + layers * (2 * dim + attn + 3 * dim * ffn) + dim


# ---- the posts' figures ----

def test_llama2_7b_kv_bytes():
    _, info = json_one(["--shape", "llama2-7b", "--info", "--kv-dtype", "bf16"])
    assert info["type"] == "info" and info["generated_weights"] is True and info["checkpoint"] is None
    assert info["shape"] == "llama2-7b" and info["variant"] == "mha"
    assert info["kv_bytes_per_token"] == 2 * 32 * 32 * 128 * 2 == 524288
    assert info["kv_bytes_full"] == 524288 * 4096 and info["context"] == 4096
    assert info["parameters"] == llama_params(32, 4096, 32, 32, 128, 11008, 32000)
    assert info["weight_bytes"] == 2 * info["parameters"]


def test_llama2_70b_and_its_mha_twin():
    _, info = json_one(["--shape", "llama2-70b", "--info", "--kv-dtype", "bf16"])
    assert info["variant"] == "gqa" and info["kv_heads"] == 8
    assert info["kv_bytes_per_token"] == 2 * 80 * 8 * 128 * 2 == 327680
    assert info["parameters"] == llama_params(80, 8192, 64, 8, 128, 28672, 32000)
    _, twin = json_one(["--shape", "llama2-70b,kv_heads=64", "--info", "--kv-dtype", "bf16", "-c", 32768])
    assert twin["variant"] == "mha" and twin["context"] == 32768
    assert twin["kv_bytes_full"] == 80 * GIB == 85899345920
    _, batch = json_one(["--shape", "llama2-70b,kv_heads=64", "--info", "--kv-dtype", "bf16", "-c", 32768,
                         "--kv", "--batch", 4])
    assert batch["kv_bytes_batch"] == 4 * 80 * GIB and batch["kv_pool_bytes"] == 4 * 80 * GIB


def test_info_by_dtype_and_variant():
    for dtype, size, scale in (("fp32", 4, 0), ("bf16", 2, 0), ("int8", 1, 4)):
        _, info = json_one(["--shape", "tinyllama-1.1b", "--info", "--kv-dtype", dtype])
        assert info["kv_bytes_per_token"] == 2 * 22 * 4 * (64 * size + scale), (dtype, info)
    _, mla = json_one(["--shape", "deepseek-v2-lite-attn", "--info", "--kv-dtype", "bf16"])
    assert mla["variant"] == "mla512" and mla["kv_heads"] == 0 and mla["rope_dim"] == 64
    assert mla["kv_bytes_per_token"] == 27 * (512 + 64) * 2
    _, twin = json_one(["--shape", "tinyllama-1.1b,latent=256", "--info", "--kv-dtype", "bf16"])
    assert twin["variant"] == "mla256" and twin["rope_dim"] == 32  # head_dim / 2 by default
    assert twin["kv_bytes_per_token"] == 22 * (256 + 32) * 2


def test_info_names_the_matmul_tile():
    # AVX-512 takes wide tiles (4 rows x 6 tokens) past 6 tokens except on AMD's processors
    _, info = json_one(["--shape", "gqa", "--info"])
    if info["kernels"] != "avx512":
        assert info["matmul_tiles"] == "4x3", info
        return
    with open("/proc/cpuinfo") as f:
        amd = "AuthenticAMD" in f.read()
    assert info["matmul_tiles"] == ("8x3" if amd else "4x6"), info


def test_info_says_whether_it_fits():
    _, info = json_one(["--shape", "llama2-70b", "--info"])
    assert info["memory_needed_bytes"] == info["model_bytes"] + info["kv_pool_bytes"] + info["scratch_bytes"]
    # at least the logits of a pass: 2,048 prompt tokens (4,096 context) and one a slot
    assert info["scratch_bytes"] >= (2048 + 1) * 32000 * 4
    _, longer = json_one(["--shape", "llama2-70b", "-c", 32768, "--info"])
    assert longer["scratch_bytes"] == info["scratch_bytes"]  # a pass's rows do not grow with the context
    assert info["model_bytes"] >= info["weight_bytes"]
    assert info["memory_total_bytes"] >= info["memory_available_bytes"] > 0
    assert info["fits_in_memory"] == (info["memory_needed_bytes"] <= info["memory_available_bytes"])


def test_info_allocates_nothing_big():
    """A 70B model's --info allocates nothing big: no weights, no pool, no scratch. The plain
    build runs in a 1 GiB address space; ASan needs the whole address space for its shadow,
    so there its allocator refuses any single allocation over 1 GiB instead."""
    env = dict(os.environ)
    if sanitized():
        env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":max_allocation_size_mb=1024:allocator_may_return_null=0"
        limit = None
    else:
        limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (GIB, GIB))
    for shape in ("llama2-70b", "llama2-70b,kv_heads=64,ctx=131072", "deepseek-v2-lite-attn"):
        p = subprocess.Popen([RUN, "--shape", shape, "--info", "--json", "--kv", "--batch", "256"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit, env=env)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()
        assert b'"fits_in_memory"' in out


def test_info_of_a_checkpoint_reads_its_header(small_checkpoints):
    path, model = small_checkpoints["gqa"]
    cfg = model.cfg
    _, info = json_one([path, "--info", "--kv-dtype", "bf16"])
    assert info["generated_weights"] is False and info["shape"] is None and info["checkpoint"] == path
    assert info["kv_bytes_per_token"] == 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2


# ---- -c ----

def test_ctx_size(small_checkpoints):
    path, model = small_checkpoints["gqa"]
    trained = model.cfg.max_seq_len
    _, info = json_one([path, "--info", "-c", trained // 2])
    assert info["context"] == trained // 2 and info["kv_bytes_full"] == info["kv_bytes_per_token"] * (trained // 2)
    one_line_error([path, "-c", trained + 1, "--info"], 2, f"-c {trained + 1} is more than the {trained} positions")
    # a shorter context runs, and -n is bounded by it
    _, seqs, summary = generate_json([path, "-c", 32, "-n", 20, "-s", 1, "--kv"])
    assert summary["context"] == 32 and len(seqs[0]["tokens"]) == 20
    one_line_error([path, "-c", 32, "-n", 40], 2, "-n 40 is out of range (1..32, the context")
    _, info = json_one(["--shape", "gqa", "--info", "-c", 131072])
    assert info["context"] == 131072
    one_line_error(["--shape", "gqa", "-c", 131073], 2, "-c 131073 is out of range (1..131072)")
    one_line_error(["--shape", "gqa", "-c", 0], 2, "-c 0 is out of range")
    one_line_error(["--shape", "llama2-7b,head_dim=256", "-c", 131072, "--info"], 2, "RoPE tables")


# ---- the model's sliding window ----

def test_model_window_is_the_default():
    _, info = json_one(["--shape", "mistral-7b", "--info", "--kv"])
    assert info["model_window"] == 4096 and info["window"] == 4096 and info["window_from_model"] is True
    assert info["kv_bytes_full"] == 4096 * info["kv_bytes_per_token"] and info["context"] == 32768
    _, info = json_one(["--shape", "mistral-7b", "--info", "--kv", "--window", 128])
    assert info["window"] == 128 and info["window_from_model"] is False
    _, info = json_one(["--shape", "mistral-7b", "--info", "--kv", "-c", 2048])  # the window spans it all
    assert info["model_window"] == 0 and info["window"] == 0
    _, info = json_one(["--shape", "gqa,window=64", "--info", "--kv"])
    assert info["window"] == 64


UNWINDOWED = "layers=2,dim=64,heads=4,kv_heads=2,vocab=512"
WINDOWED = UNWINDOWED + ",window=32"


def id_prompt(n, stride, first=5):
    """A prompt of n token ids for generated weights, first + (i * stride) % 500."""
    return " ".join(str(first + (i * stride) % 500) for i in range(n))


def test_model_window_holds_without_the_cache(tmp_path):
    """A model's own window is part of the model: without the cache a step recomputes each
    position through the window as the cached run keeps it, so the two give bitwise the same
    logits from a prompt past the window on, and past the context. An uncached run that saw
    the whole sequence (the old behaviour) differs from the first step; so does the model
    without its window."""
    prompt = id_prompt(40, 11)
    dumps = {}
    for name, shape, n, mode in (("kv", WINDOWED, 60, ["--kv"]), ("no-kv", WINDOWED, 60, []),
                                 ("unwindowed", UNWINDOWED, 20, [])):
        out = tmp_path / f"{name}.f32"
        generate_json(["--shape", shape, "-c", 64, "-s", 5, "-k", 1, "-n", n, "-p", prompt, "--ignore-eos",
                       "--dump-logits", out] + mode)
        dumps[name] = read_logits(out, 512)
    assert dumps["kv"].shape == (60, 512)  # 41 prompt positions and 60 more: past the 64 of the context
    assert dumps["kv"].tobytes() == dumps["no-kv"].tobytes()
    assert (dumps["kv"][0] != dumps["unwindowed"][0]).any()
    code, check = json_one(["--shape", WINDOWED, "-c", 64, "-s", 5, "-n", 20, "-p", prompt, "--check-kv"],
                           check=False)
    assert code == 0 and check["comparisons"][0]["bitwise_identical"] is True, check
    # --window on such a model is the lever: against the model (its own window), the cached
    # run agrees until its shorter window is full, then differs
    code, check = json_one(["--shape", WINDOWED, "-s", 5, "-n", 30, "-p", "5 6 7", "--check-kv", "--window", 16],
                           check=False)
    # (step s's logits come from position 3 + s, after BOS and three prompt tokens; the
    # query at position 16 is the first whose window of 16 leaves a position out)
    assert code == 1 and check["comparisons"][0]["first_bitwise_difference"] == 16 - 3, check


def test_steps_of_several_passes_on_more_threads_than_cores(tmp_path):
    """Without the cache a model's window takes a pass a position; thread 0 writes the next
    pass's count and rows while the others may still be reading this one's (a model this
    small runs every operation on thread 0 alone, so nothing holds it back). On more threads
    than cores a member read the next pass's count, left the step a barrier early and the
    team hung. Such runs end, and with --threads 1's bits, here and in --check-kv."""
    shape = "layers=1,dim=32,heads=2,head_dim=16,ffn=64,vocab=64,ctx=64,window=16"
    prompt = " ".join(str(5 + i) for i in range(20))
    dumps = {}
    for threads in (1, 32):
        out = tmp_path / f"{threads}.f32"
        _, objs = run_json(["--shape", shape, "-p", prompt, "-n", 6, "-k", 1, "-s", 1, "--ignore-eos",
                            "--threads", threads, "--dump-logits", out], timeout=60)
        (summary,) = [o for o in objs if o["type"] == "summary"]
        assert summary["threads"] == threads and summary["steps"] == 6, summary
        dumps[threads] = read_logits(out, 64)
    assert dumps[1].shape == (6, 64) and dumps[1].tobytes() == dumps[32].tobytes()
    code, check = json_one(["--shape", shape, "-p", prompt, "-n", 6, "--threads", 32, "--check-kv"], check=False)
    assert code == 0 and check["comparisons"][0]["bitwise_identical"] is True, check


def test_a_ring_without_n_ends_at_the_context():
    """A ring could go on forever (generated weights need never sample EOS, and the old runs
    went on until interrupted): without -n a run ends when the context is full, as any run
    does, with the model's window or --window; -n takes it past; --check-batch needs no -n."""
    for args in (["--shape", WINDOWED], ["--shape", UNWINDOWED, "--kv", "--window", 16]):
        _, objs = run_json(args + ["-c", 64, "-k", 1, "-s", 1, "-p", "5 6", "--ignore-eos"], timeout=60)
        (seq,) = [o for o in objs if o["type"] == "sequence"]
        assert seq["stop"] == "context full" and seq["generated"] == 64 - 3 + 1, seq  # BOS, 5, 6, then 62
        _, objs = run_json(args + ["-c", 64, "-k", 1, "-s", 1, "-p", "5 6", "--ignore-eos", "-n", 100], timeout=60)
        (seq,) = [o for o in objs if o["type"] == "sequence"]
        assert seq["stop"] == "steps" and seq["generated"] == 100, seq
        code, check = json_one(args + ["-c", 64, "-p", "5 6", "--check-batch", "--batch", 2], check=False)
        assert code == 0 and check["identical"] is True, check


# ---- generated weights ----

SMALL = "gqa,layers=2,vocab=512"


def test_generated_weights_run(tmp_path):
    a, b, c = (tmp_path / f"{n}.f32" for n in "abc")
    _, seqs, summary = generate_json(["--shape", SMALL, "-s", 5, "-n", 8, "-p", "1 2 3", "--kv",
                                      "--dump-logits", a])
    assert summary["generated_weights"] is True and summary["checkpoint"] is None
    (seq,) = seqs
    assert seq["prompt_tokens"] == 4 and len(seq["tokens"]) == 8 and all(0 <= t < 512 for t in seq["tokens"])
    assert seq["text"] == " ".join(str(t) for t in [1, 2, 3] + seq["tokens"])  # BOS dropped, as text drops it
    _, again, _ = generate_json(["--shape", SMALL, "-s", 5, "-n", 8, "-p", "1 2 3", "--kv", "--dump-logits", b])
    assert again[0]["tokens"] == seq["tokens"]
    assert a.read_bytes() == b.read_bytes()  # the seed decides the weights and the sampling
    generate_json(["--shape", SMALL, "-s", 6, "-n", 8, "-p", "1 2 3", "--kv", "--dump-logits", c])
    assert read_logits(a, 512)[0].tolist() != read_logits(c, 512)[0].tolist()  # another seed, other weights
    # the human output says what the tokens are
    p = run(["--shape", SMALL, "-s", 5, "-n", 8, "-p", "1 2 3", "--kv"])
    assert "generated from the seed" in p.stderr.decode() and "mean nothing" in p.stderr.decode()


@pytest.mark.parametrize("shape", ["gqa,layers=2,vocab=512", "mqa,layers=2", "mla64,layers=2",
                                   "tinyllama-1.1b,layers=1,dim=256,heads=4,kv_heads=2,ffn=512,vocab=1000"])
def test_generated_weights_keep_the_bitwise_promise(shape):
    code, check = json_one(["--shape", shape, "--check-kv", "-n", 12, "-p", "7 8 9"], check=False)
    assert code == 0 and check["generated_weights"] is True, check
    code, check = json_one(["--shape", shape, "--check-batch", "--batch", 3, "--kv", "-n", 6, "-s", 2], check=False)
    assert code == 0, check


def test_products_that_take_over_keep_the_one_thread_bits(tmp_path):
    # a batch-1 cached step whose FFN and head are 2^22 multiply-adds each: from there the
    # threads take over one another's items (kernels/threads.h), which must not move a bit
    shape = "gqa,layers=1,ffn=8192,vocab=8192"
    dumps = []
    for threads in (1, 2, 3):
        out = tmp_path / f"t{threads}.f32"
        generate_json(["--shape", shape, "-s", 3, "-n", 6, "-p", "5 6 7", "--kv", "--threads", threads,
                       "--dump-logits", out])
        dumps.append(out.read_bytes())
    assert len(dumps[0]) == 6 * 8192 * 4
    assert dumps[0] == dumps[1] == dumps[2]


def test_many_threads_on_few_heads(tmp_path):
    """A long chunked query's per-thread scratch was laid out for 32 heads an item: with 4
    heads, threads from 32 on wrote past it (ASan: heap-buffer-overflow in kv_heads_mix).
    40 threads give the one-thread bits over 300 keys."""
    prompt = id_prompt(300, 13)
    dumps = []
    for threads in (1, 40):
        out = tmp_path / f"t{threads}.f32"
        generate_json(["--shape", "layers=1,dim=64,heads=4,ctx=1024,vocab=512,ffn=128", "--kv", "-p", prompt, "-n", 2,
                       "-k", 1, "-s", 1, "--threads", threads, "--dump-logits", out])
        dumps.append(out.read_bytes())
    assert len(dumps[0]) == 2 * 512 * 4 and dumps[0] == dumps[1]


def test_generated_weights_refuse_text():
    one_line_error(["--shape", SMALL, "-p", "Once upon a time", "-n", 2], 1,
                   "the prompt is not token ids: generated weights (--shape) have no tokenizer")
    one_line_error(["--shape", SMALL, "-p", "1 512", "-n", 2], 1, "numbers 0..511")
    one_line_error(["--shape", SMALL, "--ppl", "docs/prompts.txt"], 2, "--ppl scores text")


def test_a_run_that_does_not_fit_is_refused():
    with open("/proc/meminfo") as f:
        available = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))
    if available > 200 * GIB:
        pytest.skip("this machine holds a 70B model")
    err = one_line_error(["--shape", "llama2-70b", "-n", 1], 1, "not enough memory: the weights (")
    assert "GiB available" in err


def test_a_run_holds_what_info_counts():
    """The memory --info counts (and a run checks before it allocates) is what a run holds at
    its peak: one pass's scratch, not a second one for the warm-up. Two shapes whose scratch
    differs by half (the logits of 2,048 or 1,024 prompt tokens a pass, a 32,000-token
    vocabulary over tiny layers): their peak RSS differs by what --info's figure does, where
    a second scratch would double it. Differences, so the process's own pages and ASan's
    shadow (an eighth more) leave the ratio near 1."""
    from conftest import run_measured
    shape = "layers=1,dim=64,heads=2,kv_heads=2,head_dim=32,ffn=64,vocab=32000"
    need, peak = [], []
    for ctx in (2048, 1024):
        args = ["--shape", f"{shape},ctx={ctx}", "-n", 2, "-p", "1", "--kv"]
        _, info = json_one(args + ["--info"])
        code, err, rss_kb = run_measured(args + ["-q"])
        assert code == 0, err
        need.append(info["memory_needed_bytes"])
        peak.append(rss_kb * 1024)
    assert need[0] - need[1] > 100 << 20, need
    ratio = (peak[0] - peak[1]) / (need[0] - need[1])
    assert 0.8 < ratio < 1.3, (ratio, need, peak)  # with the warm-up's own scheduler: 2.0


# ---- bad input ----

@pytest.mark.parametrize("args,code,needle", [
    (["--shape", "llama3-8b", "--info"], 2, "unknown preset 'llama3-8b' (presets: llama2-7b, "),
    (["--shape", "llama2-7b,foo=1", "--info"], 2, "unknown key 'foo'"),
    (["--shape", "llama2-7b,heads=0", "--info"], 2, "--shape: heads = 0 is out of range (1..65536)"),
    (["--shape", "llama2-7b,layers=1000", "--info"], 2, "--shape: layers = 1000 is out of range (1..256)"),
    (["--shape", "layers=2,dim=30000,heads=2", "--info"], 2, "--shape: ffn = 80000 is out of range (1..65536)"),
    (["--shape", "llama2-7b,kv_heads=5", "--info"], 2, "kv_heads = 5 does not divide heads = 32"),
    (["--shape", "llama2-7b,ctx=200000", "--info"], 2, "--shape: ctx = 200000 is out of range (1..131072)"),
    (["--shape", "tinyllama-1.1b,latent=256,kv_heads=4", "--info"], 2, "MLA, which has no KV heads"),
    (["--shape", "layers=1,dim=64,heads=4,latent=1,rope_dim=65536", "--info"], 2,
     "--shape: heads * (head_dim + rope_dim) = 262208 is over 65536"),
    (["--shape", "layers=2,dim=64,heads=2,vocab=512,window=32", "--kv", "-p", "7", "--draft", "ngram"], 2,
     "--draft (a ring cannot be rolled back) takes no window, and this model has its own sliding window of 32"),
    (["--shape", "layers=2,dim=64,heads=2,vocab=512,window=32", "--kv", "-p", "7", "--kv-dtype", "int2"], 2,
     "--kv-dtype int4 or int2 (whole blocks) takes no window"),
    (["--shape", "layers=2,dim=64,heads=2,vocab=512,window=32", "--kv", "-p", "7", "--fill", "40"], 2,
     "--fill takes no window"),
    (["--shape", "", "--info"], 2, "--shape needs a preset"),
    (["weights/gqa.bin", "--shape", "gqa"], 2, "--shape generates a model's weights: it takes no checkpoint"),
    (["--shape", "gqa", "-c", "abc"], 2, "-c needs an integer, got 'abc'"),
])
def test_bad_input(args, code, needle):
    one_line_error(args, code, needle)


def test_a_prefill_of_several_steps_is_counted_as_prefill(tmp_path):
    """A 3,001-id prompt takes two steps (a pass holds 2,048), and a prompt past a window
    with the cache one step a position past it: the summary counted only the first step as
    the prefill and the rest as decode steps (a 3,001-id prompt: 'prefill 2048 tokens |
    decode 2 steps' for -n 2). The prefill is the steps up to the first token; --log's rows
    say which steps those are, and the summary's sums are theirs."""
    cases = (("layers=1,dim=64,heads=2,vocab=512", 4096, 3001), ("layers=1,dim=64,heads=2,vocab=512,window=16", 64, 40))
    for shape, ctx, n_prompt in cases:
        log = tmp_path / "steps.csv"
        prompt = id_prompt(n_prompt, 7)
        _, seqs, s = generate_json(["--shape", shape, "-c", ctx, "--kv", "-p", prompt, "-n", 5, "-k", 1, "-s", 1,
                                    "--ignore-eos", "--log", log])
        assert seqs[0]["prompt_tokens"] == n_prompt + 1
        rows = [line.split(",") for line in log.read_text().splitlines()[1:]]
        prefill_steps = next(i for i, r in enumerate(rows) if r[1] != "prefill")  # the last samples the first token
        assert prefill_steps >= 2  # the prompt took more than one step
        assert s["prefill_tokens"] == n_prompt + 1 and s["decode_steps"] == 4 == len(rows) - prefill_steps
        assert s["steps"] == len(rows)


def test_a_prompt_longer_than_a_pass_without_the_cache(tmp_path):
    """Without the cache a prompt past SCHEDULER_PASS_TOKENS (2048) takes two passes in one
    step; the warm-up's scored forward of it overran the step's rows (a heap overflow: exit
    134 or 139). It runs now, and its logits are bitwise those of the cached run."""
    prompt = id_prompt(2100, 7, first=3)
    logits = {}
    for mode in ([], ["--kv"]):
        dump = tmp_path / f"logits{len(mode)}.bin"
        p = subprocess.run([RUN, "--shape", "layers=1,dim=64,heads=2,vocab=512", "-c", "3000", "-n", "2", "-k", "1",
                            "-s", "1", "-q", "-p", prompt, "--dump-logits", str(dump)] + mode,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
        assert p.returncode == 0, p.stderr
        logits[len(mode)] = dump.read_bytes()
    assert len(logits[0]) == 2 * 512 * 4 and logits[0] == logits[1]
