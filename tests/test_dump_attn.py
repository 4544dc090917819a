"""--dump-attn (docs/PROFILE.md): the attention weights the fast path computes, against
PyTorch's (train/model.py, softmax(q k^T / sqrt(d)) of the same sequence), for the
KV-head and latent variants, with and without the cache, over more keys than a chunk,
and per sequence of a batch."""
import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import export
import model as reference
from conftest import PROMPT, TOKENIZER, generate_json, run

HEADER = struct.Struct("<8s6i")
RECORD = struct.Struct("<6i")


def read_dump(path):
    """(header dict, [(step, sequence, layer, head, pos, probabilities)])"""
    data = open(path, "rb").read()
    magic, version, n_layers, n_heads, context, record_ints, _ = HEADER.unpack_from(data, 0)
    assert magic == b"ATTNDUMP" and version == 1 and record_ints == 6
    records, off = [], HEADER.size
    while off < len(data):
        step, seq, layer, head, pos, n = RECORD.unpack_from(data, off)
        off += RECORD.size
        records.append((step, seq, layer, head, pos, np.frombuffer(data, "<f4", n, off)))
        off += 4 * n
    assert off == len(data)
    return {"n_layers": n_layers, "n_heads": n_heads, "context": context}, records


def reference_probs(model, tokens, absorb):
    """Every layer's attention weights over the whole sequence: [(H, T, T)], from the
    reference's own causal_attention inputs."""
    captured, plain = [], reference.causal_attention

    def spy(q, k, v, scale, start_pos, window=0):
        scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
        qpos, kpos = torch.arange(start_pos, start_pos + q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
        scores.masked_fill_((kpos > qpos) | ((kpos <= qpos - window) if window else False), float("-inf"))
        captured.append(F.softmax(scores, dim=-1)[0].numpy())
        return plain(q, k, v, scale, start_pos, window)

    reference.causal_attention = spy
    try:
        model.set_absorb(absorb)
        with torch.no_grad():
            model(torch.tensor([tokens]))
    finally:
        reference.causal_attention = plain
        model.set_absorb(False)
    return captured


def prompt_tokens():
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=TOKENIZER)
    return [sp.bos_id()] + sp.encode(PROMPT)


def c_dump(path, tmp_path, args, name="attn.bin"):
    out = tmp_path / name
    _, sequences, _ = generate_json([path, "-p", PROMPT, "-q", "--dump-attn", out] + args)
    return sequences, read_dump(out)


