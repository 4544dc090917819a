"""train/convert.py (issue 39): MHA into GQA, MQA (mean-pooled KV heads) and MLA (SVD latent)."""
import os
import sys

import pytest
import torch

from conftest import ROOT, TOKENIZER
from test_parity import check_parity

sys.path.insert(0, os.path.join(ROOT, "train"))
import convert  # noqa: E402
import export  # noqa: E402


SMALL = {"gqa": dict(n_kv_heads=2), "mqa": dict(n_kv_heads=1), "mla64": dict(kv_latent=16),
         "mla128": dict(kv_latent=32)}   # export.small_config's shapes


def small_mha(seed=7):
    return export.random_model("mha", small=True, seed=seed)


@pytest.mark.parametrize("variant", ["gqa", "mqa"])
def test_pooling_identical_heads_keeps_the_function(variant):
    """A group of identical key and value heads pools to that head: the same logits to rounding
    (the mean of g equal floats may differ from them in the last bit)."""
    parent = small_mha()
    cfg = parent.cfg
    g = cfg.n_heads // SMALL[variant]["n_kv_heads"]
    with torch.no_grad():
        for layer in parent.layers:
            for w in (layer.attn.wk.weight, layer.attn.wv.weight):
                heads = w.view(cfg.n_heads // g, g, cfg.head_dim, cfg.dim)
                heads.copy_(heads[:, :1].expand_as(heads))   # every head of a group = its first
    child = convert.convert(parent, variant, **SMALL[variant])
    assert g > 1 and child.cfg.n_kv_heads == cfg.n_heads // g
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = parent(tokens), child(tokens)
    assert torch.allclose(a, b, rtol=0, atol=1e-5 * float(a.abs().max())), float((a - b).abs().max())


def test_pooling_is_the_group_mean():
    parent = small_mha()
    child = convert.convert(parent, "gqa", n_kv_heads=2)
    w, c = parent.layers[0].attn.wk.weight, child.layers[0].attn.wk.weight     # (4*16, 64), (2*16, 64)
    hd = parent.cfg.head_dim
    assert torch.allclose(c[hd:2 * hd], (w[2 * hd:3 * hd] + w[3 * hd:4 * hd]) / 2, atol=1e-7)


def test_full_rank_factorisation_reproduces_keys_and_values():
    """At full rank (latent = dim) W_UK W_DKV and W_UV W_DKV are the MHA layer's key (content
    part) and value projections to rounding, so its keys and values before the latent's RMSNorm."""
    parent = small_mha()
    cfg = parent.cfg
    child = convert.to_mla(parent, "mla64", kv_latent=cfg.dim)
    assert child.cfg.kv_latent == cfg.dim               # full rank for the small model
    H, hd = cfg.n_heads, cfg.head_dim
    odd = torch.arange(hd).view(hd // 2, 2)[1::2].reshape(-1)
    x = torch.randn(5, cfg.dim, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for p, c in zip(parent.layers, child.layers):
            lat = c.attn.wdkv(x)                                    # (5, d_c)
            k = c.attn.wuk(lat).view(5, H, hd)[..., :hd // 2]       # content dims of each head
            v = c.attn.wuv(lat).view(5, H, hd)
            k_ref = p.attn.wk(x).view(5, H, hd)[..., odd]
            v_ref = p.attn.wv(x).view(5, H, hd)
            assert torch.allclose(k, k_ref, atol=1e-5), float((k - k_ref).abs().max())
            assert torch.allclose(v, v_ref, atol=1e-5), float((v - v_ref).abs().max())
            assert float(c.attn.wuk(lat).view(5, H, hd)[..., hd // 2:].abs().max()) < 1e-5


def test_rope_part_is_the_even_pairs():
    """MLA's RoPE part rotates at MHA's even-pair frequencies: the query's RoPE part is its even
    pairs (scaled for MLA's softmax scale), the shared key the mean of the heads' even pairs."""
    parent = small_mha()
    cfg = parent.cfg
    child = convert.to_mla(parent, "mla128", kv_latent=32)
    H, hd, D = cfg.n_heads, cfg.head_dim, cfg.dim
    rd = child.cfg.rope_dim
    even = torch.arange(hd).view(hd // 2, 2)[0::2].reshape(-1)
    wq = parent.layers[1].attn.wq.weight.view(H, hd, D)
    wk = parent.layers[1].attn.wk.weight.view(H, hd, D)
    q = child.layers[1].attn.wq.weight.view(H, hd + rd, D)
    scale = ((hd + rd) / hd) ** 0.5
    assert torch.allclose(q[:, hd:], wq[:, even] * scale, atol=1e-6)
    assert torch.allclose(child.layers[1].attn.wkr.weight, wk[:, even].mean(0), atol=1e-6)


def test_refuses_a_parent_that_is_not_mha():
    with pytest.raises(ValueError, match="MHA"):
        convert.convert(export.random_model("gqa", small=True), "mqa")


@pytest.mark.parametrize("variant", ["gqa", "mqa", "mla64", "mla128"])
def test_converted_checkpoint_parity(variant, tmp_path):
    """A converted checkpoint runs in the C engine as the PyTorch reference computes it."""
    child = convert.convert(small_mha(), variant, **SMALL[variant])
    export.round_to_bf16_(child)
    path = str(tmp_path / f"{variant}.bin")
    export.export(child, path, TOKENIZER, dtype="bf16")
    check_parity(path, export.load_engine_checkpoint(path), tmp_path)


def test_cli_refusals_are_one_line(tmp_path):
    """convert.py onto its own parent, or of a parent holding a NaN: one line, the parent as it
    was, nothing written (the first replaced the parent; the second was a traceback)."""
    parent = tmp_path / "mha.bin"
    export.export(small_mha(), str(parent), TOKENIZER, dtype="bf16")
    before = parent.read_bytes()
    with pytest.raises(SystemExit) as e:
        convert.main([str(parent), "mqa", str(parent)])
    assert e.value.code == f"convert.py: cannot write {parent}: it is the input {parent}"
    assert parent.read_bytes() == before
    broken = small_mha()
    with torch.no_grad():
        broken.tok_embeddings.weight[0, 0] = float("nan")
    torch.save({"model": broken.state_dict(), "config": broken.cfg.__dict__, "step": 1, "tokens": 1,
                "elapsed": 0.0, "best_val": 9.9, "kind": "best"}, tmp_path / "nan.pt")
    with pytest.raises(SystemExit) as e:
        convert.main([str(tmp_path / "nan.pt"), "mqa", str(tmp_path / "out.bin")])
    assert e.value.code == "convert.py: tok_embeddings.weight holds NaN or inf"
    assert sorted(os.listdir(tmp_path)) == ["mha.bin", "nan.pt"]
