"""The reference model: the same function the C engine computes.

d_model 512, 4 layers, 16 query heads of dim 32, context 256, vocabulary 4096,
tied embedding/head, RMSNorm (eps 1e-5), SwiGLU FFN (hidden 1344), no biases,
interleaved RoPE (theta 10000) as in llama2.c.

Attention variants (names used everywhere):
  mha    16 KV heads          gqa   4 KV heads (query head h reads KV head h/4)
  mqa     1 KV head           mla64 / mla128: DeepSeek-V2 MLA, latent width 64 / 128

Plain PyTorch, one class for the KV-head family (mha/gqa/mqa differ only in the
number of KV heads) and one for MLA.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VARIANTS = {
    # name: (n_kv_heads, kv_latent)
    "mha": (16, 0),
    "gqa": (4, 0),
    "mqa": (1, 0),
    "mla64": (0, 64),
    "mla128": (0, 128),
}


@dataclass
class Config:
    variant: str = "mha"
    dim: int = 512
    n_layers: int = 4
    n_heads: int = 16
    head_dim: int = 32
    n_kv_heads: int = 16       # 0 for MLA
    kv_latent: int = 0         # d_c for MLA, 0 otherwise
    rope_dim: int = 16         # MLA: width of the decoupled RoPE part of q and k
    hidden_dim: int = 1344
    vocab_size: int = 4096
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    untied_head: bool = False  # an output head of its own (imported models), else tied to the embedding
    window: int = 0            # the model's sliding window (imported Mistral models); 0: none

    @property
    def is_mla(self):
        return self.kv_latent > 0

    @staticmethod
    def for_variant(variant, **overrides):
        n_kv, latent = VARIANTS[variant]
        cfg = Config(variant=variant, n_kv_heads=n_kv, kv_latent=latent)
        for k, v in overrides.items():
            setattr(cfg, k, v)
        return cfg


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope_tables(width, max_seq_len, theta):
    """cos, sin: (max_seq_len, width/2); pair i rotates at theta^(-2i/width)."""
    i = torch.arange(0, width, 2, dtype=torch.float64)
    freq = theta ** (-i / width)
    ang = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * freq[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x, cos, sin):
    """x: (..., T, width), rotated on interleaved pairs (x[2i], x[2i+1]); cos/sin: (T, width/2)."""
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(xc * torch.complex(cos, sin)).flatten(-2)


def _cpu_autocast_check():
    """A function telling whether CPU autocast is on: torch.is_autocast_enabled("cpu") where it
    takes a device type (PyTorch 2.4 on; is_autocast_cpu_enabled is deprecated there), else
    torch.is_autocast_cpu_enabled (1.13, whose is_autocast_enabled takes no argument)."""
    try:
        torch.is_autocast_enabled("cpu")
    except TypeError:
        return torch.is_autocast_cpu_enabled
    return lambda: torch.is_autocast_enabled("cpu")


cpu_autocast_enabled = _cpu_autocast_check()


def causal_attention(q, k, v, scale, start_pos, window=0):
    """q: (B, H, Tq, d); k: (B, H, Tk, d); v: (B, H, Tk, dv). Query i sits at position start_pos+i and
    sees the keys up to its own, with a sliding window (Config.window) only the last `window` of them.
    Under autocast (training) the two products run in bf16 and the softmax in fp32; otherwise all fp32."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    dtype = torch.bfloat16 if cpu_autocast_enabled() else torch.float32
    with torch.autocast("cpu", enabled=False):
        scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-2, -1))    # (B, H, Tq, Tk)
        scores.mul_(scale)
        if Tq > 1 or 0 < window < Tk:
            qpos = torch.arange(start_pos, start_pos + Tq, device=scores.device)[:, None]
            kpos = torch.arange(Tk, device=scores.device)[None, :]
            hidden = kpos > qpos
            if window:
                hidden |= kpos <= qpos - window
            scores.masked_fill_(hidden, float("-inf"))
        probs = F.softmax(scores, dim=-1)       # bf16 in and out under autocast, fp32 inside
        return torch.matmul(probs, v.to(dtype))                              # (B, H, Tq, dv)


