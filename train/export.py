"""Writes a model into the engine's checkpoint format (docs/FORMAT.md), and optionally
into llama2.c's legacy fp32 format.

    python3 train/export.py INPUT OUT.bin [--dtype bf16|fp32] [--tokenizer T.model] [--llama2c DIR]
    python3 train/export.py INPUT --llama2c DIR
    python3 train/export.py INPUT --hf DIR [--force]
    python3 train/export.py --random VARIANT OUT.bin [--small] [--seed N] [--dtype ...] [--tokenizer ...]

INPUT is either a checkpoint saved by train/train.py (out/VARIANT/best.pt: a dict with
"model", the state dict, and "config", Config.__dict__) or a checkpoint in the engine's
format (weights/VARIANT.bin); the file's first bytes tell which, not its name. A training
checkpoint is exported with --tokenizer (default tokenizer/tokenizer.model) and as bf16;
an engine checkpoint keeps its embedded tokenizer and its dtype unless --tokenizer or
--dtype say otherwise. The third form exports randomly initialised weights (for tests);
its vocabulary is the tokenizer's piece count.

--llama2c DIR (mha, gqa, mqa only) also writes DIR/VARIANT_llama2c.bin (llama2.c's
legacy "version 0" fp32 format) and DIR/tokenizer.bin (llama2.c's tokenizer format).
Its tensors hold the same numbers as the main file (bf16-rounded when --dtype bf16).

--hf DIR writes a Hugging Face model directory (train/hf.py, docs/MODELS_IN_OUT.md):
LlamaForCausalLM for mha, gqa and mqa, DeepseekV2ForCausalLM for mla64 and mla128, with the
engine file's tensors bit for bit (in its dtype) and its tokenizer. An existing DIR is
replaced only with --force.

A training checkpoint is never loaded with a general unpickler: torch.load(weights_only=True)
on PyTorch 2.x, an unpickler restricted to tensors and plain values on 1.13 (train/checkpoint.py). An output that would replace a checkpoint the project ships (a file
in weights/ that git tracks) is refused unless --force is given.

Functions used by the tests: export, round_to_bf16_, load_checkpoint, load_input, random_model,
read_header, read_tensors, export_llama2c, tensor_layout.
"""
import argparse
import os
import stat
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint  # noqa: E402
from model import VARIANTS, Config, Transformer, rope_tables  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TOKENIZER = os.path.join(ROOT, "tokenizer", "tokenizer.model")

MAGIC = b"AKVC"
VERSION = 1
HEADER_SIZE = 128
ALIGN = 64
DTYPES = {"fp32": 0, "bf16": 1}
# "mla": an MLA model read from a .bin whose latent width is neither 64 nor 128 (header_config).
VARIANT_CODES = {"mha": 0, "gqa": 1, "mqa": 2, "mla64": 3, "mla128": 3, "mla": 3}
VARIANT_NAMES = {0: "mha", 1: "gqa", 2: "mqa", 3: "mla"}

# magic, version, variant, dtype, dim, n_layers, n_heads, head_dim, n_kv_heads, kv_latent, rope_dim,
# hidden_dim, vocab_size, max_seq_len, rope_theta, norm_eps, bos_id, eos_id,
# tokenizer_offset, tokenizer_size, weights_offset, weights_size, flags, window, 16 reserved bytes
HEADER_STRUCT = struct.Struct("<4s13I2f2I4Q2I16x")
HEADER_FIELDS = ("magic", "version", "variant", "dtype", "dim", "n_layers", "n_heads", "head_dim", "n_kv_heads",
                 "kv_latent", "rope_dim", "hidden_dim", "vocab_size", "max_seq_len", "rope_theta", "norm_eps",
                 "bos_id", "eos_id", "tokenizer_offset", "tokenizer_size", "weights_offset", "weights_size",
                 "flags", "window")
FLAG_UNTIED_HEAD = 1  # flags bit 0: an output head of its own, the tensor "output" after final_norm
assert HEADER_STRUCT.size == HEADER_SIZE

LLAMA2C_HEADER = struct.Struct("<7i")


# ---------------------------------------------------------------- bf16

