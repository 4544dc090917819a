"""Converts a model from elsewhere into the engine's checkpoint format, so that ./run runs it
(docs/MODELS_IN_OUT.md):

    python3 train/import_model.py MODEL.bin OUT.bin --tokenizer tokenizer.model   # llama2.c
    python3 train/import_model.py HF_DIR OUT.bin [--context N]                    # Hugging Face

llama2.c: the legacy format its run.c reads (seven int32 dim, hidden_dim, n_layers, n_heads,
n_kv_heads, vocab_size, seq_len; a negative vocab_size means an untied classifier, stored
last; fp32 tensors grouped by kind across layers, with RoPE tables this importer skips) and
its version-1 format (magic "ak42", a 256-byte header, shared-classifier byte). Its run.c
fixes RoPE theta 10000 and RMSNorm eps 1e-5 and heads dim / n_heads wide, and rotates
interleaved pairs as the engine does: the tensors go over unchanged. llama2.c's own
tokenizer.bin is not a SentencePiece model; give the tokenizer.model it was made from.

Hugging Face: train/hf.py (LlamaForCausalLM, MistralForCausalLM, DeepseekV2ForCausalLM).

--dtype: fp32 or bf16 (default: bf16 for an all-bf16 Hugging Face model, else fp32). The
output is written to OUT.bin.tmp and renamed; on a refusal nothing is written and the reason
is one line, exit 1.
"""
import argparse
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export  # noqa: E402
import hf  # noqa: E402
from model import Config  # noqa: E402

LLAMA2C_MAGIC = 0x616B3432  # "ak42"
V1_HEADER = 256


