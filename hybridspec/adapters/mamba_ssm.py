"""mamba_ssm's own weight layout (`MambaLMHeadModel`, state-spaces/mamba):
config.json with `d_model`/`n_layer` and a state dict under `backbone.`.

Every layer is `norm -> mixer` (+ `norm2 -> GatedMLP` when d_intermediate > 0):
the mixer is Mamba2 or Mamba1 (`ssm_cfg["layer"]`, "Mamba1" when absent), or
multi-head attention (`MHA`) at the indices in `attn_layer_idx`. Fused
tensors are split into views (no copy):

    MHA  in_proj  [(h + 2·h_kv)·d_head, d_model]  rows: q, then k, then v
    MHA  out_proj                                  -> o_proj
    MLP  fc1      [2·I, d_model]                   rows: up (y), then gate;
                                                   y · silu(gate), I rounded up to 128
    Mamba2 in_proj rows z, x, B, C, dt             (hybridspec's own order)

RMSNorms use eps 1e-5 (mamba_ssm fixes it). `residual_in_fp32` keeps
mamba_ssm's residual stream in float32 for half-precision weights; hybridspec
keeps it in the model dtype, so bfloat16 logits differ by rounding only.
"""
from __future__ import annotations

import math
import re

import torch

from hybridspec.config import AttentionConfig, HybridConfig, Mamba1Config, Mamba2Config, MLPConfig
from hybridspec.errors import ModelFilesError, UnsupportedModelError
from hybridspec.adapters.common import rename

NORM_EPS = 1e-5
MLP_MULTIPLE = 128  # GatedMLP rounds hidden_features up to a multiple of this

RULES = [
    (r"^backbone\.embedding\.", "embed_tokens."),
    (r"^backbone\.norm_f\.", "final_norm."),
    (r"^lm_head\.", "lm_head."),
    (r"^backbone\.layers\.(\d+)\.norm\.", r"layers.\1.input_norm."),
    (r"^backbone\.layers\.(\d+)\.norm2\.", r"layers.\1.ffn_norm."),
    (r"^backbone\.layers\.(\d+)\.mlp\.fc1\.weight$", r"layers.\1.ffn.fc1"),
    (r"^backbone\.layers\.(\d+)\.mlp\.fc2\.", r"layers.\1.ffn.down_proj."),
    (r"^backbone\.layers\.(\d+)\.mixer\.", r"layers.\1.mixer."),
]
_FC1 = re.compile(r"^layers\.(\d+)\.ffn\.fc1$")


def _unsupported(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"mamba_ssm model: {what} is not supported")


def _check_equal(cfg: dict, key: str, value, default) -> None:
    if cfg.get(key, default) != value:
        raise _unsupported(f"{key}={cfg.get(key)!r} (only {value!r} is)")


def _rotary_factor(rotary_dim: int, head_dim: int) -> float:
    """partial_rotary_factor with int(head_dim · factor) == rotary_dim exactly."""
    factor = rotary_dim / head_dim
    return factor if int(head_dim * factor) == rotary_dim else math.nextafter(factor, 2.0)


def _mamba2(ssm: dict, d_model: int) -> Mamba2Config:
    for key, value, default in (("D_has_hdim", False, False), ("rmsnorm", True, True),
                                ("norm_before_gate", False, False)):
        _check_equal(ssm, key, value, default)
    expand, headdim = ssm.get("expand", 2), ssm.get("headdim", 64)
    d_inner = expand * d_model
    if ssm.get("d_ssm") not in (None, d_inner):
        raise _unsupported(f"d_ssm={ssm['d_ssm']} < d_inner={d_inner} (a Mamba2 layer with a gated-MLP part)")
    return Mamba2Config(
        num_heads=d_inner // headdim, head_dim=headdim, d_state=ssm.get("d_state", 128),
        n_groups=ssm.get("ngroups", 1), d_conv=ssm.get("d_conv", 4), expand=expand,
        conv_bias=ssm.get("conv_bias", True), proj_bias=ssm.get("bias", False),
        time_step_limit=tuple(ssm.get("dt_limit") or (0.0, float("inf"))), chunk_size=ssm.get("chunk_size", 256))


def _mamba1(ssm: dict, d_model: int) -> Mamba1Config:
    dt_rank = ssm.get("dt_rank", "auto")
    return Mamba1Config(
        d_inner=ssm.get("expand", 2) * d_model, d_state=ssm.get("d_state", 16),
        dt_rank=math.ceil(d_model / 16) if dt_rank == "auto" else dt_rank, d_conv=ssm.get("d_conv", 4),
        conv_bias=ssm.get("conv_bias", True), proj_bias=ssm.get("bias", False), inner_layernorms=False)


