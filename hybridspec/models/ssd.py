"""Chunked SSD scan for Mamba2 prefill (Dao & Gu 2024, §6 "state space duality").

Within a chunk of L inputs, with per-head log-decays a_t = Δ_t·A and their
running sums s_t = a_1 + … + a_t, the recurrence h_t = exp(a_t)·h_{t-1} + Δ_t x_t ⊗ B_t
unrolls to a masked, attention-like product plus the carried-in state:
    y_t = Σ_{τ≤t} exp(s_t − s_τ)·Δ_τ·(C_t·B_τ)·x_τ + exp(s_t)·(C_t·h_0) + D·x_t
    h_L = exp(s_L)·h_0 + Σ_τ exp(s_L − s_τ)·Δ_τ·x_τ ⊗ B_τ
Chunks run one after another, so only the state at chunk ends is formed: this
serves prefill and plain extends (one state wanted, at the last input) where
the C recurrence does not run (see `SSD_MIN_TOKENS` in `mamba2.py`), while
verification, which wants a state after every input, uses the token-by-token
`mamba2_verify`. Rows shorter than T must carry Δ = 0 on their padding, which
leaves their state unchanged there.
"""
from __future__ import annotations

import torch


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, h0: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [batch, T, nheads, headdim]; dt [batch, T, nheads]; A, D [nheads];
    B, C [batch, T, nheads, d_state] (already expanded from groups to heads);
    h0 [batch, nheads, headdim, d_state]. All in one float dtype.
    Returns (y [batch, T, nheads, headdim], final state like h0)."""
    T = x.shape[1]
    ys, h = [], h0
    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        y, h = _chunk(x[:, start:end], dt[:, start:end], A, B[:, start:end], C[:, start:end], h)
        ys.append(y)
    return torch.cat(ys, dim=1) + D[:, None] * x, h


def _chunk(x, dt, A, B, C, h0):
    L = x.shape[1]
    s = torch.cumsum(dt * A, dim=1)  # [batch, L, nheads]
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()  # [t, τ]: τ ≤ t
    gap = (s[:, :, None, :] - s[:, None, :, :]).masked_fill(~causal[None, :, :, None], -torch.inf)
    weights = torch.exp(gap) * dt[:, None, :, :]  # [batch, t, τ, nheads]: exp(s_t − s_τ)·Δ_τ
    scores = torch.einsum("bthn,bshn->btsh", C, B) * weights  # [batch, t, τ, nheads]
    y = torch.einsum("btsh,bshp->bthp", scores, x)  # within the chunk
    y = y + torch.exp(s)[..., None] * torch.einsum("bthn,bhpn->bthp", C, h0)  # carried-in state
    to_end = torch.exp(s[:, -1:, :] - s) * dt  # [batch, L, nheads]: exp(s_L − s_τ)·Δ_τ
    h = torch.exp(s[:, -1])[..., None, None] * h0 + torch.einsum("bsh,bshp,bshn->bhpn", to_end, x, B)
    return y, h
