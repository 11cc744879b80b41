"""Grouped-query attention over the paged KV cache, with optional (partial)
rotary position embeddings (Su et al. 2021)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from hybridspec.kernels import cpu_rope
from hybridspec.kernels.dispatch import use_triton
from hybridspec.kernels.descriptors import AttentionDesc
from hybridspec.kernels.paged_attention import SUPPORTED_DTYPES, paged_attention, paged_attention_cpu

from ..config import AttentionConfig
from .batch import ForwardBatch
from .common import as_dtype, compute_dtype, linear, param


def rope_inv_freq(cfg: AttentionConfig) -> torch.Tensor:
    """θ_i = base^(-2i/d) over the rotary dims, computed in float32 as HF does."""
    dim = cfg.rotary_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


_ROTATE_HALF: dict[tuple, torch.Tensor] = {}


def rotate_half_matrix(head_dim: int, rotary_dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """R [head_dim, head_dim] with x @ R = (-x2, x1, 0) over the rotary dims (x1, x2
    their halves) and 0 on the rest: an exact signed permutation. Cached."""
    key = (head_dim, rotary_dim, dtype, str(device))
    if key not in _ROTATE_HALF:
        _ROTATE_HALF[key] = _rotate_half_matrix(head_dim, rotary_dim, dtype, device)
    return _ROTATE_HALF[key]


def _rotate_half_matrix(head_dim: int, rotary_dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    half = rotary_dim // 2
    R = torch.zeros(head_dim, head_dim, dtype=dtype, device=device)
    i = torch.arange(half, device=device)
    R[i + half, i] = -1.0
    R[i, i + half] = 1.0
    return R


_PADDED_INV_FREQ: dict[tuple, torch.Tensor] = {}


def padded_inv_freq(inv_freq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """inv_freq in `dtype`, zero-padded to a multiple of 16 values; cached per storage."""
    key = (inv_freq.data_ptr(), inv_freq.numel(), dtype, str(inv_freq.device))
    padded = _PADDED_INV_FREQ.get(key)
    if padded is None:
        padded = inv_freq.new_zeros(-(-inv_freq.numel() // 16) * 16, dtype=dtype)
        padded[:inv_freq.numel()] = as_dtype(inv_freq, dtype)
        _PADDED_INV_FREQ[key] = padded
    return padded


class Rotation:
    """One forward's rotary angles, shared by every attention layer: cos and sin
    of each input's position over the rotary half [batch, T, rotary_dim / 2]
    (views of rows padded to 16 values; four operations per forward).
    `apply` is HF's rotate-half rotation with its products and sums: in C for float32 on CPU (`kernels.cpu_rope`, the
    same bits), else as x·cos + (x R)·sin with cos and sin padded to the whole
    head (1 and 0 past rotary_dim), in four operations per tensor."""

    def __init__(self, cfg: AttentionConfig, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
        cd = compute_dtype(dtype)
        # each position's angles padded to a multiple of 16: torch's vectorised cos and sin then take
        # every value in full vectors, so a position's bits do not depend on how many inputs the forward has
        freqs = positions.to(cd)[..., None] * padded_inv_freq(inv_freq, cd)  # [batch, T, ≥ rotary_dim / 2]
        half = cfg.rotary_dim // 2
        self.cos_half = as_dtype(freqs.cos(), dtype)[..., :half]  # [batch, T, rotary_dim / 2] views
        self.sin_half = as_dtype(freqs.sin(), dtype)[..., :half]
        self.cfg, self.device = cfg, positions.device

    @functools.cached_property
    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin [batch, T, 1, head_dim], R) for the torch form."""
        cfg = self.cfg
        cos, sin = torch.cat((self.cos_half, self.cos_half), dim=-1), torch.cat((self.sin_half, self.sin_half), dim=-1)
        if cfg.rotary_dim < cfg.head_dim:  # the dims past rotary_dim pass through: cos 1, sin 0
            pad = cos.new_zeros(*cos.shape[:-1], cfg.head_dim - cfg.rotary_dim)
            cos, sin = torch.cat((cos, pad + 1), dim=-1), torch.cat((sin, pad), dim=-1)
        return cos[:, :, None], sin[:, :, None], rotate_half_matrix(cfg.head_dim, cfg.rotary_dim, cos.dtype,
                                                                    self.device)

    def apply(self, x: torch.Tensor) -> torch.Tensor:  # [batch, T, heads, head_dim]
        if cpu_rope.applies(x, self.cos_half, self.sin_half):
            return cpu_rope.rope(x, self.cos_half, self.sin_half)
        cos, sin, R = self.padded
        rotated = torch.mm(x.reshape(-1, x.shape[-1]), R).view(x.shape)
        return x * cos + rotated * sin


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

    def describe(self) -> AttentionDesc:
        cfg = self.cfg
        return AttentionDesc(q_proj=self.q_proj, k_proj=self.k_proj, v_proj=self.v_proj, o_proj=self.o_proj,
                             qkv_bias=bool(cfg.bias), o_bias=bool(cfg.out_bias),
                             inv_freq=self.inv_freq if cfg.use_rope else None, rotary_dim=cfg.rotary_dim,
                             softmax_scale=cfg.softmax_scale, num_heads=cfg.num_heads,
                             num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, kv_layer=self.kv_layer)

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [batch, T, h·d], k, v [batch, T, h_kv·d] (Zamba2's occurrences add their adapters here)."""
        return (linear(h, self.q_proj, self.q_bias), linear(h, self.k_proj, self.k_bias),
                linear(h, self.v_proj, self.v_bias))

    def rotation(self, batch: ForwardBatch, dtype: torch.dtype) -> Rotation:
        """The forward's rotary angles, made by the first attention layer that asks."""
        key = ("rope", dtype, id(self.inv_freq))
        if key not in batch.shared:
            batch.shared[key] = Rotation(self.cfg, self.inv_freq, batch.positions, dtype)
        return batch.shared[key]

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        cfg = self.cfg
        bsz, T, _ = h.shape
        q, k, v = self.project(h)
        q = q.view(bsz, T, cfg.num_heads, cfg.head_dim)
        k = k.view(bsz, T, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(bsz, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.use_rope:
            rotation = self.rotation(batch, h.dtype)
            q, k = rotation.apply(q), rotation.apply(k)
        meta = batch.kv
        cache.kv.write(self.kv_layer, meta, k, v)
        k_cache, v_cache = cache.kv.k_cache[self.kv_layer], cache.kv.v_cache[self.kv_layer]
        if use_triton(q) and q.dtype in SUPPORTED_DTYPES:
            out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_lens,
                                  cfg.softmax_scale)  # [batch, T, heads, head_dim]
        else:  # torch (CPU, and float64 anywhere): a sequence's consecutive pages are read as one view of the cache
            out = paged_attention_cpu(q, k_cache, v_cache, meta.page_runs, meta.context_list, meta.query_list,
                                      cfg.softmax_scale)
        return linear(out.reshape(bsz, T, -1), self.o_proj, self.o_bias)