def _attention(attn: dict, d_model: int) -> AttentionConfig:
    if "num_heads" not in attn:
        raise _unsupported("attn_cfg without num_heads")
    _check_equal(attn, "causal", True, False)  # MHA defaults to non-causal; a decoder needs causal
    for key in ("mlp_dim", "d_conv"):
        _check_equal(attn, key, 0, 0)
    _check_equal(attn, "rotary_emb_interleaved", False, False)
    heads = attn["num_heads"]
    head_dim = attn.get("head_dim") or d_model // heads
    rotary_dim = attn.get("rotary_emb_dim", 0)
    return AttentionConfig(
        num_heads=heads, num_kv_heads=attn.get("num_heads_kv") or heads, head_dim=head_dim,
        use_rope=rotary_dim > 0, rope_theta=float(attn.get("rotary_emb_base", 10000.0)),
        partial_rotary_factor=_rotary_factor(rotary_dim, head_dim) if rotary_dim else 1.0,
        scale=attn.get("softmax_scale"), bias=attn.get("qkv_proj_bias", True),
        out_bias=attn.get("out_proj_bias", True))


def config_from_dict(cfg: dict) -> HybridConfig:
    _check_equal(cfg, "rms_norm", True, True)
    if cfg.get("bidirectional", False):
        raise _unsupported("bidirectional=True")
    d_model, n_layer = cfg["d_model"], cfg["n_layer"]
    ssm = dict(cfg.get("ssm_cfg") or {})
    layer = ssm.pop("layer", "Mamba1")
    if layer not in ("Mamba1", "Mamba2"):
        raise _unsupported(f"ssm_cfg layer={layer!r} (Mamba1 and Mamba2 are)")
    attn_layers = set(cfg.get("attn_layer_idx") or [])
    ssm_type = "mamba2" if layer == "Mamba2" else "mamba1"
    vocab, multiple = cfg["vocab_size"], cfg.get("pad_vocab_size_multiple", 8)
    d_intermediate = cfg.get("d_intermediate", 0)
    return HybridConfig(
        vocab_size=-(-vocab // multiple) * multiple,
        hidden_size=d_model,
        layer_types=tuple("attention" if i in attn_layers else ssm_type for i in range(n_layer)),
        ffn_types=("mlp" if d_intermediate > 0 else "none",) * n_layer,
        rms_norm_eps=NORM_EPS,
        attention=_attention(cfg.get("attn_cfg") or {}, d_model) if attn_layers else None,
        mamba2=_mamba2(ssm, d_model) if ssm_type == "mamba2" else None,
        mamba1=_mamba1(ssm, d_model) if ssm_type == "mamba1" else None,
        mlp=(MLPConfig(-(-d_intermediate // MLP_MULTIPLE) * MLP_MULTIPLE, "silu", gated=True)
             if d_intermediate > 0 else None),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_embeddings", True),
        family="mamba_ssm",
    )


def _split_attention(weights: dict[str, torch.Tensor], layer: int, attn: AttentionConfig) -> None:
    """MHA's fused in_proj -> q/k/v_proj views, out_proj -> o_proj (in place)."""
    prefix = f"layers.{layer}.mixer"
    sizes = [attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim]
    for part in ("weight", "bias"):
        fused = weights.pop(f"{prefix}.in_proj.{part}", None)
        if fused is not None:
            if fused.shape[0] != sum(sizes):
                raise ModelFilesError(f"layer {layer}: the MHA in_proj.{part} has {fused.shape[0]} rows, but "
                                      f"attn_cfg implies {sum(sizes)} (q, k, v: {sizes}); check num_heads, "
                                      "num_heads_kv and head_dim in config.json")
            for name, tensor in zip(("q_proj", "k_proj", "v_proj"), fused.split(sizes, dim=0)):
                weights[f"{prefix}.{name}.{part}"] = tensor
        out = weights.pop(f"{prefix}.out_proj.{part}", None)
        if out is not None:
            weights[f"{prefix}.o_proj.{part}"] = out


def weights_from_state(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    config = config_from_dict(cfg)
    weights = rename(state, RULES)
    for name in [n for n in weights if _FC1.match(n)]:
        layer = _FC1.match(name).group(1)
        up, gate = weights.pop(name).chunk(2, dim=0)  # GatedMLP: y, gate = fc1(x).chunk(2)
        weights[f"layers.{layer}.ffn.up_proj.weight"], weights[f"layers.{layer}.ffn.gate_proj.weight"] = up, gate
    for layer in config.attention_layers:
        _split_attention(weights, layer, config.attention)
    return weights
