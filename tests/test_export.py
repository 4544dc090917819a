"""train/export.py: the checkpoint format (docs/FORMAT.md) and the llama2.c legacy export."""
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "train"))
import export  # noqa: E402
from model import Config, Transformer  # noqa: E402

TOKENIZER = os.path.join(ROOT, "tokenizer", "tokenizer.model")
VARIANTS = ["mha", "gqa", "mqa", "mla64", "mla128"]
# what the small configurations must put in the header: (variant code, n_kv_heads, kv_latent, rope_dim)
EXPECTED = {"mha": (0, 4, 0, 0), "gqa": (1, 2, 0, 0), "mqa": (2, 1, 0, 0), "mla64": (3, 0, 16, 8),
            "mla128": (3, 0, 32, 8)}


def bf16_reference(t):
    """PyTorch's own fp32 -> bf16 conversion (round to nearest even), an independent oracle."""
    return t.detach().float().bfloat16().float()


@pytest.fixture(scope="module")
def tokenizer_bytes():
    with open(TOKENIZER, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{variant: (model, path)}: a random small model of every variant, exported as bf16."""
    d = tmp_path_factory.mktemp("export")
    out = {}
    for i, v in enumerate(VARIANTS):
        m = export.random_model(v, small=True, seed=i)
        p = str(d / f"{v}.bin")
        export.export(m, p, TOKENIZER, "bf16")
        out[v] = (m, p)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_header_fields(exported, variant, tokenizer_bytes):
    model, path = exported[variant]
    h = export.read_header(path)
    code, n_kv, latent, rope = EXPECTED[variant]
    assert h["magic"] == "AKVC"
    assert h["version"] == 1
    assert h["variant"] == code
    assert h["dtype"] == 1
    assert (h["dim"], h["n_layers"], h["n_heads"], h["head_dim"]) == (64, 2, 4, 16)
    assert (h["n_kv_heads"], h["kv_latent"], h["rope_dim"]) == (n_kv, latent, rope)
    assert h["hidden_dim"] == 96
    assert h["vocab_size"] == 4096
    assert h["max_seq_len"] == 64
    assert h["rope_theta"] == 10000.0
    assert h["norm_eps"] == np.float32(1e-5)
    assert (h["bos_id"], h["eos_id"]) == (1, 2)
    assert h["tokenizer_offset"] == 128
    assert h["tokenizer_size"] == len(tokenizer_bytes)
    assert h["weights_offset"] % 64 == 0
    assert h["tokenizer_offset"] + h["tokenizer_size"] <= h["weights_offset"] < h["tokenizer_offset"] + h["tokenizer_size"] + 64
    n_params = sum(p.numel() for p in model.parameters())
    assert h["weights_size"] == 2 * n_params
    assert h["reserved"] == bytes(24)
    assert os.path.getsize(path) == h["weights_offset"] + h["weights_size"]


def test_header_byte_offsets(exported):
    """The raw bytes at the offsets FORMAT.md gives, independently of read_header's struct."""
    _, path = exported["gqa"]
    with open(path, "rb") as f:
        raw = f.read(128)
    u32 = lambda o: struct.unpack_from("<I", raw, o)[0]  # noqa: E731
    u64 = lambda o: struct.unpack_from("<Q", raw, o)[0]  # noqa: E731
    assert raw[0:4] == b"AKVC"
    assert [u32(o) for o in range(4, 56, 4)] == [1, 1, 1, 64, 2, 4, 16, 2, 0, 0, 96, 4096, 64]
    assert struct.unpack_from("<ff", raw, 56) == (10000.0, np.float32(1e-5))
    assert (u32(64), u32(68)) == (1, 2)
    assert u64(72) == 128
    assert u64(88) + u64(96) == os.path.getsize(path)


@pytest.mark.parametrize("variant", VARIANTS)
def test_embedded_tokenizer_and_padding(exported, variant, tokenizer_bytes):
    _, path = exported[variant]
    h = export.read_header(path)
    with open(path, "rb") as f:
        data = f.read(h["weights_offset"])
    end = h["tokenizer_offset"] + h["tokenizer_size"]
    assert data[h["tokenizer_offset"]:end] == tokenizer_bytes
    assert data[end:] == bytes(h["weights_offset"] - end)


@pytest.mark.parametrize("variant", VARIANTS)
def test_tensors_read_back(exported, variant):
    """tok_embeddings sits at weights_offset as the bf16-rounded tensor; every other tensor
    follows in FORMAT.md's order and equals the bf16-rounded parameter."""
    model, path = exported[variant]
    h = export.read_header(path)
    emb = model.tok_embeddings.weight
    raw = np.fromfile(path, dtype="<u2", count=emb.numel(), offset=h["weights_offset"])
    got = torch.from_numpy((raw.astype(np.uint32) << 16).view(np.float32).reshape(emb.shape))
    assert torch.equal(got, bf16_reference(emb))
    assert not torch.equal(got, emb.detach())  # the rounding did something

    back = export.read_tensors(path)
    sd = model.state_dict()
    assert list(back) == [n for n, _ in export.tensor_layout(model.cfg)]
    assert set(back) == set(sd)
    for name, t in sd.items():
        assert torch.equal(torch.from_numpy(back[name]), bf16_reference(t)), name


def test_fp32_export_is_exact(tmp_path):
    model = export.random_model("mla64", small=True, seed=7)
    path = str(tmp_path / "m.bin")
    export.export(model, path, TOKENIZER, "fp32")
    h = export.read_header(path)
    n_params = sum(p.numel() for p in model.parameters())
    assert h["dtype"] == 0 and h["weights_size"] == 4 * n_params
    assert os.path.getsize(path) == h["weights_offset"] + h["weights_size"]
    back = export.read_tensors(path)
    for name, t in model.state_dict().items():
        assert torch.equal(torch.from_numpy(back[name]), t), name
    assert not os.path.exists(path + ".tmp")


def test_bf16_rounding_matches_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g) * 3
    # exact ties in both directions, values just around them, subnormals, signed zeros, big values
    ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), -(1 + 3 * 2 ** -8),
                         np.nextafter(np.float32(1 + 2 ** -8), np.float32(2)),
                         np.nextafter(np.float32(1 + 2 ** -8), np.float32(0)),
                         1e-40, -1e-40, 0.0, -0.0, 3.0e38, -3.0e38], dtype=torch.float32)
    x = torch.cat([x, ties])
    got = torch.from_numpy(export.round_to_bf16(x.numpy()))
    ref = bf16_reference(x)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))  # bitwise (keeps -0.0)
    assert got[-12] == 1.0 and got[-11] == 1 + 4 * 2 ** -8  # ties go to even
    with pytest.raises(AssertionError):
        export.bf16_bits(np.array([1.0, np.nan], dtype=np.float32))


