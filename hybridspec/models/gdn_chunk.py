"""Chunked gated delta rule for GDN prefill (Yang, Kautz & Hatamizadeh 2025,
§3.3, the WY / UT-transform form; the layout of HF's `torch_chunk_gated_delta_rule`).

Per head, within a chunk of L inputs with log decays g_t, their running sums
c_t = g_1 + … + g_t and the carried-in state S_0 [d_k, d_v], the token-by-token
rule S_t = exp(g_t)·S_{t-1} + k_t ⊗ β_t (v_t − exp(g_t)·S_{t-1}ᵀ k_t) unrolls to:
    A        [L, L]  A_ij = β_i (k_i·k_j) exp(c_i − c_j) for j < i, else 0
    U        = (I + A)⁻¹ (β ⊙ V)                  the writes if S_0 were zero
    W        = (I + A)⁻¹ (β ⊙ exp(c) ⊙ K)         how much each write reads S_0
    U'       = U − W S_0                          the writes (the delta rule's corrections)
    o_t      = exp(c_t)·q_t S_0 + Σ_{τ≤t} exp(c_t − c_τ)(q_t·k_τ) U'_τ
    S_L      = exp(c_L)·S_0 + Σ_τ exp(c_L − c_τ) k_τ ⊗ U'_τ
Chunks run one after another, so only states at chunk ends are formed: this
serves prefill and plain extends (one state wanted, at each row's last input),
while verification, which wants a state after every input, uses the
token-by-token `gdn_verify`. Rows shorter than T must carry g = 0 and β = 0 on
their padding, which leaves their state unchanged there.
"""
from __future__ import annotations

import torch


def gdn_chunk_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   h0: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [batch, T, HV, d_k] (already one per value head, normalised, q scaled);
    v [batch, T, HV, d_v]; g, beta [batch, T, HV]; h0 [batch, HV, d_k, d_v].
    All in one float dtype. Returns (o [batch, T, HV, d_v], final state like h0)."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [batch, HV, T, d]
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [batch, HV, T]
    outs, state = [], h0
    for start in range(0, q.shape[2], chunk_size):
        end = min(start + chunk_size, q.shape[2])
        o, state = _chunk(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], g[:, :, start:end],
                          beta[:, :, start:end], state)
        outs.append(o)
    return torch.cat(outs, dim=2).transpose(1, 2), state


def _chunk(q, k, v, g, beta, state):
    """One chunk: q, k [batch, HV, L, d_k], v [batch, HV, L, d_v], g, beta [batch, HV, L]."""
    L = q.shape[2]
    c = torch.cumsum(g, dim=-1)  # [batch, HV, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()  # [t, τ]: τ ≤ t
    gap = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, -torch.inf)
    decay = torch.exp(gap)  # [batch, HV, t, τ]: exp(c_t − c_τ) for τ ≤ t, else 0
    k_beta = k * beta[..., None]
    A = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)  # strictly lower
    eye = torch.eye(L, dtype=q.dtype, device=q.device)
    U = torch.linalg.solve_triangular(eye + A, v * beta[..., None], upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(eye + A, k_beta * torch.exp(c)[..., None], upper=False, unitriangular=True)
    writes = U - W @ state  # [batch, HV, L, d_v]
    o = (q * torch.exp(c)[..., None]) @ state + (q @ k.transpose(-1, -2) * decay) @ writes
    to_end = torch.exp(c[..., -1:] - c)[..., None]  # [batch, HV, L, 1]: exp(c_L − c_τ)
    state = state * torch.exp(c[..., -1])[..., None, None] + (k * to_end).transpose(-1, -2) @ writes
    return o, state