def check_against_reference(model, path, tmp_path, args, absorb, steps, heads=None):
    (seq,), (header, records) = c_dump(path, tmp_path, ["-k", 1, "-n", steps, "--ignore-eos"] + args)
    cfg = model.cfg
    assert header == {"n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "context": cfg.max_seq_len}
    tokens = prompt_tokens() + seq["tokens"][:-1]   # the last token sampled is never computed
    probs = reference_probs(model, tokens, absorb)
    n_prompt = seq["prompt_tokens"]
    # every layer and head of every position computed, once: the prompt at step 0, then one a step
    assert sorted((r[4], r[2], r[3]) for r in records) == \
        [(p, l, h) for p in range(len(tokens)) for l in range(cfg.n_layers) for h in heads or range(cfg.n_heads)]
    worst = 0.0
    for step, sequence, layer, head, pos, p in records:
        assert sequence == 0 and step == (0 if pos < n_prompt else pos - n_prompt + 1)
        assert len(p) == pos + 1
        assert abs(float(p.astype(np.float64).sum()) - 1.0) < 1e-5, (step, layer, head, pos)
        worst = max(worst, float(np.abs(p - probs[layer][head, pos, :pos + 1]).max()))
    assert worst < 2e-5, worst
    return records


@pytest.mark.parametrize("variant,args,absorb", [
    ("gqa", ["--kv"], False), ("gqa", [], False), ("mha", ["--kv"], False),
    ("mla64", ["--kv"], True), ("mla64", [], False), ("mla64", ["--kv", "--mla", "expand"], False)])
def test_weights_match_pytorch(small_checkpoints, variant, args, absorb, tmp_path):
    path, model = small_checkpoints[variant]
    check_against_reference(model, path, tmp_path, args, absorb, 20)


def test_cache_and_forms_agree(small_checkpoints, tmp_path):
    """The cache changes nothing (the same bits); MLA's two forms the same weights up to rounding."""
    path, _ = small_checkpoints["mla128"]
    args = ["-k", 1, "-n", 12]
    dumps = {name: c_dump(path, tmp_path, args + extra, name)[1][1]
             for name, extra in [("kv", ["--kv"]), ("nokv", ["--mla", "absorb"]), ("expand", ["--kv", "--mla", "expand"])]}
    assert all(np.array_equal(a[5], b[5]) and a[:5] == b[:5] for a, b in zip(dumps["kv"], dumps["nokv"]))
    assert len(dumps["kv"]) == len(dumps["expand"])
    assert max(float(np.abs(a[5] - b[5]).max()) for a, b in zip(dumps["kv"], dumps["expand"])) < 1e-5


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    """A small GQA and MLA model of 640 positions: queries past 256 keys run in chunks."""
    out = {}
    for i, variant in enumerate(["gqa", "mla64"]):
        cfg = export.small_config(variant, max_seq_len=640)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(300 + i)
            model = reference.Transformer(cfg)
            g = torch.Generator().manual_seed(300 + i)
            with torch.no_grad():
                for _, p in model.named_parameters():
                    p.copy_(torch.rand(p.shape, generator=g) * 0.5 + 0.75 if p.dim() == 1
                            else torch.randn(p.shape, generator=g) * 0.1)
        model.eval()
        export.round_to_bf16_(model)
        path = str(tmp_path_factory.mktemp("long") / f"{variant}.bin")
        export.export(model, path, TOKENIZER, dtype="bf16")
        out[variant] = (path, model)
    return out


@pytest.mark.parametrize("variant,args,absorb", [("gqa", ["--kv"], False), ("mla64", ["--kv"], True),
                                                 ("mla64", ["--mla", "expand"], False)])
def test_weights_over_several_chunks(long_context, variant, args, absorb, tmp_path):
    """Past 256 keys each chunk has its own softmax: the dump scales each by its share."""
    path, model = long_context[variant]
    records = check_against_reference(model, path, tmp_path, args + ["--dump-attn-heads", "0,3"], absorb, 300, [0, 3])
    assert max(len(r[5]) for r in records) > 256


def test_a_sequence_of_a_batch(small_checkpoints, tmp_path):
    """Sequence 2 of a batch (seed s + 2) is recorded as it is alone with that seed, but for
    the prompt positions it shares with sequence 0 (computed, and recorded, once)."""
    path, _ = small_checkpoints["gqa"]
    args = ["-n", 10, "--kv", "--dump-attn-layers", "1"]
    _, (_, batch) = c_dump(path, tmp_path, args + ["--batch", 3, "-s", 5, "--dump-attn-seqs", 2], "batch.bin")
    (seq,), (_, alone) = c_dump(path, tmp_path, args + ["-s", 7], "alone.bin")
    assert batch and {r[1] for r in batch} == {2} and {r[1] for r in alone} == {0} and {r[2] for r in batch} == {1}
    alone_at = {r[2:5]: r[5] for r in alone}
    positions = {r[4] for r in batch}
    n_prompt = seq["prompt_tokens"]
    assert set(range(n_prompt - 1, n_prompt + 9)) <= positions <= set(range(n_prompt + 9))
    assert all(np.array_equal(r[5], alone_at[r[2:5]]) for r in batch)


def test_chosen_steps_layers_heads(small_checkpoints, tmp_path):
    path, model = small_checkpoints["mqa"]
    args = ["-n", 10, "--kv", "--dump-attn-layers", "1", "--dump-attn-heads", "0,2-3", "--dump-attn-steps", "0,4-6"]
    (seq,), (_, records) = c_dump(path, tmp_path, args)
    n_prompt = seq["prompt_tokens"]
    want = [(0, p) for p in range(n_prompt)] + [(s, n_prompt + s - 1) for s in (4, 5, 6)]
    assert sorted({(r[0], r[4]) for r in records}) == want
    assert {r[2] for r in records} == {1} and sorted({r[3] for r in records}) == [0, 2, 3]
    assert len(records) == len(want) * 3


@pytest.mark.parametrize("args,message", [
    (["--dump-attn", "F", "--dump-attn-layers", "2"], "--dump-attn-layers 2 is out of range: the model has 2 layers"),
    (["--dump-attn", "F", "--dump-attn-heads", "1,x"], "--dump-attn-heads takes all or indices like 0,3,5-7"),
    (["--dump-attn", "F", "--dump-attn-steps", "5-2"], "runs backwards"),
    (["--dump-attn-steps", "1"], "choose what --dump-attn FILE records"),
    (["--dump-attn", "F", "--ppl", "x"], "--dump-attn records a generation"),
    (["--dump-attn", "F", "--dump-attn-seqs", "1"], "--dump-attn-seqs 1 is out of range: the run has 1 sequence (0..0)"),
    (["--dump-attn", "F", "--batch", "2", "--dump-attn-seqs", "0,5"],
     "--dump-attn-seqs 5 is out of range: the run has 2 sequences (0..1)"),
])
def test_bad_choices_refused(small_checkpoints, tmp_path, args, message):
    args = [str(tmp_path / "out.bin") if a == "F" else a for a in args]
    p = run([small_checkpoints["gqa"][0], "-n", 2, "--kv"] + args, check=False)
    err = p.stderr.decode()
    assert p.returncode == 2 and message in err and err.count("\n") == 1, err
