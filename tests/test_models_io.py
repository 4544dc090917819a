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

from conftest import PROMPT, ROOT, TOKENIZER, json_one, run, run_json

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
    _, info = json_one([path, "--info", "--kv"])
    assert (info["model_window"], info["window"], info["window_from_model"]) == (48, 48, True)
    _, info = json_one([path, "--info", "--kv", "--window", 32])
    assert (info["model_window"], info["window"], info["window_from_model"]) == (48, 32, False)
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


@pytest.mark.parametrize("version, untied, kv", [(0, False, 2), (0, True, 4), (1, False, 1), (1, True, 2),
                                                (0, False, 6)],
                         ids=["legacy-tied-gqa", "legacy-untied-mha", "v1-tied-mqa", "v1-untied-gqa",
                              "stories15M-shape"])
def test_llama2c_import_greedy(tmp_path, version, untied, kv):
    """A llama2.c file (legacy or version 1; its classifier tied or not) converted by import_model.py:
    ./run's greedy tokens are those of llama2.c's algorithm, and its logits agree. The last case
    has stories15M's shape (dim 288, 6 layers, 6 heads of 48, hidden 768, context 256) with our
    4096-piece tokenizer in place of Llama 2's 32000."""
    if kv == 6:
        w = llama2c_weights(dim=288, hidden=768, L=6, H=6, Hkv=6, seq=256, seed=15)
    else:
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


# ---------------------------------------------------------------- Hugging Face in and out