def bf16_bits(a):
    """fp32 array -> uint16 array: the upper halves, rounded to nearest even."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    assert not np.isnan(a).any(), "NaN in a tensor to be rounded to bf16"
    bits = a.view(np.uint32)
    # No overflow in uint32 for any non-NaN input: the largest is 0xFF800000 (-inf) + 0x8000.
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype(np.uint16)


def bf16_to_f32(h):
    """uint16 array of bf16 bits -> the fp32 values they stand for."""
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_to_bf16(a):
    """fp32 array -> fp32 array holding the nearest bf16 values (round to nearest even)."""
    return bf16_to_f32(bf16_bits(a))


@torch.no_grad()
def round_to_bf16_(model):
    """Rounds every parameter of model in place to the nearest bf16 value, keeping fp32 storage,
    so that PyTorch computes on exactly the numbers a bf16 file holds. Returns model."""
    for p in model.parameters():
        a = p.detach().cpu().float().numpy()
        p.copy_(torch.from_numpy(round_to_bf16(a)).view(p.shape))
    return model


# ---------------------------------------------------------------- layout

def variant_code(cfg):
    """Header variant code from the Config, checked against the head counts (as model.c does)."""
    if cfg.variant not in VARIANT_CODES:
        raise ValueError(f"unknown variant {cfg.variant!r} (expected one of {sorted(VARIANT_CODES)})")
    code = VARIANT_CODES[cfg.variant]
    H, Hkv = cfg.n_heads, cfg.n_kv_heads
    if code == 3:
        if not cfg.kv_latent > 0 or Hkv != 0:
            raise ValueError(f"{cfg.variant}: an MLA config needs kv_latent > 0 and n_kv_heads == 0 "
                             f"(got kv_latent {cfg.kv_latent}, n_kv_heads {Hkv})")
        if cfg.rope_dim <= 0 or cfg.rope_dim % 2:
            raise ValueError(f"{cfg.variant}: rope_dim = {cfg.rope_dim} must be even and positive")
    else:
        if cfg.kv_latent != 0:
            raise ValueError(f"{cfg.variant}: kv_latent must be 0 (got {cfg.kv_latent})")
        ok = {0: Hkv == H, 1: 1 < Hkv < H and H % Hkv == 0, 2: Hkv == 1}[code]
        if not ok:
            raise ValueError(f"{cfg.variant}: n_kv_heads = {Hkv} does not fit the variant with n_heads = {H}")
    if cfg.head_dim % 2:
        raise ValueError(f"head_dim = {cfg.head_dim} is odd (RoPE rotates pairs)")
    if not 0 <= cfg.window <= cfg.max_seq_len:
        raise ValueError(f"window = {cfg.window} must lie in 0..max_seq_len ({cfg.max_seq_len})")
    return code


def tensor_layout(cfg):
    """[(state_dict name, shape)] in file order (docs/FORMAT.md, "Tensors")."""
    D, H, hd, F = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.hidden_dim
    out = [("tok_embeddings.weight", (cfg.vocab_size, D))]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out.append((p + "attn_norm.weight", (D,)))
        if cfg.is_mla:
            rd, dc = cfg.rope_dim, cfg.kv_latent
            out += [(p + "attn.wq.weight", (H * (hd + rd), D)),
                    (p + "attn.wdkv.weight", (dc, D)),
                    (p + "attn.kv_norm.weight", (dc,)),
                    (p + "attn.wkr.weight", (rd, D)),
                    (p + "attn.wuk.weight", (H * hd, dc)),
                    (p + "attn.wuv.weight", (H * hd, dc))]
        else:
            Hkv = cfg.n_kv_heads
            out += [(p + "attn.wq.weight", (H * hd, D)),
                    (p + "attn.wk.weight", (Hkv * hd, D)),
                    (p + "attn.wv.weight", (Hkv * hd, D))]
        out += [(p + "attn.wo.weight", (D, H * hd)),
                (p + "ffn_norm.weight", (D,)),
                (p + "ffn.w1.weight", (F, D)),
                (p + "ffn.w2.weight", (D, F)),
                (p + "ffn.w3.weight", (F, D))]
    out.append(("norm.weight", (D,)))
    if cfg.untied_head:
        out.append(("output.weight", (cfg.vocab_size, D)))
    return out


def _numpy_tensors(model):
    """The model's tensors in file order as contiguous fp32 numpy arrays, after checking that
    the state dict holds exactly the tensors the layout names, with the right shapes."""
    cfg = model.cfg
    sd = model.state_dict()
    layout = tensor_layout(cfg)
    names = [n for n, _ in layout]
    missing = [n for n in names if n not in sd]
    extra = [n for n in sd if n not in set(names)]
    if missing or extra:
        raise ValueError(f"state dict does not match the {cfg.variant} layout: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    out = []
    for name, shape in layout:
        t = sd[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
        a = np.ascontiguousarray(t.detach().cpu().float().numpy(), dtype=np.float32)
        check_finite(name, a)
        out.append((name, a))
    return out


def check_finite(name, a):
    """Raises ValueError when tensor a (floats, or bf16 bits as uint16) holds NaN or inf."""
    if ((a & 0x7F80) == 0x7F80).any() if a.dtype == np.uint16 else not np.isfinite(a).all():
        raise ValueError(f"{name} holds NaN or inf")


def tokenizer_bytes(tokenizer):
    """A serialized SentencePiece model: tokenizer itself if bytes, else the file it names."""
    if isinstance(tokenizer, (bytes, bytearray)):
        return bytes(tokenizer)
    with open(tokenizer, "rb") as f:
        return f.read()


def _tokenizer_name(tokenizer):
    return "the embedded tokenizer" if isinstance(tokenizer, (bytes, bytearray)) else tokenizer


def tokenizer_info(tokenizer):
    """(piece count, bos id, eos id, SentencePieceProcessor) of a SentencePiece model (a path or its bytes)."""
    import sentencepiece as spm
    proto = tokenizer_bytes(tokenizer)
    if not proto:  # SentencePiece takes an empty model without a word, then crashes on its first call
        raise ValueError(f"{_tokenizer_name(tokenizer)} is empty, not a SentencePiece model")
    try:
        sp = spm.SentencePieceProcessor(model_proto=proto)
    except RuntimeError as e:  # SentencePiece's message ends with the failed check, on its last line
        raise ValueError(f"{_tokenizer_name(tokenizer)} is not a SentencePiece model "
                         f"({str(e).strip().splitlines()[-1]})") from None
    return sp.get_piece_size(), sp.bos_id(), sp.eos_id(), sp


def _check_tokenizer(cfg, tokenizer):
    n, bos, eos, sp = tokenizer_info(tokenizer)
    if n != cfg.vocab_size:
        raise ValueError(f"the model's vocabulary ({cfg.vocab_size}) differs from the tokenizer's piece count "
                         f"({n}, {_tokenizer_name(tokenizer)})")
    if not (0 <= bos < n and 0 <= eos < n):
        raise ValueError(f"{_tokenizer_name(tokenizer)} has no BOS or no EOS (bos {bos}, eos {eos})")
    return bos, eos, sp


def _align(n, a=ALIGN):
    return (n + a - 1) // a * a


def _write_atomic(path, write):
    """Calls write(file) on a new file beside path, then renames it to path, so that path is
    either as it was or whole. A character device or a FIFO (/dev/null, a pipe) is written in
    place: a rename would put a file where it was."""
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        with open(path, "wb") as f:
            write(f)
        return
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp's 0600, as open() would have made it
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def umask():
    """The process's file mode creation mask (reading it means setting it, so it is set back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_outputs(outputs, inputs):
    """Raises ValueError, before anything is written, when an output is one of the inputs (the
    same file, whatever the name; an input directory stands for the files in it), or a
    directory, socket or block device where a file goes."""
    seen = {}
    for p in inputs:
        if not p or not os.path.exists(p):
            continue
        for f in ([os.path.join(p, n) for n in os.listdir(p)] if os.path.isdir(p) else [p]):
            st = os.stat(f)
            if stat.S_ISREG(st.st_mode):
                seen[(st.st_dev, st.st_ino)] = f
    for out in outputs:
        try:
            st = os.stat(out)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in seen and stat.S_ISREG(st.st_mode):
            raise ValueError(f"cannot write {out}: it is the input {seen[(st.st_dev, st.st_ino)]}")
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "a block device" if stat.S_ISBLK(st.st_mode) else None)
        if kind:
            raise ValueError(f"cannot write {out}: it is {kind}")


