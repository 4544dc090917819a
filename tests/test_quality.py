"""bench/quality.py (make quality) on small checkpoints: the tables it writes hold the
numbers the engine gives, and the cache bytes follow the variants' shapes."""
import csv
import hashlib
import os
import subprocess
import sys

from conftest import ROOT, RUN

VALID = """Tom had a red ball. He liked to throw it high. One day the ball went over the fence.
<|endoftext|>
Lily saw a big cat in the garden. The cat was sad. Lily gave it some milk and the cat was happy.
<|endoftext|>
Ben and Sue went to the park. They played on the swings. Then it started to rain and they ran home.
<|endoftext|>
A little bird could not fly. Its mother helped it every day. Soon the bird flew over the trees.
<|endoftext|>
"""


def bytes_per_token(model, dtype):
    """The cache of one token from the shapes alone: int8 keeps a 4-byte scale for every
    stored vector (a key or value head; an MLA latent and its RoPE key)."""
    c = model.cfg
    size = {"fp32": 4, "bf16": 2, "int8": 1}[dtype]
    scales = 4 if dtype == "int8" else 0
    if c.kv_latent:
        return c.n_layers * ((c.kv_latent + c.rope_dim) * size + 2 * scales)
    return 2 * c.n_layers * c.n_kv_heads * (c.head_dim * size + scales)


def test_quality_tables(small_checkpoints, tmp_path):
    valid = tmp_path / "valid.txt"
    valid.write_text(VALID)
    ckpts = {v: small_checkpoints[v] for v in ("gqa", "mla64")}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "quality.py"), "--valid", str(valid),
                        "--long-texts", "1", "--evict-stories", "1", "--evict-stories-per-text", "4", "--stories-per-text", "4", "--out", str(tmp_path)]
                       + [path for path, _ in ckpts.values()],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       env=dict(os.environ, RUN_BINARY=RUN), timeout=600)
    assert p.returncode == 0, p.stderr
    rows = {}
    with open(tmp_path / "quality.csv") as f:
        for r in csv.DictReader(f):
            rows[(r["table"], r["variant"], r["setting"], r["quantity"])] = r["value"]
    md = (tmp_path / "quality.md").read_text()
    for _, model in ckpts.values():
        c = model.cfg
        variant = f"mla{c.kv_latent}" if c.kv_latent else {c.n_heads: "mha", 1: "mqa"}.get(c.n_kv_heads, "gqa")
        for dtype in ("fp32", "bf16", "int8"):
            assert int(rows[("dtype", variant, dtype, "bytes_per_token")]) == bytes_per_token(model, dtype)
        assert float(rows[("dtype", variant, "fp32", "delta")]) == 0
        # fp32 agrees with itself for every greedy token; the other dtypes never for more.
        n = int(rows[("dtype", variant, "fp32", "greedy_of")])
        assert n > 0 and int(rows[("dtype", variant, "fp32", "greedy_agree")]) == n
        # quantized caches move the NLL (by enough to show in the table's 4 decimals), but by little on a
        # model this size
        for dtype in ("bf16", "int8"):
            delta = float(rows[("dtype", variant, dtype, "delta")])
            assert round(delta, 4) != 0 and abs(delta) < 0.5, (variant, dtype, delta)
            assert int(rows[("dtype", variant, dtype, "greedy_agree")]) <= n
        # the long text outgrows the small models' 64-token context; every policy scores
        # the same tokens, and the same ones past it
        restart = {q: rows[("window", variant, "restart", q)] for q in ("tokens", "past_tokens", "past_nll")}
        assert int(restart["past_tokens"]) > 0
        for policy in ("ring", "sinks"):
            assert rows[("window", variant, policy, "tokens")] == restart["tokens"]
            assert rows[("window", variant, policy, "past_tokens")] == restart["past_tokens"]
            assert f"{float(rows[('window', variant, policy, 'past_nll')]):.4f}" != f"{float(restart['past_nll']):.4f}"
        # eviction: every policy scores the same tokens past a budget (block only at whole blocks, 32 on)
        for budget in (16, 32, 48):
            past = {q: rows[("evict", variant, f"ring@{budget}", q)] for q in ("past_tokens", "past_nll")}
            assert int(past["past_tokens"]) > 0
            for policy in ("sinks", "h2o") + (("block",) if budget >= 32 else ()):
                assert rows[("evict", variant, f"{policy}@{budget}", "past_tokens")] == past["past_tokens"]
                assert f"{float(rows[('evict', variant, f'{policy}@{budget}', 'past_nll')]):.4f}" != \
                    f"{float(past['past_nll']):.4f}", (variant, policy, budget)
        assert rows[("evict", variant, "block@16", "past_nll")] == ""
        assert f"| {variant} | int8 |" in md and f"| {variant} | fp8 |" in md
        # int4 and int2 where the rows come in slices of 16 (small gqa: 16 wide; small mla64: 24)
        width = c.kv_latent + c.rope_dim if c.kv_latent else c.head_dim
        for dtype in ("int4", "int2"):
            assert (("dtype", variant, dtype, "nll") in rows) == (width % 16 == 0), (variant, dtype)
        # KIVI's statistics: every layer, a max over a median is at least 1
        for layer in range(c.n_layers):
            for q in ("key_channel", "key_token"):
                assert float(rows[("key_statistics", variant, f"layer {layer}", q)]) >= 1.0
    version = subprocess.run([RUN, "--version"], stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
    assert f"Engine: `{version}`." in md
    for path, _ in ckpts.values():
        with open(path, "rb") as f:
            assert f"`{os.path.basename(path)}` {hashlib.sha256(f.read()).hexdigest()[:12]}" in md
