"""Training checkpoints (.pt) saved and loaded the same way on Debian's PyTorch 1.13 and on 2.x.

torch.load unpickles, and unpickling an untrusted file can run arbitrary code. So:

- save() writes only what a weights-only load accepts: tensors, dicts (OrderedDict too),
  lists, tuples, str, int, float, bool and None. plain() converts what else could creep in
  (numpy scalars and arrays, argparse Namespaces, dataclasses) and refuses anything other.
- load() never runs a general unpickler. Where torch.load's own weights_only=True reads
  such a checkpoint (PyTorch 2.x: the default from 2.6 on), it is used. PyTorch 1.13 has
  the argument, but its weights-only unpickler knows no float opcode, so every checkpoint
  with a learning rate in it fails there; 1.13 (and any torch whose weights-only load fails
  the probe below) unpickles with pickle's own Unpickler whose find_class allows only the
  globals a tensor checkpoint needs (Python's "restricting globals" recipe), so nothing
  else can be built or called. load_mode() says which of the two this torch uses.
- Any failure to load (missing, empty, truncated or damaged file, a file of another kind,
  an object that is not allowed) raises CheckpointError with a one-line reason, for the
  scripts to print as their one line on stderr.
"""
import argparse
import collections
import dataclasses
import functools
import inspect
import io
import os
import pickle
import re

import numpy as np
import torch


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; str() is one line: "PATH: reason"."""


# ---------------------------------------------------------------- saving

def plain(obj, where="checkpoint"):
    """obj as tensors and plain Python values only (what weights-only loading accepts):
    numpy scalars become Python numbers, numpy arrays lists, Namespaces and dataclasses
    dicts. Anything else raises TypeError naming where it sits."""
    if isinstance(obj, np.generic):  # before the plain types: np.float64 is a float subclass
        return obj.item()
    if isinstance(obj, torch.Tensor) or obj is None or type(obj) in (bool, int, float, str):
        return obj
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, argparse.Namespace):
        return plain(vars(obj), where)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return plain(dataclasses.asdict(obj), where)
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}, not a str or int")
            out[k] = plain(v, f"{where}[{k!r}]")
        if isinstance(obj, collections.OrderedDict):  # a state_dict: keep its type and _metadata
            od = collections.OrderedDict(out)
            if hasattr(obj, "_metadata"):
                od._metadata = plain(obj._metadata, f"{where}._metadata")
            return od
        return out
    if isinstance(obj, (list, tuple)):
        items = [plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    raise TypeError(f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which a weights-only "
                    "load would refuse")


def save(obj, path):
    """torch.save(plain(obj)) to path through path.tmp, so a stop never leaves half a file."""
    tmp = path + ".tmp"
    torch.save(plain(obj), tmp)
    os.replace(tmp, path)


# ---------------------------------------------------------------- loading

# The globals a checkpoint of tensors and plain values refers to (storage types are resolved
# by torch.load itself before find_class is asked).
_ALLOWED = {
    ("collections", "OrderedDict"),
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch.nn.parameter", "Parameter"),
    ("torch", "Size"),
    ("torch", "device"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED or (module == "torch" and name.endswith("Storage")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not allowed")


class _restricted_pickle:
    """A pickle_module for torch.serialization: pickle's own Unpickler (every opcode) with the
    globals restricted to _ALLOWED."""
    Unpickler = _RestrictedUnpickler
    UnpicklingError = pickle.UnpicklingError

    @staticmethod
    def load(f, **kw):
        return _RestrictedUnpickler(f, **kw).load()


def _load_restricted(path):
    """torch.load's own steps with _restricted_pickle as the pickle module. Not torch.load(path,
    pickle_module=...): 1.13's torch.load replaces any pickle_module by pickle unless
    weights_only is set (and then refuses one), so these are its internals, called directly."""
    ser = torch.serialization
    with open(path, "rb") as f:
        if ser._is_zipfile(f):
            with ser._open_zipfile_reader(f) as zf:
                if ser._is_torchscript_zip(zf):
                    raise pickle.UnpicklingError("a TorchScript archive, not a checkpoint")
                return ser._load(zf, "cpu", _restricted_pickle, encoding="utf-8")
        return ser._legacy_load(f, "cpu", _restricted_pickle, encoding="utf-8")


# What a training checkpoint holds besides tensors: floats (lr, betas), large ints (the
# sampler's PCG64 state), tuples, None, bools, strings, nested dicts and lists.
_PROBE = {"f": 0.5, "inf": float("inf"), "big": 2 ** 100, "neg": -3, "t": torch.zeros(2), "tup": (0.9, 0.95),
          "n": None, "b": True, "s": "x", "l": [1, [2.5]], "od": collections.OrderedDict(a=torch.ones(1))}


@functools.lru_cache(maxsize=1)
def load_mode():
    """"weights_only" where torch.load(weights_only=True) reads back what save() writes (2.x),
    else "restricted" (1.13: no float opcode in its weights-only unpickler)."""
    if "weights_only" not in inspect.signature(torch.load).parameters:
        return "restricted"
    buf = io.BytesIO()
    torch.save(_PROBE, buf)
    buf.seek(0)
    try:
        back = torch.load(buf, map_location="cpu", weights_only=True)
    except Exception:
        return "restricted"
    return "weights_only" if back["f"] == 0.5 and back["big"] == 2 ** 100 else "restricted"


def _file_kind(path):
    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        return "empty"
    if head.startswith(b"PK\x03\x04"):
        return "zip"
    if head.startswith(b"\x80"):
        return "pickle"
    return "other"


def _one_line(text, limit=120):
    """text without terminal escapes or control characters, its whitespace collapsed, cut to limit."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _reason(exc, kind):
    """One short clause for why loading failed. PyTorch 2.x's weights-only errors span several
    lines of advice (among it: load with weights_only=False, which this project never does)
    around the cause, "WeightsUnpickler error: CAUSE"; only the cause is kept."""
    if kind == "empty":
        return "it is empty"
    if kind == "other":
        return "it is not a PyTorch file"
    msg = str(exc)
    m = (re.search(r"\bGLOBAL ([\w.]+)", msg)                   # 2.x weights_only; _RestrictedUnpickler
         or re.search(r"Unsupported class ([\w.]+)", msg))      # 1.13 weights_only
    if m:
        return f"it holds an object of {m.group(1)}, which is not loaded for safety (not a train.py checkpoint)"
    if isinstance(exc, MemoryError):
        return "it is damaged (it asks for more memory than there is)"
    if "WeightsUnpickler error:" in msg:
        msg = msg.split("WeightsUnpickler error:", 1)[1].strip().split("\n")[0]
    return f"it is truncated or damaged ({_one_line(msg) or type(exc).__name__})"


def load(path):
    """The object saved at path, loaded without a general unpickler (see the module's notes).
    Raises CheckpointError("PATH: reason") on any failure."""
    try:
        kind = _file_kind(path)
    except OSError as e:
        raise CheckpointError(f"{path}: {_one_line(e.strerror or str(e))}") from None
    if kind in ("empty", "other"):
        raise CheckpointError(f"{path}: {_reason(None, kind)}")
    try:
        if load_mode() == "weights_only":
            return torch.load(path, map_location="cpu", weights_only=True)
        return _load_restricted(path)
    except Exception as e:  # noqa: BLE001 - any failure to unpickle means the file cannot be used
        raise CheckpointError(f"{path}: {_reason(e, kind)}") from None
