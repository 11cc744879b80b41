"""GGUF metadata <-> config for llama.cpp's gated-DeltaNet architectures: Qwen3-Next (`qwen3next`) and
Qwen3.5 (`qwen35` dense, `qwen35moe`), as its converter writes them.

The GDN sizes ride on the ssm.* keys: ssm.state_size is d_k, ssm.group_count HK, ssm.time_step_rank
HV and ssm.inner_size HV·d_v. Layer i is full attention when (i + 1) % full_attention_interval == 0,
as llama.cpp reads it (a model whose layer_types break that pattern cannot be written). A layer's
feed-forward is a mixture of experts where the file holds its router (`ffn_gate_inp`). Qwen3.5 files
may end with multi-token-prediction blocks (`nextn_predict_layers` of the block_count): not part of
the target. The zero-centred norms are stored as 1 + w (`names`), so the config read multiplies by
the stored weight as it is (`zero_centred_norms` off).
"""
from __future__ import annotations

from hybridspec.config import HybridConfig
from hybridspec.errors import UnsupportedModelError
from hybridspec.adapters.gguf.keys import Tensors, get


def num_layers(meta: dict, arch: str) -> int:
    """The target's layers: block_count less the MTP blocks Qwen3.5's converter appends."""
    return int(get(meta, arch, "block_count")) - int(get(meta, arch, "nextn_predict_layers", 0))


def config_dict(meta: dict, arch: str, tensors: Tensors) -> dict:
    layers, heads = num_layers(meta, arch), int(get(meta, arch, "attention.head_count"))
    hidden, head_dim = int(get(meta, arch, "embedding_length")), int(get(meta, arch, "attention.key_length"))
    value_heads = int(get(meta, arch, "ssm.time_step_rank"))
    interval = int(get(meta, arch, "full_attention_interval"))
    moe_layers = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors.names]
    cfg = {"vocab_size": int(get(meta, arch, "vocab_size", 0)) or None, "hidden_size": hidden,
           "num_hidden_layers": layers, "num_attention_heads": heads, "head_dim": head_dim,
           "num_key_value_heads": int(get(meta, arch, "attention.head_count_kv")),
           "layer_types": ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)],
           "rms_norm_eps": float(get(meta, arch, "attention.layer_norm_rms_epsilon")),
           "rope_theta": float(get(meta, arch, "rope.freq_base", 10000.0)),
           "partial_rotary_factor": int(get(meta, arch, "rope.dimension_count")) / head_dim,
           "max_position_embeddings": int(get(meta, arch, "context_length", 32768)),
           "tie_word_embeddings": "output.weight" not in tensors.names,
           "attention_bias": tensors.any(".attn_q.bias"), "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
           "linear_num_key_heads": int(get(meta, arch, "ssm.group_count")), "linear_num_value_heads": value_heads,
           "linear_key_head_dim": int(get(meta, arch, "ssm.state_size")),
           "linear_value_head_dim": int(get(meta, arch, "ssm.inner_size")) // value_heads,
           "linear_conv_kernel_dim": int(get(meta, arch, "ssm.conv_kernel")),
           "intermediate_size": int(get(meta, arch, "feed_forward_length", 0)) or None}
    if moe_layers:
        cfg |= {"num_experts": int(get(meta, arch, "expert_count")),
                "num_experts_per_tok": int(get(meta, arch, "expert_used_count")),
                "moe_intermediate_size": int(get(meta, arch, "expert_feed_forward_length")),
                "shared_expert_intermediate_size": int(get(meta, arch, "expert_shared_feed_forward_length")),
                "norm_topk_prob": bool(get(meta, arch, "expert_weights_norm", True)),
                "mlp_only_layers": [i for i in range(layers) if i not in moe_layers]}
    return cfg


def _interval(config: HybridConfig) -> int:
    attention = config.attention_layers
    interval = attention[0] + 1 if attention else config.num_layers + 1
    expected = tuple("gdn" if (i + 1) % interval else "attention" for i in range(config.num_layers))
    if config.layer_types != expected:
        raise UnsupportedModelError(f"llama.cpp places a {config.family} model's attention layers every "
                                    "full_attention_interval layers; this model's layer types "
                                    f"{list(config.layer_types)} follow no interval, so it cannot be written as GGUF")
    return interval


def metadata(config: HybridConfig) -> dict:
    a, g, moe = config.attention, config.gdn, config.moe
    out = {"block_count": config.num_layers, "embedding_length": config.hidden_size,
           "context_length": config.max_position_embeddings, "vocab_size": config.vocab_size,
           "attention.head_count": a.num_heads, "attention.head_count_kv": a.num_kv_heads,
           "attention.key_length": a.head_dim, "attention.value_length": a.head_dim,
           "attention.layer_norm_rms_epsilon": config.rms_norm_eps, "rope.freq_base": a.rope_theta,
           "rope.dimension_count": int(a.head_dim * a.partial_rotary_factor),
           "ssm.conv_kernel": g.d_conv, "ssm.state_size": g.key_head_dim, "ssm.group_count": g.num_key_heads,
           "ssm.time_step_rank": g.num_value_heads, "ssm.inner_size": g.num_value_heads * g.value_head_dim,
           "full_attention_interval": _interval(config)}
    if config.family in ("qwen3_5", "qwen3_5_moe"):  # text positions: every M-RoPE section turns alike
        out["rope.dimension_sections"] = [out["rope.dimension_count"] // 2, 0, 0, 0]
    if config.mlp is not None:
        out["feed_forward_length"] = config.mlp.intermediate_size
    if moe is not None:
        out |= {"expert_count": moe.num_experts, "expert_used_count": moe.top_k,
                "expert_feed_forward_length": moe.intermediate_size,
                "expert_shared_feed_forward_length": moe.shared_intermediate_size,
                "expert_weights_norm": bool(moe.norm_topk_prob)}
    return out