def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def hf_llama_logits(cfg, T, ids):
    """Logits of every position of a Hugging Face Llama/Mistral model, written from transformers'
    LlamaForCausalLM in float64: RoPE on halves (cos/sin of cat(freqs, freqs), rotate_half), KV
    heads repeated (repeat_kv), RMSNorm weight * x / sqrt(mean x^2 + eps), SwiGLU, lm_head
    (or the embedding when tie_word_embeddings). T: {HF name: float64 tensor}."""
    H, Hkv, L = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"]), \
        cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // H
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
    n = len(ids)
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()  # (n, hd)
    mask = torch.triu(torch.full((n, n), float("-inf"), dtype=torch.float64), 1)
    if cfg.get("sliding_window"):  # Mistral: position i sees the sliding_window positions up to itself
        at = torch.arange(n)
        mask = mask.masked_fill(at[None, :] <= at[:, None] - cfg["sliding_window"], float("-inf"))

    def norm(x, w):
        return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    x = T["model.embed_tokens.weight"][ids]
    for i in range(L):
        p = f"model.layers.{i}."
        h = norm(x, T[p + "input_layernorm.weight"])
        q = (h @ T[p + "self_attn.q_proj.weight"].T).view(n, H, hd).transpose(0, 1)
        k = (h @ T[p + "self_attn.k_proj.weight"].T).view(n, Hkv, hd).transpose(0, 1)
        v = (h @ T[p + "self_attn.v_proj.weight"].T).view(n, Hkv, hd).transpose(0, 1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / np.sqrt(hd) + mask, dim=-1)
        x = x + (att @ v).transpose(0, 1).reshape(n, H * hd) @ T[p + "self_attn.o_proj.weight"].T
        h = norm(x, T[p + "post_attention_layernorm.weight"])
        g = h @ T[p + "mlp.gate_proj.weight"].T
        x = x + (torch.nn.functional.silu(g) * (h @ T[p + "mlp.up_proj.weight"].T)) @ T[p + "mlp.down_proj.weight"].T
    x = norm(x, T["model.norm.weight"])
    head = T["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else T["lm_head.weight"]
    return x @ head.T


def hf_deepseek_v2_logits(cfg, T, ids):
    """Logits of a dense DeepseekV2ForCausalLM without query compression, written from DeepSeek's
    modeling code in float64: q_proj -> per head [q_nope ; q_pe]; kv_a_proj_with_mqa -> [c ; k_pe];
    k_nope, v from kv_b_proj(kv_a_layernorm(c)) per head; q_pe and k_pe de-interleaved
    (view(d/2, 2).transpose) and rotated by halves; scale 1/sqrt(nope + rope). kv_a_layernorm's eps
    is passed in as cfg["rms_norm_eps"] here (transformers fixes it at 1e-6; see MODELS_IN_OUT.md)."""
    H, L, eps = cfg["num_attention_heads"], cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    nope, rd, vd, dc = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    n = len(ids)
    inv_freq = 1.0 / cfg.get("rope_theta", 10000.0) ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    mask = torch.triu(torch.full((n, n), float("-inf"), dtype=torch.float64), 1)

    def norm(x, w):
        return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x):  # (..., n, rd): de-interleave, then rotate halves
        x = x.view(*x.shape[:-1], rd // 2, 2).transpose(-1, -2).reshape(x.shape)
        return x * cos + rotate_half(x) * sin

    x = T["model.embed_tokens.weight"][ids]
    for i in range(L):
        p = f"model.layers.{i}."
        h = norm(x, T[p + "input_layernorm.weight"])
        q = (h @ T[p + "self_attn.q_proj.weight"].T).view(n, H, nope + rd).transpose(0, 1)
        q_nope, q_pe = q[..., :nope], rope(q[..., nope:])
        ckv = h @ T[p + "self_attn.kv_a_proj_with_mqa.weight"].T
        c, k_pe = ckv[:, :dc], rope(ckv[:, dc:])
        kv = (norm(c, T[p + "self_attn.kv_a_layernorm.weight"]) @ T[p + "self_attn.kv_b_proj.weight"].T)
        kv = kv.view(n, H, nope + vd).transpose(0, 1)
        k = torch.cat([kv[..., :nope], k_pe.expand(H, n, rd)], dim=-1)
        qq = torch.cat([q_nope, q_pe], dim=-1)
        att = torch.softmax(qq @ k.transpose(1, 2) / np.sqrt(nope + rd) + mask, dim=-1)
        x = x + (att @ kv[..., nope:]).transpose(0, 1).reshape(n, H * vd) @ T[p + "self_attn.o_proj.weight"].T
        h = norm(x, T[p + "post_attention_layernorm.weight"])
        g = h @ T[p + "mlp.gate_proj.weight"].T
        x = x + (torch.nn.functional.silu(g) * (h @ T[p + "mlp.up_proj.weight"].T)) @ T[p + "mlp.down_proj.weight"].T
    x = norm(x, T["model.norm.weight"])
    head = T["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else T["lm_head.weight"]
    return x @ head.T


def read_hf(d):
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    return cfg, {k: torch.from_numpy(t.to_f32().astype(np.float64)) for k, t in st.read_dir(d).items()}


LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 112, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
                "rope_theta": 500000.0, "rope_scaling": None, "hidden_act": "silu", "attention_bias": False,
                "mlp_bias": False, "pretraining_tp": 1, "tie_word_embeddings": False, "vocab_size": 4096,
                "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, "initializer_range": 0.02,
                "use_cache": True, "torch_dtype": "bfloat16", "transformers_version": "4.44.0",
                "attention_dropout": 0.0}


def make_hf_dir(d, config, st_dtype="BF16", shards=2, seed=0):
    """A Hugging Face model directory with random weights, written by hand: config.json,
    safetensors (sharded with an index when shards > 1), tokenizer.model."""
    os.makedirs(d, exist_ok=True)
    g = np.random.default_rng(seed)
    D, H, L, F, V = (config[k] for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                                         "intermediate_size", "vocab_size"))
    Hkv = config.get("num_key_value_heads", H)
    hd = config.get("head_dim") or D // H
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (H * hd, D), p + "self_attn.k_proj.weight": (Hkv * hd, D),
                       p + "self_attn.v_proj.weight": (Hkv * hd, D), p + "self_attn.o_proj.weight": (D, H * hd),
                       p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F)})
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (V, D)
    tensors = {}
    for name, shape in shapes.items():
        a = g.uniform(0.75, 1.25, shape) if len(shape) == 1 else g.standard_normal(shape) * 0.1
        a = a.astype(np.float32)
        if st_dtype == "BF16":
            tensors[name] = st.Tensor("BF16", export.bf16_bits(a))
        elif st_dtype == "F16":
            tensors[name] = st.Tensor("F16", a.astype("<f2"))
        else:
            tensors[name] = st.Tensor("F32", a)
    if shards > 1:
        write_shards(d, tensors, shards)
    else:
        with open(os.path.join(d, "model.safetensors"), "wb") as f:
            st.write_file(f, tensors, {"format": "pt"})
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    with open(TOKENIZER, "rb") as src, open(os.path.join(d, "tokenizer.model"), "wb") as dst:
        dst.write(src.read())
    return d


