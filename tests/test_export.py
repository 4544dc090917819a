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
    assert (h["flags"], h["window"], h["reserved"]) == (0, 0, bytes(16))
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
    path = str(save_training_checkpoint(model, tmp_path / "best.pt"))
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


# FORMAT.md's table of tensors, a layer's in file order: (name, shape from the header's fields)
FORMAT_LAYER = {
    "kv_heads": [("attn_norm", "D"), ("wq", "H*hd,D"), ("wk", "Hkv*hd,D"), ("wv", "Hkv*hd,D"), ("wo", "D,H*hd")],
    "mla": [("attn_norm", "D"), ("wq", "H*(hd+rd),D"), ("wdkv", "dc,D"), ("kv_norm", "dc"), ("wkr", "rd,D"),
            ("wuk", "H*hd,dc"), ("wuv", "H*hd,dc"), ("wo", "D,H*hd")],
}
FORMAT_FFN = [("ffn_norm", "D"), ("w1", "F,D"), ("w2", "D,F"), ("w3", "F,D")]


@pytest.mark.parametrize("variant", ["mla64", "gqa"])
def test_tensor_offsets_follow_format_md(exported, variant):
    """Every tensor at the offset FORMAT.md's table gives, walked by hand from the header's
    fields (independent of export.tensor_layout): tok_embeddings, each layer's tensors in the
    table's order, final_norm ending the file."""
    model, path = exported[variant]
    h = export.read_header(path)
    dims = dict(V=h["vocab_size"], D=h["dim"], H=h["n_heads"], hd=h["head_dim"], Hkv=h["n_kv_heads"],
                dc=h["kv_latent"], rd=h["rope_dim"], F=h["hidden_dim"])
    data = np.fromfile(path, dtype="<u2", offset=h["weights_offset"])
    widen = lambda a: torch.from_numpy((a.astype(np.uint32) << 16).view(np.float32))  # noqa: E731
    off = 0

    def take(shape, want):
        nonlocal off
        size = [eval(d, {}, dims) for d in shape.split(",")]
        n = int(np.prod(size))
        assert tuple(want.shape) == tuple(size), (shape, want.shape)
        assert torch.equal(widen(data[off:off + n]).view(*size), bf16_reference(want)), shape
        off += n

    take("V,D", model.tok_embeddings.weight)
    attention = FORMAT_LAYER["mla" if dims["dc"] else "kv_heads"]
    for layer in model.layers:
        for name, shape in attention + FORMAT_FFN:
            owner = layer if name in ("attn_norm", "ffn_norm") else layer.ffn if name in ("w1", "w2", "w3") \
                else layer.attn
            take(shape, getattr(owner, name).weight)
    take("D", model.norm.weight)
    assert off == len(data) and h["flags"] == 0  # the head is tied: nothing after final_norm


def test_cli_exports_a_training_checkpoint(tmp_path):
    model = export.random_model("mqa", small=True, seed=9)
    ck = str(save_training_checkpoint(model, tmp_path / "best.pt"))
    out = str(tmp_path / "mqa.bin")
    r = run_cli(ck, out, "--dtype", "fp32", "--tokenizer", TOKENIZER)
    assert r.returncode == 0, r.stderr
    h = export.read_header(out)
    assert (h["variant"], h["n_kv_heads"], h["dtype"]) == (2, 1, 0)
    back = export.read_tensors(out)
    assert all(torch.equal(torch.from_numpy(back[k]), v) for k, v in model.state_dict().items())


# ---------------------------------------------------------------- engine checkpoints as input

def save_training_checkpoint(model, path):
    """A .pt laid out as train.py's best.pt."""
    torch.save({"model": model.state_dict(), "config": model.cfg.__dict__, "step": 1, "tokens": 1,
                "elapsed": 0.0, "best_val": 9.9, "kind": "best"}, path)
    return path


