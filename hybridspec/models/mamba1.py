"""Mamba1 selective-scan mixer (Gu & Dao 2023, "Mamba"), with the dt/B/C
RMSNorms Jamba adds (Lieber et al. 2024).

Symbols: x (SSM input, d_inner channels), z (gate), Δ = dt (per-channel
step), A ([d_inner, d_state], negative), B, C ([d_state], input-dependent,
shared by every channel), D (skip), h (state, [d_inner, d_state]).  Per token:
    x, z = W_in · u
    x ← silu(causal_conv(x))
    dt_in, B, C = W_x · x                      (dt_in has dt_rank dims)
    dt_in, B, C ← RMSNorm(dt_in), RMSNorm(B), RMSNorm(C)   (Jamba only)
    Δ = softplus(W_dt · dt_in + b_dt)
    h ← exp(Δ ⊗ A) ⊙ h + (Δ·x) ⊗ B,   y = h·C + D·x     (eq. 2a-2b)
    out = W_out · (y ⊙ silu(z))

Every forward advances the state from the ring head over the batch's inputs
(`mamba1_verify`), writing the snapshots the ForwardBatch asks for: prefill
(from a zeroed slot), extend and decode are the same code path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridspec.kernels.descriptors import Mamba1Desc

from hybridspec.config import Mamba1Config
from hybridspec.cache.forward_batch import ForwardBatch
from hybridspec.models.common import Kernelled, RMSNorm, compute_dtype, param
from hybridspec.models.log_replay import LogReplay
from hybridspec.models.mamba_log import MambaInputLog


class Mamba1Mixer(LogReplay, Kernelled, nn.Module):
    """weights: in_proj.weight [2·d_inner, hidden] (x rows first, then z),
    conv1d.weight [d_inner, 1, d_conv], x_proj.weight [dt_rank + 2·d_state, d_inner],
    dt_proj.weight [d_inner, dt_rank], dt_proj.bias, A_log [d_inner, d_state], D,
    out_proj.weight, and with `inner_layernorms` dt_norm/b_norm/c_norm.weight."""

    replay_op = "mamba1_replay"  # the backend's log replay of this kind (`log_replay.LogReplay`)

    def __init__(self, cfg: Mamba1Config, weights: dict[str, torch.Tensor], state_layer: int, eps: float):
        super().__init__()
        self.state_spec = cfg.state_spec()
        self.cfg, self.state_layer = cfg, state_layer
        self.in_proj = param(weights["in_proj.weight"])
        self.in_bias = param(weights["in_proj.bias"]) if cfg.proj_bias else None
        self.conv_weight = param(weights["conv1d.weight"])  # [d_inner, 1, d_conv]
        self.conv_bias = param(weights["conv1d.bias"]) if cfg.conv_bias else None
        self.x_proj = param(weights["x_proj.weight"])
        self.dt_proj, self.dt_bias = param(weights["dt_proj.weight"]), param(weights["dt_proj.bias"])
        self.A_log, self.D = param(weights["A_log"]), param(weights["D"])
        self.out_proj = param(weights["out_proj.weight"])
        self.out_bias = param(weights["out_proj.bias"]) if cfg.proj_bias else None
        if cfg.inner_layernorms:
            self.dt_norm = RMSNorm(weights["dt_norm.weight"], eps)
            self.b_norm = RMSNorm(weights["b_norm.weight"], eps)
            self.c_norm = RMSNorm(weights["c_norm.weight"], eps)
        self.reduce = None  # tensor parallel: the sum over ranks of x_proj's partial dt, B, C

    def describe(self) -> Mamba1Desc:
        return Mamba1Desc(d_inner=self.cfg.d_inner, d_state=self.cfg.d_state, state_layer=self.state_layer)

    def ssm_params(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(Δ [batch, T, d_inner] in the compute dtype, B, C [batch, T, d_state]) from x [batch, T, d_inner]."""
        cfg = self.cfg
        linear = self.ops.linear
        projected = linear(x, self.x_proj)  # [batch, T, dt_rank + 2·d_state]
        if self.reduce is not None:  # x holds this rank's channels: x_proj's product is a partial sum
            projected = self.reduce(projected)
        dt, B, C = projected.split([cfg.dt_rank, cfg.d_state, cfg.d_state], dim=-1)
        if cfg.inner_layernorms:
            dt, B, C = self.dt_norm(dt), self.b_norm(B), self.c_norm(C)
        cd = compute_dtype(x.dtype)
        dt = self.ops.pointwise.softplus(linear(dt, self.dt_proj).to(cd) + self.dt_bias.to(cd))
        return dt.contiguous(), B.contiguous(), C.contiguous()

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        cfg = self.cfg
        cd = compute_dtype(h.dtype)
        ops = self.ops
        xs, gate = ops.linear(h, self.in_proj, self.in_bias).split([cfg.d_inner, cfg.d_inner], dim=-1)
        ssm_states = cache.states.ssm_states[self.state_layer]
        conv_states = cache.states.conv_states[self.state_layer]
        xs = xs.contiguous()  # [batch, T, d_inner]
        tree = batch.tree  # a tree of inputs: each input's state from its parent's (`cache.tree_batch`)
        x = (ops.conv_window(conv_states, batch, xs, self.conv_weight[:, 0], self.conv_bias, "silu") if tree is None
             else tree.window(self.state_layer, ops.tree_forms.conv_window, conv_states, xs, self.conv_weight[:, 0],
                              self.conv_bias, "silu"))
        x = x.contiguous()  # [batch, T, d_inner]
        dt, B, C = self.ssm_params(x)  # [batch, T, d_inner], [batch, T, d_state] x 2
        A = -torch.exp(self.A_log.to(cd))  # [d_inner, d_state]
        y = (ops.mamba1_steps(ssm_states, batch, x, dt, A, B, C, self.D) if tree is None
             else tree.recurrence(self.state_layer, ops.tree_forms.mamba1, ssm_states, x, dt, A, B, C, self.D))
        if batch.input_log is not None:
            batch.input_log[self.state_layer] = MambaInputLog(xs=xs, x=x, dt=dt, B=B, C=C)
        y = y * F.silu(gate)  # [batch, T, d_inner]
        return ops.linear(y, self.out_proj, self.out_bias)
