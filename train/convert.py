"""Converts an MHA checkpoint into GQA, MQA or MLA without training (issue 39), writing an
engine checkpoint that ./run reads and train.py --init uptrains:

    python3 train/convert.py weights/mha.bin gqa out/convert/gqa.bin
    python3 train/convert.py weights/mha.bin mla64 out/convert/mla64.bin

GQA / MQA (Ainslie et al., 2023): the key and value projections of each group of
n_heads/n_kv_heads consecutive heads are mean-pooled. RoPE is linear and the same for every
head, so pooling before it equals pooling the rotated keys.

MLA: MHA rotates all head_dim/2 pairs of a head; MLA rotates rope_dim/2 pairs of a key shared by
the heads, at frequencies theta^(-2i/rope_dim), which are exactly MHA's even pairs 0, 2, 4, ...
So each head's even pairs go to the RoPE part: q_R,h takes the query's even pairs, and the shared
key k_R the mean over heads of the key's even pairs (MLA has one k_R for all heads). The odd pairs
lose their rotation and become the content part: q_C,h = the query's odd pairs (the other
head_dim - head_dim/2 content dims are zero), k_C,h the key's odd pairs, through the latent.
The latent is a truncated SVD of the stacked projections [W_K,odd; W_V] = U S V^T:
W_DKV = V_r^T (d_c x dim), [W_UK; W_UV] = U_r S_r. MLA normalises the latent (RMSNorm) before the
up-projections, which a linear map cannot undo; the norm's gain is set to the mean rms of the
latent over a sample of training text, so that keys and values keep their typical scale.
The query is scaled by sqrt((head_dim + rope_dim) / head_dim) to undo MLA's wider softmax scale.
"""
import argparse
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export  # noqa: E402
from model import VARIANTS, Config, Transformer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pool_kv(w, n_heads, n_kv, head_dim):
    """w: (n_heads*head_dim, dim) -> (n_kv*head_dim, dim), the mean of each group's heads."""
    g = n_heads // n_kv
    return w.view(n_kv, g, head_dim, -1).mean(dim=1).reshape(n_kv * head_dim, -1)


def to_kv_heads(parent, variant, n_kv_heads=None):
    """A GQA/MQA Transformer from an MHA one by mean-pooling each group's keys and values
    (n_kv_heads: the variant's, 4 or 1, unless given)."""
    pc = parent.cfg
    n_kv = n_kv_heads or VARIANTS[variant][0]
    if pc.n_heads % n_kv or n_kv >= pc.n_heads or (variant == "mqa") != (n_kv == 1):
        raise ValueError(f"{pc.n_heads} heads cannot be pooled into {n_kv} KV heads of {variant}")
    cfg = Config(**{**pc.__dict__, "variant": variant, "n_kv_heads": n_kv})
    model = Transformer(cfg)
    sd = parent.state_dict()
    for i in range(cfg.n_layers):
        for w in ("wk", "wv"):
            name = f"layers.{i}.attn.{w}.weight"
            sd[name] = pool_kv(sd[name], pc.n_heads, cfg.n_kv_heads, pc.head_dim)
    model.load_state_dict(sd)
    return model.eval()


def factorise(w, rank):
    """w: (rows, dim) -> (down (rank, dim), up (rows, rank)) with up @ down the best rank-`rank`
    approximation of w (truncated SVD, in fp64)."""
    u, s, vt = torch.linalg.svd(w.double(), full_matrices=False)
    return vt[:rank].float(), (u[:, :rank] * s[:rank]).float()