def test_round_to_bf16_in_place():
    model = export.random_model("gqa", small=True, seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert export.round_to_bf16_(model) is model
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p.detach(), bf16_reference(before[name])), name
        assert (p.detach().view(torch.int32) & 0xFFFF).eq(0).all()


def test_random_model_configs():
    for v, (code, n_kv, latent, rope) in EXPECTED.items():
        c = export.random_model(v, small=True).cfg
        assert (c.variant, c.dim, c.n_layers, c.n_heads, c.head_dim, c.hidden_dim, c.max_seq_len) == \
            (v, 64, 2, 4, 16, 96, 64)
        assert (c.n_kv_heads, c.kv_latent) == (n_kv, latent)
        if latent:
            assert c.rope_dim == rope
    a, b = export.random_model("mqa", small=True, seed=5), export.random_model("mqa", small=True, seed=5)
    c = export.random_model("mqa", small=True, seed=6)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.tok_embeddings.weight, c.tok_embeddings.weight)
    assert export.random_model("mha", small=True, vocab_size=320).tok_embeddings.weight.shape == (320, 64)
    # large enough weights that the logits are spread out, norms around 1
    assert 0.08 < a.tok_embeddings.weight.std() < 0.12
    assert not torch.equal(a.norm.weight, torch.ones(64)) and (a.norm.weight - 1).abs().max() <= 0.25
    logits = a(torch.tensor([[1, 300, 259, 17]]))[0, -1]
    top2 = logits.topk(2).values
    assert logits.std() > 0.3 and top2[0] - top2[1] > 1e-3


def test_load_checkpoint_roundtrip(tmp_path):
    """A .pt in train.py's layout comes back as the same model."""
    model = export.random_model("mla128", small=True, seed=11)
    path = str(tmp_path / "best.pt")
    torch.save({"model": model.state_dict(), "config": model.cfg.__dict__, "step": 3, "tokens": 100,
                "elapsed": 1.0, "best_val": 2.5, "kind": "best"}, path)
    back = export.load_checkpoint(path)
    assert isinstance(back, Transformer)
    assert back.cfg == model.cfg
    sd = back.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())


