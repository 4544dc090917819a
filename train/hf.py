"""Hugging Face checkpoints in and out (docs/MODELS_IN_OUT.md).

In:  a directory with config.json, model.safetensors (or shards and
     model.safetensors.index.json) and tokenizer.model: LlamaForCausalLM, MistralForCausalLM
     (its sliding_window becomes the model's window), and the DeepseekV2ForCausalLM that
     export_hf writes (dense, no query compression). What the engine cannot run is refused
     with one line: biases, rope_scaling, another activation or tokenizer, an unknown field.
Out: LlamaForCausalLM (mha, gqa, mqa; MistralForCausalLM if the model has a window) or
     DeepseekV2ForCausalLM (mla64, mla128), with tokenizer.model, tokenizer.json (for a BPE
     model), tokenizer_config.json and generation_config.json, written into DIR.tmp and
     renamed to DIR.

RoPE: our q and k rotate interleaved pairs (x[2i], x[2i+1]); Hugging Face's Llama rotates
halves (x[i], x[i + d/2]). to_rotate_half / to_interleaved reorder each head's rows of wq
and wk (the permutation of transformers' convert_llama_weights_to_hf.py and its inverse),
which gives the same scores. DeepSeek-V2's decoupled RoPE part needs none: transformers
rotates it as interleaved pairs (the older modeling code de-interleaves q_pe and k_pe alike
before rotating halves, which is the same function), so wq, wkr go over unchanged.
"""
import json
import os
import re
import shutil
import tempfile

import numpy as np

import export
import safetensors_io as st
from model import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class HFError(ValueError):
    pass


def engine_max_seq_len():
    """The loader's longest context, read from config.h (MAX_SEQ_LEN), 8192 if not found."""
    try:
        with open(os.path.join(ROOT, "config.h")) as f:
            m = re.search(r"MAX_SEQ_LEN\s*=\s*(\d+)", f.read())
        return int(m.group(1)) if m else 8192
    except OSError:
        return 8192


def to_rotate_half(w, n_heads):
    """Rows of wq/wk, interleaved pairs per head -> halves per head."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def to_interleaved(w, n_heads):
    """Rows of wq/wk, halves per head -> interleaved pairs per head (to_rotate_half's inverse)."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def short_float(x):
    """The shortest decimal that reads back as the same float32 (1e-05 for float32(1e-5))."""
    x32 = np.float32(x)
    for p in range(1, 10):
        v = float(f"{float(x32):.{p}g}")
        if np.float32(v) == x32:
            return v
    return float(x32)


# ---------------------------------------------------------------- config.json

# fields read, fields whose value changes nothing at inference (any value), and fields that
# must hold one value (or be absent)
COMMON = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "vocab_size", "bos_token_id",
          "eos_token_id", "tie_word_embeddings", "architectures", "model_type", "rope_parameters"}
IGNORED = {"initializer_range", "use_cache", "torch_dtype", "dtype", "transformers_version", "pad_token_id",
           "attention_dropout", "_name_or_path", "max_length", "output_attentions", "output_hidden_states",
           "return_dict", "auto_map"}
FIXED = {"hidden_act": "silu", "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
         "pretraining_tp": 1}
ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "DeepseekV2ForCausalLM": "deepseek_v2"}
EXTRA = {"llama": set(), "mistral": {"sliding_window"},
         "deepseek_v2": {"q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                         "first_k_dense_replace", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                         "moe_intermediate_size", "topk_method", "n_group", "topk_group", "routed_scaling_factor",
                         "norm_topk_prob", "moe_layer_freq", "scoring_func", "aux_loss_alpha", "seq_aux",
                         "qk_head_dim", "rope_interleave"}}


def _int(cfg, key, default=None, lo=1):
    v = cfg.get(key, default)
    if type(v) is not int or v < lo:
        raise HFError(f"config.json: {key} = {v!r} is not an integer >= {lo}")
    return v


