"""int4 and int2 caches after KIVI (kvcache.h): a block is quantized from its 16 fp32 rows
when its 16th position is written, and a query reads its own block in fp32, so --check-kv
and --check-batch stay bitwise; the capacity formula counts codes, scales, mins and the
fp32 tail; the flags they cannot take are refused in one line."""
import os

import pytest

from conftest import PROMPT, ROOT, VARIANTS, json_one, run

# a prompt of ~60 tokens: the prefill spans blocks, so a pass quantizes blocks that its
# own earlier tokens read in fp32
LONG = ("Once upon a time, there was a little girl named Lily. She loved to play outside with her dog, "
        "Max. One day, Lily and Max went to the park. They saw a big tree with a red ball in it.")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", ["int4", "int2"])
def test_check_kv_bitwise_on_the_shipped_weights(variant, dtype):
    path = os.path.join(ROOT, "weights", f"{variant}.bin")
    code, check = json_one([path, "-p", LONG, "--kv", "--kv-dtype", dtype, "--check-kv", "-n", 40, "--ignore-eos"])
    pairs = check["comparisons"]
    same_form = [c for c in pairs if c["same_form"]]
    assert code == 0 and check["kv_dtype"] == dtype, check
    assert same_form and all(c["bitwise_identical"] is True and c["identical_tokens"] == 40 for c in same_form), pairs
    # MLA's expanded form recomputes from the same packed latents: other arithmetic, the same tokens
    assert all(c["identical_tokens"] == 40 for c in pairs), pairs


@pytest.mark.parametrize("variant", ["mha", "gqa", "mqa"])  # the small MLA models' rows are not in slices of 16
def test_check_kv_bitwise_on_small_models(small_checkpoints, variant):
    path, _ = small_checkpoints[variant]
    code, check = json_one([path, "-p", LONG, "--kv", "--kv-dtype", "int4", "--check-kv", "-n", 30, "--ignore-eos"])
    same_form = [c for c in check["comparisons"] if c["same_form"]]
    assert code == 0 and same_form and all(c["bitwise_identical"] is True for c in same_form), check


@pytest.mark.parametrize("variant", ["gqa", "mla64"])
def test_check_batch_int4(variant):
    """Sequences of different lengths in one batch, sharing the pool: each as alone."""
    path = os.path.join(ROOT, "weights", f"{variant}.bin")
    code, verdict = json_one([path, "--prompts", os.path.join(ROOT, "docs", "prompts.txt"), "--kv", "--batch", 3,
                              "-s", 8, "-n", 40, "--ignore-eos", "--kv-dtype", "int4", "--check-batch"])
    assert code == 0 and verdict["sequences_identical"] == verdict["batch"] == 6, verdict


def test_draft_rolls_back_into_a_quantized_block(tmp_path):
    """A verify pass of 16 drafts crosses block ends, and rejected drafts roll back into
    blocks already quantized: the logits stay those of plain decoding."""
    path = os.path.join(ROOT, "weights", "gqa.bin")
    dumps = []
    for extra in ([], ["--draft", "ngram", "--draft-k", 16]):
        out = tmp_path / f"d{len(dumps)}.bin"
        run([path, "-p", LONG, "-k", 1, "-n", 70, "--ignore-eos", "-q", "--kv", "--kv-dtype", "int4",
             "--dump-logits", out] + extra)
        dumps.append(out.read_bytes())
    assert len(dumps[0]) == 70 * 4096 * 4 and dumps[0] == dumps[1]


def test_info_counts_codes_scales_and_the_tail():
    """mha (4 layers, 16 KV heads of 32): a token's key is 32 codes plus its share of a bf16
    scale and min per channel over 16 tokens, its value 32 codes plus a scale and min of its
    own; a sequence's tail is 16 fp32 rows, spread over the 256 positions of its context."""
    path = os.path.join(ROOT, "weights", "mha.bin")
    tail = 2 * 4 * 16 * 32 * 4 * 16
    for dtype, bits in (("int4", 4), ("int2", 2)):
        per_head = (32 * bits // 8 + 2 * 32 * 2 // 16) + (32 * bits // 8 + 2 * 2)
        _, info = json_one([path, "--info", "--kv", "--kv-dtype", dtype])
        assert info["kv_dtype"] == dtype and info["kv_bytes_per_token"] == 4 * 16 * per_head + tail // 256, info
    _, fp32 = json_one([path, "--info", "--kv"])
    _, int4 = json_one([path, "--info", "--kv", "--kv-dtype", "int4"])
    assert int4["kv_block_bytes"] * 4 < fp32["kv_block_bytes"], (int4, fp32)


@pytest.mark.parametrize("args, message", [
    (["--kv", "--kv-dtype", "int3"], "--kv-dtype takes fp32, bf16, int8, fp8, int4 or int2, got 'int3'"),
    (["--kv", "--kv-dtype", "int4", "--window", "32"], "--kv-dtype int4 quantizes whole blocks: it takes no --window"),
    (["--kv", "--kv-dtype", "int2", "--kv-offload", "/tmp/x"],
     "--kv-dtype int2 quantizes whole blocks: it takes no --kv-offload"),
])
def test_bad_packed_flags(small_checkpoints, args, message):
    path, _ = small_checkpoints["gqa"]
    p = run([path] + args, check=False)
    assert p.returncode == 2 and p.stderr.decode() == f"run: {message}\n" and p.stdout == b""


def test_rows_not_in_slices_of_16_are_refused():
    p = run(["--shape", "layers=1,dim=48,heads=2,head_dim=24,vocab=64,ctx=32", "-p", "1 2", "--kv", "--kv-dtype",
             "int4", "-n", 4], check=False)
    assert p.returncode == 2 and p.stdout == b"", p.stderr
    assert p.stderr.decode() == "run: --kv-dtype int4 packs rows in slices of 16 elements; this model's rows have 24\n"