# ---------------------------------------------------------------- export

def export(model, path, tokenizer=DEFAULT_TOKENIZER, dtype="bf16"):
    """Writes model (a Transformer) and the tokenizer (a path or the model's bytes) into path
    (docs/FORMAT.md). Returns the header as a dict (read_header's format)."""
    return write_checkpoint(model.cfg, _numpy_tensors(model), path, tokenizer, dtype)


def write_checkpoint(cfg, tensors, path, tokenizer=DEFAULT_TOKENIZER, dtype="bf16"):
    """Writes a checkpoint of Config cfg from tensors, [(name, array)] in tensor_layout's order
    (fp32 arrays, rounded to bf16 when dtype is bf16; or, for dtype bf16 only, uint16 arrays of
    bf16 bits, written as they are), and the tokenizer. Returns the header as a dict."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    code = variant_code(cfg)
    tok_bytes = tokenizer_bytes(tokenizer)
    bos, eos, _ = _check_tokenizer(cfg, tok_bytes)
    layout = tensor_layout(cfg)
    if [n for n, _ in tensors] != [n for n, _ in layout]:
        raise ValueError(f"tensors do not follow the {cfg.variant} layout")
    blobs = []
    for (name, a), (_, shape) in zip(tensors, layout):
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(a.shape)}, expected {tuple(shape)}")
        if a.dtype == np.uint16:
            if dtype != "bf16":
                raise ValueError(f"{name}: bf16 bits given for an {dtype} file")
            check_finite(name, a)
            blobs.append(np.ascontiguousarray(a, dtype="<u2"))
            continue
        a = np.asarray(a, dtype=np.float32)
        check_finite(name, a)
        blobs.append(bf16_bits(a).astype("<u2") if dtype == "bf16" else np.ascontiguousarray(a, dtype="<f4"))
    weights_size = sum(b.nbytes for b in blobs)
    n_params = sum(int(np.prod(shape)) for _, shape in layout)
    assert weights_size == n_params * (2 if dtype == "bf16" else 4)

    tok_off = HEADER_SIZE
    w_off = _align(tok_off + len(tok_bytes))
    is_mla = code == 3
    hdr = dict(magic=MAGIC, version=VERSION, variant=code, dtype=DTYPES[dtype], dim=cfg.dim,
               n_layers=cfg.n_layers, n_heads=cfg.n_heads, head_dim=cfg.head_dim,
               n_kv_heads=0 if is_mla else cfg.n_kv_heads, kv_latent=cfg.kv_latent if is_mla else 0,
               rope_dim=cfg.rope_dim if is_mla else 0, hidden_dim=cfg.hidden_dim, vocab_size=cfg.vocab_size,
               max_seq_len=cfg.max_seq_len, rope_theta=float(cfg.rope_theta), norm_eps=float(cfg.norm_eps),
               bos_id=bos, eos_id=eos, tokenizer_offset=tok_off, tokenizer_size=len(tok_bytes),
               weights_offset=w_off, weights_size=weights_size,
               flags=FLAG_UNTIED_HEAD if cfg.untied_head else 0, window=int(cfg.window))
    header = HEADER_STRUCT.pack(*(hdr[k] for k in HEADER_FIELDS))

    assert len(header) == tok_off and w_off - tok_off >= len(tok_bytes)

    def write(f):  # in order, without tell(): a pipe cannot say where it is
        f.write(header)
        f.write(tok_bytes)
        f.write(b"\0" * (w_off - tok_off - len(tok_bytes)))
        for b in blobs:
            f.write(b.tobytes())

    _write_atomic(path, write)
    hdr["magic"] = MAGIC.decode()
    return hdr


def read_header(path):
    """Parses a checkpoint's 128-byte header into a dict (field names as in docs/FORMAT.md;
    magic as a str, plus 'reserved', the 16 reserved bytes)."""
    with open(path, "rb") as f:
        raw = f.read(HEADER_SIZE)
    if len(raw) < HEADER_SIZE:
        raise ValueError(f"{path}: {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header")
    hdr = dict(zip(HEADER_FIELDS, HEADER_STRUCT.unpack(raw)))
    hdr["magic"] = hdr["magic"].decode("latin-1")
    hdr["reserved"] = raw[112:128]
    return hdr


def header_config(hdr):
    """The Config a header describes (variant name mla64/mla128 from kv_latent, else 'mla')."""
    code = hdr["variant"]
    name = VARIANT_NAMES[code]
    if code == 3 and hdr["kv_latent"] in (64, 128):
        name = f"mla{hdr['kv_latent']}"
    return Config(variant=name, dim=hdr["dim"], n_layers=hdr["n_layers"], n_heads=hdr["n_heads"],
                  head_dim=hdr["head_dim"], n_kv_heads=hdr["n_kv_heads"], kv_latent=hdr["kv_latent"],
                  rope_dim=hdr["rope_dim"], hidden_dim=hdr["hidden_dim"], vocab_size=hdr["vocab_size"],
                  max_seq_len=hdr["max_seq_len"], rope_theta=hdr["rope_theta"], norm_eps=hdr["norm_eps"],
                  untied_head=bool(hdr["flags"] & FLAG_UNTIED_HEAD), window=hdr["window"])


def check_header(hdr, path):
    """Raises ValueError unless hdr (read_header's) describes the file at path: its magic,
    version and codes, and a tokenizer and tensors that lie where the file has them."""
    if hdr["magic"] != MAGIC.decode() or hdr["version"] != VERSION:
        raise ValueError(f"{path}: not a version-{VERSION} engine checkpoint "
                         f"(magic {hdr['magic']!r}, version {hdr['version']})")
    if hdr["variant"] not in VARIANT_NAMES or hdr["dtype"] not in (0, 1):
        raise ValueError(f"{path}: unknown variant code {hdr['variant']} or dtype code {hdr['dtype']}")
    if hdr["flags"] & ~FLAG_UNTIED_HEAD or hdr["reserved"] != bytes(16) or hdr["window"] > hdr["max_seq_len"]:
        raise ValueError(f"{path}: unknown header flags 0x{hdr['flags']:x}, a window over the context, or "
                         "non-zero reserved bytes (a newer format?)")
    n_params = sum(int(np.prod(shape)) for _, shape in tensor_layout(header_config(hdr)))
    expected = n_params * (2 if hdr["dtype"] == 1 else 4)
    size = os.path.getsize(path)
    if hdr["tokenizer_size"] == 0:
        raise ValueError(f"{path}: its header gives the embedded tokenizer 0 bytes")
    if (hdr["tokenizer_offset"] + hdr["tokenizer_size"] > hdr["weights_offset"]
            or hdr["weights_size"] != expected or hdr["weights_offset"] + expected != size):
        raise ValueError(f"{path}: {size:,} bytes, but its header puts {expected:,} bytes of tensors at "
                         f"{hdr['weights_offset']:,} (truncated or not written by export.py)")


def read_embedded_tokenizer(path):
    """The SentencePiece model embedded in an engine checkpoint, as bytes."""
    hdr = read_header(path)
    check_header(hdr, path)
    with open(path, "rb") as f:
        f.seek(hdr["tokenizer_offset"])
        return f.read(hdr["tokenizer_size"])


def read_tensors(path, bf16_bits_too=False):
    """Reads every tensor of a checkpoint back: {state_dict name: fp32 numpy array} (bf16 widened;
    with bf16_bits_too, a bf16 file's tensors come as their uint16 bits instead)."""
    hdr = read_header(path)
    check_header(hdr, path)
    cfg = header_config(hdr)
    np_dtype = {0: "<f4", 1: "<u2"}[hdr["dtype"]]
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    off, out = hdr["weights_offset"], {}
    for name, shape in tensor_layout(cfg):
        n = int(np.prod(shape))
        a = np.frombuffer(raw, dtype=np_dtype, count=n, offset=off).reshape(shape)
        off += a.nbytes
        if hdr["dtype"] == 1:
            out[name] = np.array(a) if bf16_bits_too else bf16_to_f32(a).reshape(shape)
        else:
            out[name] = np.array(a, dtype=np.float32)
    if off != hdr["weights_offset"] + hdr["weights_size"]:
        raise ValueError(f"{path}: tensors end at {off}, header says {hdr['weights_offset'] + hdr['weights_size']}")
    return out


def load_engine_checkpoint(path):
    """A Transformer (fp32) holding exactly the values of an engine checkpoint (.bin)."""
    tensors = read_tensors(path)  # checks the header before a model of its shape is built
    model = Transformer(header_config(read_header(path)))
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()})
    model.eval()
    return model


