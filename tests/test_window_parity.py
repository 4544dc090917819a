"""Logits past a full window, C engine against a windowed reference written here.

With `--kv --window W` the cache keeps W positions (kvcache.h): a query at position p sees
all of 0..p while p < W; after that, with the ring policy, the most recent W, and with the
sinks policy the first 4 (CLI_WINDOW_SINKS) and the most recent W - 4, oldest first. The
keys are stored before RoPE and turned by their place i in that list (0..W-1), and the
query by its own place (the list's length - 1), not by absolute positions. A position's
keys and values are what its token computed when it came, through its own window, so the
whole sequence can be computed layer by layer with each query attending only to its
window. This file computes that, in float64, from train/model.py's weights and nothing of
the engine; ./run generates greedily past the window with --dump-logits, and every step
must agree to max|d| <= 1e-4 * max(1, max|logit|) (test_parity.py's tolerance), with the
same greedy tokens.

Turning keys by their absolute positions (as without a window) instead of their places
changes every score past the window under either policy (the query is at its place);
with sinks even a query turned by its absolute position too gives the sinks the wrong
distances. A self-check shows that past the window the plain, unwindowed model's logits
are outside that tolerance, so agreeing here means the window was applied."""
import glob
import math
import os

import numpy as np
import pytest
import torch

from conftest import PROMPT, ROOT, TOKENIZER, read_logits, run

SINKS = 4          # serve/cli.h's CLI_WINDOW_SINKS, what --window-policy sinks keeps
WINDOW = 32
STEPS = 100        # 5 prompt positions + 100: far past the window, within RoPE's table (256)


def window_of(p, window, sinks):
    """The positions a query at p attends to, oldest first (place i is the list's i-th)."""
    if window is None or p < window:
        return list(range(p + 1))
    return list(range(sinks)) + list(range(p + 1 - (window - sinks), p + 1))


def rotate(x, places, theta):
    """x (..., n, width) turned on interleaved pairs (x[2j], x[2j+1]) by angle place * theta^(-2j/width),
    the place of row k being places[k]."""
    width = x.shape[-1]
    freq = theta ** (-torch.arange(0, width, 2, dtype=torch.float64) / width)
    ang = torch.as_tensor(places, dtype=torch.float64)[:, None] * freq[None, :]   # (n, width/2)
    cos, sin = torch.cos(ang), torch.sin(ang)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def rmsnorm(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def weight(linear):
    return linear.weight.detach().double()


def windowed_attention(attn, cfg, xn, window, sinks):
    """One layer's attention output (T, dim) for input xn (T, dim), every query through its window."""
    T, H, hd = xn.shape[0], cfg.n_heads, cfg.head_dim
    heads = torch.empty(T, H, hd, dtype=torch.float64)
    if cfg.is_mla:
        rd, dc = cfg.rope_dim, cfg.kv_latent
        q = (xn @ weight(attn.wq).T).view(T, H, hd + rd)
        latent = rmsnorm(xn @ weight(attn.wdkv).T, attn.kv_norm.weight.detach().double(), cfg.norm_eps)   # (T, dc)
        k_rope = xn @ weight(attn.wkr).T                                                                    # (T, rd)
        k_content = (latent @ weight(attn.wuk).T).view(T, H, hd)
        values = (latent @ weight(attn.wuv).T).view(T, H, hd)
        scale = 1.0 / math.sqrt(hd + rd)
        for p in range(T):
            seen = window_of(p, window, sinks)
            places = list(range(len(seen)))
            q_rope = rotate(q[p, :, hd:][None], [len(seen) - 1], cfg.rope_theta)[0]   # (H, rd)
            k_r = rotate(k_rope[seen], places, cfg.rope_theta)                        # (n, rd), shared by the heads
            scores = (torch.einsum("hd,nhd->hn", q[p, :, :hd], k_content[seen]) + q_rope @ k_r.T) * scale
            heads[p] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), values[seen])
    else:
        Hkv = cfg.n_kv_heads
        q = (xn @ weight(attn.wq).T).view(T, H, hd)
        k = (xn @ weight(attn.wk).T).view(T, Hkv, hd)
        v = (xn @ weight(attn.wv).T).view(T, Hkv, hd)
        group = H // Hkv   # query head h reads KV head h // group
        for p in range(T):
            seen = window_of(p, window, sinks)
            q_p = rotate(q[p][:, None], [len(seen) - 1], cfg.rope_theta)[:, 0]             # (H, hd)
            keys = rotate(k[seen].transpose(0, 1), list(range(len(seen))), cfg.rope_theta)   # (Hkv, n, hd)
            keys = keys.repeat_interleave(group, dim=0)                                      # (H, n, hd)
            vals = v[seen].transpose(0, 1).repeat_interleave(group, dim=0)
            probs = torch.softmax(torch.einsum("hd,hnd->hn", q_p, keys) / math.sqrt(hd), dim=-1)
            heads[p] = torch.einsum("hn,hnd->hd", probs, vals)
    return heads.reshape(T, H * hd) @ weight(attn.wo).T


