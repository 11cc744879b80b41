"""Grouped-query attention over the paged KV cache, with optional (partial)
rotary position embeddings (Su et al. 2021)."""
from __future__ import annotations

import torch
from torch import nn

from hybridspec.kernels.descriptors import AttentionDesc
from hybridspec.kernels.rotary import Rotation

from hybridspec.config import AttentionConfig
from hybridspec.cache.forward_batch import ForwardBatch
from hybridspec.models.common import Kernelled, param


def rope_inv_freq(cfg: AttentionConfig) -> torch.Tensor:
    """θ_i = base^(-2i/d) over the rotary dims, computed in float32 as HF does."""
    dim = cfg.rotary_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


class Attention(Kernelled, nn.Module):
    def __init__(self, cfg: AttentionConfig, weights: dict[str, torch.Tensor], kv_layer: int,
                 inv_freq: torch.Tensor | None):
        super().__init__()
        self.cfg = cfg
        self.kv_layer = kv_layer  # index of this layer in the paged KV cache
        self.q_proj, self.k_proj = param(weights["q_proj.weight"]), param(weights["k_proj.weight"])
        self.v_proj, self.o_proj = param(weights["v_proj.weight"]), param(weights["o_proj.weight"])
        self.q_bias, self.k_bias, self.v_bias = (param(weights[f"{p}_proj.bias"]) if cfg.bias else None
                                                 for p in "qkv")
        self.o_bias = param(weights["o_proj.bias"]) if cfg.out_bias else None
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def describe(self) -> AttentionDesc:
        cfg = self.cfg
        return AttentionDesc(q_proj=self.q_proj, k_proj=self.k_proj, v_proj=self.v_proj, o_proj=self.o_proj,
                             qkv_bias=bool(cfg.bias), o_bias=bool(cfg.out_bias),
                             inv_freq=self.inv_freq if cfg.use_rope else None, rotary_dim=cfg.rotary_dim,
                             softmax_scale=cfg.softmax_scale, num_heads=cfg.num_heads,
                             num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, kv_layer=self.kv_layer)

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [batch, T, h·d], k, v [batch, T, h_kv·d] (Zamba2's occurrences add their adapters here)."""
        linear = self.ops.linear
        return (linear(h, self.q_proj, self.q_bias), linear(h, self.k_proj, self.k_bias),
                linear(h, self.v_proj, self.v_bias))

    def rotation(self, batch: ForwardBatch, dtype: torch.dtype) -> Rotation:
        """The forward's rotary angles, made by the first attention layer that asks."""
        key = ("rope", dtype, id(self.inv_freq))
        if key not in batch.shared:
            batch.shared[key] = self.ops.rotary(self.cfg.rotary_dim, self.cfg.head_dim, self.inv_freq,
                                                batch.positions, dtype)
        return batch.shared[key]

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        cfg = self.cfg
        bsz, T, _ = h.shape
        q, k, v = self.project(h)
        q = q.view(bsz, T, cfg.num_heads, cfg.head_dim)
        k = k.view(bsz, T, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(bsz, T, cfg.num_kv_heads, cfg.head_dim)
        out = self.attend(q, k, v, batch, cache)  # [batch, T, heads, head_dim]
        return self.ops.linear(out.reshape(bsz, T, -1), self.o_proj, self.o_bias)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
               cache) -> torch.Tensor:
        """Rotate q [batch, T, heads, d] and k [batch, T, kv_heads, d], write k and v
        to the paged cache and attend over it.  # [batch, T, heads, d]"""
        if self.cfg.use_rope:
            rotation = self.rotation(batch, q.dtype)
            q, k = rotation.apply(q), rotation.apply(k)
        meta = batch.kv
        cache.kv.write(self.kv_layer, meta, k, v)
        k_cache, v_cache = cache.kv.k_cache[self.kv_layer], cache.kv.v_cache[self.kv_layer]
        if batch.tree is not None:  # each input sees the context and its ancestors (`cache.tree_batch`)
            return self.ops.tree_forms.attention(q, k_cache, v_cache, meta, batch.tree.plan, self.cfg.softmax_scale)
        return self.ops.paged_attention(q, k_cache, v_cache, meta, self.cfg.softmax_scale)