class KVHeadAttention(nn.Module):
    """MHA, GQA and MQA: n_kv_heads KV heads, query head h reads KV head h // (n_heads/n_kv_heads).
    Cache per layer: k, v of (1, n_kv_heads, T, head_dim); k after RoPE."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, H * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, Hkv * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, Hkv * hd, bias=False)
        self.wo = nn.Linear(H * hd, cfg.dim, bias=False)
        cos, sin = rope_tables(hd, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x, start_pos=0, cache=None):
        cfg = self.cfg
        B, T, _ = x.shape
        H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        cos, sin = self.cos[start_pos:start_pos + T], self.sin[start_pos:start_pos + T]
        q = apply_rope(self.wq(x).view(B, T, H, hd).transpose(1, 2), cos, sin)    # (B, H, T, hd)
        k = apply_rope(self.wk(x).view(B, T, Hkv, hd).transpose(1, 2), cos, sin)  # (B, Hkv, T, hd)
        v = self.wv(x).view(B, T, Hkv, hd).transpose(1, 2)                         # (B, Hkv, T, hd)
        if cache is not None:
            k, v = cache.append(k, v)                                              # (1, Hkv, pos+T, hd)
        if Hkv < H:  # each KV head serves H/Hkv consecutive query heads
            k = k.repeat_interleave(H // Hkv, dim=1)                               # (B, H, Tk, hd)
            v = v.repeat_interleave(H // Hkv, dim=1)
        o = causal_attention(q, k, v, 1.0 / math.sqrt(hd), start_pos, cfg.window)
        return self.wo(o.transpose(1, 2).reshape(B, T, H * hd))


class LatentAttention(nn.Module):
    """MLA after DeepSeek-V2, without query compression.
    q = W_Q x: per head a content part q_C (head_dim) and a RoPE part q_R (rope_dim).
    c = RMSNorm(W_DKV x) (kv_latent); k_R = RoPE(W_KR x) (rope_dim), shared by all heads.
    key_h = [W_UK,h c ; k_R], value_h = W_UV,h c; scores scaled by 1/sqrt(head_dim+rope_dim).
    Cache per layer: c (1, T, d_c) and k_R (1, T, rope_dim)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        H, hd, rd, dc = cfg.n_heads, cfg.head_dim, cfg.rope_dim, cfg.kv_latent
        self.wq = nn.Linear(cfg.dim, H * (hd + rd), bias=False)
        self.wdkv = nn.Linear(cfg.dim, dc, bias=False)
        self.kv_norm = RMSNorm(dc, cfg.norm_eps)
        self.wkr = nn.Linear(cfg.dim, rd, bias=False)
        self.wuk = nn.Linear(dc, H * hd, bias=False)
        self.wuv = nn.Linear(dc, H * hd, bias=False)
        self.wo = nn.Linear(H * hd, cfg.dim, bias=False)
        cos, sin = rope_tables(rd, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.absorb = False  # set by generate(): absorbed form for cached decoding

    def forward(self, x, start_pos=0, cache=None):
        cfg = self.cfg
        B, T, _ = x.shape
        H, hd, rd, dc = cfg.n_heads, cfg.head_dim, cfg.rope_dim, cfg.kv_latent
        cos, sin = self.cos[start_pos:start_pos + T], self.sin[start_pos:start_pos + T]
        q = self.wq(x).view(B, T, H, hd + rd).transpose(1, 2)                # (B, H, T, hd+rd)
        q_c, q_r = q[..., :hd], apply_rope(q[..., hd:], cos, sin)            # (B, H, T, hd), (B, H, T, rd)
        c = self.kv_norm(self.wdkv(x))                                       # (B, T, dc)
        k_r = apply_rope(self.wkr(x), cos, sin)                              # (B, T, rd)
        if cache is not None:
            c, k_r = cache.append(c, k_r)                                    # (1, pos+T, dc), (1, pos+T, rd)
        scale = 1.0 / math.sqrt(hd + rd)
        Tk = c.shape[1]
        if self.absorb:
            # q_lat,h = W_UK,h^T q_C,h; score_j = q_lat,h . c_j + q_R,h . k_R,j; o_h = W_UV,h (sum_j p_j c_j)
            w_uk = self.wuk.weight.view(H, hd, dc)
            w_uv = self.wuv.weight.view(H, hd, dc)
            q_lat = torch.einsum("bhtd,hdc->bhtc", q_c.float(), w_uk.float())   # (B, H, T, dc)
            q_cat = torch.cat([q_lat, q_r], dim=-1)                              # (B, H, T, dc+rd)
            k_cat = torch.cat([c, k_r], dim=-1).float()[:, None]                 # (B, 1, Tk, dc+rd)
            ctx_lat = causal_attention(q_cat, k_cat.expand(B, H, Tk, dc + rd), c.float()[:, None].expand(B, H, Tk, dc),
                                       scale, start_pos, cfg.window)             # (B, H, T, dc)
            o = torch.einsum("bhtc,hdc->bhtd", ctx_lat, w_uv.float())            # (B, H, T, hd)
        else:
            k_c = self.wuk(c).view(B, Tk, H, hd).transpose(1, 2)                 # (B, H, Tk, hd)
            v = self.wuv(c).view(B, Tk, H, hd).transpose(1, 2)                   # (B, H, Tk, hd)
            k = torch.cat([k_c.float(), k_r[:, None].expand(B, H, Tk, rd)], dim=-1)
            q_full = torch.cat([q_c.float(), q_r], dim=-1)
            o = causal_attention(q_full, k, v, scale, start_pos, cfg.window)
        return self.wo(o.transpose(1, 2).reshape(B, T, H * hd))


class KVCache:
    """Per-layer cache: two growing tensors along the time axis (k/v, or c/k_R for MLA)."""

    def __init__(self):
        self.a = None
        self.b = None

    def append(self, a, b):
        self.a = a if self.a is None else torch.cat([self.a, a], dim=-2)
        self.b = b if self.b is None else torch.cat([self.b, b], dim=-2)
        return self.a, self.b

    def nbytes(self):
        return 0 if self.a is None else self.a.numel() * 4 + self.b.numel() * 4


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def forward(self, h):
        return self.w2(F.silu(self.w1(h)) * self.w3(h))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = LatentAttention(cfg) if cfg.is_mla else KVHeadAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = FeedForward(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, start_pos=0, cache=None):
        x = x + self.dropout(self.attn(self.attn_norm(x), start_pos, cache))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.untied_head:
            self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # residual projections, as in GPT-2 / llama2.c
            if name.endswith("wo.weight") or name.endswith("w2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def head(self, x):
        """The output head: tied to the embedding, or the model's own (cfg.untied_head)."""
        return F.linear(x, (self.output if self.cfg.untied_head else self.tok_embeddings).weight)

    def set_absorb(self, absorb):
        for layer in self.layers:
            if isinstance(layer.attn, LatentAttention):
                layer.attn.absorb = absorb

    def forward(self, tokens, targets=None, start_pos=0, caches=None, last_only=False):
        """tokens: (B, T) -> logits (B, T, vocab) in fp32 (B, 1, vocab with last_only, as generation
        needs); the loss too if targets is given (-1 is ignored)."""
        x = self.dropout(self.tok_embeddings(tokens))                       # (B, T, dim)
        for i, layer in enumerate(self.layers):
            x = layer(x, start_pos, None if caches is None else caches[i])
        x = self.norm(x[:, -1:] if last_only else x)
        logits = self.head(x)                                                # (B, T, vocab)
        if targets is None:
            return logits.float()
        # Under autocast the logits stay bf16 here: casting 16.7M of them to fp32 and back cost
        # ~15% of a training step (measured). Validation scores fp32 logits (targets=None).
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, prompt, steps, kv_cache=True, top_k=1, temperature=1.0, eos_id=None,
                 absorb=None, generator=None, return_logits=False):
        """Generates after a list of prompt ids. The prompt is one prefill; then one token per step,
        either from the cache (kv_cache=True) or by recomputing the whole sequence. MLA uses the
        absorbed form with the cache and the expanded form without, unless `absorb` says otherwise.
        Returns the new token ids (and the logits of every step if asked)."""
        self.eval()
        self.set_absorb(kv_cache if absorb is None else absorb)
        tokens = list(prompt)
        caches = [KVCache() for _ in self.layers] if kv_cache else None
        out, all_logits = [], []
        pending = tokens
        for _ in range(steps):
            if len(tokens) > self.cfg.max_seq_len:
                break
            if kv_cache:
                start = len(tokens) - len(pending)
                logits = self(torch.tensor([pending]), start_pos=start, caches=caches, last_only=True)[0, -1]
            else:
                logits = self(torch.tensor([tokens]), last_only=True)[0, -1]
            all_logits.append(logits)
            nxt = sample(logits, top_k, temperature, generator)
            out.append(nxt)
            if eos_id is not None and nxt == eos_id:
                break
            tokens.append(nxt)
            pending = [nxt]
            if len(tokens) >= self.cfg.max_seq_len:
                break
        self.set_absorb(False)
        return (out, all_logits) if return_logits else out


def onednn_copy(model):
    """A copy of model for fp32 inference whose nn.Linear layers run through oneDNN: Debian's
    PyTorch 1.13 is built with a generic BLAS, so plain fp32 products are slow (~100x), while
    oneDNN's fp32 inner product is fast and gives the same values to rounding. MLA's W_UK and
    W_UV stay nn.Linear: the absorbed form reads their weights directly.
    Returns (model, names of the converted layers)."""
    import copy

    class OneDNNLinear(nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.register_buffer("weight", lin.weight.detach().to_mkldnn())
            self.register_buffer("bias", torch.zeros(lin.weight.shape[0]).to_mkldnn())

        def forward(self, x):
            return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), self.weight, self.bias).to_dense()

    m = copy.deepcopy(model)
    converted = []
    for name, mod in list(m.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear) and not (isinstance(mod, LatentAttention) and child_name in ("wuk", "wuv")):
                setattr(mod, child_name, OneDNNLinear(child))
                converted.append(f"{name}.{child_name}" if name else child_name)
    # the head (tied, or its own): shadows the method
    object.__setattr__(m, "head", OneDNNLinear(m.output if m.cfg.untied_head else m.tok_embeddings))
    converted.append("head")
    return m, converted


def sample(logits, top_k, temperature, generator=None):
    if top_k == 1 or temperature == 0:
        return int(torch.argmax(logits))
    v, idx = torch.topk(logits.float() / temperature, top_k)
    p = F.softmax(v, dim=-1)
    return int(idx[torch.multinomial(p, 1, generator=generator)])


def story_windows(story, ctx):
    """How a story (a list of ids, BOS ... EOS) is scored within the context: consecutive
    non-overlapping windows, each predicting up to ctx targets. Yields (inputs, targets).
    The C engine's --ppl uses the same windows."""
    for start in range(0, len(story) - 1, ctx):
        chunk = story[start:start + ctx + 1]
        yield chunk[:-1], chunk[1:]
