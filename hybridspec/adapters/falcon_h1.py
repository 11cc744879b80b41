"""Falcon-H1 (`FalconH1ForCausalLM`): every layer runs attention (RoPE) and a
Mamba2 mixer side by side on one normed input (a "parallel" mixer), then a
SwiGLU MLP. Falcon-H1's µP multipliers map onto HybridConfig:

    h_0     = embedding_multiplier · embed(t)
    mixer   = ssm_out_multiplier · Mamba2(x) + attention_out_multiplier · Attention(attention_in_multiplier · x)
    Mamba2  : in_proj output [z | x | B | C | dt] times ssm_multipliers (HF's non-persistent
              `mup_vector`), input times ssm_in_multiplier      -> Mamba2Config.in_proj_multipliers
    Attention: keys times key_multiplier, i.e. softmax scale key_multiplier / sqrt(head_dim)
    MLP     = down_multiplier · down(silu(gate_multiplier · gate(x)) ⊙ up(x))
    logits  = lm_head_multiplier · lm_head(norm(h))             -> logits_scaling = 1 / lm_head_multiplier

The Mamba2 width is `mamba_d_ssm` (else mamba_expand · hidden_size). The output
is y ⊙ silu(z) without a norm unless `mamba_rms_norm`; then RMSNorm(y) ⊙ silu(z)
(`mamba_norm_before_gate`, the default) or RMSNorm(y ⊙ silu(z)), over
mamba_n_groups groups.
"""
from __future__ import annotations

import torch

from hybridspec.config import AttentionConfig, HybridConfig, Mamba2Config, MLPConfig, ParallelMixerConfig
from hybridspec.errors import UnsupportedModelError
from hybridspec.adapters.common import eos_id, rename, rope_settings

ARCHITECTURE = "FalconH1ForCausalLM"

RULES = [
    (r"^model\.embed_tokens\.", "embed_tokens."),
    (r"^model\.final_layernorm\.", "final_norm."),
    (r"^lm_head\.", "lm_head."),
    (r"^model\.rotary_emb\.inv_freq$", "rotary.inv_freq"),
    (r"^model\.rotary_emb\.original_inv_freq$", None),  # a copy kept for dynamic RoPE scaling
    # HF's non-persistent buffer, recomputed from ssm_multipliers (Mamba2Config.in_proj_multipliers)
    (r"^model\.layers\.\d+\.mamba\.mup_vector$", None),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.input_norm."),
    (r"^model\.layers\.(\d+)\.pre_ff_layernorm\.", r"layers.\1.ffn_norm."),
    (r"^model\.layers\.(\d+)\.mamba\.", r"layers.\1.mixer.mamba."),
    (r"^model\.layers\.(\d+)\.self_attn\.", r"layers.\1.mixer.attention."),
    (r"^model\.layers\.(\d+)\.feed_forward\.", r"layers.\1.ffn."),
]


def mamba_norm(cfg: dict) -> str:
    if not cfg.get("mamba_rms_norm", False):
        return "gate_only"
    return "norm_then_gate" if cfg.get("mamba_norm_before_gate", True) else "gate_then_norm"


def config_from_dict(cfg: dict) -> HybridConfig:
    activation = cfg.get("hidden_act", "silu")
    if activation != "silu":
        raise UnsupportedModelError(f"Falcon-H1 hidden_act={activation!r} is not supported; the Mamba2 conv and "
                                    "the MLP run with 'silu' only")
    if bool(cfg.get("mamba_proj_bias", False)) != bool(cfg.get("projectors_bias", False)):
        raise UnsupportedModelError(
            f"Falcon-H1 mamba_proj_bias={cfg.get('mamba_proj_bias')} with projectors_bias="
            f"{cfg.get('projectors_bias')} is not supported: hybridspec's Mamba2 has biases on both in_proj and "
            "out_proj or on neither")
    hidden, heads, n = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // heads
    d_ssm = cfg.get("mamba_d_ssm") or cfg.get("mamba_expand", 2) * hidden
    mamba_heads = cfg["mamba_n_heads"]
    d_head = cfg.get("mamba_d_head", "auto")
    if d_head in (None, "auto"):
        d_head = d_ssm // mamba_heads
    theta, partial = rope_settings(cfg)
    gate_multiplier, down_multiplier = cfg.get("mlp_multipliers") or (1.0, 1.0)
    ssm_in = float(cfg.get("ssm_in_multiplier", 1.0))
    ssm_multipliers = cfg.get("ssm_multipliers") or (1.0,) * 5
    return HybridConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        layer_types=("parallel",) * n,
        ffn_types=("mlp",) * n,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        attention=AttentionConfig(
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
            use_rope=True, rope_theta=theta, partial_rotary_factor=partial,
            # q·(m·k) = m·(q·k): the key multiplier is a factor of the softmax scale
            scale=float(cfg.get("key_multiplier", 1.0)) * head_dim ** -0.5, bias=cfg.get("attention_bias", False)),
        mamba2=Mamba2Config(
            num_heads=mamba_heads, head_dim=d_head, d_state=cfg["mamba_d_state"],
            n_groups=cfg.get("mamba_n_groups", 1), d_conv=cfg.get("mamba_d_conv", 4),
            expand=cfg.get("mamba_expand", 2), conv_bias=cfg.get("mamba_conv_bias", True),
            proj_bias=cfg.get("mamba_proj_bias", False),
            time_step_limit=tuple(cfg.get("time_step_limit") or (0.0, float("inf"))),
            chunk_size=cfg.get("mamba_chunk_size", 256), norm=mamba_norm(cfg),
            in_proj_multipliers=tuple(ssm_in * float(m) for m in ssm_multipliers)),
        mlp=MLPConfig(cfg["intermediate_size"], activation, gated=True, bias=cfg.get("mlp_bias", False),
                      gate_multiplier=float(gate_multiplier), down_multiplier=float(down_multiplier)),
        parallel=ParallelMixerConfig(
            attention_in_multiplier=float(cfg.get("attention_in_multiplier", 1.0)),
            attention_out_multiplier=float(cfg.get("attention_out_multiplier", 1.0)),
            mamba_out_multiplier=float(cfg.get("ssm_out_multiplier", 1.0))),
        max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        logits_scaling=1.0 / float(cfg.get("lm_head_multiplier", 1.0)),
        eos_token_id=eos_id(cfg),
        family="falcon_h1",
    )


def weights_from_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return rename(state, RULES)
