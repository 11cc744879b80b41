"""Zamba2's shared transformer block (Glorioso et al. 2024, "Zamba2"): a few
blocks of attention + MLP weights, run at many layers. Occurrence j, at layer
i, with block b = j mod num_blocks, feeds the layer's Mamba2 mixer:

    x   = RMSNorm_b([h, e])                      (h: layer input, e: the token embeddings; 2·hidden wide)
    a   = Attention_b(x),  with q, k, v += U_j·D_j·x when attention adapters are on (LoRA, rank r)
    y   = MLP_b(RMSNorm'_b(a)),  gate|up += U'_j·D'_j·RMSNorm'_b(a)
    t_j = W_j · y                                (per-occurrence linear)
    h  ← h + Mamba2(RMSNorm_i(h + t_j))           (DecoderLayer; the residual is h, not h + t_j)

The weights of block b are shared by its occurrences; KV pages are not: each
occurrence is an attention layer of its own for the cache (`kv_layer`), so a
speculative round writes, commits and rolls back each occurrence's K/V at the
same boundary as the Mamba state next to it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridspec.config import AttentionConfig, HybridConfig
from hybridspec.models.attention import Attention
from hybridspec.cache.forward_batch import ForwardBatch
from hybridspec.models.common import Kernelled, RMSNorm, activation, param, take
from hybridspec.models.ffn import MLP


class LoRA(nn.Module):
    """x -> up(down(x)); weights down.weight [r, in], up.weight [out, r]."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.down, self.up = param(weights["down.weight"]), param(weights["up.weight"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.down), self.up)


class SharedBlock(nn.Module):
    """One block's shared weights: input_norm [2H], attention.*, ffn_norm [H], ffn.* (gated MLP)."""

    def __init__(self, cfg: HybridConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.input_norm = RMSNorm(weights["input_norm.weight"], cfg.rms_norm_eps)
        self.attention_weights = take(weights, "attention")
        self.ffn_norm = RMSNorm(weights["ffn_norm.weight"], cfg.rms_norm_eps)
        self.ffn = MLP(cfg.shared_blocks.mlp, take(weights, "ffn"))


class AdaptedAttention(Attention):
    """The block's attention with one occurrence's q/k/v adapters (None: no adapters)."""

    def __init__(self, cfg: AttentionConfig, weights: dict[str, torch.Tensor], kv_layer: int, inv_freq,
                 adapters: dict[str, LoRA] | None):
        super().__init__(cfg, weights, kv_layer, inv_freq)
        self.adapters = nn.ModuleDict(adapters) if adapters else None

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(h)
        if self.adapters is None:
            return q, k, v
        return q + self.adapters["q"](h), k + self.adapters["k"](h), v + self.adapters["v"](h)


class SharedBlockOccurrence(Kernelled, nn.Module):
    """Occurrence of `block` at layer `index`; weights: linear.weight [H, H],
    adapters.gate_up.{down,up}.weight and, with attention adapters,
    adapters.{q,k,v}.{down,up}.weight."""

    def __init__(self, cfg: HybridConfig, block: SharedBlock, weights: dict[str, torch.Tensor], index: int,
                 inv_freq):
        super().__init__()
        shared = cfg.shared_blocks
        self.block = block
        adapters = ({p: LoRA(take(weights, f"adapters.{p}")) for p in "qkv"} if shared.attention_adapters else None)
        self.attention = AdaptedAttention(cfg.attention, block.attention_weights, cfg.attention_layers.index(index),
                                          inv_freq, adapters)
        self.gate_up_adapter = LoRA(take(weights, "adapters.gate_up"))
        self.linear = param(weights["linear.weight"])
        self.reduce = None  # tensor parallel: the sum over ranks of the attention's and the MLP's partial outputs

    def forward(self, h: torch.Tensor, embeddings: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        """h, embeddings [batch, T, hidden] -> t [batch, T, hidden], added to the mixer's input."""
        block = self.block
        a = self.summed(self.attention(block.input_norm(torch.cat([h, embeddings], dim=-1)), batch, cache))
        return F.linear(self.summed(self.mlp(block.ffn_norm(a))), self.linear)

    def summed(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.reduce is None else self.reduce(partial)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate) ⊙ up) with [gate | up] = W·x + adapter(x)."""
        ffn = self.block.ffn
        linear = self.ops.linear
        gate_up = torch.cat([linear(x, ffn.gate_proj), linear(x, ffn.up_proj)], dim=-1) + self.gate_up_adapter(x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.ops.linear(activation(ffn.cfg.activation, gate) * up, ffn.down_proj)
