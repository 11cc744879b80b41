"""llama.cpp's Falcon-H1 (`falcon-h1`) layout: GGUF metadata <-> config, and the µP multipliers its
converter folds into the weights (`fold`).

Every layer is parallel (attention and Mamba-2 on the same normed input), so head_count_kv is one
scalar and no key says which layers are which. llama.cpp's graph has no multiplier: its converter
multiplies them into the tensors (shapes in torch order):
    token_embd   = embedding_multiplier · embed            output = lm_head_multiplier · lm_head
    attn_q, attn_v = attention_in_multiplier · W           attn_k = key_multiplier · attention_in · W
    attn_output  = attention_out_multiplier · W            ssm_out = ssm_out_multiplier · W
    ssm_in [z | x | B | C | dt] rows times ssm_in_multiplier · ssm_multipliers[slice]
    ffn_gate     = mlp_multipliers[0] · W                  ffn_down = mlp_multipliers[1] · W
so a file read back has every multiplier 1 (softmax scale head_dim ** -0.5). The Mamba-2 output is
RMSNorm(y ⊙ silu(z)) where the file holds ssm_norm, else y ⊙ silu(z) (llama.cpp normalises after the
gate only). Its pre-feed-forward norm is `blk.N.ffn_norm`, without a `.weight` suffix (gguf-py maps
the whole HF name `pre_ff_layernorm.weight` to it).
"""
from __future__ import annotations

import math

import torch

from hybridspec.config import HybridConfig
from hybridspec.errors import UnsupportedModelError
from hybridspec.adapters.gguf.keys import Tensors, get, per_layer