# ---------------------------------------------------------------- llama2.c

def llama2c_tokenizer_bytes(tokenizer):
    """llama2.c's tokenizer.bin (karpathy/llama2.c tokenizer.py export): u32 max_token_length, then per id
    f32 score, u32 length, the UTF-8 bytes; '\u2581' becomes ' ', BOS is '\\n<s>\\n', EOS '\\n</s>\\n'."""
    _, bos, eos, sp = tokenizer_info(tokenizer)
    tokens, scores = [], []
    for i in range(sp.get_piece_size()):
        t = sp.id_to_piece(i)
        if i == bos:
            t = "\n<s>\n"
        elif i == eos:
            t = "\n</s>\n"
        tokens.append(t.replace("\u2581", " ").encode("utf-8"))
        scores.append(sp.get_score(i))
    parts = [struct.pack("<I", max(len(b) for b in tokens))]
    for b, s in zip(tokens, scores):
        parts.append(struct.pack("<fI", s, len(b)))
        parts.append(b)
    return b"".join(parts)


def check_llama2c(cfg):
    """Raises ValueError unless llama2.c can run a model of this config: no MLA, and what
    llama2.c's run.c assumes instead of reading it (heads dim / n_heads wide, RoPE theta
    10000, RMSNorm eps 1e-5)."""
    if variant_code(cfg) == 3:
        raise ValueError(f"--llama2c: {cfg.variant} has no llama2.c equivalent (llama2.c has no latent "
                         "attention); use it with mha, gqa or mqa")
    if cfg.n_heads * cfg.head_dim != cfg.dim:
        raise ValueError(f"--llama2c: llama2.c takes heads dim / n_heads = {cfg.dim // cfg.n_heads} wide, "
                         f"this model's are {cfg.head_dim} (n_heads x head_dim must equal dim)")
    if cfg.rope_theta != 10000 or np.float32(cfg.norm_eps) != np.float32(1e-5):
        raise ValueError(f"--llama2c: llama2.c fixes RoPE theta 10000 and RMSNorm eps 1e-5; this model has "
                         f"{cfg.rope_theta:g} and {cfg.norm_eps:g}")
    if 0 < cfg.window < cfg.max_seq_len:
        raise ValueError(f"--llama2c: llama2.c has no sliding window; this model's is {cfg.window}")


