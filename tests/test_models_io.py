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
