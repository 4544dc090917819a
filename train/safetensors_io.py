"""A reader and a writer of the safetensors format, with no dependency but numpy.

A file is: an unsigned little-endian 64-bit header length N, N bytes of a UTF-8 JSON object
(each tensor name -> {"dtype", "shape", "data_offsets": [begin, end]}, offsets relative to
the byte after the header; an optional "__metadata__" of strings to strings), then the data.
The reader trusts nothing: the header's length and JSON, every dtype, shape and offset are
checked against the file (in bounds, of the size the shape implies, no overlaps, no holes, no
duplicate names) before any tensor is read; a bad file raises SafetensorsError with one line.

Tensors come back as numpy arrays of their stored dtype; bf16 as uint16 bits (Tensor.dtype
says "BF16"). Sharded checkpoints (model.safetensors.index.json) are read by read_dir.
"""
import json
import os

import numpy as np

# safetensors dtype -> (numpy dtype of its storage, bytes per element); bf16 is kept as its bits
DTYPES = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2), "F64": ("<f8", 8),
          "I64": ("<i8", 8), "I32": ("<i4", 4), "I16": ("<i2", 2), "I8": ("i1", 1), "U8": ("u1", 1),
          "BOOL": ("?", 1)}
MAX_HEADER = 100 * 1024 * 1024  # the format's own limit on the JSON header


class SafetensorsError(ValueError):
    pass


class Tensor:
    """One tensor: its safetensors dtype name, shape, and data (a numpy array of the storage type)."""

    def __init__(self, dtype, data):
        self.dtype = dtype
        self.data = data

    @property
    def shape(self):
        return tuple(self.data.shape)

    def to_f32(self):
        """The values as float32 (exact for F32, F16 and BF16)."""
        if self.dtype == "BF16":
            return (self.data.astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(self.data.shape)
        if self.dtype in ("F32", "F16"):
            return self.data.astype(np.float32)
        raise SafetensorsError(f"tensor of dtype {self.dtype} is not a float")


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise SafetensorsError(f"duplicate key {k!r} in the header")
        d[k] = v
    return d


def parse_header(path):
    """(header dict without __metadata__, metadata dict, data start, file size), checked."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path}: {size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(raw, "little")
        if n > MAX_HEADER or n > size - 8:
            raise SafetensorsError(f"{path}: header length {n} runs past the {size}-byte file (or over 100 MB)")
        text = f.read(n)
    try:
        hdr = json.loads(text.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: the header is not JSON ({e})") from None
    if not isinstance(hdr, dict):
        raise SafetensorsError(f"{path}: the header is not a JSON object")
    meta = hdr.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise SafetensorsError(f"{path}: __metadata__ must map strings to strings")
    start = 8 + n
    spans = []
    for name, e in hdr.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise SafetensorsError(f"{path}: tensor {name!r} needs exactly dtype, shape and data_offsets")
        dt, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if dt not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r} has an unknown dtype {dt!r}")
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2 ** 40 for d in shape):
            raise SafetensorsError(f"{path}: tensor {name!r} has a bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and 0 <= offs[0] <= offs[1] <= size - start):
            raise SafetensorsError(f"{path}: tensor {name!r} has data_offsets {offs!r} outside the "
                                   f"{size - start}-byte data")
        want = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt][1] if shape else DTYPES[dt][1]
        if offs[1] - offs[0] != want:
            raise SafetensorsError(f"{path}: tensor {name!r} ({dt} {shape}) needs {want} bytes, its offsets "
                                   f"give {offs[1] - offs[0]}")
        spans.append((offs[0], offs[1], name))
    spans.sort()
    at = 0
    for b, e, name in spans:
        if b != at:
            raise SafetensorsError(f"{path}: tensor {name!r} starts at {b}, expected {at} "
                                   f"({'an overlap' if b < at else 'a hole'} in the data)")
        at = e
    if at != size - start:
        raise SafetensorsError(f"{path}: the tensors end at {at}, the data has {size - start} bytes")
    return hdr, meta, start, size


def read_file(path):
    """{name: Tensor} of one .safetensors file, in the order of the data; plus its metadata."""
    hdr, meta, start, _ = parse_header(path)
    out = {}
    with open(path, "rb") as f:
        for name, e in sorted(hdr.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            b, end = e["data_offsets"]
            f.seek(start + b)
            buf = f.read(end - b)
            if len(buf) != end - b:
                raise SafetensorsError(f"{path}: shrank while it was read")
            arr = np.frombuffer(buf, dtype=DTYPES[e["dtype"]][0]).reshape(e["shape"])
            out[name] = Tensor(e["dtype"], arr)
    return out, meta


def read_dir(d):
    """{name: Tensor} of a Hugging Face model directory: model.safetensors.index.json and its
    shards, or a single model.safetensors. Every tensor of the index must be in the shard it
    names, and every shard's tensor in the index."""
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                idx = json.load(f, object_pairs_hook=_no_duplicates)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{index}: not JSON ({e})") from None
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
            raise SafetensorsError(f"{index}: no weight_map of tensor names to shard files")
        out = {}
        shards = sorted(set(wm.values()))
        for shard in shards:  # every shard there before any is read
            if os.path.basename(shard) != shard or not shard.endswith(".safetensors"):
                raise SafetensorsError(f"{index}: shard {shard!r} is not a .safetensors file in the directory")
            if not os.path.isfile(os.path.join(d, shard)):
                raise SafetensorsError(f"{index}: the shard {shard} is missing")
        for shard in shards:
            p = os.path.join(d, shard)
            tensors, _ = read_file(p)
            listed = {k for k, v in wm.items() if v == shard}
            if set(tensors) != listed:
                extra, missing = sorted(set(tensors) - listed), sorted(listed - set(tensors))
                raise SafetensorsError(f"{p}: holds {extra[:3]} that the index does not list there, "
                                       f"lacks {missing[:3]} that it does")
            out.update(tensors)
        return out
    p = os.path.join(d, "model.safetensors")
    if not os.path.isfile(p):
        raise SafetensorsError(f"{d}: neither model.safetensors nor model.safetensors.index.json")
    return read_file(p)[0]


def _header_bytes(tensors, metadata):
    hdr, at = {}, 0
    if metadata:
        hdr["__metadata__"] = dict(metadata)
    for name, t in tensors.items():
        n = t.data.nbytes
        hdr[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(hdr, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-aligned
    return text


def write_file(f, tensors, metadata=None):
    """Writes {name: Tensor} (in the dict's order) to the open binary file f."""
    for name, t in tensors.items():
        want = np.dtype(DTYPES[t.dtype][0])
        if t.data.dtype.newbyteorder("<") != want.newbyteorder("<") or t.data.dtype.itemsize != want.itemsize:
            raise SafetensorsError(f"tensor {name!r}: numpy {t.data.dtype} does not store {t.dtype}")
    text = _header_bytes(tensors, metadata)
    f.write(len(text).to_bytes(8, "little"))
    f.write(text)
    for t in tensors.values():
        f.write(np.ascontiguousarray(t.data, dtype=DTYPES[t.dtype][0]).tobytes())