def export_llama2c(model, out_dir, tokenizer=DEFAULT_TOKENIZER, dtype="bf16"):
    """Writes out_dir/VARIANT_llama2c.bin (llama2.c legacy fp32, version 0) and out_dir/tokenizer.bin.
    The tensors hold the values of the main export: bf16-rounded if dtype is bf16. Refuses what
    llama2.c cannot run (check_llama2c). Returns the two paths."""
    cfg = model.cfg
    check_llama2c(cfg)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    _check_tokenizer(cfg, tokenizer)
    t = dict(_numpy_tensors(model))
    if dtype == "bf16":
        t = {k: round_to_bf16(v) for k, v in t.items()}
    L = range(cfg.n_layers)
    order = ["tok_embeddings.weight"]
    for kind in ("attn_norm", "attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn_norm", "ffn.w1", "ffn.w2", "ffn.w3"):
        order += [f"layers.{i}.{kind}.weight" for i in L]
    order.append("norm.weight")
    cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)  # (max_seq_len, head_dim/2)
    # vocab_size positive: the classifier is shared with the embedding; negative: wcls follows the tables
    header = LLAMA2C_HEADER.pack(cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                                 -cfg.vocab_size if cfg.untied_head else cfg.vocab_size, cfg.max_seq_len)

    def write_model(f):
        f.write(header)
        for name in order:
            f.write(t[name].astype("<f4").tobytes())
        f.write(cos.numpy().astype("<f4").tobytes())
        f.write(sin.numpy().astype("<f4").tobytes())
        if cfg.untied_head:
            f.write(t["output.weight"].astype("<f4").tobytes())

    model_path = os.path.join(out_dir, f"{cfg.variant}_llama2c.bin")
    tok_path = os.path.join(out_dir, "tokenizer.bin")
    tok_blob = llama2c_tokenizer_bytes(tokenizer)
    _write_atomic(model_path, write_model)
    _write_atomic(tok_path, lambda f: f.write(tok_blob))
    return model_path, tok_path