def _token_id(cfg, key):
    v = cfg.get(key)
    if isinstance(v, list) and len(v) == 1:
        v = v[0]
    if v is not None and type(v) is not int:
        raise HFError(f"config.json: {key} = {v!r} is not one token id")
    return v


def read_config(d):
    """(Config, arch kind, bos, eos) from d/config.json, refusing what the engine cannot run."""
    path = os.path.join(d, "config.json")
    try:
        with open(path, "rb") as f:
            cfg = json.loads(f.read().decode("utf-8"), object_pairs_hook=st._no_duplicates)
    except FileNotFoundError:
        raise HFError(f"{d}: no config.json") from None
    except (UnicodeDecodeError, json.JSONDecodeError, st.SafetensorsError) as e:
        raise HFError(f"{path}: not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise HFError(f"{path}: not a JSON object")
    arch = cfg.get("architectures")
    if not (isinstance(arch, list) and len(arch) == 1 and arch[0] in ARCH):
        raise HFError(f"config.json: architectures {arch!r}; this engine runs {', '.join(ARCH)}")
    kind = ARCH[arch[0]]
    if cfg.get("model_type") != kind:
        raise HFError(f"config.json: model_type {cfg.get('model_type')!r} does not go with {arch[0]} ({kind!r})")
    unknown = sorted(set(cfg) - COMMON - IGNORED - set(FIXED) - EXTRA[kind])
    if unknown:
        raise HFError(f"config.json: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                      f"(the engine cannot tell what {'they change' if len(unknown) > 1 else 'it changes'})")
    for k, v in FIXED.items():
        if k in cfg and cfg[k] != v and not (k == "pretraining_tp" and kind == "deepseek_v2"):
            raise HFError(f"config.json: {k} = {json.dumps(cfg[k])}; the engine runs only {json.dumps(v)}")
    D = _int(cfg, "hidden_size")
    H = _int(cfg, "num_attention_heads")
    L = _int(cfg, "num_hidden_layers")
    F = _int(cfg, "intermediate_size")
    V = _int(cfg, "vocab_size")
    ctx = _int(cfg, "max_position_embeddings")
    eps = cfg.get("rms_norm_eps")
    if not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise HFError(f"config.json: rms_norm_eps = {eps!r} is not in (0, 1)")
    theta = cfg.get("rope_theta", 10000.0)
    rp = cfg.get("rope_parameters")
    if rp is not None:
        if not isinstance(rp, dict) or rp.get("rope_type", "default") != "default" or \
                set(rp) - {"rope_type", "rope_theta"}:
            raise HFError(f"config.json: rope_parameters {json.dumps(rp)}; the engine runs only the default RoPE")
        if "rope_theta" in cfg and "rope_theta" in rp and rp["rope_theta"] != cfg["rope_theta"]:
            raise HFError("config.json: rope_theta and rope_parameters.rope_theta differ")
        theta = rp.get("rope_theta", theta)
    if not isinstance(theta, (int, float)) or not 1 < theta < 1e9:
        raise HFError(f"config.json: rope_theta = {theta!r} is not a sane number")
    tied = cfg.get("tie_word_embeddings", False)  # transformers' default for all three
    if not isinstance(tied, bool):
        raise HFError(f"config.json: tie_word_embeddings = {tied!r} is not true or false")
    common = dict(dim=D, n_layers=L, n_heads=H, hidden_dim=F, vocab_size=V, max_seq_len=ctx,
                  rope_theta=float(np.float32(theta)), norm_eps=float(np.float32(eps)), untied_head=not tied)
    if kind == "deepseek_v2":
        for k, want in (("q_lora_rank", None), ("n_routed_experts", (None, 0)), ("n_shared_experts", (None, 0)),
                        ("num_experts_per_tok", (None, 0))):
            if cfg.get(k) not in (want if isinstance(want, tuple) else (want,)):
                raise HFError(f"config.json: {k} = {json.dumps(cfg.get(k))}; the engine runs no query compression "
                              "and no experts")
        if cfg.get("first_k_dense_replace") != L:
            raise HFError(f"config.json: first_k_dense_replace = {cfg.get('first_k_dense_replace')!r}; the engine "
                          f"runs only dense layers (= num_hidden_layers, {L})")
        hd, vd = _int(cfg, "qk_nope_head_dim"), _int(cfg, "v_head_dim")
        if hd != vd:
            raise HFError(f"config.json: qk_nope_head_dim {hd} != v_head_dim {vd}; the engine's MLA has one head width")
        if cfg.get("num_key_value_heads", H) != H:
            raise HFError("config.json: num_key_value_heads must equal num_attention_heads for MLA")
        rd, dc = _int(cfg, "qk_rope_head_dim"), _int(cfg, "kv_lora_rank")
        if cfg.get("head_dim", rd) not in (rd, None):  # transformers sets it to qk_rope_head_dim
            raise HFError(f"config.json: head_dim {cfg['head_dim']} is not qk_rope_head_dim {rd}")
        if rd % 2:
            raise HFError(f"config.json: qk_rope_head_dim = {rd} is odd (RoPE rotates pairs)")
        if cfg.get("qk_head_dim", hd + rd) != hd + rd:  # transformers 5 writes the sum
            raise HFError(f"config.json: qk_head_dim {cfg['qk_head_dim']} is not qk_nope_head_dim + "
                          f"qk_rope_head_dim ({hd + rd})")
        if cfg.get("rope_interleave", True) is not True:
            raise HFError("config.json: rope_interleave is not true; the engine's RoPE key rotates "
                          "interleaved pairs, as DeepSeek-V2's does")
        variant = {64: "mla64", 128: "mla128"}.get(dc, "mla")
        c = Config(variant=variant, head_dim=hd, n_kv_heads=0, kv_latent=dc, rope_dim=rd, **common)
    else:
        Hkv = H if cfg.get("num_key_value_heads") is None else _int(cfg, "num_key_value_heads")  # null: MHA
        hd = cfg.get("head_dim")
        if hd is None:
            if D % H:
                raise HFError(f"config.json: hidden_size {D} is not a multiple of num_attention_heads {H}")
            hd = D // H
        hd = _int({"head_dim": hd}, "head_dim")
        if hd % 2:
            raise HFError(f"config.json: head_dim = {hd} is odd (RoPE rotates pairs)")
        if H % Hkv:
            raise HFError(f"config.json: num_key_value_heads {Hkv} does not divide num_attention_heads {H}")
        variant = "mha" if Hkv == H else "mqa" if Hkv == 1 else "gqa"
        window = 0
        if kind == "mistral":
            sw = cfg.get("sliding_window")
            if sw is not None:
                window = _int(cfg, "sliding_window")
                if window >= ctx:
                    window = 0  # a window of the whole context changes nothing
        c = Config(variant=variant, head_dim=hd, n_kv_heads=Hkv, kv_latent=0, rope_dim=0, window=window, **common)
    return c, kind, _token_id(cfg, "bos_token_id"), _token_id(cfg, "eos_token_id")


# ---------------------------------------------------------------- names

def hf_names(cfg, kind):
    """[(our name, HF name)] in our file order; the untied head last."""
    out = [("tok_embeddings.weight", "model.embed_tokens.weight")]
    for i in range(cfg.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out.append((p + "attn_norm.weight", q + "input_layernorm.weight"))
        if kind == "deepseek_v2":
            out += [(p + "attn.wq.weight", q + "self_attn.q_proj.weight")]
        else:
            out += [(p + f"attn.w{x}.weight", q + f"self_attn.{x}_proj.weight") for x in "qkv"]
        out += [(p + "attn.wo.weight", q + "self_attn.o_proj.weight"),
                (p + "ffn_norm.weight", q + "post_attention_layernorm.weight"),
                (p + "ffn.w1.weight", q + "mlp.gate_proj.weight"),
                (p + "ffn.w2.weight", q + "mlp.down_proj.weight"),
                (p + "ffn.w3.weight", q + "mlp.up_proj.weight")]
    out.append(("norm.weight", "model.norm.weight"))
    if cfg.untied_head:
        out.append(("output.weight", "lm_head.weight"))
    return out


def _mla_parts(cfg, i):
    q = f"model.layers.{i}.self_attn."
    return q + "kv_a_proj_with_mqa.weight", q + "kv_a_layernorm.weight", q + "kv_b_proj.weight"


# ---------------------------------------------------------------- in

def _storage(t, dtype):
    """A safetensors Tensor as what write_checkpoint takes: bf16 bits kept for a bf16 file, else fp32."""
    if dtype == "bf16" and t.dtype == "BF16":
        return np.array(t.data)
    return t.to_f32()


def import_hf(d, out, dtype=None, context=None, tokenizer=None):
    """Converts the Hugging Face directory d into our checkpoint out. dtype: bf16 or fp32 (default:
    bf16 if every tensor is bf16, else fp32, which holds fp16 exactly). context: a shorter
    context than max_position_embeddings. Returns (Config, header)."""
    cfg, kind, bos, eos = read_config(d)
    tok_path = tokenizer or os.path.join(d, "tokenizer.model")
    if not os.path.isfile(tok_path):
        have = [f for f in ("tokenizer.json", "tokenizer_config.json") if os.path.exists(os.path.join(d, f))]
        raise HFError(f"{d}: no tokenizer.model (a SentencePiece model){'; it has ' + ', '.join(have) if have else ''}"
                      " -- the engine runs only SentencePiece tokenizers")
    n, t_bos, t_eos, _ = export.tokenizer_info(tok_path)
    if n != cfg.vocab_size:
        raise HFError(f"{tok_path} has {n} pieces but config.json's vocab_size (the embedding's rows) is "
                      f"{cfg.vocab_size}")
    if (bos is not None and bos != t_bos) or (eos is not None and eos != t_eos):
        raise HFError(f"config.json's bos/eos ({bos}, {eos}) are not tokenizer.model's ({t_bos}, {t_eos})")
    if context is not None:
        if not 0 < context <= cfg.max_seq_len:
            raise HFError(f"--context {context} must lie in 1..max_position_embeddings ({cfg.max_seq_len})")
        cfg.max_seq_len = context
        if cfg.window >= context:
            cfg.window = 0
    if cfg.max_seq_len > engine_max_seq_len():
        raise HFError(f"max_position_embeddings {cfg.max_seq_len} is over the engine's context limit "
                      f"({engine_max_seq_len()}); pass --context N to use the first N positions")
    export.variant_code(cfg)
    tensors = st.read_dir(d)
    for name in [k for k in tensors if k.endswith("rotary_emb.inv_freq")]:
        del tensors[name]  # old checkpoints saved RoPE's frequencies; the engine computes them
    for name, t in tensors.items():
        if t.dtype not in ("F32", "F16", "BF16"):
            raise HFError(f"tensor {name} is {t.dtype}; the engine reads F32, F16 and BF16")
    if dtype is None:
        dtype = "bf16" if all(t.dtype == "BF16" for t in tensors.values()) else "fp32"
    names = hf_names(cfg, kind)
    want = {h for _, h in names}
    if kind == "deepseek_v2":
        want |= {x for i in range(cfg.n_layers) for x in _mla_parts(cfg, i)}
    if cfg.untied_head is False and "lm_head.weight" in tensors:
        # a tied model may store its head anyway; it must then be the embedding
        if not np.array_equal(tensors["lm_head.weight"].data, tensors["model.embed_tokens.weight"].data):
            raise HFError("tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight")
        del tensors["lm_head.weight"]
    missing, extra = sorted(want - set(tensors)), sorted(set(tensors) - want)
    if missing:
        raise HFError(f"{d}: tensor{'s' if len(missing) > 1 else ''} {', '.join(missing[:3])} missing"
                      f"{' (and ' + str(len(missing) - 3) + ' more)' if len(missing) > 3 else ''}")
    if extra:
        raise HFError(f"{d}: tensor{'s' if len(extra) > 1 else ''} {', '.join(extra[:3])} that a "
                      f"{kind} model of this config does not have (biases?)")
    layout = dict(export.tensor_layout(cfg))
    arrays = {}
    for ours, theirs in names:
        arrays[ours] = _storage(tensors[theirs], dtype)
    for i in range(cfg.n_layers):
        p = f"layers.{i}.attn."
        if kind == "deepseek_v2":
            a, norm, b = (_storage(tensors[x], dtype) for x in _mla_parts(cfg, i))
            dc, rd, H, hd = cfg.kv_latent, cfg.rope_dim, cfg.n_heads, cfg.head_dim
            if a.shape != (dc + rd, cfg.dim) or b.shape != (H * 2 * hd, dc):
                raise HFError(f"layer {i}: kv_a_proj_with_mqa {a.shape} or kv_b_proj {b.shape} does not fit the config")
            arrays[p + "wdkv.weight"], arrays[p + "wkr.weight"] = a[:dc], a[dc:]
            arrays[p + "kv_norm.weight"] = norm
            b = b.reshape(H, 2, hd, dc)
            arrays[p + "wuk.weight"] = b[:, 0].reshape(H * hd, dc)
            arrays[p + "wuv.weight"] = b[:, 1].reshape(H * hd, dc)
        else:
            for x, heads in (("wq", cfg.n_heads), ("wk", cfg.n_kv_heads)):
                w = arrays[p + x + ".weight"]
                if w.ndim != 2 or w.shape[0] != heads * cfg.head_dim:
                    raise HFError(f"layer {i}: {x} has shape {w.shape}, the config implies "
                                  f"{(heads * cfg.head_dim, cfg.dim)}")
                arrays[p + x + ".weight"] = to_interleaved(w, heads)
    for name, shape in layout.items():
        if tuple(arrays[name].shape) != tuple(shape):
            hf = dict(names).get(name, name)
            raise HFError(f"tensor {hf}: shape {tuple(arrays[name].shape)}, the config implies {tuple(shape)}")
    ordered = [(name, np.ascontiguousarray(arrays[name])) for name in layout]
    with open(tok_path, "rb") as f:
        tok = f.read()
    hdr = export.write_checkpoint(cfg, ordered, out, tok, dtype)
    return cfg, hdr


# ---------------------------------------------------------------- out

def hf_config(cfg, bos, eos, dtype):
    """config.json of a model of Config cfg."""
    torch_dtype = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    common = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.hidden_dim,
              "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
              "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": short_float(cfg.norm_eps),
              "rope_theta": short_float(cfg.rope_theta), "rope_scaling": None, "hidden_act": "silu",
              "attention_bias": False, "tie_word_embeddings": not cfg.untied_head, "bos_token_id": bos,
              "eos_token_id": eos, "initializer_range": 0.02, "use_cache": True, "attention_dropout": 0.0,
              "torch_dtype": torch_dtype}
    if cfg.is_mla:
        return {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", **common,
                "num_key_value_heads": cfg.n_heads, "q_lora_rank": None, "kv_lora_rank": cfg.kv_latent,
                "qk_rope_head_dim": cfg.rope_dim, "qk_nope_head_dim": cfg.head_dim, "v_head_dim": cfg.head_dim,
                "first_k_dense_replace": cfg.n_layers, "n_routed_experts": 0, "n_shared_experts": 0,
                "num_experts_per_tok": 0, "moe_intermediate_size": cfg.hidden_dim, "topk_method": "greedy",
                "mlp_bias": False}
    arch, kind, extra = ("LlamaForCausalLM", "llama", {"mlp_bias": False, "pretraining_tp": 1})
    if cfg.window:
        arch, kind, extra = "MistralForCausalLM", "mistral", {"sliding_window": cfg.window}
    return {"architectures": [arch], "model_type": kind, **common, "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, **extra}


def hf_tensors(cfg, tensors, dtype):
    """{HF name: safetensors Tensor} from our {name: array} (fp32, or bf16 bits for dtype bf16)."""
    st_dtype = {"bf16": "BF16", "fp32": "F32"}[dtype]

    def conv(a):
        if dtype == "bf16":
            a = a if a.dtype == np.uint16 else export.bf16_bits(a)
            return st.Tensor("BF16", np.ascontiguousarray(a, dtype="<u2"))
        return st.Tensor(st_dtype, np.ascontiguousarray(a, dtype="<f4"))

    kind = "deepseek_v2" if cfg.is_mla else "llama"
    out = {}
    for ours, theirs in hf_names(cfg, kind):
        a = tensors[ours]
        if not cfg.is_mla and ours.endswith(("attn.wq.weight", "attn.wk.weight")):
            a = to_rotate_half(a, cfg.n_heads if ours.endswith("wq.weight") else cfg.n_kv_heads)
        out[theirs] = conv(a)
        if cfg.is_mla and ours.endswith("attn.wq.weight"):
            i = int(ours.split(".")[1])
            p = f"layers.{i}.attn."
            a_name, n_name, b_name = _mla_parts(cfg, i)
            out[a_name] = conv(np.concatenate([tensors[p + "wdkv.weight"], tensors[p + "wkr.weight"]]))
            out[n_name] = conv(tensors[p + "kv_norm.weight"])
            H, hd, dc = cfg.n_heads, cfg.head_dim, cfg.kv_latent
            b = np.stack([tensors[p + "wuk.weight"].reshape(H, hd, dc), tensors[p + "wuv.weight"].reshape(H, hd, dc)],
                         axis=1)
            out[b_name] = conv(b.reshape(H * 2 * hd, dc))
    return out


def _varint(buf, i):
    v = shift = 0
    while True:
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return v, i


def _proto_fields(buf):
    """{field number: last value} of one protobuf message (varints and bytes): the few settings
    tokenizer.json needs, read without the protobuf package that Debian's python lacks."""
    out, i = {}, 0
    while i < len(buf):
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 0:
            out[key >> 3], i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            out[key >> 3], i = bytes(buf[i:i + n]), i + n
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"protobuf wire type {wire}")
    return out


# sentencepiece_model.proto: ModelProto's trainer_spec and normalizer_spec; TrainerSpec's
# model_type (BPE = 2) and byte_fallback; NormalizerSpec's name, add_dummy_prefix,
# remove_extra_whitespaces and escape_whitespaces (the last three true when absent)
MODEL_TRAINER, MODEL_NORMALIZER = 2, 3
TRAINER_TYPE, TRAINER_BYTE_FALLBACK, SPM_BPE = 3, 35, 2
NORM_NAME, NORM_DUMMY_PREFIX, NORM_EXTRA_SPACES, NORM_ESCAPE_SPACES = 1, 3, 4, 5
SPACE = "\u2581"


def tokenizer_json(tok, sp):
    """The tokenizer.json (Hugging Face tokenizers) of a SentencePiece BPE model with the identity
    normalizer, as transformers' Llama converter builds it: the whole text one word, SentencePiece's
    whitespace rules as normalizers, a merge for every split of a piece into two pieces, ranked by
    the merged piece's score (SentencePiece merges the best-scored pair first). None for any other
    model (unigram, NFKC): transformers converts tokenizer.model itself then.
    Why: transformers 5 ignores tokenizer_config.json's class for DeepSeek-V2 directories and
    without tokenizer.json builds a tokenizer that adds no leading space."""
    model = _proto_fields(tok)
    trainer = _proto_fields(model.get(MODEL_TRAINER, b""))
    norm = _proto_fields(model.get(MODEL_NORMALIZER, b""))
    if (trainer.get(TRAINER_TYPE) != SPM_BPE or norm.get(NORM_NAME) != b"identity"
            or not norm.get(NORM_ESCAPE_SPACES, 1)):
        return None
    n = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]
    vocab = {p: i for i, p in enumerate(pieces)}
    mergeable = {p for i, p in enumerate(pieces) if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))}
    merges = []
    for i, p in enumerate(pieces):
        if p in mergeable and not sp.is_unused(i):
            for k in range(1, len(p)):
                if p[:k] in mergeable and p[k:] in mergeable:
                    merges.append((-sp.get_score(i), i, vocab[p[:k]], p[:k], p[k:]))
    merges.sort()
    normalizers = []
    if norm.get(NORM_EXTRA_SPACES, 1):
        # spaces only, at the text's ends (tokenizers' Strip takes newlines and tabs too, and its
        # regexes' ^ and $ match at every line)
        normalizers += [{"type": "Replace", "pattern": {"Regex": "\\A +| +\\z"}, "content": ""},
                        {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]
    if norm.get(NORM_DUMMY_PREFIX, 1):
        normalizers.append({"type": "Prepend", "prepend": SPACE})
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": SPACE})
    bos, unk = pieces[sp.bos_id()], pieces[sp.unk_id()]
    specials = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    decoders = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]
    if norm.get(NORM_DUMMY_PREFIX, 1):
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": pieces[i], "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i in specials],
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [sp.bos_id()], "tokens": [bos]}}},
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": bool(trainer.get(TRAINER_BYTE_FALLBACK, 0)),
                  "ignore_merges": False, "vocab": vocab, "merges": [[m[3], m[4]] for m in merges]},
    }


