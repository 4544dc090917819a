"""Models in and out (docs/MODELS_IN_OUT.md): the format's untied head and window, the
safetensors reader and writer, llama2.c and Hugging Face imports, Hugging Face exports."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import PROMPT, ROOT, TOKENIZER, run, run_json

sys.path.insert(0, os.path.join(ROOT, "train"))
import export  # noqa: E402

torch.set_num_threads(os.cpu_count())


def greedy_tokens(path, prompt=PROMPT, n=24):
    """./run's greedy tokens (-k 1) for prompt, from --json."""
    _, objs = run_json([path, "-p", prompt, "-k", 1, "-n", n, "--ignore-eos", "-q", "--kv", "-s", 1])
    seq = [o for o in objs if o["type"] == "sequence"]
    assert len(seq) == 1, objs
    return seq[0]


# ---------------------------------------------------------------- the format's growth

@pytest.mark.parametrize("variant", ["gqa", "mla64"])
def test_untied_head_parity(variant, tmp_path):
    """A model with an untied head: ./run's logits are the PyTorch reference's, which reads the
    head (a random matrix unlike the embedding), and the header says so."""
    from test_parity import check_parity
    model = export.random_model(variant, small=True, seed=21)
    model.cfg.untied_head = True
    model.output = torch.nn.Linear(model.cfg.dim, model.cfg.vocab_size, bias=False)
    with torch.no_grad():
        model.output.weight.copy_(torch.randn(model.output.weight.shape, generator=torch.Generator().manual_seed(3)) * 0.1)
    export.round_to_bf16_(model)
    path = str(tmp_path / "untied.bin")
    export.export(model, path, TOKENIZER, "bf16")
    h = export.read_header(path)
    assert (h["flags"], h["window"]) == (1, 0)
    assert h["weights_size"] == 2 * sum(p.numel() for p in model.parameters())
    check_parity(path, model, tmp_path)
    back = export.load_engine_checkpoint(path)
    assert torch.equal(back.output.weight, model.output.weight)


def test_window_in_header(tmp_path):
    model = export.random_model("mqa", small=True, seed=2)
    model.cfg.window = 48
    path = str(tmp_path / "w.bin")
    export.export(model, path, TOKENIZER, "bf16")
    assert export.read_header(path)["window"] == 48
    assert export.header_config(export.read_header(path)).window == 48
    run([path, "-n", 2, "-q"])  # loads
    model.cfg.window = 65
    with pytest.raises(ValueError, match="window = 65"):
        export.export(model, str(tmp_path / "w2.bin"), TOKENIZER, "bf16")


import hf  # noqa: E402
import import_model  # noqa: E402
import safetensors_io as st  # noqa: E402

IMPORT = os.path.join(ROOT, "train", "import_model.py")
EXPORT = os.path.join(ROOT, "train", "export.py")


def cli(script, *args):
    p = subprocess.run([sys.executable, script] + [str(a) for a in args], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=600)
    return p.returncode, p.stdout, p.stderr


def sp_model():
    import sentencepiece as spm
    return spm.SentencePieceProcessor(model_file=TOKENIZER)


def prompt_ids():
    sp = sp_model()
    return [sp.bos_id()] + sp.encode(PROMPT)


def greedy(logits_fn, prompt, n):
    """Greedy decoding by recomputing the whole sequence each step: logits_fn(ids) -> last logits."""
    ids, out = list(prompt), []
    for _ in range(n):
        t = int(torch.argmax(logits_fn(ids)))
        out.append(t)
        ids.append(t)
    return out


# ---------------------------------------------------------------- safetensors

def st_bytes(header, data, pad=b""):
    """A safetensors file by hand: u64 length, the JSON, the data."""
    text = json.dumps(header).encode() + pad
    return struct.pack("<Q", len(text)) + text + data