# ---------------------------------------------------------------- models

def load_checkpoint(path):
    """A Transformer from a .pt saved by train/train.py ({"model": state_dict, "config": Config.__dict__})."""
    try:
        ck = checkpoint.load(path)  # weights_only where torch has it (checkpoint.py)
    except checkpoint.CheckpointError as e:
        raise ValueError(f"{e}; export a best.pt or last.pt that train/train.py saved, or train one "
                         "(train/README.md)") from None
    if not isinstance(ck, dict) or not {"model", "config"} <= set(ck) or not isinstance(ck["config"], dict):
        raise ValueError(f"{path}: a PyTorch file, but not a checkpoint saved by train.py (no model and config)")
    try:
        cfg = Config(**ck["config"])
    except TypeError:
        raise ValueError(f"{path}: its config has fields Config does not know "
                         f"({', '.join(sorted(map(str, ck['config'])))}); not a checkpoint of this train.py") from None
    model = Transformer(cfg)
    sd = {k.removeprefix("_orig_mod."): v for k, v in ck["model"].items()}
    model.load_state_dict(sd)
    model.eval()
    return model


def load_input(path):
    """(model, embedded tokenizer bytes or None, dtype name or None) of a checkpoint of either
    kind, told apart by its first bytes: the engine's AKVC header, or torch.save's zip
    archive (or its older plain pickle) for a checkpoint saved by train.py."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head == MAGIC:
        dtype = {0: "fp32", 1: "bf16"}.get(read_header(path)["dtype"])
        return load_engine_checkpoint(path), read_embedded_tokenizer(path), dtype
    if head.startswith(b"PK\x03\x04") or head.startswith(b"\x80"):
        return load_checkpoint(path), None, None
    raise ValueError(f"{path} is neither an engine checkpoint (magic AKVC) nor a PyTorch checkpoint saved by "
                     "train.py")


def small_config(variant, **overrides):
    """The tiny test configuration of a variant."""
    n_kv, latent = VARIANTS[variant]
    kw = dict(dim=64, n_layers=2, n_heads=4, head_dim=16, hidden_dim=96, max_seq_len=64)
    if latent:
        kw.update(n_kv_heads=0, kv_latent={"mla64": 16, "mla128": 32}[variant], rope_dim=8)
    else:
        kw.update(n_kv_heads={"mha": 4, "gqa": 2, "mqa": 1}[variant], kv_latent=0)
    kw.update(overrides)
    return Config.for_variant(variant, **kw)


@torch.no_grad()
def random_model(variant, small=False, seed=0, vocab_size=None):
    """A Transformer with random weights, larger than the training init so that logits are well
    spread (parity tests compare argmaxes): matrices ~ N(0, std) with std 0.1 (small) or 0.05,
    norm weights ~ U(0.75, 1.25). Deterministic in seed; the global RNG is left as it was."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (expected one of {sorted(VARIANTS)})")
    overrides = {} if vocab_size is None else {"vocab_size": vocab_size}
    cfg = small_config(variant, **overrides) if small else Config.for_variant(variant, **overrides)
    std = 0.1 if small else 0.05
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Transformer(cfg)
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=g) * 0.5 + 0.75)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.eval()
    return model


