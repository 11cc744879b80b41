"""Grouped-query attention over the paged KV cache, with optional (partial)
rotary position embeddings (Su et al. 2021)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridspec.kernels.dispatch import use_triton
from hybridspec.kernels.paged_attention import paged_attention, paged_attention_cpu

from ..config import AttentionConfig
from .batch import ForwardBatch
from .common import compute_dtype, param


def rope_inv_freq(cfg: AttentionConfig) -> torch.Tensor:
    """θ_i = base^(-2i/d) over the rotary dims, computed in float32 as HF does."""
    dim = cfg.rotary_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `rotary_dim` dims of x by position (rotate-half layout).
    x: [batch, T, heads, head_dim]; cos/sin: [batch, T, rotary_dim]."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    x_rot = x_rot * cos[:, :, None] + rotated * sin[:, :, None]
    return torch.cat((x_rot, x_pass), dim=-1)


class Attention(nn.Module):
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

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cd = compute_dtype(dtype)
        freqs = positions.to(cd)[..., None] * self.inv_freq.to(cd)  # [batch, T, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [batch, T, h·d], k, v [batch, T, h_kv·d] (Zamba2's occurrences add their adapters here)."""
        return (F.linear(h, self.q_proj, self.q_bias), F.linear(h, self.k_proj, self.k_bias),
                F.linear(h, self.v_proj, self.v_bias))

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        cfg = self.cfg
        bsz, T, _ = h.shape
        q, k, v = self.project(h)
        q = q.view(bsz, T, cfg.num_heads, cfg.head_dim)
        k = k.view(bsz, T, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(bsz, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.use_rope:
            cos, sin = self.rope(batch.positions, h.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        meta = batch.kv
        cache.kv.write(self.kv_layer, meta, k, v)
        k_cache, v_cache = cache.kv.k_cache[self.kv_layer], cache.kv.v_cache[self.kv_layer]
        if use_triton(q):
            out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_lens,
                                  cfg.softmax_scale)  # [batch, T, heads, head_dim]
        else:  # torch: a sequence's consecutive pages are read as one view of the cache
            out = paged_attention_cpu(q, k_cache, v_cache, meta.page_runs, meta.context_lens, meta.query_lens,
                                      cfg.softmax_scale)
        return F.linear(out.reshape(bsz, T, -1), self.o_proj, self.o_bias)
