"""Zamba2 (`Zamba2ForCausalLM`): a stack of Mamba2 layers; at the "hybrid"
layers a shared transformer block runs first and its output is added to the
Mamba2 input (see `hybridspec.models.shared_block` for the math). Every layer
is a Mamba2 mixer without feed-forward; the shared blocks are
`HybridConfig.shared_blocks`.

HF stores block b's weights under the layer of its first occurrence
(`model.layers.{i}.shared_transformer.*`; later occurrences are tied to it
and the weight files may repeat them, which must then be equal), with each
occurrence j's LoRA adapters in that block's adapter lists at index j
(`self_attn.linear_q_adapter_list.{j}.0/1`, `feed_forward.gate_up_proj_adapter_list.{j}.0/1`).
hybridspec names them `shared_blocks.{b}.*` and `layers.{i}.shared.adapters.*`.
The MLP's fused `gate_up_proj` holds the gate rows first; it is split into views.
"""
from __future__ import annotations

import re

import torch

from hybridspec.config import AttentionConfig, HybridConfig, Mamba2Config, MLPConfig, SharedBlockConfig
from hybridspec.errors import ModelFilesError, UnsupportedModelError
from hybridspec.adapters.common import eos_id, rename, rope_settings

ARCHITECTURE = "Zamba2ForCausalLM"
WEIGHTS_NEED_CONFIG = True  # which layer holds which shared block comes from the config
MLP_ACTIVATIONS = ("gelu", "silu")

RULES = [
    (r"^model\.embed_tokens\.", "embed_tokens."),
    (r"^model\.final_layernorm\.", "final_norm."),
    (r"^lm_head\.", "lm_head."),
    (r"^model\.rotary_emb\.inv_freq$", "rotary.inv_freq"),
    (r"^model\.rotary_emb\.original_inv_freq$", None),  # a copy kept for dynamic RoPE scaling
    (r"^model\.layers\.(\d+)\.(?:mamba_decoder\.)?mamba\.", r"layers.\1.mixer."),
    (r"^model\.layers\.(\d+)\.(?:mamba_decoder\.)?input_layernorm\.", r"layers.\1.input_norm."),
    (r"^model\.layers\.(\d+)\.linear\.weight$", r"layers.\1.shared.linear.weight"),
    (r"^model\.layers\.(\d+)\.shared_transformer\.", r"shared_at.\1."),  # resolved by `resolve_shared_blocks`
]
_SHARED_AT = re.compile(r"^shared_at\.(\d+)\.(.+)$")
_ADAPTER = re.compile(r"^(?:self_attn\.linear_([qkv])_adapter_list|feed_forward\.(gate_up)_proj_adapter_list)"
                      r"\.(\d+)\.([01])\.weight$")
_BLOCK_NAMES = {"input_layernorm.weight": "input_norm.weight", "pre_ff_layernorm.weight": "ffn_norm.weight",
                "feed_forward.down_proj.weight": "ffn.down_proj.weight"}


def occurrences(cfg: dict) -> tuple[int, ...]:
    blocks = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not blocks:
        raise UnsupportedModelError("a Zamba2 config needs `layers_block_type` (which layers are 'hybrid')")
    unknown = sorted({b for b in blocks if b not in ("mamba", "linear_attention", "hybrid")})
    if unknown:
        raise UnsupportedModelError(f"Zamba2 layer types {unknown} are unknown; expected 'mamba', "
                                    "'linear_attention' or 'hybrid'")
    return tuple(i for i, b in enumerate(blocks) if b == "hybrid")