# ---------------------------------------------------------------- CLI

def shipped(path):
    """Whether writing path would replace a file the project ships: a file in ROOT/weights/
    that git tracks (where git cannot tell, any file there)."""
    real, weights = os.path.realpath(path), os.path.realpath(os.path.join(ROOT, "weights"))
    if os.path.dirname(real) != weights or not os.path.isfile(real):
        return False
    try:
        p = subprocess.run(["git", "-C", ROOT, "ls-files", "--error-unmatch", "--",
                            os.path.relpath(real, os.path.realpath(ROOT))],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return True
    return p.returncode != 1  # 0: tracked; 1: not tracked; other: git cannot tell



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", metavar="PATH",
                    help="INPUT OUT.bin; INPUT alone with --llama2c; OUT.bin alone with --random")
    ap.add_argument("--random", metavar="VARIANT", choices=sorted(VARIANTS),
                    help="export random weights of this variant instead of a checkpoint")
    ap.add_argument("--small", action="store_true", help="with --random: the tiny test configuration")
    ap.add_argument("--seed", type=int, default=0, help="with --random: the seed (default 0)")
    ap.add_argument("--dtype", choices=sorted(DTYPES),
                    help="tensor type (default: an engine INPUT's own, else bf16)")
    ap.add_argument("--tokenizer", help="SentencePiece model (default: the one an engine INPUT embeds, "
                                        "else tokenizer/tokenizer.model)")
    ap.add_argument("--llama2c", metavar="DIR", help="also write DIR/VARIANT_llama2c.bin and DIR/tokenizer.bin")
    ap.add_argument("--hf", metavar="DIR", help="also write a Hugging Face model directory (LlamaForCausalLM or "
                                                "DeepseekV2ForCausalLM)")
    ap.add_argument("--force", action="store_true",
                    help="replace a checkpoint the project ships (a file in weights/ that git tracks)")
    args = ap.parse_args(argv)

    if args.random:
        if len(args.paths) != 1:
            ap.error("--random VARIANT takes one path: OUT.bin")
        src, out = None, args.paths[0]
    else:
        if args.small:
            ap.error("--small only goes with --random")
        if len(args.paths) == 1 and (args.llama2c or args.hf):
            src, out = args.paths[0], None
        elif len(args.paths) == 2:
            src, out = args.paths
        else:
            ap.error("expected INPUT OUT.bin, or INPUT --llama2c DIR, or INPUT --hf DIR")
    try:
        embedded, in_dtype = None, None
        if args.random:
            n_pieces = tokenizer_info(args.tokenizer or DEFAULT_TOKENIZER)[0]
            model = random_model(args.random, small=args.small, seed=args.seed, vocab_size=n_pieces)
        else:
            model, embedded, in_dtype = load_input(src)
        tokenizer = args.tokenizer or (embedded if embedded is not None else DEFAULT_TOKENIZER)
        dtype = args.dtype or in_dtype or "bf16"
        targets = [out] if out else []
        if args.llama2c:
            check_llama2c(model.cfg)  # before anything is written
            targets += [os.path.join(args.llama2c, f"{model.cfg.variant}_llama2c.bin"),
                        os.path.join(args.llama2c, "tokenizer.bin")]
        check_outputs(targets, [src, args.tokenizer])
        for t in targets:
            if not args.force and shipped(t):
                stem = os.path.splitext(os.path.basename(t))[0]
                raise ValueError(f"{t} is a checkpoint the project ships (git tracks it); write a new file "
                                 f"(weights/{stem}-mine.bin, say), or pass --force to replace it")
        if out:
            hdr = export(model, out, tokenizer, dtype)
            n_params = sum(p.numel() for p in model.parameters())
            print(f"{out}: {model.cfg.variant}, {n_params:,} parameters, {dtype}, "
                  f"{hdr['weights_offset'] + hdr['weights_size']:,} bytes")
        if args.llama2c:
            for p in export_llama2c(model, args.llama2c, tokenizer, dtype):
                print(f"{p}: {os.path.getsize(p):,} bytes")
        if args.hf:
            import hf
            if os.path.exists(args.hf) and not args.force:
                raise ValueError(f"{args.hf} exists; choose a new directory or pass --force to replace it")
            with tempfile.TemporaryDirectory() as tmp:
                binary = out or (src if embedded is not None and not args.tokenizer and not args.dtype else None)
                if binary is None:
                    binary = os.path.join(tmp, "model.bin")
                    export(model, binary, tokenizer, dtype)
                config = hf.export_hf(binary, args.hf, force=args.force)
            print(f"{args.hf}: {config['architectures'][0]}, {os.path.getsize(os.path.join(args.hf, 'model.safetensors')):,}"
                  " bytes of safetensors")
    except OSError as e:
        ap.exit(1, f"export.py: {e.filename or ''}: {e.strerror or e}\n")
    except (ValueError, RuntimeError) as e:  # load_state_dict's errors span lines
        ap.exit(1, f"export.py: {' '.join(str(e).split())}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
