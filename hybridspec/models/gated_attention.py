"""The attention of Qwen3-Next and Qwen3.5's full-attention layers: grouped-query
attention whose q_proj also yields a per-head output gate, with RMSNorms over
each head's q and k before the (partial) rotary embedding:
    [q_h | gate_h] = (W_q x)_h            per head, 2·head_dim wide
    q, k = RMSNorm(q), RMSNorm(k)         (over head_dim; zero-centred weights held as 1 + w)
    out = W_o · (attention(q, k, v) ⊙ sigmoid(gate))
"""
from __future__ import annotations

import torch

from hybridspec.kernels.descriptors import GatedAttentionDesc

from hybridspec.models.attention import Attention
from hybridspec.cache.forward_batch import ForwardBatch
from hybridspec.models.common import norm_weight, param


class GatedAttention(Attention):
    def __init__(self, cfg, weights: dict[str, torch.Tensor], kv_layer: int, inv_freq: torch.Tensor | None,
                 eps: float, zero_centred: bool):
        super().__init__(cfg, weights, kv_layer, inv_freq)
        self.q_norm, self.k_norm = (param(norm_weight(weights[f"{p}_norm.weight"], zero_centred)) if cfg.qk_norm
                                    else None for p in "qk")  # [head_dim]
        self.eps = eps

    def describe(self) -> GatedAttentionDesc:
        cfg = self.cfg
        return GatedAttentionDesc(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                  kv_layer=self.kv_layer)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        cfg = self.cfg
        bsz, T, _ = h.shape
        q, k, v = self.project(h)
        gate = None
        if cfg.output_gate:  # [batch, T, heads, 2·head_dim]: each head's query, then its gate
            q, gate = q.view(bsz, T, cfg.num_heads, 2 * cfg.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(bsz, T, -1)
        q = q.reshape(bsz, T, cfg.num_heads, cfg.head_dim)
        k = k.view(bsz, T, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(bsz, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.ops.norm.rms(q, self.q_norm, self.eps), self.ops.norm.rms(k, self.k_norm, self.eps)
        out = self.attend(q, k, v, batch, cache).reshape(bsz, T, -1)
        if gate is not None:
            out = out * self.ops.pointwise.sigmoid(gate)
        return self.ops.linear(out, self.o_proj, self.o_bias)