def config_from_dict(cfg: dict) -> HybridConfig:
    activation = cfg.get("hidden_act", "gelu")
    if activation not in MLP_ACTIVATIONS:
        raise UnsupportedModelError(f"Zamba2 hidden_act={activation!r} is not supported; expected one of "
                                    f"{MLP_ACTIVATIONS}")
    if cfg.get("add_bias_linear", False):
        raise UnsupportedModelError("Zamba2 add_bias_linear=true is not supported: hybridspec's Zamba2 layers "
                                    "have no biases on the Mamba and MLP projections")
    if cfg.get("use_long_context", False):
        raise UnsupportedModelError("Zamba2 use_long_context=true (rescaled RoPE) is not supported")
    eps = cfg.get("rms_norm_eps", 1e-5)
    if eps != 1e-5:
        raise UnsupportedModelError(f"Zamba2 rms_norm_eps={eps} is not supported: HF's Mamba2 norm uses 1e-5 "
                                    "whatever the config says, and hybridspec's uses rms_norm_eps")
    hidden, heads, n = cfg["hidden_size"], cfg["num_attention_heads"], len(cfg["layers_block_type"])
    kv_heads = cfg.get("num_key_value_heads") or heads
    if cfg.get("use_shared_attention_adapter", False) and kv_heads != heads:
        raise UnsupportedModelError(
            f"Zamba2 use_shared_attention_adapter=true with num_key_value_heads={kv_heads} != num_attention_heads="
            f"{heads} is not supported: the k/v adapters are 2·hidden_size wide, as wide as k and v only without "
            "grouped-query attention (HF's Zamba2 cannot run it either)")
    head_dim = 2 * hidden // heads  # the block attends over [h, embeddings], 2·hidden wide
    use_rope = bool(cfg.get("use_mem_rope", False))
    theta, partial = rope_settings(cfg) if use_rope else (10000.0, 1.0)
    expand = cfg.get("mamba_expand", 2)
    mamba_heads = cfg["n_mamba_heads"]
    return HybridConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        layer_types=("mamba2",) * n,
        ffn_types=("none",) * n,
        rms_norm_eps=eps,
        # HF scales scores by (head_dim / 2)^-1/2: head_dim counts both halves of [h, embeddings]
        attention=AttentionConfig(
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            use_rope=use_rope, rope_theta=theta, partial_rotary_factor=partial, scale=(head_dim / 2) ** -0.5),
        mamba2=Mamba2Config(
            num_heads=mamba_heads, head_dim=expand * hidden // mamba_heads, d_state=cfg.get("mamba_d_state", 64),
            n_groups=cfg.get("mamba_ngroups", 1), d_conv=cfg.get("mamba_d_conv", 4), expand=expand,
            conv_bias=True,  # HF's Zamba2 conv always has a bias (use_conv_bias is not read)
            # HF's Zamba2Mamba2Mixer clamps Δ at (time_step_min, inf); its config has no time_step_limit
            time_step_limit=(float(cfg.get("time_step_min", 0.001)), float("inf")),
            chunk_size=cfg.get("chunk_size", 256)),
        shared_blocks=SharedBlockConfig(
            num_blocks=cfg.get("num_mem_blocks", 1), occurrences=occurrences(cfg),
            mlp=MLPConfig(cfg.get("intermediate_size") or 4 * hidden, activation, gated=True),
            adapter_rank=cfg.get("adapter_rank", 128),
            attention_adapters=bool(cfg.get("use_shared_attention_adapter", False))),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        eos_token_id=eos_id(cfg),
        family="zamba2",
    )


def weights_from_state(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    return resolve_shared_blocks(rename(state, RULES), occurrences(cfg), cfg.get("num_mem_blocks", 1))


def resolve_shared_blocks(weights: dict[str, torch.Tensor], layers: tuple[int, ...],
                          num_blocks: int) -> dict[str, torch.Tensor]:
    """`shared_at.{layer}.*` -> `shared_blocks.{b}.*` and the adapters to their
    occurrences' `layers.{i}.shared.adapters.*`. A tensor found under several
    occurrences of one block (tied copies) must be the same every time. Names
    that fit nothing keep a `shared_at.` name, which the strict check reports."""
    out = {}
    for name, tensor in weights.items():
        match = _SHARED_AT.match(name)
        renamed = {name: tensor} if match is None else _canonical_shared(int(match.group(1)), match.group(2), tensor,
                                                                         layers, num_blocks)
        for key, value in renamed.items():
            if key in out and not torch.equal(out[key], value):
                stored = _SHARED_AT.sub(r"model.layers.\1.shared_transformer.\2", name)
                raise ModelFilesError(f"{stored} differs from the same shared-block weight stored at another "
                                      f"occurrence ({key}); the occurrences of a Zamba2 block share their weights, "
                                      "so the weights are corrupt")
            out[key] = value
    return out


def _canonical_shared(layer: int, rest: str, tensor: torch.Tensor, layers: tuple[int, ...],
                      num_blocks: int) -> dict[str, torch.Tensor]:
    """Canonical name(s) of tensor `shared_transformer.{rest}` stored at `layer`."""
    unknown = {f"shared_at.{layer}.{rest}": tensor}
    if layer not in layers:
        return unknown
    block = layers.index(layer) % num_blocks
    adapter = _ADAPTER.match(rest)
    if adapter is not None:
        proj, occurrence, part = adapter.group(1) or adapter.group(2), int(adapter.group(3)), adapter.group(4)
        if occurrence >= len(layers) or occurrence % num_blocks != block:
            return unknown
        return {f"layers.{layers[occurrence]}.shared.adapters.{proj}.{('down', 'up')[int(part)]}.weight": tensor}
    prefix = f"shared_blocks.{block}."
    if rest == "feed_forward.gate_up_proj.weight":
        gate, up = tensor.chunk(2, dim=0)  # [2·I, H] -> two [I, H] views, gate rows first
        return {prefix + "ffn.gate_proj.weight": gate, prefix + "ffn.up_proj.weight": up}
    attention = re.match(r"^self_attn\.([qkvo]_proj\.weight)$", rest)
    if attention is not None:
        return {prefix + "attention." + attention.group(1): tensor}
    return {prefix + _BLOCK_NAMES[rest]: tensor} if rest in _BLOCK_NAMES else unknown
