"""Jamba (`JambaForCausalLM`): Mamba1 mixers with dt/B/C RMSNorms and
attention mixers without positional embeddings, each followed by a SwiGLU MLP
or a mixture of experts (softmax over all experts, top-k weights kept
unnormalised).

Layer i is attention when i % attn_layer_period == attn_layer_offset, and
its feed-forward is a MoE when i % expert_layer_period == expert_layer_offset
(and num_experts > 1). Models on the Hub store each expert separately
(`experts.{e}.gate_proj/up_proj/down_proj.weight`); HF transformers 5 and
hybridspec stack them into `experts.gate_up_proj [E, 2·I, hidden]` and
`experts.down_proj [E, hidden, I]`.
"""
from __future__ import annotations

import re

import torch

from hybridspec.config import AttentionConfig, HybridConfig, Mamba1Config, MLPConfig, MoEConfig
from hybridspec.errors import ModelFilesError, UnsupportedModelError
from hybridspec.adapters.common import eos_id, rename

ARCHITECTURE = "JambaForCausalLM"

RULES = [
    (r"^model\.embed_tokens\.", "embed_tokens."),
    (r"^model\.final_layernorm\.", "final_norm."),
    (r"^lm_head\.", "lm_head."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.input_norm."),
    (r"^model\.layers\.(\d+)\.pre_ff_layernorm\.", r"layers.\1.ffn_norm."),
    (r"^model\.layers\.(\d+)\.mamba\.(dt|b|c)_layernorm\.", r"layers.\1.mixer.\2_norm."),
    (r"^model\.layers\.(\d+)\.(mamba|self_attn)\.", r"layers.\1.mixer."),
    (r"^model\.layers\.(\d+)\.feed_forward\.", r"layers.\1.ffn."),
]

_PER_EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def num_experts(cfg: dict) -> int:
    return cfg.get("num_experts", cfg.get("num_local_experts", 16))


def layer_pattern(cfg: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(mixer types, feed-forward types) from the period/offset keys."""
    n = cfg["num_hidden_layers"]
    attn_period, attn_offset = cfg.get("attn_layer_period", 8), cfg.get("attn_layer_offset", 4)
    expert_period, expert_offset = cfg.get("expert_layer_period", 2), cfg.get("expert_layer_offset", 1)
    mixers = tuple("attention" if i % attn_period == attn_offset else "mamba1" for i in range(n))
    ffns = tuple("moe" if num_experts(cfg) > 1 and i % expert_period == expert_offset else "mlp" for i in range(n))
    return mixers, ffns


def config_from_dict(cfg: dict) -> HybridConfig:
    activation = cfg.get("hidden_act", "silu")
    if activation != "silu":
        raise UnsupportedModelError(f"Jamba hidden_act={activation!r} is not supported; the Mamba1 conv and "
                                    "the experts run with 'silu' only")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    layer_types, ffn_types = layer_pattern(cfg)
    d_inner = cfg.get("mamba_expand", 2) * hidden
    dt_rank = cfg.get("mamba_dt_rank", "auto")
    if dt_rank == "auto":
        dt_rank = -(-hidden // 16)
    intermediate = cfg["intermediate_size"]
    return HybridConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        layer_types=layer_types,
        ffn_types=ffn_types,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        attention=AttentionConfig(
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads, use_rope=False),
        mamba1=Mamba1Config(
            d_inner=d_inner, d_state=cfg.get("mamba_d_state", 16), dt_rank=dt_rank,
            d_conv=cfg.get("mamba_d_conv", 4), conv_bias=cfg.get("mamba_conv_bias", True),
            proj_bias=cfg.get("mamba_proj_bias", False), inner_layernorms=True),
        mlp=MLPConfig(intermediate, activation, gated=True),
        moe=(MoEConfig(num_experts=num_experts(cfg),
                       top_k=cfg.get("num_experts_per_tok", 2), intermediate_size=intermediate,
                       router="softmax_topk", activation=activation)
             if "moe" in ffn_types else None),
        max_position_embeddings=cfg.get("max_position_embeddings", 262144),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        eos_token_id=eos_id(cfg),
        family="jamba",
    )


def stack_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stack Hub-layout per-expert weights into `experts.gate_up_proj` (gate rows
    first) and `experts.down_proj`; names already stacked pass through."""
    per_expert: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, tensor in weights.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        per_expert.setdefault(prefix, {}).setdefault(expert, {})[proj] = tensor
    for prefix, experts in per_expert.items():
        order = sorted(experts)
        if order != list(range(len(order))) or any(len(experts[e]) != 3 for e in order):
            raise ModelFilesError(f"{prefix}: expected gate_proj, up_proj and down_proj for experts "
                                  f"0..{len(order) - 1}, got experts {order}; the weights are incomplete")
        shapes = {proj: {tuple(experts[e][proj].shape) for e in order}
                  for proj in ("gate_proj", "up_proj", "down_proj")}
        if any(len(s) > 1 for s in shapes.values()) or shapes["gate_proj"] != shapes["up_proj"]:
            raise ModelFilesError(f"{prefix}: the experts' weights differ in shape ({shapes}); every expert needs "
                                  "the same gate_proj, up_proj and down_proj shapes: the weights are corrupt")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], dim=0) for e in order])
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    return out


def weights_from_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return stack_experts(rename(state, RULES))
