"""C engine against the PyTorch reference (train/model.py), on the same bf16 weight values.

For every variant, a small and a full-size random model (and every trained checkpoint in
weights/): ./run generates 64 greedy tokens with --dump-logits, with and without the cache.
PyTorch (fp32) computes the logits of the same token sequence; every step must agree to
max|d| <= 1e-4 * max(1, max|logit|), and PyTorch's greedy choice must be C's token."""
import glob
import os

import numpy as np
import pytest
import torch

from conftest import PROMPT, ROOT, TOKENIZER, VARIANTS, read_logits, run

torch.set_num_threads(os.cpu_count())


def c_greedy_logits(path, kv, steps, tmp_path):
    out = tmp_path / ("kv.bin" if kv else "nokv.bin")
    run([path, "-p", PROMPT, "-k", 1, "-n", steps, "--ignore-eos", "-q", "--dump-logits", out] + (["--kv"] if kv else []))
    return read_logits(out, 4096)


def check_parity(path, model, tmp_path):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=TOKENIZER)
    prompt = [sp.bos_id()] + sp.encode(PROMPT)
    steps = min(64, model.cfg.max_seq_len - len(prompt))
    model.eval()
    for kv in (False, True):
        c_logits = c_greedy_logits(path, kv, steps, tmp_path)
        assert c_logits.shape == (steps, 4096)
        c_tokens = c_logits.argmax(axis=1)
        seq = prompt + [int(t) for t in c_tokens[:-1]]
        model.set_absorb(kv)   # MLA: the C engine's default form, absorbed with the cache, expanded without
        with torch.no_grad():
            pt = model(torch.tensor([seq]))[0, len(prompt) - 1:].numpy()   # (steps, vocab)
        model.set_absorb(False)
        for s in range(steps):
            tol = 1e-4 * max(1.0, float(np.abs(pt[s]).max()))
            diff = float(np.abs(pt[s] - c_logits[s]).max())
            assert diff <= tol, f"{path} kv={kv} step {s}: max|d| {diff:.3g} > {tol:.3g}"
        assert list(pt.argmax(axis=1)) == list(c_tokens), f"{path} kv={kv}: greedy tokens differ"


@pytest.mark.parametrize("variant", VARIANTS)
def test_parity_small(small_checkpoints, variant, tmp_path):
    path, model = small_checkpoints[variant]
    check_parity(path, model, tmp_path)


@pytest.mark.parametrize("variant", VARIANTS)
def test_parity_full_size(variant, tmp_path):
    import export
    model = export.random_model(variant, small=False, seed=7)
    export.round_to_bf16_(model)
    path = str(tmp_path / f"{variant}.bin")
    export.export(model, path, TOKENIZER, dtype="bf16")
    check_parity(path, model, tmp_path)


TRAINED = sorted(glob.glob(os.path.join(ROOT, "weights", "*.bin")))


@pytest.mark.parametrize("path", TRAINED, ids=[os.path.basename(p) for p in TRAINED])
def test_parity_trained(path, tmp_path):
    import export
    check_parity(path, export.load_engine_checkpoint(path), tmp_path)


def test_trained_checkpoints_are_listed():
    """The trained-checkpoint parity runs on what weights/ holds: the five shipped variants, so
    a checkout without them fails here rather than running no trained parity at all."""
    names = sorted(os.path.basename(p) for p in TRAINED)
    assert set(names) == {f"{v}.bin" for v in VARIANTS}, names


@pytest.mark.parametrize("variant", VARIANTS)
def test_pytorch_generate_cached_matches_uncached(small_checkpoints, variant):
    """The reference's own generate(): the cache changes nothing but the speed (MLA absorbed
    both ways, so the same function up to rounding)."""
    _, model = small_checkpoints[variant]
    prompt = [1, 400, 500, 600]
    a, la = model.generate(prompt, 30, kv_cache=True, return_logits=True)
    b, lb = model.generate(prompt, 30, kv_cache=False, absorb=True, return_logits=True)
    assert a == b
    assert max(float((x - y).abs().max()) for x, y in zip(la, lb)) < 1e-4