def cli(capsys, *args):
    """export.main in this process: (exit status, stderr)."""
    try:
        status = export.main([str(a) for a in args])
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


def read_llama2c(path):
    """A llama2.c legacy file read as llama2.c's run.c maps it (header; each kind of tensor for
    all layers in turn; the final norm; the RoPE tables it skips; no classifier when vocab_size
    is positive): (header, {state-dict name: array}); fails unless that ends the file."""
    data = open(path, "rb").read()
    hdr = struct.unpack_from("<7i", data)
    dim, hidden, L, H, Hkv, V, T = hdr
    hs = dim // H
    floats = np.frombuffer(data, dtype="<f4", offset=28)
    out, off = {}, 0

    def take(shape):
        nonlocal off
        n = int(np.prod(shape))
        a = floats[off:off + n].reshape(shape)
        off += n
        return a

    out["tok_embeddings.weight"] = take((V, dim))
    for kind, shape in (("attn_norm", (dim,)), ("attn.wq", (H * hs, dim)), ("attn.wk", (Hkv * hs, dim)),
                        ("attn.wv", (Hkv * hs, dim)), ("attn.wo", (dim, H * hs)), ("ffn_norm", (dim,)),
                        ("ffn.w1", (hidden, dim)), ("ffn.w2", (dim, hidden)), ("ffn.w3", (hidden, dim))):
        for i in range(L):
            out[f"layers.{i}.{kind}.weight"] = take(shape)
    out["norm.weight"] = take((dim,))
    take((2, T, hs // 2))  # freq_cis_real, freq_cis_imag
    assert V > 0 and off == len(floats)
    return hdr, out


def test_engine_checkpoint_reads_back(tmp_path, capsys):
    """A .pt exported to .bin and read back (export.load_input) gives the same tensors, bf16-rounded;
    re-exported as fp32 it keeps them, its tokenizer and every header field but dtype and size."""
    model = export.random_model("gqa", small=True, seed=21)
    pt, b16, b32 = tmp_path / "best.pt", tmp_path / "gqa.bin", tmp_path / "gqa32.bin"
    save_training_checkpoint(model, pt)
    assert cli(capsys, pt, b16) == (0, "")
    back, tok, dtype = export.load_input(str(b16))
    assert dtype == "bf16" and tok == open(TOKENIZER, "rb").read()
    sd = back.state_dict()
    assert set(sd) == set(model.state_dict())
    for name, t in model.state_dict().items():
        assert torch.equal(sd[name], bf16_reference(t)), name
    assert cli(capsys, b16, b32, "--dtype", "fp32") == (0, "")
    h16, h32 = export.read_header(str(b16)), export.read_header(str(b32))
    assert h32["dtype"] == 0 and h32["weights_size"] == 2 * h16["weights_size"]
    assert {k: v for k, v in h16.items() if k not in ("dtype", "weights_size")} == \
        {k: v for k, v in h32.items() if k not in ("dtype", "weights_size")}
    b32_tensors = export.read_tensors(str(b32))
    for name, t in model.state_dict().items():
        assert torch.equal(torch.from_numpy(b32_tensors[name]), bf16_reference(t)), name
    assert export.read_embedded_tokenizer(str(b32)) == tok


def test_input_kind_comes_from_magic_not_name(tmp_path, capsys):
    """A training checkpoint named .bin and an engine checkpoint named .pt are each read as what they are."""
    model = export.random_model("mqa", small=True, seed=22)
    pt_named_bin = save_training_checkpoint(model, tmp_path / "really_a_pt.bin")
    assert cli(capsys, pt_named_bin, tmp_path / "a.bin") == (0, "")
    os.replace(tmp_path / "a.bin", tmp_path / "really_a_bin.pt")
    assert cli(capsys, tmp_path / "really_a_bin.pt", tmp_path / "b.bin") == (0, "")
    assert (tmp_path / "b.bin").read_bytes() == (tmp_path / "really_a_bin.pt").read_bytes()


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    """A 300-piece tokenizer made here: a model with its vocabulary cannot go out with the committed one."""
    import prepare
    rng = np.random.default_rng(0)
    words = "once upon a time there was little cat who liked to play in the sun with her friend".split()
    prefix = str(tmp_path_factory.mktemp("tok") / "tok")
    prepare.train_tokenizer([" ".join(rng.choice(words, 20)) for _ in range(50)], prefix, vocab_size=300)
    return prefix + ".model"


def test_engine_input_keeps_its_tokenizer_and_dtype(tmp_path, capsys, small_tokenizer):
    """An engine checkpoint's own tokenizer and dtype are the defaults: an fp32 one goes to llama2.c
    unrounded, with a tokenizer.bin made from its embedded tokenizer."""
    model = export.random_model("mha", small=True, seed=23, vocab_size=300)
    src = str(tmp_path / "mha32.bin")
    export.export(model, src, small_tokenizer, dtype="fp32")
    assert cli(capsys, src, tmp_path / "again.bin") == (0, "")
    assert export.read_header(str(tmp_path / "again.bin"))["dtype"] == 0
    assert export.read_embedded_tokenizer(str(tmp_path / "again.bin")) == open(small_tokenizer, "rb").read()
    assert cli(capsys, src, "--llama2c", tmp_path / "l2c") == (0, "")
    assert sorted(os.listdir(tmp_path)) == ["again.bin", "l2c", "mha32.bin"]  # no OUT.bin was asked for
    _, got = read_llama2c(tmp_path / "l2c" / "mha_llama2c.bin")
    for name, t in model.state_dict().items():
        assert np.array_equal(got[name], t.numpy()), name
    assert (tmp_path / "l2c" / "tokenizer.bin").read_bytes() == export.llama2c_tokenizer_bytes(small_tokenizer)


def test_shipped_checkpoint_to_llama2c(tmp_path, capsys):
    """weights/gqa.bin through --llama2c: every tensor is the .bin's bf16 widened to fp32."""
    gqa = os.path.join(ROOT, "weights", "gqa.bin")
    assert cli(capsys, gqa, "--llama2c", tmp_path) == (0, "")
    hdr, got = read_llama2c(tmp_path / "gqa_llama2c.bin")
    assert hdr == (512, 1344, 4, 16, 4, 4096, 256)
    h = export.read_header(gqa)
    assert h["dtype"] == 1
    widened = (np.fromfile(gqa, dtype="<u2", offset=h["weights_offset"]).astype(np.uint32) << 16).view(np.float32)
    off = 0
    for name, shape in export.tensor_layout(export.header_config(h)):
        n = int(np.prod(shape))
        assert np.array_equal(got[name], widened[off:off + n].reshape(shape)), name
        off += n
    assert off == len(widened) and len(got) == len(export.tensor_layout(export.header_config(h)))
    assert (tmp_path / "tokenizer.bin").read_bytes() == export.llama2c_tokenizer_bytes(TOKENIZER)


def test_cli_refusals_are_one_line(tmp_path, capsys):
    """Inputs export.py cannot use: one line on stderr, exit status 1, nothing written."""
    out, l2c = tmp_path / "out.bin", tmp_path / "l2c"
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(open(os.path.join(ROOT, "weights", "mqa.bin"), "rb").read(100_000))
    not_a_run = tmp_path / "tensor.pt"
    torch.save(torch.zeros(3), not_a_run)
    wide_heads = save_training_checkpoint(  # train.py --small: 16 heads of 32 on a width of 64
        Transformer(Config.for_variant("mha", dim=64, n_layers=2, hidden_dim=96)), tmp_path / "small.pt")
    cases = [
        ((os.path.join(ROOT, "weights", "mla64.bin"), "--llama2c", l2c), ["mla64", "no llama2.c equivalent"]),
        ((wide_heads, "--llama2c", l2c), ["dim / n_heads"]),
        ((os.path.join(ROOT, "README.md"), out), ["neither an engine checkpoint", "nor a PyTorch checkpoint"]),
        ((truncated, out), ["truncated.bin", "100,000 bytes"]),
        ((tmp_path / "missing.pt", out), ["missing.pt", "No such file"]),
        ((not_a_run, out), ["not a checkpoint saved by train.py"]),
        ((wide_heads, out, "--tokenizer", tmp_path / "none.model"), ["none.model", "No such file"]),
    ]
    for args, words in cases:
        status, err = cli(capsys, *args)
        assert status == 1, (args, err)
        assert err.startswith("export.py: ") and err.count("\n") == 1, err
        assert all(w in err for w in words), err
    assert not out.exists() and not l2c.exists()


@pytest.mark.parametrize("damage", ["half", "head", "random"])
def test_damaged_training_checkpoint_is_one_line(tmp_path, capsys, damage):
    """A best.pt cut short, or random bytes behind torch.save's zip signature: one line naming the
    file and what to give instead, exit status 1, nothing written."""
    good = save_training_checkpoint(export.random_model("gqa", small=True), tmp_path / "good.pt")
    raw = good.read_bytes()
    bad = tmp_path / "best.pt"
    bad.write_bytes({"half": raw[:len(raw) // 2], "head": raw[:1000],
                     "random": raw[:4] + np.random.default_rng(45).bytes(len(raw))}[damage])
    status, err = cli(capsys, bad, tmp_path / "out.bin")
    assert status == 1 and err.startswith(f"export.py: {bad}: it is truncated or damaged"), err
    assert err.count("\n") == 1 and "train/train.py" in err, err
    assert not (tmp_path / "out.bin").exists()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository standing in for the project (export.ROOT): weights/shipped.bin tracked,
    weights/untracked.bin not."""
    root = tmp_path / "repo"
    (root / "weights").mkdir(parents=True)
    (root / "weights" / "shipped.bin").write_bytes(b"shipped")
    (root / "weights" / "untracked.bin").write_bytes(b"mine")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "weights/shipped.bin"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "x"], check=True)
    monkeypatch.setattr(export, "ROOT", str(root))
    return root


def test_export_refuses_to_replace_a_shipped_checkpoint(repo, tmp_path, capsys):
    """README's old recipe wrote over weights/gqa.bin: a file git tracks in weights/ is replaced
    only with --force; an untracked or new file there is written as before."""
    pt = save_training_checkpoint(export.random_model("gqa", small=True), tmp_path / "best.pt")
    shipped = repo / "weights" / "shipped.bin"
    status, err = cli(capsys, pt, shipped)
    assert status == 1 and err.count("\n") == 1, err
    assert str(shipped) in err and "--force" in err and "shipped-mine.bin" in err, err
    assert shipped.read_bytes() == b"shipped"
    assert cli(capsys, pt, repo / "weights" / "untracked.bin")[0] == 0
    assert cli(capsys, pt, repo / "weights" / "new.bin")[0] == 0
    for f in ("untracked.bin", "new.bin"):
        assert export.read_header(str(repo / "weights" / f))["magic"] == "AKVC"
    assert cli(capsys, pt, shipped, "--force")[0] == 0
    assert export.read_header(str(shipped))["magic"] == "AKVC"


def llama2c_logits(path, tokens):
    """The logits llama2.c's run.c computes for tokens, position by position, from a legacy file:
    its arithmetic in numpy (heads dim / n_heads wide, query head h reading KV head h / (n_heads /
    n_kv_heads), RoPE on pairs (i, i+1) at 10000^(-(i mod head) / head), RMSNorm eps 1e-5)."""
    (dim, _, L, H, Hkv, _, _), w = read_llama2c(path)
    hs, kv_mul = dim // H, H // Hkv
    norm = lambda x, g: g * x / np.sqrt(np.mean(x * x) + 1e-5)  # noqa: E731
    keys, values, out = [[] for _ in range(L)], [[] for _ in range(L)], []
    for pos, tok in enumerate(tokens):
        x = w["tok_embeddings.weight"][tok].astype(np.float64)
        ang = pos * 10000.0 ** -((np.arange(0, dim, 2) % hs) / hs)
        cos, sin = np.cos(ang), np.sin(ang)

        def rope(v):
            a, b = v[0::2].copy(), v[1::2].copy()
            v[0::2], v[1::2] = a * cos[:len(a)] - b * sin[:len(a)], a * sin[:len(a)] + b * cos[:len(a)]
            return v

        for i in range(L):
            p = f"layers.{i}."
            xb = norm(x, w[p + "attn_norm.weight"])
            q = rope(w[p + "attn.wq.weight"] @ xb)
            keys[i].append(rope(w[p + "attn.wk.weight"] @ xb))
            values[i].append(w[p + "attn.wv.weight"] @ xb)
            heads = []
            for h in range(H):
                kv = slice((h // kv_mul) * hs, (h // kv_mul + 1) * hs)
                s = np.array([q[h * hs:(h + 1) * hs] @ k[kv] for k in keys[i]]) / np.sqrt(hs)
                a = np.exp(s - s.max())
                heads.append(sum(ai * v[kv] for ai, v in zip(a / a.sum(), values[i])))
            x = x + w[p + "attn.wo.weight"] @ np.concatenate(heads)
            xb = norm(x, w[p + "ffn_norm.weight"])
            g = w[p + "ffn.w1.weight"] @ xb
            x = x + w[p + "ffn.w2.weight"] @ (g / (1 + np.exp(-g)) * (w[p + "ffn.w3.weight"] @ xb))
        out.append(w["tok_embeddings.weight"] @ norm(x, w["norm.weight"]))
    return np.array(out)


@pytest.mark.parametrize("variant", ["mha", "gqa", "mqa"])
def test_llama2c_computes_our_model(tmp_path, variant):
    """llama2.c's arithmetic on the exported file gives model.py's logits: the tensors' order,
    the KV-head sharing and the RoPE pairing all agree."""
    model = export.round_to_bf16_(export.random_model(variant, small=True, seed=31))
    path, _ = export.export_llama2c(model, str(tmp_path), TOKENIZER)
    tokens = [1, 300, 259, 17, 4000, 42, 7]
    with torch.no_grad():
        want = model(torch.tensor([tokens]))[0].double().numpy()
    assert np.allclose(llama2c_logits(path, tokens), want, atol=1e-4, rtol=1e-4)


def test_outputs_never_replace_inputs(tmp_path, capsys):
    """An output that is an input (by its name, a hard link or a symbolic link) or a directory is
    refused before anything is written, the input as it was; a FIFO is written through, not
    replaced by a file; files beside the outputs named like temporaries are left alone."""
    import stat
    import threading
    src = tmp_path / "in.bin"
    src.write_bytes(open(os.path.join(ROOT, "weights", "gqa.bin"), "rb").read())
    before = src.read_bytes()
    os.link(src, tmp_path / "hard.bin")
    (tmp_path / "soft.bin").symlink_to(src)
    (tmp_path / "dir").mkdir()
    tok = tmp_path / "tok.model"
    tok.write_bytes(open(TOKENIZER, "rb").read())
    cases = [((src, src), f"cannot write {src}: it is the input {src}"),
             ((src, tmp_path / "hard.bin"), f"cannot write {tmp_path / 'hard.bin'}: it is the input {src}"),
             ((src, tmp_path / "soft.bin"), f"cannot write {tmp_path / 'soft.bin'}: it is the input {src}"),
             ((src, tmp_path / "dir"), f"cannot write {tmp_path / 'dir'}: it is a directory"),
             (("--random", "gqa", "--small", tok, "--tokenizer", tok), f"cannot write {tok}: it is the input {tok}")]
    for args, says in cases:
        status, err = cli(capsys, *args)
        assert status == 1 and err == f"export.py: {says}\n", err
    assert src.read_bytes() == before and tok.read_bytes() == open(TOKENIZER, "rb").read()

    fifo, got = tmp_path / "pipe", []
    os.mkfifo(fifo)
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()), daemon=True)
    reader.start()
    status, err = cli(capsys, src, fifo)
    reader.join(timeout=60)
    assert status == 0 and stat.S_ISFIFO(os.stat(fifo).st_mode), err
    assert got and got[0] == before  # an engine checkpoint in, the same bytes out

    (tmp_path / "out.bin.tmp").write_bytes(b"mine")
    (tmp_path / "hf.tmp").mkdir()
    (tmp_path / "hf.tmp" / "notes.txt").write_bytes(b"mine too")
    status, err = cli(capsys, src, tmp_path / "out.bin", "--hf", tmp_path / "hf")
    assert status == 0, err
    assert (tmp_path / "out.bin").read_bytes() == before and (tmp_path / "hf" / "model.safetensors").exists()
    assert (tmp_path / "out.bin.tmp").read_bytes() == b"mine"
    mask = os.umask(0)
    os.umask(mask)  # the outputs have the modes a plain open() and mkdir() give, not the temporaries' 0600/0700
    assert stat.S_IMODE(os.stat(tmp_path / "out.bin").st_mode) == 0o666 & ~mask
    assert stat.S_IMODE(os.stat(tmp_path / "hf").st_mode) == 0o777 & ~mask
    assert (tmp_path / "hf.tmp" / "notes.txt").read_bytes() == b"mine too"
    assert sorted(os.listdir(tmp_path)) == sorted(["in.bin", "hard.bin", "soft.bin", "dir", "tok.model", "pipe",
                                                   "out.bin", "out.bin.tmp", "hf", "hf.tmp"])


def test_bad_headers_and_tokenizers_are_one_line(tmp_path, capsys):
    """A header's unknown variant, an embedded tokenizer of 0 bytes, a NaN weight on the way to
    Hugging Face, an empty tokenizer file: one line each, exit status 1, nothing written (the
    empty tokenizer crashed SentencePiece; the NaN went into the safetensors)."""
    raw = open(os.path.join(ROOT, "weights", "gqa.bin"), "rb").read()

    def damaged(name, patch):
        b = bytearray(raw)
        patch(b)
        (tmp_path / name).write_bytes(b)
        return tmp_path / name

    def nan_weight(b):
        at = struct.unpack_from("<Q", b, 88)[0]  # weights_offset: the first weight, a bf16
        b[at:at + 2] = b"\xc0\x7f"

    empty = tmp_path / "empty.model"
    empty.write_bytes(b"")
    out, hf_dir = tmp_path / "out.bin", tmp_path / "hf"
    cases = [
        ((damaged("variant7.bin", lambda b: struct.pack_into("<I", b, 8, 7)), out), "unknown variant code 7"),
        ((damaged("notok.bin", lambda b: struct.pack_into("<Q", b, 80, 0)), out), "the embedded tokenizer 0 bytes"),
        ((damaged("nan.bin", nan_weight), "--hf", hf_dir), "tok_embeddings.weight holds NaN or inf"),
        (("--random", "gqa", "--small", out, "--tokenizer", empty), f"{empty} is empty, not a SentencePiece model"),
    ]
    for args, needle in cases:
        status, err = cli(capsys, *args)
        assert status == 1 and err.startswith("export.py: ") and err.count("\n") == 1 and needle in err, err
    assert not out.exists() and not hf_dir.exists()
    assert sorted(os.listdir(tmp_path)) == ["empty.model", "nan.bin", "notok.bin", "variant7.bin"]