def config_dict(meta: dict, arch: str, tensors: Tensors) -> dict:
    hidden, heads = int(get(meta, arch, "embedding_length")), int(get(meta, arch, "attention.head_count"))
    head_dim = int(get(meta, arch, "attention.key_length", hidden // max(heads, 1)))
    inner, ssm_heads = int(get(meta, arch, "ssm.inner_size")), int(get(meta, arch, "ssm.time_step_rank"))
    layers = int(get(meta, arch, "block_count"))
    kv = set(per_layer(meta, arch, "attention.head_count_kv", layers))  # the converter writes one scalar
    if len(kv) != 1 or 0 in kv:
        raise UnsupportedModelError(f"{arch}.attention.head_count_kv={sorted(kv)}: every Falcon-H1 layer holds "
                                    "attention with the same KV heads")
    cfg = {"vocab_size": int(get(meta, arch, "vocab_size", 0)) or None, "hidden_size": hidden,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv.pop(),
           "head_dim": head_dim,
           "intermediate_size": int(get(meta, arch, "feed_forward_length")),
           "rms_norm_eps": float(get(meta, arch, "attention.layer_norm_rms_epsilon")),
           "rope_theta": float(get(meta, arch, "rope.freq_base", 10000.0)),
           "max_position_embeddings": int(get(meta, arch, "context_length", 8192)),
           "tie_word_embeddings": "output.weight" not in tensors.names,
           "attention_bias": tensors.any(".attn_q.bias"), "mlp_bias": tensors.any(".ffn_up.bias"),
           "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
           "mamba_d_ssm": inner, "mamba_n_heads": ssm_heads, "mamba_d_head": inner // ssm_heads,
           "mamba_d_state": int(get(meta, arch, "ssm.state_size")),
           "mamba_n_groups": int(get(meta, arch, "ssm.group_count")),
           "mamba_d_conv": int(get(meta, arch, "ssm.conv_kernel")), "mamba_expand": max(inner // hidden, 1),
           "mamba_conv_bias": tensors.any(".ssm_conv1d.bias"),
           "mamba_proj_bias": tensors.any(".ssm_in.bias"), "projectors_bias": tensors.any(".ssm_in.bias"),
           "mamba_rms_norm": tensors.any(".ssm_norm.weight"), "mamba_norm_before_gate": False}
    rotary = get(meta, arch, "rope.dimension_count", None)
    if rotary is not None:
        cfg["partial_rotary_factor"] = int(rotary) / head_dim
    for key, field in (("ssm.chunk_size", "mamba_chunk_size"), ("ssm.dt_limit", "time_step_limit")):
        value = get(meta, arch, key, None)
        if value is not None:
            cfg[field] = int(value) if field == "mamba_chunk_size" else [float(x) for x in value]
    return cfg


def _check_writable(config: HybridConfig) -> None:
    """What llama.cpp's Falcon-H1 graph cannot hold, named before anything is written."""
    a, m = config.attention, config.mamba2
    problems = []
    if m.norm == "norm_then_gate":
        problems.append("mamba_norm_before_gate=True (llama.cpp normalises after the gate only)")
    if a.bias or m.proj_bias:
        problems.append("attention or Mamba projection biases (llama.cpp's graph has none)")
    if config.tie_word_embeddings and not math.isclose(config.embedding_multiplier * config.logits_scaling, 1.0,
                                                         rel_tol=1e-6):
        problems.append("tied embeddings with embedding_multiplier != lm_head_multiplier (the converter folds "
                        "each multiplier into its own copy)")
    if problems:
        raise UnsupportedModelError("this Falcon-H1 cannot be written as GGUF in llama.cpp's falcon-h1 layout: "
                                    + "; ".join(problems))


def metadata(config: HybridConfig) -> dict:
    _check_writable(config)
    a, m = config.attention, config.mamba2
    out = {"block_count": config.num_layers, "embedding_length": config.hidden_size,
           "context_length": config.max_position_embeddings, "vocab_size": config.vocab_size,
           "feed_forward_length": config.mlp.intermediate_size, "attention.head_count": a.num_heads,
           "attention.head_count_kv": a.num_kv_heads, "attention.key_length": a.head_dim,
           "attention.value_length": a.head_dim, "attention.layer_norm_rms_epsilon": config.rms_norm_eps,
           "rope.freq_base": a.rope_theta, "ssm.conv_kernel": m.d_conv, "ssm.state_size": m.d_state,
           "ssm.group_count": m.n_groups, "ssm.inner_size": m.d_inner, "ssm.time_step_rank": m.num_heads,
           "ssm.chunk_size": m.chunk_size}
    if a.partial_rotary_factor != 1.0:  # the converter writes none: llama.cpp then turns the whole head
        out["rope.dimension_count"] = int(a.head_dim * a.partial_rotary_factor)
    if tuple(m.time_step_limit) != (0.0, float("inf")):
        out["ssm.dt_limit"] = [float(x) for x in m.time_step_limit]
    return out


def _in_proj_rows(config: HybridConfig) -> torch.Tensor:
    """[2·n·p + 2·g·N + n] each in_proj row's multiplier (z, x, B, C, dt slices)."""
    m = config.mamba2
    widths = (m.d_inner, m.d_inner, m.n_groups * m.d_state, m.n_groups * m.d_state, m.num_heads)
    multipliers = m.in_proj_multipliers or (1.0,) * 5
    return torch.cat([torch.full((w,), float(x)) for w, x in zip(widths, multipliers)])


def multiplier(rest: str, config: HybridConfig) -> float | torch.Tensor | None:
    """The factor the converter folds into the canonical tensor `rest` (a name under layers.N., or a
    global one): a number, per-row factors [rows, 1], or None where it keeps the tensor."""
    a, p, mlp = config.attention, config.parallel, config.mlp
    attention_in = p.attention_in_multiplier
    key = a.softmax_scale * a.head_dim ** 0.5  # the key multiplier our config folds into the softmax scale
    factors = {"embed_tokens.weight": config.embedding_multiplier, "lm_head.weight": 1.0 / config.logits_scaling,
               "mixer.q_proj.weight": attention_in, "mixer.v_proj.weight": attention_in,
               "mixer.k_proj.weight": key * attention_in, "mixer.o_proj.weight": p.attention_out_multiplier,
               "mixer.out_proj.weight": p.mamba_out_multiplier,
               "ffn.gate_proj.weight": mlp.gate_multiplier, "ffn.gate_proj.bias": mlp.gate_multiplier,
               "ffn.down_proj.weight": mlp.down_multiplier, "ffn.down_proj.bias": mlp.down_multiplier}
    if rest == "mixer.in_proj.weight":
        return _in_proj_rows(config)[:, None]
    return factors.get(rest)


def fold(rest: str, tensor: torch.Tensor, config: HybridConfig) -> torch.Tensor:
    """The canonical tensor `rest` with its multiplier folded in, in float32. The converter multiplies
    k_proj and in_proj twice (by attention_in / ssm_in, then by key_multiplier / the slice's) in the
    checkpoint's dtype; once by the product, here: a value may differ from its file by an ulp."""
    factor = multiplier(rest, config)
    if factor is None or (not isinstance(factor, torch.Tensor) and factor == 1.0):
        return tensor
    return tensor.float() * factor