def test_safetensors_reads_hand_written_file(tmp_path):
    a = np.arange(6, dtype="<f4").reshape(2, 3) / 4
    h = np.array([1.5, -2.0], dtype="<f2")
    bf = np.array([0x3F80, 0xC000, 0x3E20], dtype="<u2")  # 1.0, -2.0, 0.15625
    data = h.tobytes() + a.tobytes() + bf.tobytes()  # not in header order: offsets decide
    hdr = {"__metadata__": {"format": "pt"},
           "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [4, 28]},
           "h": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
           "b": {"dtype": "BF16", "shape": [3], "data_offsets": [28, 34]}}
    p = tmp_path / "x.safetensors"
    p.write_bytes(st_bytes(hdr, data, pad=b"   "))
    got, meta = st.read_file(str(p))
    assert meta == {"format": "pt"}
    assert list(got) == ["h", "a", "b"]
    assert got["a"].dtype == "F32" and np.array_equal(got["a"].to_f32(), a)
    assert np.array_equal(got["h"].to_f32(), [1.5, -2.0])
    assert got["b"].dtype == "BF16" and list(got["b"].to_f32()) == [1.0, -2.0, 0.15625]


def test_safetensors_writer_layout(tmp_path):
    t = {"w": st.Tensor("F32", np.ones((2, 2), dtype="<f4")), "v": st.Tensor("BF16", np.array([0x3F80], "<u2"))}
    p = tmp_path / "w.safetensors"
    with open(p, "wb") as f:
        st.write_file(f, t, {"format": "pt"})
    raw = p.read_bytes()
    n = struct.unpack_from("<Q", raw)[0]
    assert (8 + n) % 8 == 0
    hdr = json.loads(raw[8:8 + n])
    assert hdr == {"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                   "v": {"dtype": "BF16", "shape": [1], "data_offsets": [16, 18]}}
    assert raw[8 + n:] == np.ones(4, "<f4").tobytes() + b"\x80\x3f"
    with open(p, "wb") as f:
        with pytest.raises(st.SafetensorsError, match="does not store"):
            st.write_file(f, {"x": st.Tensor("BF16", np.ones(2, "<f4"))})


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
LYING = [
    (b"\x05\x00", "shorter than the 8-byte"),
    (struct.pack("<Q", 1 << 40) + b"{}", "runs past"),
    (struct.pack("<Q", 4) + b"nope" + bytes(8), "not JSON"),
    (st_bytes([1, 2], b""), "not a JSON object"),
    (st_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(4)), "outside"),
    (st_bytes({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)), "needs 12 bytes"),
    (st_bytes({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)), "unknown dtype"),
    (st_bytes({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8)), "bad shape"),
    (st_bytes({"a": {"dtype": "F32", "shape": [2]}}, bytes(8)), "exactly dtype"),
    (st_bytes(GOOD, bytes(12)), "the data has 12 bytes"),
    (st_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)), "a hole"),
    (st_bytes({**GOOD, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)), "an overlap"),
    (struct.pack("<Q", 2 * len(json.dumps(GOOD)) + 1) + b'{"a":' + json.dumps(GOOD["a"]).encode() + b',"a":'
     + json.dumps(GOOD["a"]).encode() + b"}" + bytes(8), "duplicate key"),
    (st_bytes({"__metadata__": {"k": 1}}, b""), "__metadata__"),
]


@pytest.mark.parametrize("raw, needle", LYING, ids=[n for _, n in LYING])
def test_safetensors_refuses_lying_headers(tmp_path, raw, needle):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(raw)
    with pytest.raises(st.SafetensorsError, match=needle) as e:
        st.read_file(str(p))
    assert "\n" not in str(e.value)


def write_shards(d, tensors, n_shards):
    """tensors {name: Tensor} into n_shards files with an index, as transformers shards them."""
    names = list(tensors)
    wm = {}
    for k in range(n_shards):
        part = names[k::n_shards]
        fn = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        with open(os.path.join(d, fn), "wb") as f:
            st.write_file(f, {n: tensors[n] for n in part}, {"format": "pt"})
        wm.update({n: fn for n in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.data.nbytes for t in tensors.values())}, "weight_map": wm}, f)