def latent_rms(parent, layer_downs, data, n_tokens=8192, seed=0):
    """The mean rms over n_tokens training tokens of each layer's latent down @ attn_norm(x)."""
    tokens = np.memmap(os.path.join(data, "train.bin"), dtype=np.uint16, mode="r")
    rng = np.random.default_rng(seed)
    T = parent.cfg.max_seq_len
    ix = rng.integers(0, len(tokens) - T, max(1, n_tokens // T))
    batch = torch.from_numpy(np.stack([tokens[i:i + T] for i in ix]).astype(np.int64))
    rms = []
    with torch.no_grad():
        x = parent.tok_embeddings(batch)
        for layer, down in zip(parent.layers, layer_downs):
            c = layer.attn_norm(x) @ down.T                                   # (B, T, d_c)
            rms.append(float(c.pow(2).mean(-1).sqrt().mean()))
            x = layer(x)
    return rms


def to_mla(parent, variant, data=None, kv_latent=None):
    """An MLA Transformer from an MHA one (module docstring: even RoPE pairs, SVD latent)."""
    pc = parent.cfg
    H, hd, D = pc.n_heads, pc.head_dim, pc.dim
    dc = kv_latent or VARIANTS[variant][1]
    rd = hd // 2                       # the even pairs of a head
    cfg = Config(**{**pc.__dict__, "variant": variant, "n_kv_heads": 0, "kv_latent": dc, "rope_dim": rd})
    model = Transformer(cfg)
    sd = {k: v for k, v in parent.state_dict().items() if ".attn." not in k}
    pairs = torch.arange(hd).view(hd // 2, 2)
    even, odd = pairs[0::2].reshape(-1), pairs[1::2].reshape(-1)   # dims of the even / odd pairs, (hd/2,)
    q_scale = math.sqrt((hd + rd) / hd)
    downs, ups = [], []
    for i, layer in enumerate(parent.layers):
        a = layer.attn
        wq = a.wq.weight.detach().view(H, hd, D)
        wk = a.wk.weight.detach().view(H, hd, D)
        wv = a.wv.weight.detach().view(H, hd, D)
        q = torch.zeros(H, hd + rd, D)
        q[:, :hd - rd] = wq[:, odd]                                    # content: odd pairs, unrotated
        q[:, hd:] = wq[:, even]                                        # RoPE part: even pairs
        sd[f"layers.{i}.attn.wq.weight"] = (q * q_scale).reshape(H * (hd + rd), D)
        sd[f"layers.{i}.attn.wkr.weight"] = wk[:, even].mean(dim=0)    # (rd, D), shared by the heads
        kc = torch.zeros(H, hd, D)
        kc[:, :hd - rd] = wk[:, odd]
        stacked = torch.cat([kc.reshape(H * hd, D), wv.reshape(H * hd, D)])   # (2*H*hd, D)
        down, up = factorise(stacked, dc)
        downs.append(down)
        ups.append(up)
        sd[f"layers.{i}.attn.wo.weight"] = a.wo.weight.detach()
    gains = latent_rms(parent, downs, data) if data else [1.0] * pc.n_layers
    for i, (down, up, g) in enumerate(zip(downs, ups, gains)):
        sd[f"layers.{i}.attn.wdkv.weight"] = down
        sd[f"layers.{i}.attn.kv_norm.weight"] = torch.full((dc,), g)
        sd[f"layers.{i}.attn.wuk.weight"] = up[:H * hd]
        sd[f"layers.{i}.attn.wuv.weight"] = up[H * hd:]
    model.load_state_dict(sd)
    return model.eval()


def convert(parent, variant, data=None, n_kv_heads=None, kv_latent=None):
    if parent.cfg.variant != "mha" or parent.cfg.n_kv_heads != parent.cfg.n_heads:
        raise ValueError(f"the parent must be an MHA model, not {parent.cfg.variant}")
    if variant in ("gqa", "mqa"):
        return to_kv_heads(parent, variant, n_kv_heads)
    if variant.startswith("mla"):
        return to_mla(parent, variant, data, kv_latent)
    raise ValueError(f"cannot convert MHA into {variant}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parent", help="the MHA engine checkpoint (.bin) or train.py checkpoint (.pt)")
    ap.add_argument("variant", choices=["gqa", "mqa", "mla64", "mla128"])
    ap.add_argument("out", help="the engine checkpoint to write (.bin)")
    ap.add_argument("--data", default=os.path.join(ROOT, "data"), help="folder with train.bin (MLA's latent gain)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    args = ap.parse_args(argv)
    try:
        export.check_outputs([args.out], [args.parent])
        parent, tok, _ = export.load_input(args.parent)
        model = convert(parent, args.variant, args.data if args.variant.startswith("mla") else None)
        export.export(model, args.out, tok if tok is not None else export.DEFAULT_TOKENIZER, args.dtype)
    except (OSError, ValueError) as e:
        sys.exit(f"convert.py: {e}")
    print(f"{args.out}: {args.variant} from {args.parent}")


if __name__ == "__main__":
    main()