def export_hf(src, out_dir, force=False):
    """Writes our checkpoint src (a .bin) as a Hugging Face directory out_dir, in src's dtype
    (bf16 bits unchanged). The directory is built as out_dir.tmp and renamed; an existing
    out_dir is refused unless force (then replaced). Returns the config dict."""
    hdr = export.read_header(src)
    export.check_header(hdr, src)
    cfg = export.header_config(hdr)
    dtype = {0: "fp32", 1: "bf16"}[hdr["dtype"]]
    if os.path.exists(out_dir) and not force:
        raise HFError(f"{out_dir} exists; choose a new directory or pass --force to replace it")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise HFError(f"{out_dir} is not a directory; --force replaces a model directory only")
    tensors = export.read_tensors(src, bf16_bits_too=True)
    for name, a in tensors.items():
        export.check_finite(name, a)
    tok = export.read_embedded_tokenizer(src)
    _, bos, eos, sp = export.tokenizer_info(tok)
    config = hf_config(cfg, bos, eos, dtype)
    hf = hf_tensors(cfg, tensors, dtype)
    tok_config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
                  "bos_token": sp.id_to_piece(bos), "eos_token": sp.id_to_piece(eos),
                  "unk_token": sp.id_to_piece(sp.unk_id()) if sp.unk_id() >= 0 else None,
                  "pad_token": None, "model_max_length": cfg.max_seq_len, "legacy": False,
                  "clean_up_tokenization_spaces": False, "sp_model_kwargs": {}}
    gen_config = {"bos_token_id": bos, "eos_token_id": eos, "max_length": cfg.max_seq_len, "do_sample": False}
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=os.path.basename(os.path.abspath(out_dir)) + ".", suffix=".tmp")
    try:
        files = [("config.json", config), ("tokenizer_config.json", tok_config),
                 ("generation_config.json", gen_config)]
        tok_json = tokenizer_json(tok, sp)
        if tok_json is not None:
            files.append(("tokenizer.json", tok_json))
        for name, obj in files:
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(obj, f, indent=2)
                f.write("\n")
        with open(os.path.join(tmp, "tokenizer.model"), "wb") as f:
            f.write(tok)
        with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
            st.write_file(f, hf, {"format": "pt"})
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.chmod(tmp, 0o777 & ~export.umask())  # mkdtemp's 0700 would keep the model from other users
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return config