def test_validation_refuses_bad_models(tmp_path):
    out = str(tmp_path / "x.bin")
    wrong_vocab = export.random_model("mha", small=True, vocab_size=320)
    with pytest.raises(ValueError, match="vocabulary"):
        export.export(wrong_vocab, out, TOKENIZER)
    bad_gqa = Transformer(export.small_config("gqa", n_kv_heads=3))  # 3 does not divide n_heads 4
    with pytest.raises(ValueError, match="n_kv_heads"):
        export.export(bad_gqa, out, TOKENIZER)
    mha_as_mqa = Transformer(export.small_config("mqa", n_kv_heads=4))
    with pytest.raises(ValueError, match="n_kv_heads"):
        export.export(mha_as_mqa, out, TOKENIZER)
    with pytest.raises(ValueError, match="dtype"):
        export.export(export.random_model("mha", small=True), out, TOKENIZER, dtype="fp16")
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")


def read_llama2c_tokenizer(path):
    with open(path, "rb") as f:
        data = f.read()
    (max_len,), off, entries = struct.unpack_from("<I", data), 4, []
    while off < len(data):
        score, n = struct.unpack_from("<fI", data, off)
        off += 8
        entries.append((data[off:off + n], score))
        off += n
    assert off == len(data)
    return max_len, entries


