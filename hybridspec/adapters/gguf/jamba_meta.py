"""llama.cpp's Jamba (`jamba`) layout: GGUF metadata <-> config.

A layer is attention where `attention.head_count_kv[i]` > 0, else Mamba-1; its feed-forward is a
mixture of experts where the file holds its router (`ffn_gate_inp`), else a SwiGLU MLP: llama.cpp
reads the layer pattern from these, not from HF's attn/expert period and offset keys, which the
converter does not write. Reading, the period and offset that reproduce the pattern are found again
(hybridspec's Jamba config is built from them). The Mamba-1 sizes ride on the ssm.* keys:
ssm.inner_size is d_inner, ssm.time_step_rank the Δ rank r, ssm.state_size N. Tensors as the
converter stores them: ssm_x (x_proj), ssm_dt (dt_proj, with its bias), ssm_dt_norm / ssm_b_norm /
ssm_c_norm, ssm_a = -exp(A_log) [d_inner, N], ssm_conv1d [d_inner, k], the experts stacked.
"""
from __future__ import annotations

from hybridspec.config import HybridConfig
from hybridspec.errors import UnsupportedModelError
from hybridspec.adapters.gguf.keys import Tensors, get, per_layer


def period_of(flags: list[bool], what: str) -> tuple[int, int]:
    """The smallest (period, offset) with flags[i] == (i % period == offset) for every layer i (an
    offset past the period marks none)."""
    n = len(flags)
    for period in range(1, n + 2):
        for offset in range(period + 1):
            if all(flag == (i % period == offset) for i, flag in enumerate(flags)):
                return period, offset
    raise UnsupportedModelError(f"the file's {what} layers {[i for i, f in enumerate(flags) if f]} follow no "
                                "period and offset; hybridspec's Jamba places them every period layers")


def config_dict(meta: dict, arch: str, tensors: Tensors) -> dict:
    hidden, layers = int(get(meta, arch, "embedding_length")), int(get(meta, arch, "block_count"))
    kv = per_layer(meta, arch, "attention.head_count_kv", layers)
    attn_period, attn_offset = period_of([k > 0 for k in kv], "attention")
    moe = [f"blk.{i}.ffn_gate_inp.weight" in tensors.names for i in range(layers)]
    expert_period, expert_offset = period_of(moe, "mixture-of-experts")
    heads = int(get(meta, arch, "attention.head_count"))
    return {"vocab_size": int(get(meta, arch, "vocab_size", 0)) or None, "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": max(kv) or heads,
            "attn_layer_period": attn_period, "attn_layer_offset": attn_offset,
            "expert_layer_period": expert_period, "expert_layer_offset": expert_offset,
            "num_experts": int(get(meta, arch, "expert_count", 0)),
            "num_experts_per_tok": int(get(meta, arch, "expert_used_count", 0)),
            "intermediate_size": int(get(meta, arch, "feed_forward_length")),
            "mamba_expand": int(get(meta, arch, "ssm.inner_size")) // hidden,
            "mamba_d_state": int(get(meta, arch, "ssm.state_size")),
            "mamba_dt_rank": int(get(meta, arch, "ssm.time_step_rank")),
            "mamba_d_conv": int(get(meta, arch, "ssm.conv_kernel")),
            "mamba_conv_bias": tensors.any(".ssm_conv1d.bias"), "mamba_proj_bias": tensors.any(".ssm_in.bias"),
            "rms_norm_eps": float(get(meta, arch, "attention.layer_norm_rms_epsilon")),
            "max_position_embeddings": int(get(meta, arch, "context_length", 262144)),
            "tie_word_embeddings": "output.weight" not in tensors.names,
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id")}


def metadata(config: HybridConfig) -> dict:
    a, m, moe = config.attention, config.mamba1, config.moe
    if m.d_inner != 2 * config.hidden_size or m.proj_bias or not m.conv_bias:
        raise UnsupportedModelError(
            f"this Jamba (d_inner={m.d_inner}, hidden_size={config.hidden_size}, mamba_proj_bias={m.proj_bias}, "
            f"mamba_conv_bias={m.conv_bias}) cannot be written in llama.cpp's jamba layout: it holds "
            "d_inner = 2·hidden_size, conv biases and no in/out projection biases only")
    return {"block_count": config.num_layers, "embedding_length": config.hidden_size,
            "context_length": config.max_position_embeddings, "vocab_size": config.vocab_size,
            "feed_forward_length": config.mlp.intermediate_size, "attention.head_count": a.num_heads,
            "attention.head_count_kv": [a.num_kv_heads if t == "attention" else 0 for t in config.layer_types],
            "attention.layer_norm_rms_epsilon": config.rms_norm_eps,
            "ssm.conv_kernel": m.d_conv, "ssm.inner_size": m.d_inner, "ssm.state_size": m.d_state,
            "ssm.time_step_rank": m.dt_rank,
            # no mixture of experts: 0 and 0, which llama.cpp's loader accepts (the converter writes HF's counts)
            "expert_count": moe.num_experts if moe else 0, "expert_used_count": moe.top_k if moe else 0}