@pytest.mark.parametrize("kind", ["llama-bf16-sharded-untied", "mistral-f16-tied-window", "llama-f32-mqa"])
def test_hf_import_greedy(tmp_path, kind):
    """A tiny Hugging Face directory written here, converted by import_model.py: ./run's greedy
    tokens equal the test's own PyTorch transcription of transformers' Llama."""
    config = dict(LLAMA_CONFIG)
    st_dtype, shards = "BF16", 2
    if kind.startswith("mistral"):
        config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=16,
                      tie_word_embeddings=True, num_key_value_heads=4, rope_theta=10000.0,
                      max_position_embeddings=1024)  # a context over 256
        del config["mlp_bias"], config["pretraining_tp"]
        st_dtype, shards = "F16", 1
    elif kind == "llama-f32-mqa":
        config.update(num_key_value_heads=1, head_dim=24, rms_norm_eps=1e-5)
        st_dtype, shards = "F32", 1
    d = make_hf_dir(str(tmp_path / "hf"), config, st_dtype, shards, seed=len(kind))
    out = tmp_path / "ours.bin"
    rc, stdout, err = cli(IMPORT, d, out)
    assert rc == 0, err
    h = export.read_header(str(out))
    assert h["dtype"] == (1 if st_dtype == "BF16" else 0)
    assert h["flags"] == (0 if config["tie_word_embeddings"] else 1)
    assert h["window"] == config.get("sliding_window", 0)
    assert h["max_seq_len"] == config["max_position_embeddings"]
    assert h["n_kv_heads"] == config["num_key_value_heads"] and h["head_dim"] == config.get("head_dim", 16)
    assert np.float32(h["rope_theta"]) == np.float32(config["rope_theta"])
    assert np.float32(h["norm_eps"]) == np.float32(config["rms_norm_eps"])
    cfg, T = read_hf(d)
    n = 24  # past the window of 16: the prompt's 5 positions and 24 more
    seq = greedy_tokens(str(out), n=n)
    want = greedy(lambda ids: hf_llama_logits(cfg, T, ids)[-1], prompt_ids(), n)
    assert seq["tokens"] == want
    if config.get("sliding_window"):
        # the window is the model's: the run without the cache and train/model.py keep it too
        _, objs = run_json([out, "-p", PROMPT, "-k", 1, "-n", n, "--ignore-eos", "-q", "-s", 1])
        assert [o for o in objs if o["type"] == "sequence"][0]["tokens"] == want
        ids = prompt_ids() + want
        with torch.no_grad():
            ours = export.load_engine_checkpoint(str(out))(torch.tensor([ids]))[0].double()
        theirs = hf_llama_logits(cfg, T, ids)
        assert (ours - theirs).abs().max() <= 1e-4 * max(1.0, float(theirs.abs().max()))


@pytest.mark.parametrize("variant, dtype", [("mha", "bf16"), ("gqa", "fp32"), ("mqa", "bf16"), ("mla64", "bf16"),
                                            ("mla128", "fp32")])