def test_llama2c_export(tmp_path):
    import sentencepiece as spm
    model = export.random_model("mha", small=True, seed=2)
    mpath, tpath = export.export_llama2c(model, str(tmp_path / "l2c"), TOKENIZER)
    assert mpath == str(tmp_path / "l2c" / "mha_llama2c.bin")
    assert tpath == str(tmp_path / "l2c" / "tokenizer.bin")
    c = model.cfg
    n_params = sum(p.numel() for p in model.parameters())
    n_floats = n_params + 2 * c.max_seq_len * (c.head_dim // 2)
    assert os.path.getsize(mpath) == 7 * 4 + 4 * n_floats
    with open(mpath, "rb") as f:
        data = f.read()
    assert struct.unpack_from("<7i", data) == (64, 96, 2, 4, 4, 4096, 64)
    floats = np.frombuffer(data, dtype="<f4", offset=28)
    D, V, L = c.dim, c.vocab_size, c.n_layers
    emb = floats[:V * D]
    assert torch.equal(torch.from_numpy(emb.copy()).view(V, D), bf16_reference(model.tok_embeddings.weight))
    # grouped by kind: all attention norms, then all wq (each [n_heads*head_dim][dim])
    off = V * D
    for i in range(L):
        assert np.array_equal(floats[off + i * D:off + (i + 1) * D],
                              bf16_reference(model.layers[i].attn_norm.weight).numpy())
    off += L * D
    wq1 = floats[off + D * D:off + 2 * D * D].reshape(D, D)  # layer 1's wq (n_heads*head_dim == dim here)
    assert np.array_equal(wq1, bf16_reference(model.layers[1].attn.wq.weight).numpy())
    # the final norm, then freqs_cos and freqs_sin (max_seq_len x head_dim/2)
    half = c.head_dim // 2
    tail = floats[-(D + 2 * c.max_seq_len * half):]
    assert np.array_equal(tail[:D], bf16_reference(model.norm.weight).numpy())
    cos = tail[D:D + c.max_seq_len * half].reshape(c.max_seq_len, half)
    sin = tail[D + c.max_seq_len * half:].reshape(c.max_seq_len, half)
    assert np.allclose(cos[5], np.cos(5 * 10000.0 ** (-np.arange(0, c.head_dim, 2) / c.head_dim)), atol=1e-6)
    assert np.allclose(sin[5], np.sin(5 * 10000.0 ** (-np.arange(0, c.head_dim, 2) / c.head_dim)), atol=1e-6)

    sp = spm.SentencePieceProcessor(model_file=TOKENIZER)
    max_len, entries = read_llama2c_tokenizer(tpath)
    assert len(entries) == 4096
    assert max_len == max(len(b) for b, _ in entries)
    assert entries[0][0] == b"<unk>"
    assert entries[1][0] == b"\n<s>\n"
    assert entries[2][0] == b"\n</s>\n"
    assert entries[100][0] == b"<0x61>"  # byte-fallback pieces stay as they are
    assert entries[300] == (b" g", sp.get_score(300))  # '\u2581' becomes a space
    assert entries[4095] == (sp.id_to_piece(4095).encode("utf-8"), sp.get_score(4095))
    spaced = [i for i in range(4096) if sp.id_to_piece(i).startswith("\u2581")]
    assert len(spaced) > 100 and all(entries[i][0].startswith(b" ") for i in spaced)
    assert all(b"\xe2\x96\x81" not in b for b, _ in entries)


def test_llama2c_refuses_mla(tmp_path):
    model = export.random_model("mla64", small=True)
    with pytest.raises(ValueError, match="llama2.c"):
        export.export_llama2c(model, str(tmp_path / "l2c"), TOKENIZER)
    assert not os.path.exists(tmp_path / "l2c")


def run_cli(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train", "export.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_random_with_llama2c(tmp_path):
    out, d = str(tmp_path / "w" / "gqa.bin"), str(tmp_path / "l2c")
    r = run_cli("--random", "gqa", out, "--small", "--seed", "4", "--llama2c", d)
    assert r.returncode == 0, r.stderr
    h = export.read_header(out)
    assert (h["variant"], h["n_kv_heads"], h["dtype"]) == (1, 2, 1)
    back = export.read_tensors(out)
    model = export.random_model("gqa", small=True, seed=4)
    assert torch.equal(torch.from_numpy(back["layers.1.attn.wk.weight"]),
                       bf16_reference(model.layers[1].attn.wk.weight))
    assert sorted(os.listdir(d)) == ["gqa_llama2c.bin", "tokenizer.bin"]
    assert sorted(os.listdir(tmp_path / "w")) == ["gqa.bin"]  # no .tmp left behind


def test_cli_refuses_mla_llama2c(tmp_path):
    out = str(tmp_path / "mla.bin")
    r = run_cli("--random", "mla128", out, "--small", "--llama2c", str(tmp_path / "l2c"))
    assert r.returncode != 0
    assert "llama2.c" in r.stderr and "mla128" in r.stderr
    assert not os.path.exists(out) and not os.path.exists(tmp_path / "l2c")


def test_tensor_offsets_follow_format_md(exported):
    """Offsets computed by hand from FORMAT.md's table, independent of export.tensor_layout:
    MLA layer 0 is attn_norm, wq, wdkv, kv_norm, wkr, wuk, wuv, wo, ffn_norm, w1, w2, w3; final_norm ends the file."""
    model, path = exported["mla64"]
    h = export.read_header(path)
    V, D, H, hd, rd, dc, F = 4096, 64, 4, 16, 8, 16, 96
    data = np.fromfile(path, dtype="<u2", offset=h["weights_offset"])
    widen = lambda a: torch.from_numpy((a.astype(np.uint32) << 16).view(np.float32))  # noqa: E731
    att = model.layers[0].attn
    off = V * D + D                                   # tok_embeddings, attn_norm
    off += H * (hd + rd) * D                          # wq
    assert torch.equal(widen(data[off:off + dc * D]).view(dc, D), bf16_reference(att.wdkv.weight))
    off += dc * D
    assert torch.equal(widen(data[off:off + dc]), bf16_reference(att.kv_norm.weight))
    off += dc + rd * D + 2 * H * hd * dc              # kv_norm, wkr, wuk, wuv
    assert torch.equal(widen(data[off:off + D * H * hd]).view(D, H * hd), bf16_reference(att.wo.weight))
    assert torch.equal(widen(data[-D:]), bf16_reference(model.norm.weight))
    per_layer = D + H * (hd + rd) * D + dc * D + dc + rd * D + 2 * H * hd * dc + D * H * hd + D + 3 * F * D
    assert len(data) == V * D + 2 * per_layer + D


def test_cli_exports_a_training_checkpoint(tmp_path):
    model = export.random_model("mqa", small=True, seed=9)
    ck = str(tmp_path / "best.pt")
    torch.save({"model": model.state_dict(), "config": model.cfg.__dict__, "step": 1, "tokens": 1,
                "elapsed": 0.0, "best_val": 9.9, "kind": "best"}, ck)
    out = str(tmp_path / "mqa.bin")
    r = run_cli(ck, out, "--dtype", "fp32", "--tokenizer", TOKENIZER)
    assert r.returncode == 0, r.stderr
    h = export.read_header(out)
    assert (h["variant"], h["n_kv_heads"], h["dtype"]) == (2, 1, 0)
    back = export.read_tensors(out)
    assert all(torch.equal(torch.from_numpy(back[k]), v) for k, v in model.state_dict().items())
