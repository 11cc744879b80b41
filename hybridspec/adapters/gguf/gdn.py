"""The gated DeltaNet's tensors in llama.cpp's Qwen3-Next (`qwen3next`) and Qwen3.5 (`qwen35`,
`qwen35moe`) layouts, as row (or column) index maps from hybridspec's canonical tensors.

hybridspec's `in_proj` [2·HK·d_k + 2·HV·d_v + 2·HV, H] is [q | k | v | z | b | a], value heads in HF's
grouped order (key head h owns value heads h·r .. h·r + r - 1, r = HV / HK). llama.cpp's converter
stores it as:
    qwen3next: attn_qkv [q | k | v], attn_gate [z], ssm_ba: per key head its r b rows then its r a rows
               (HF's in_proj_ba as it is);
    qwen35:    attn_qkv [q | k | v'], attn_gate [z'], ssm_beta [b'], ssm_alpha [a'], where ' is the
               value heads in tiled order (position i·HK + h holds head h·r + i), which llama.cpp's
               broadcast wants; A_log, dt_bias, the conv's v channels and out_proj's input columns are
               tiled the same way (`_LinearAttentionVReorderBase` in its converter).
Every map is a permutation of whole rows, so a row-blocked quantized tensor (Q8_0, Q4_0, Q4_K) moves
with its blocks: stored blocks reassemble into the canonical in_proj's blocks bit for bit. Columns are
not whole blocks in general, so a quantized qwen35 out_proj is read as float (`column_map`).
"""
from __future__ import annotations

import torch

from hybridspec.config import HybridConfig

QWEN3NEXT, QWEN35 = "qwen3next", ("qwen35", "qwen35moe")


def tiled(num_key_heads: int, per_key: int, head_dim: int) -> torch.Tensor:
    """Grouped -> tiled value-head order: stored row j holds canonical row tiled(...)[j]."""
    return torch.arange(num_key_heads * per_key * head_dim).reshape(num_key_heads, per_key, head_dim) \
        .transpose(0, 1).reshape(-1)


def _heads(config: HybridConfig, arch: str, head_dim: int) -> torch.Tensor:
    g = config.gdn
    if arch in QWEN35:
        return tiled(g.num_key_heads, g.num_value_heads // g.num_key_heads, head_dim)
    return torch.arange(g.num_value_heads * head_dim)


def in_proj_parts(config: HybridConfig, arch: str) -> dict[str, torch.Tensor]:
    """GGUF tensor suffix -> the canonical in_proj rows it holds, in stored order."""
    g = config.gdn
    qk, v = g.num_key_heads * g.key_head_dim, g.num_value_heads * g.value_head_dim
    v_at, z_at, b_at = 2 * qk, 2 * qk + v, 2 * qk + 2 * v
    a_at = b_at + g.num_value_heads
    values, gates = _heads(config, arch, g.value_head_dim), _heads(config, arch, 1)
    qkv = torch.cat([torch.arange(2 * qk), v_at + values])
    if arch == QWEN3NEXT:
        r = g.num_value_heads // g.num_key_heads
        per_key = torch.arange(g.num_value_heads).reshape(g.num_key_heads, r)
        ba = torch.cat([b_at + per_key, a_at + per_key], dim=1).reshape(-1)
        return {"attn_qkv.weight": qkv, "attn_gate.weight": z_at + values, "ssm_ba.weight": ba}
    return {"attn_qkv.weight": qkv, "attn_gate.weight": z_at + values, "ssm_beta.weight": b_at + gates,
            "ssm_alpha.weight": a_at + gates}


def row_map(rest: str, config: HybridConfig, arch: str) -> torch.Tensor | None:
    """The canonical rows of a GDN layer's single-tensor `rest` (A_log, dt_bias, conv1d) in stored order;
    None where stored as is."""
    if arch not in QWEN35:
        return None
    g = config.gdn
    if rest in ("mixer.A_log", "mixer.dt_bias"):
        return _heads(config, arch, 1)
    if rest == "mixer.conv1d.weight":
        qk = 2 * g.num_key_heads * g.key_head_dim
        return torch.cat([torch.arange(qk), qk + _heads(config, arch, g.value_head_dim)])
    return None


def column_map(rest: str, config: HybridConfig, arch: str) -> torch.Tensor | None:
    """out_proj's canonical input columns in stored order (qwen35), else None."""
    if arch in QWEN35 and rest == "mixer.out_proj.weight":
        return _heads(config, arch, config.gdn.value_head_dim)
    return None


def inverse(order: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(order)
    out[order] = torch.arange(order.numel())
    return out