def test_safetensors_shards(tmp_path):
    t = {f"t{i}": st.Tensor("F32", np.full((i + 1,), i, "<f4")) for i in range(5)}
    write_shards(str(tmp_path), t, 2)
    got = st.read_dir(str(tmp_path))
    assert sorted(got) == sorted(t) and all(np.array_equal(got[k].data, t[k].data) for k in t)
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    idx["weight_map"]["t0"] = "model-00002-of-00002.safetensors"  # listed in the wrong shard
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(st.SafetensorsError, match="does not list there"):
        st.read_dir(str(tmp_path))
    idx["weight_map"]["t0"] = "model-00003-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(st.SafetensorsError, match="is missing"):
        st.read_dir(str(tmp_path))


# ---------------------------------------------------------------- llama2.c in

def llama2c_weights(dim=64, hidden=96, L=2, H=4, Hkv=2, V=4096, seq=64, seed=0):
    """Random weights of a llama2.c model, by llama2.c's names (run.c's TransformerWeights)."""
    g = np.random.default_rng(seed)
    hs = dim // H

    def m(*shape):
        return (g.standard_normal(shape) * 0.1).astype(np.float32)

    def n(*shape):
        return g.uniform(0.75, 1.25, shape).astype(np.float32)

    return dict(dims=(dim, hidden, L, H, Hkv, V, seq), token_embedding=m(V, dim), rms_att=n(L, dim),
                wq=m(L, dim, dim), wk=m(L, Hkv * hs, dim), wv=m(L, Hkv * hs, dim), wo=m(L, dim, dim),
                rms_ffn=n(L, dim), w1=m(L, hidden, dim), w2=m(L, dim, hidden), w3=m(L, hidden, dim),
                rms_final=n(dim), wcls=m(V, dim))