def test_ours_to_hf_and_back(tmp_path, variant, dtype):
    """ours -> HF -> ours is the same file, bit for bit; the HF directory computes our model's
    function (the test's transcriptions of transformers' Llama and DeepSeek-V2 against
    train/model.py)."""
    model = export.random_model(variant, small=True, seed=5)
    src = str(tmp_path / "src.bin")
    export.export(model, src, TOKENIZER, dtype)
    hf_dir = tmp_path / "hf"
    rc, _, err = cli(EXPORT, src, "--hf", hf_dir)
    assert rc == 0, err
    assert sorted(os.listdir(hf_dir)) == ["config.json", "generation_config.json", "model.safetensors",
                                          "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    assert not os.path.exists(str(hf_dir) + ".tmp")
    back = tmp_path / "back.bin"
    rc, _, err = cli(IMPORT, hf_dir, back)
    assert rc == 0, err
    assert back.read_bytes() == open(src, "rb").read()

    cfg, T = read_hf(str(hf_dir))
    assert cfg["architectures"] == (["DeepseekV2ForCausalLM"] if variant.startswith("mla") else ["LlamaForCausalLM"])
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in T
    ref = export.load_engine_checkpoint(src)
    ids = prompt_ids() + [500, 600, 700, 800, 900, 1000]
    with torch.no_grad():
        ours = ref(torch.tensor([ids]))[0].double()
    fn = hf_deepseek_v2_logits if variant.startswith("mla") else hf_llama_logits
    theirs = fn(cfg, T, ids)
    assert (ours - theirs).abs().max() <= 1e-4 * max(1.0, float(theirs.abs().max()))


def test_mla_as_transformers_5_saves_it(tmp_path):
    """transformers 5 types n_routed_experts and n_shared_experts as int (null fails its strict
    config), and its save_pretrained adds qk_head_dim (nope + rope) and may add rope_interleave:
    what it writes back imports to the same bits; a qk_head_dim or rope_interleave that would
    change the function is refused."""
    model = export.random_model("mla64", small=True, seed=6)
    src = str(tmp_path / "src.bin")
    export.export(model, src, TOKENIZER, "bf16")
    hf_dir = str(tmp_path / "hf")
    assert cli(EXPORT, src, "--hf", hf_dir)[0] == 0
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    for k in ("n_routed_experts", "n_shared_experts", "num_experts_per_tok"):
        assert type(cfg[k]) is int and cfg[k] == 0, k
    nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    _edit_config(hf_dir, qk_head_dim=nope + rope, rope_interleave=True, head_dim=rope)
    back = tmp_path / "back.bin"
    rc, _, err = cli(IMPORT, hf_dir, back)
    assert rc == 0, err
    assert back.read_bytes() == open(src, "rb").read()
    for bad, needle in (({"qk_head_dim": nope}, "qk_head_dim"), ({"rope_interleave": False}, "rope_interleave")):
        _edit_config(hf_dir, **{"qk_head_dim": nope + rope, "rope_interleave": True, **bad})
        out = tmp_path / "bad.bin"
        rc, _, err = cli(IMPORT, hf_dir, out)
        assert rc == 1 and needle in err and err.count("\n") == 1, err
        assert not out.exists()


def hf_tokenize(tj, text):
    """ids of text through a tokenizer.json, transcribed from Hugging Face tokenizers: the
    normalizers in order (Replace of a string or regex, Prepend, Strip), no pre-tokenizer (the
    text is one word), BPE (each character a symbol, one not in the vocabulary as its UTF-8 byte
    pieces; then the adjacent pair of lowest merge rank, leftmost first, merged until none is
    left), then the post-processor's leading special token."""
    import re
    for n in tj["normalizer"]["normalizers"]:
        if n["type"] == "Replace":
            pat = n["pattern"]
            # Oniguruma's \z (the end of the text) is Python's \Z
            text = (re.sub(pat["Regex"].replace("\\z", "\\Z"), n["content"], text) if "Regex" in pat
                    else text.replace(pat["String"], n["content"]))
        elif n["type"] == "Prepend":
            text = n["prepend"] + text if text else text
        elif n["type"] == "Strip":
            text = text.lstrip() if n["strip_left"] else text
            text = text.rstrip() if n["strip_right"] else text
        else:
            raise AssertionError(n["type"])
    m = tj["model"]
    vocab, rank = m["vocab"], {tuple(pair): r for r, pair in enumerate(m["merges"])}
    syms = []
    for ch in text:
        if ch in vocab:
            syms.append(ch)
        else:
            assert m["byte_fallback"]
            syms += [f"<0x{b:02X}>" for b in ch.encode("utf-8")]
    while True:
        best = min(((rank[p], i) for i, p in enumerate(zip(syms, syms[1:])) if p in rank), default=None)
        if best is None:
            break
        i = best[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    first = tj["post_processor"]["single"][0]["SpecialToken"]["id"]
    return tj["post_processor"]["special_tokens"][first]["ids"] + [vocab[s] for s in syms]


def test_tokenizer_json_is_sentencepiece():
    """The tokenizer.json the export writes (transformers 5 reads it, not tokenizer.model, for
    DeepSeek-V2 directories) gives SentencePiece's ids: stories, runs of spaces at either end
    and inside, tabs and newlines, digits, and characters only byte fallback can spell."""
    tok = open(TOKENIZER, "rb").read()
    sp = export.tokenizer_info(tok)[3]
    tj = json.loads(json.dumps(hf.tokenizer_json(tok, sp)))
    texts = [line for line in open(os.path.join(ROOT, "tests", "fixtures", "tiny.txt"), encoding="utf-8")]
    texts += [PROMPT, "", " ", "   ", "  Once upon  a   time  ", "a\tb\nc\n", "one \n two  \n", "\n\nThe end.\n",
              "Tom had 12345 apples in 2024.", "caf\u00e9 \U0001F642 \u65e5\u672c \u3000 wide",
              "she said, \"Hello!\" and ran-away...", "\u2581 already"]
    for t in texts:
        assert hf_tokenize(tj, t) == [sp.bos_id()] + sp.encode(t), repr(t)
    assert len(tj["model"]["merges"]) > 1000 and tj["model"]["vocab"][sp.id_to_piece(300)] == 300


def test_hf_to_ours_and_back(tmp_path):
    """HF -> ours -> HF gives the same tensors (bf16 bits; an untied head; sharded in, one file out)."""
    d = make_hf_dir(str(tmp_path / "hf"), dict(LLAMA_CONFIG), "BF16", 3, seed=9)
    ours, again = tmp_path / "ours.bin", tmp_path / "again"
    assert cli(IMPORT, d, ours)[0] == 0
    rc, _, err = cli(EXPORT, ours, "--hf", again)
    assert rc == 0, err
    a, b = st.read_dir(d), st.read_dir(str(again))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype == "BF16" and np.array_equal(a[k].data, b[k].data), k
    ca, cb = (json.load(open(os.path.join(x, "config.json"))) for x in (d, str(again)))
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "vocab_size"):
        assert ca[k] == cb[k], k
    rc, _, err = cli(EXPORT, ours, "--hf", again)  # exists: refused, left alone
    assert rc == 1 and "exists" in err and err.count("\n") == 1
    assert st.read_dir(str(again)).keys() == b.keys()


def _edit_config(d, **kw):
    p = os.path.join(d, "config.json")
    cfg = json.load(open(p))
    for k, v in kw.items():
        if v is _DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    json.dump(cfg, open(p, "w"))


_DROP = object()


def _lying_shard(d):
    p = os.path.join(d, "model-00001-of-00002.safetensors")
    raw = bytearray(open(p, "rb").read())
    n = struct.unpack_from("<Q", raw)[0]
    hdr = json.loads(raw[8:8 + n])
    name = next(k for k in hdr if k != "__metadata__")
    hdr[name]["shape"][0] += 1  # the header claims more than its offsets hold
    text = json.dumps(hdr).encode()
    open(p, "wb").write(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def _bias(d):
    p = os.path.join(d, "model-00002-of-00002.safetensors")
    t, meta = st.read_file(p)
    t["model.layers.0.self_attn.q_proj.bias"] = st.Tensor("BF16", np.zeros(64, "<u2"))
    with open(p, "wb") as f:
        st.write_file(f, t, meta)
    idx = os.path.join(d, "model.safetensors.index.json")
    j = json.load(open(idx))
    j["weight_map"]["model.layers.0.self_attn.q_proj.bias"] = "model-00002-of-00002.safetensors"
    json.dump(j, open(idx, "w"))


def _other_tokenizer(d):
    os.remove(os.path.join(d, "tokenizer.model"))
    open(os.path.join(d, "tokenizer.json"), "w").write("{}")


def _small_tokenizer(d):
    import sentencepiece as spm
    text = os.path.join(d, "t.txt")
    open(text, "w").write("\n".join(["once upon a time there was a little girl named lily"] * 50))
    spm.SentencePieceTrainer.train(input=text, model_prefix=os.path.join(d, "tokenizer"), vocab_size=40,
                                   model_type="bpe", byte_fallback=False, minloglevel=2)


BAD_HF = [
    ("unknown-field", lambda d: _edit_config(d, use_magic=True), "unknown field use_magic"),
    ("heads-do-not-divide", lambda d: _edit_config(d, num_key_value_heads=3), "does not divide"),
    ("kv-heads-null-is-mha", lambda d: _edit_config(d, num_key_value_heads=None), "wk has shape (32, 64), the config implies (64, 64)"),
    ("attention-bias", lambda d: _edit_config(d, attention_bias=True), "attention_bias = true"),
    ("mlp-bias", lambda d: _edit_config(d, mlp_bias=True), "mlp_bias = true"),
    ("rope-scaling", lambda d: _edit_config(d, rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
    ("gelu", lambda d: _edit_config(d, hidden_act="gelu"), "hidden_act"),
    ("arch", lambda d: _edit_config(d, architectures=["GPT2LMHeadModel"]), "architectures"),
    ("model-type", lambda d: _edit_config(d, model_type="mistral"), "model_type"),
    ("no-hidden-size", lambda d: _edit_config(d, hidden_size=_DROP), "hidden_size"),
    ("wrong-hidden-size", lambda d: _edit_config(d, hidden_size=80), "shape"),
    ("vocab-not-tokenizer", lambda d: _edit_config(d, vocab_size=4000), "4096 pieces"),
    ("bos-not-tokenizer", lambda d: _edit_config(d, bos_token_id=5), "bos/eos"),
    ("tied-but-head", lambda d: _edit_config(d, tie_word_embeddings=True), "lm_head.weight differs"),
    ("context-too-long", lambda d: _edit_config(d, max_position_embeddings=1 << 20), "--context"),
    ("lying-safetensors", _lying_shard, "needs"),
    ("missing-shard", lambda d: os.remove(os.path.join(d, "model-00002-of-00002.safetensors")), "is missing"),
    ("bias-tensor", _bias, "q_proj.bias"),
    ("tokenizer-json", _other_tokenizer, "SentencePiece"),
    ("small-tokenizer", _small_tokenizer, "40 pieces"),
    ("not-json", lambda d: open(os.path.join(d, "config.json"), "w").write("{"), "not JSON"),
]


@pytest.mark.parametrize("name, damage, needle", BAD_HF, ids=[b[0] for b in BAD_HF])
def test_hf_import_refusals(tmp_path, name, damage, needle):
    """Each bad directory: one line naming the problem, exit 1, nothing written."""
    d = make_hf_dir(str(tmp_path / "hf"), dict(LLAMA_CONFIG), "BF16", 2, seed=1)
    damage(d)
    out = tmp_path / "ours.bin"
    rc, stdout, err = cli(IMPORT, d, out)
    assert rc == 1, (rc, err)
    assert err.startswith("import_model.py: ") and err.count("\n") == 1 and needle in err, err
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_llama2c_export_and_import_round_trip(tmp_path):
    """export.py --llama2c of a model with an untied head (negative vocab, classifier last), then
    import_model.py: the same fp32 tensors and header (our export writes fp32 of the bf16 values)."""
    model = export.random_model("gqa", small=True, seed=8)
    model.cfg.untied_head = True
    model.output = torch.nn.Linear(model.cfg.dim, model.cfg.vocab_size, bias=False)
    export.round_to_bf16_(model)
    mpath, _ = export.export_llama2c(model, str(tmp_path), TOKENIZER, "fp32")
    assert struct.unpack_from("<7i", open(mpath, "rb").read(28))[5] == -4096
    out = tmp_path / "back.bin"
    rc, _, err = cli(IMPORT, mpath, out, "--tokenizer", TOKENIZER)
    assert rc == 0, err
    back = export.read_tensors(str(out))
    for name, t in model.state_dict().items():
        assert np.array_equal(back[name], t.numpy()), name
    assert export.read_header(str(out))["flags"] == 1


def test_window_and_untied_head_out_and_back(tmp_path):
    """A model with a window and an untied head goes out as MistralForCausalLM (sliding_window,
    lm_head.weight) and comes back the same file."""
    model = export.random_model("gqa", small=True, seed=12)
    model.cfg.window, model.cfg.untied_head = 40, True
    model.output = torch.nn.Linear(model.cfg.dim, model.cfg.vocab_size, bias=False)
    src = str(tmp_path / "src.bin")
    export.export(model, src, TOKENIZER, "bf16")
    rc, _, err = cli(EXPORT, src, "--hf", tmp_path / "hf")
    assert rc == 0, err
    cfg = json.load(open(tmp_path / "hf" / "config.json"))
    assert (cfg["architectures"], cfg["sliding_window"], cfg["tie_word_embeddings"]) == (["MistralForCausalLM"], 40,
                                                                                         False)
    assert "lm_head.weight" in st.read_dir(str(tmp_path / "hf"))
    assert cli(IMPORT, tmp_path / "hf", tmp_path / "back.bin")[0] == 0
    assert (tmp_path / "back.bin").read_bytes() == open(src, "rb").read()