def reference_logits(model, tokens, window, sinks):
    """(T, vocab) float64 logits of every position of tokens, each attending through its window
    (window None: all earlier positions)."""
    cfg = model.cfg
    emb = model.tok_embeddings.weight.detach().double()
    x = emb[torch.tensor(tokens)]
    with torch.no_grad():
        for layer in model.layers:
            xn = rmsnorm(x, layer.attn_norm.weight.detach().double(), cfg.norm_eps)
            x = x + windowed_attention(layer.attn, cfg, xn, window, sinks)
            h = rmsnorm(x, layer.ffn_norm.weight.detach().double(), cfg.norm_eps)
            ffn = layer.ffn
            x = x + (torch.nn.functional.silu(h @ weight(ffn.w1).T) * (h @ weight(ffn.w3).T)) @ weight(ffn.w2).T
        x = rmsnorm(x, model.norm.weight.detach().double(), cfg.norm_eps)
    return (x @ emb.T).numpy()


def prompt_tokens(text):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=TOKENIZER)
    return [sp.bos_id()] + sp.encode(text)


def c_windowed_logits(path, text, window, policy, steps, tmp_path, vocab):
    out = tmp_path / f"{policy}.bin"
    run([path, "-p", text, "-k", 1, "-n", steps, "--ignore-eos", "-q", "--kv", "--window", window,
         "--window-policy", policy, "--dump-logits", out])
    return read_logits(out, vocab)


def check_window_parity(path, model, policy, tmp_path, text=PROMPT, window=WINDOW, steps=STEPS):
    model.eval()
    cfg = model.cfg
    sinks = SINKS if policy == "sinks" else 0
    prompt = prompt_tokens(text)
    last = len(prompt) - 1 + steps - 1   # the last step's position
    assert last < cfg.max_seq_len and window <= last
    c_logits = c_windowed_logits(path, text, window, policy, steps, tmp_path, cfg.vocab_size)
    assert c_logits.shape == (steps, cfg.vocab_size)
    c_tokens = [int(t) for t in c_logits.argmax(axis=1)]
    tokens = prompt + c_tokens[:-1]
    ref = reference_logits(model, tokens, window, sinks)[len(prompt) - 1:]          # (steps, vocab)
    plain = reference_logits(model, tokens, None, 0)[len(prompt) - 1:]
    past_window = 0
    for s in range(steps):
        tol = 1e-4 * max(1.0, float(np.abs(ref[s]).max()))
        diff = float(np.abs(ref[s] - c_logits[s]).max())
        assert diff <= tol, f"{path} {policy} step {s} (position {len(prompt) - 1 + s}): max|d| {diff:.3g} > {tol:.3g}"
        past_window += float(np.abs(plain[s] - c_logits[s]).max()) > tol
        if len(prompt) - 1 + s < window:   # until the window is full it is the plain model
            assert float(np.abs(plain[s] - ref[s]).max()) <= tol
    assert list(ref.argmax(axis=1)) == c_tokens, f"{path} {policy}: greedy tokens differ"
    # the self-check: at every position past the window the plain model's logits are not the engine's
    assert past_window == min(steps, last + 1 - window), (path, policy, past_window)


TRAINED = {os.path.basename(p)[:-4]: p for p in glob.glob(os.path.join(ROOT, "weights", "*.bin"))}
CASES = [(v, policy) for v in ("gqa", "mla64") for policy in ("ring", "sinks")]


@pytest.mark.parametrize("variant,policy", CASES, ids=[f"{v}-{p}" for v, p in CASES])
def test_window_parity_trained(variant, policy, tmp_path):
    assert variant in TRAINED, f"weights/{variant}.bin is not here"
    import export
    check_window_parity(TRAINED[variant], export.load_engine_checkpoint(TRAINED[variant]), policy, tmp_path)


LONG_PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun "
               "with her big red ball.")


@pytest.mark.parametrize("variant", ["gqa", "mla64"])
def test_window_parity_prompt_longer_than_the_window(variant, tmp_path):
    """A prompt of about 30 tokens through a sinks window of 8: the engine computes it in pieces
    the window can take (then one token a pass), and every step still matches."""
    assert variant in TRAINED, f"weights/{variant}.bin is not here"
    import export
    assert len(prompt_tokens(LONG_PROMPT)) > 3 * 8
    check_window_parity(TRAINED[variant], export.load_engine_checkpoint(TRAINED[variant]), "sinks", tmp_path,
                        text=LONG_PROMPT, window=8, steps=30)


def test_window_of_follows_the_cache():
    """The reference's windows are kvcache.h's (test_kvcache's test_window_slots_and_positions)."""
    assert window_of(5, 8, 0) == list(range(6))
    assert window_of(20, 8, 0) == list(range(13, 21))
    assert window_of(20, 8, 3) == [0, 1, 2, 16, 17, 18, 19, 20]


def test_rotate_is_relative():
    """RoPE on interleaved pairs: a query at place a and a key at place b score as at a - b and 0."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 16, generator=g, dtype=torch.float64), torch.randn(1, 16, generator=g, dtype=torch.float64)
    a = float((rotate(q, [9], 10000.0) * rotate(k, [4], 10000.0)).sum())
    b = float((rotate(q, [5], 10000.0) * rotate(k, [0], 10000.0)).sum())
    assert a == pytest.approx(b, abs=1e-12)
    x = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(rotate(x, [1], 10000.0), torch.tensor([[math.cos(1.0), math.sin(1.0)]], dtype=torch.float64))
