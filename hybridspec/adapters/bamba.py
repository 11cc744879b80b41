"""Bamba (`BambaForCausalLM`): Mamba2 and attention mixers, each followed by a
SwiGLU MLP; RoPE on half of each attention head."""
from __future__ import annotations

import torch

from hybridspec.config import AttentionConfig, HybridConfig, Mamba2Config, MLPConfig
from hybridspec.adapters.common import eos_id, rename, rope_settings

ARCHITECTURE = "BambaForCausalLM"

RULES = [
    (r"^model\.embed_tokens\.", "embed_tokens."),
    (r"^model\.final_layernorm\.", "final_norm."),
    (r"^lm_head\.", "lm_head."),
    (r"^model\.rotary_emb\.inv_freq$", "rotary.inv_freq"),
    (r"^model\.rotary_emb\.original_inv_freq$", None),  # a copy kept for dynamic RoPE scaling
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.input_norm."),
    (r"^model\.layers\.(\d+)\.pre_ff_layernorm\.", r"layers.\1.ffn_norm."),
    (r"^model\.layers\.(\d+)\.(mamba|self_attn)\.", r"layers.\1.mixer."),
    (r"^model\.layers\.(\d+)\.feed_forward\.", r"layers.\1.ffn."),
]


def config_from_dict(cfg: dict) -> HybridConfig:
    n = cfg["num_hidden_layers"]
    attn_layers = set(cfg.get("attn_layer_indices") or [])
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    theta, factor = rope_settings(cfg)
    mamba_heads = cfg["mamba_n_heads"]
    d_head = cfg.get("mamba_d_head", "auto")
    if d_head in (None, "auto"):
        d_head = cfg.get("mamba_expand", 2) * hidden // mamba_heads
    return HybridConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        layer_types=tuple("attention" if i in attn_layers else "mamba2" for i in range(n)),
        ffn_types=("mlp",) * n,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        attention=AttentionConfig(
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads, use_rope=True, rope_theta=theta,
            partial_rotary_factor=factor if "rope_parameters" in cfg else 0.5,
            bias=cfg.get("attention_bias", False)),
        mamba2=Mamba2Config(
            num_heads=mamba_heads, head_dim=d_head, d_state=cfg["mamba_d_state"],
            n_groups=cfg.get("mamba_n_groups", 1), d_conv=cfg.get("mamba_d_conv", 4),
            expand=cfg.get("mamba_expand", 2), conv_bias=cfg.get("mamba_conv_bias", True),
            proj_bias=cfg.get("mamba_proj_bias", False),
            time_step_limit=tuple(cfg.get("time_step_limit") or (0.0, float("inf")))),
        mlp=MLPConfig(cfg["intermediate_size"], cfg.get("hidden_act", "silu"), gated=True,
                      bias=cfg.get("mlp_bias", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        eos_token_id=eos_id(cfg),
        family="bamba",
    )


def weights_from_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return rename(state, RULES)