def _llama2c_config(dim, hidden, L, H, Hkv, vocab, seq, path):
    if min(dim, hidden, L, H, Hkv, seq) <= 0 or vocab == 0:
        raise ValueError(f"{path}: not a llama2.c checkpoint (header {dim}, {hidden}, {L}, {H}, {Hkv}, {vocab}, "
                         f"{seq})")
    if max(dim, hidden, H, Hkv, abs(vocab)) > 65536 or L > 256 or seq > 1 << 20:
        raise ValueError(f"{path}: absurd llama2.c header ({dim}, {hidden}, {L}, {H}, {Hkv}, {vocab}, {seq})")
    if dim % H or H % Hkv or (dim // H) % 2:
        raise ValueError(f"{path}: n_heads {H} must divide dim {dim} into an even head width, and n_kv_heads "
                         f"{Hkv} divide n_heads")
    variant = "mha" if Hkv == H else "mqa" if Hkv == 1 else "gqa"
    return Config(variant=variant, dim=dim, n_layers=L, n_heads=H, head_dim=dim // H, n_kv_heads=Hkv,
                  kv_latent=0, rope_dim=0, hidden_dim=hidden, vocab_size=abs(vocab), max_seq_len=seq,
                  rope_theta=10000.0, norm_eps=1e-5)


def read_llama2c(path):
    """(Config, [(our name, fp32 array)] in our file order) of a llama2.c checkpoint, legacy or version 1."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(V1_HEADER)
    if len(head) < 28:
        raise ValueError(f"{path}: {size} bytes, too short for a llama2.c checkpoint")
    if struct.unpack_from("<I", head)[0] == LLAMA2C_MAGIC:
        version = struct.unpack_from("<i", head, 4)[0]
        if version != 1:
            raise ValueError(f"{path}: llama2.c format version {version}; only version 1 (fp32) and the legacy "
                             "format are read (version 2 is int8)")
        if len(head) < V1_HEADER:
            raise ValueError(f"{path}: shorter than llama2.c's 256-byte version-1 header")
        dims = struct.unpack_from("<7i", head, 8)
        shared = head[36]
        if shared not in (0, 1) or any(head[37:V1_HEADER]):
            raise ValueError(f"{path}: llama2.c version-1 header with a bad shared-classifier byte or padding")
        cfg = _llama2c_config(*dims, path)
        cfg.untied_head = not shared
        if dims[5] < 0:
            raise ValueError(f"{path}: a negative vocab_size in a version-1 header")
        legacy, offset = False, V1_HEADER
    else:
        dims = struct.unpack_from("<7i", head)
        cfg = _llama2c_config(*dims, path)
        cfg.untied_head = dims[5] < 0
        legacy, offset = True, 28
    D, F, L, H, V = cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.vocab_size
    kv = cfg.n_kv_heads * cfg.head_dim
    per_layer = {"attn_norm": (D,), "attn.wq": (D, D), "attn.wk": (kv, D), "attn.wv": (kv, D), "attn.wo": (D, D),
                 "ffn_norm": (D,), "ffn.w1": (F, D), "ffn.w2": (D, F), "ffn.w3": (F, D)}
    if legacy:
        order = [("tok_embeddings.weight", (V, D))]
        for k in per_layer:
            order += [(f"layers.{i}.{k}.weight", per_layer[k]) for i in range(L)]
        order += [("norm.weight", (D,)), (None, (cfg.max_seq_len, cfg.head_dim // 2)),
                  (None, (cfg.max_seq_len, cfg.head_dim // 2))]
    else:
        order = [(f"layers.{i}.attn_norm.weight", (D,)) for i in range(L)]
        order += [(f"layers.{i}.ffn_norm.weight", (D,)) for i in range(L)]
        order += [("norm.weight", (D,)), ("tok_embeddings.weight", (V, D))]
        for k in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn.w1", "ffn.w2", "ffn.w3"):
            order += [(f"layers.{i}.{k}.weight", per_layer[k]) for i in range(L)]
    if cfg.untied_head:
        order.append(("output.weight", (V, D)))
    n = sum(int(np.prod(s)) for _, s in order)
    if size != offset + 4 * n:
        raise ValueError(f"{path}: {size:,} bytes, but a llama2.c {'legacy' if legacy else 'version-1'} file of "
                         f"this header has {offset + 4 * n:,} (truncated, or another format?)")
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    got = {}
    for name, shape in order:
        cnt = int(np.prod(shape))
        if name:
            got[name] = np.frombuffer(raw, dtype="<f4", count=cnt, offset=offset).reshape(shape).astype(np.float32)
        offset += 4 * cnt
    return cfg, [(name, got[name]) for name, _ in export.tensor_layout(cfg)]


def import_llama2c(path, out, tokenizer, dtype="fp32"):
    cfg, tensors = read_llama2c(path)
    n, _, _, _ = export.tokenizer_info(tokenizer)
    if n != cfg.vocab_size:
        raise ValueError(f"{tokenizer} has {n} pieces but {path}'s vocabulary (its embedding's rows) is "
                         f"{cfg.vocab_size}")
    if cfg.max_seq_len > hf.engine_max_seq_len():
        raise ValueError(f"{path}: seq_len {cfg.max_seq_len} is over the engine's context limit")
    return cfg, export.write_checkpoint(cfg, tensors, out, tokenizer, dtype)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="a llama2.c .bin, or a Hugging Face model directory")
    ap.add_argument("out", help="the engine checkpoint to write")
    ap.add_argument("--tokenizer", help="SentencePiece tokenizer.model (required for llama2.c; default "
                                        "HF_DIR/tokenizer.model)")
    ap.add_argument("--dtype", choices=sorted(export.DTYPES))
    ap.add_argument("--context", type=int, help="Hugging Face: use the first N positions of a longer context")
    ap.add_argument("--force", action="store_true", help="replace a checkpoint the project ships")
    args = ap.parse_args(argv)
    try:
        export.check_outputs([args.out], [args.src, args.tokenizer])
        if not args.force and export.shipped(args.out):
            raise ValueError(f"{args.out} is a checkpoint the project ships (git tracks it); write a new file")
        if os.path.isdir(args.src):
            cfg, hdr = hf.import_hf(args.src, args.out, args.dtype, args.context, args.tokenizer)
            kind = "Hugging Face"
        else:
            if not args.tokenizer:
                ap.error("a llama2.c checkpoint needs --tokenizer tokenizer.model (the SentencePiece model its "
                         "tokenizer.bin was made from)")
            if args.context:
                ap.error("--context goes with a Hugging Face directory")
            cfg, hdr = import_llama2c(args.src, args.out, args.tokenizer, args.dtype or "fp32")
            kind = "llama2.c"
        print(f"{args.out}: {cfg.variant} from {kind}, {cfg.n_layers} layers, dim {cfg.dim}, vocab {cfg.vocab_size}, "
              f"context {cfg.max_seq_len}{', untied head' if cfg.untied_head else ''}"
              f"{', window ' + str(cfg.window) if cfg.window else ''}, "
              f"{'bf16' if hdr['dtype'] == 1 else 'fp32'}, {hdr['weights_offset'] + hdr['weights_size']:,} bytes")
    except OSError as e:
        ap.exit(1, f"import_model.py: {e.filename or ''}: {e.strerror or e}\n")
    except (ValueError, RuntimeError) as e:  # HFError, SafetensorsError are ValueErrors
        ap.exit(1, f"import_model.py: {' '.join(str(e).split())}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