def write_llama2c(path, w, version, untied):
    """llama2.c's files as its export.py writes them: legacy_export (version 0) or version1_export."""
    dim, hidden, L, H, Hkv, V, seq = w["dims"]
    hs = dim // H
    with open(path, "wb") as f:
        if version == 0:
            f.write(struct.pack("<7i", dim, hidden, L, H, Hkv, -V if untied else V, seq))
            for k in ("token_embedding", "rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3", "rms_final"):
                f.write(w[k].astype("<f4").tobytes())
            freqs = 1.0 / 10000.0 ** (np.arange(0, hs, 2)[: hs // 2] / hs)
            ang = np.outer(np.arange(seq), freqs)
            f.write(np.cos(ang).astype("<f4").tobytes())
            f.write(np.sin(ang).astype("<f4").tobytes())
        else:
            f.write(struct.pack("<Ii7iB", 0x616B3432, 1, dim, hidden, L, H, Hkv, V, seq, 0 if untied else 1))
            f.write(bytes(256 - f.tell()))
            for k in ("rms_att", "rms_ffn", "rms_final", "token_embedding", "wq", "wk", "wv", "wo", "w1", "w2", "w3"):
                f.write(w[k].astype("<f4").tobytes())
        if untied:
            f.write(w["wcls"].astype("<f4").tobytes())


def llama2c_logits(w, ids, untied):
    """The logits of every position, computed as llama2.c's run.c does (written from its forward(),
    in float64): RMSNorm eps 1e-5; RoPE on pairs (i, i+1) with freq 10000^-(i % head_size / head_size);
    query head h reads KV head h / (n_heads / n_kv_heads); SwiGLU; wcls or the embedding."""
    dim, hidden, L, H, Hkv, V, seq = w["dims"]
    hs = dim // H
    W = {k: torch.from_numpy(np.asarray(v, dtype=np.float64)) for k, v in w.items() if k != "dims"}
    T = len(ids)

    def rmsnorm(x, g):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * g

    def rope(v):  # v: (T, width), width a multiple of hs
        out = v.clone()
        for i in range(0, v.shape[1], 2):
            freq = 1.0 / 10000.0 ** ((i % hs) / hs)
            ang = torch.arange(T, dtype=torch.float64) * freq
            c, s = torch.cos(ang), torch.sin(ang)
            out[:, i], out[:, i + 1] = v[:, i] * c - v[:, i + 1] * s, v[:, i] * s + v[:, i + 1] * c
        return out

    x = W["token_embedding"][ids]
    mask = torch.triu(torch.full((T, T), float("-inf"), dtype=torch.float64), 1)
    for l in range(L):
        xb = rmsnorm(x, W["rms_att"][l])
        q, k, v = rope(xb @ W["wq"][l].T), rope(xb @ W["wk"][l].T), xb @ W["wv"][l].T
        heads = []
        for h in range(H):
            kh = h // (H // Hkv)
            qh, kk, vv = q[:, h * hs:(h + 1) * hs], k[:, kh * hs:(kh + 1) * hs], v[:, kh * hs:(kh + 1) * hs]
            att = torch.softmax(qh @ kk.T / np.sqrt(hs) + mask, dim=-1)
            heads.append(att @ vv)
        x = x + torch.cat(heads, 1) @ W["wo"][l].T
        xb = rmsnorm(x, W["rms_ffn"][l])
        a = xb @ W["w1"][l].T
        x = x + ((a * torch.sigmoid(a)) * (xb @ W["w3"][l].T)) @ W["w2"][l].T
    x = rmsnorm(x, W["rms_final"])
    return x @ (W["wcls"] if untied else W["token_embedding"]).T


@pytest.mark.parametrize("version, untied, kv", [(0, False, 2), (0, True, 4), (1, False, 1), (1, True, 2)],
                         ids=["legacy-tied-gqa", "legacy-untied-mha", "v1-tied-mqa", "v1-untied-gqa"])
def test_llama2c_import_greedy(tmp_path, version, untied, kv):
    """A llama2.c file (legacy or version 1; its classifier tied or not) converted by import_model.py:
    ./run's greedy tokens are those of llama2.c's algorithm, and its logits agree."""
    w = llama2c_weights(Hkv=kv, seed=10 + version * 2 + untied)
    src, out = tmp_path / "l2c.bin", tmp_path / "ours.bin"
    write_llama2c(src, w, version, untied)
    rc, stdout, stderr = cli(IMPORT, src, out, "--tokenizer", TOKENIZER)
    assert rc == 0, stderr
    h = export.read_header(str(out))
    assert (h["dtype"], h["flags"], h["n_kv_heads"]) == (0, int(untied), kv)
    n = 24
    seq = greedy_tokens(str(out), n=n)
    prompt = prompt_ids()
    assert seq["prompt_tokens"] == len(prompt)
    want = greedy(lambda ids: llama2c_logits(w, ids, untied)[-1], prompt, n)
    assert seq["tokens"] == want
    dump = tmp_path / "logits.bin"
    run([out, "-p", PROMPT, "-k", 1, "-n", n, "--ignore-eos", "-q", "--kv", "--dump-logits", dump])
    c = np.fromfile(dump, dtype=np.float32).reshape(n, -1)
    ref = llama2c_logits(w, prompt + want[:-1], untied)[len(prompt) - 1:].numpy()
    assert np.abs(c - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


def test_llama2c_refusals(tmp_path):
    w = llama2c_weights(seed=3)
    src = tmp_path / "l2c.bin"
    write_llama2c(src, w, 0, False)
    raw = src.read_bytes()
    out = tmp_path / "ours.bin"
    cases = [(raw[:-4], ["bytes, but a llama2.c legacy file"]),
             (struct.pack("<Ii", 0x616B3432, 2) + bytes(300), ["version 2"]),
             (struct.pack("<7i", 64, 96, 2, 5, 1, 4096, 64) + raw[28:], ["n_heads 5"])]
    for k, (data, needles) in enumerate(cases):
        p = tmp_path / f"bad{k}.bin"
        p.write_bytes(data)
        rc, _, err = cli(IMPORT, p, out, "--tokenizer", TOKENIZER)
        assert rc == 1 and err.count("\n") == 1 and all(s in err for s in needles), err
        assert not out.exists() and not (tmp_path / "ours.bin.tmp").exists()
    small_vocab = llama2c_weights(V=300, seed=3)
    write_llama2c(src, small_vocab, 0, False)
    rc, _, err = cli(IMPORT, src, out, "--tokenizer", TOKENIZER)
    assert rc == 1 and "4096 pieces" in err and "is 300" in err and err.count("\n") == 1, err
    rc, _, err = cli(IMPORT, src, out)
    assert rc == 2 and "--tokenizer" in err
    assert not out.exists()
