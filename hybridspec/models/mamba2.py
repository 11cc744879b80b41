"""Mamba2 mixer (Dao & Gu 2024, "Transformers are SSMs").

Symbols: x (SSM input, d_inner = nheads·headdim), Δ = dt (per-head step),
A (per-head negative scalar decay), B, C (input/output projections of the
state, shared by the heads of a group), D (skip), h (state,
[nheads, headdim, d_state]).  Per token:
    h ← exp(Δ·A)·h + Δ·x ⊗ B,   y = h·C + D·x,   out = W_out · RMSNorm(y ⊙ silu(z))

Every forward advances the state from the ring head over the batch's inputs
(`mamba2_verify`), writing the snapshots the ForwardBatch asks for: prefill
(from a zeroed slot), extend and decode are the same code path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridspec.kernels.descriptors import Mamba2Desc
from hybridspec.kernels.ops import SSD_MIN_TOKENS  # noqa: F401 (where the chunked scan takes over)
from hybridspec.kernels.ops import Norm

from hybridspec.config import Mamba2Config
from hybridspec.cache.forward_batch import ForwardBatch
from hybridspec.models.common import Kernelled, as_dtype, compute_dtype, param
from hybridspec.models.log_replay import LogReplay
from hybridspec.models.mamba_log import MambaInputLog
from hybridspec.models.ssd import ssd_chunk_scan


def gate_and_norm(norm: Norm, y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, cfg: Mamba2Config,
                  eps: float, reduce=None) -> torch.Tensor:
    """The mixer's output before out_proj, by `cfg.norm`: RMSNorm(y ⊙ silu(z))
    (Mamba2), RMSNorm(y) ⊙ silu(z) or y ⊙ silu(z) (Falcon-H1), through the
    backend's `norm` op; `reduce` sums over tensor-parallel ranks where the
    norm's group spans them (`cfg.norm_shards`).  # [batch, T, d_inner]"""
    if cfg.norm == "gate_then_norm" and cfg.norm_shards == 1:
        return norm.gated(y, gate, weight, cfg.group_size, eps)
    cd = compute_dtype(y.dtype)
    h, g = as_dtype(y, cd), F.silu(as_dtype(gate, cd))
    if cfg.norm == "gate_only":
        return as_dtype(h * g, y.dtype)
    if cfg.norm == "gate_then_norm":
        h, g = h * g, None
    if cfg.norm_shards > 1:
        normed = sharded_rms(h, cfg.group_size * cfg.norm_shards, eps, reduce)
    else:
        normed = norm.rms(h.view(*h.shape[:-1], -1, cfg.group_size), None, eps).view_as(h)
    normed = as_dtype(weight, cd) * normed
    return as_dtype(normed if g is None else normed * g, y.dtype)


def sharded_rms(h: torch.Tensor, group_size: int, eps: float, reduce) -> torch.Tensor:
    """h / sqrt(mean(h²) + eps) where h [..., channels] is this rank's share of one
    group of `group_size` channels: the sum of squares is summed across ranks."""
    squares = reduce(torch.sum(h * h, -1, keepdim=True))
    return h * (squares / group_size + eps).rsqrt()


def in_proj_scale(cfg: Mamba2Config) -> torch.Tensor | None:
    """Falcon-H1's µP vector over the in_proj output [z | x | B | C | dt] (float64; None: no scaling)."""
    if cfg.in_proj_multipliers is None:
        return None
    widths = [cfg.d_inner, cfg.d_inner, cfg.n_groups * cfg.d_state, cfg.n_groups * cfg.d_state, cfg.num_heads]
    return torch.cat([torch.full((w,), float(m), dtype=torch.float64) for w, m in zip(widths, cfg.in_proj_multipliers)])


class Mamba2Mixer(LogReplay, Kernelled, nn.Module):
    replay_op = "mamba2_replay"  # the backend's log replay of this kind (`log_replay.LogReplay`)

    def __init__(self, cfg: Mamba2Config, weights: dict[str, torch.Tensor], state_layer: int, eps: float):
        super().__init__()
        self.state_spec = cfg.state_spec()
        self.cfg, self.state_layer, self.eps = cfg, state_layer, eps
        self.in_proj = param(weights["in_proj.weight"])
        self.in_bias = param(weights["in_proj.bias"]) if cfg.proj_bias else None
        self.conv_weight = param(weights["conv1d.weight"])  # [conv_dim, 1, d_conv]
        self.conv_bias = param(weights["conv1d.bias"]) if cfg.conv_bias else None
        self.dt_bias, self.A_log, self.D = param(weights["dt_bias"]), param(weights["A_log"]), param(weights["D"])
        self.norm_weight = param(weights["norm.weight"]) if cfg.norm != "gate_only" else None
        scale = in_proj_scale(cfg)
        # in the compute dtype: D's (in_proj may be stored in 16 bits under float32 compute, `load`)
        self.register_buffer("in_scale", None if scale is None else scale.to(self.D.dtype), persistent=False)
        self.out_proj = param(weights["out_proj.weight"])
        self.out_bias = param(weights["out_proj.bias"]) if cfg.proj_bias else None
        self.reduce = None  # the sum over tensor-parallel ranks, where the norm's group spans them

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        cfg = self.cfg
        bsz, T, _ = h.shape
        cd = compute_dtype(h.dtype)
        ops = self.ops
        projected = ops.linear(h, self.in_proj, self.in_bias)  # [batch, T, d_inner + conv_dim + nheads]
        if self.in_scale is not None:
            projected = projected * self.in_scale
        gate, xs, dt = projected.split([cfg.d_inner, cfg.conv_dim, cfg.num_heads], dim=-1)
        ssm_states = cache.states.ssm_states[self.state_layer]
        conv_states = cache.states.conv_states[self.state_layer]
        xs = xs.contiguous()  # [batch, T, conv_dim]
        tree = batch.tree  # a tree of inputs: each input's state from its parent's (`cache.tree_batch`)
        xBC = (ops.conv_window(conv_states, batch, xs, self.conv_kernel(), self.conv_bias, "silu") if tree is None
               else tree.window(self.state_layer, ops.tree_forms.conv_window, conv_states, xs, self.conv_kernel(),
                                self.conv_bias, "silu"))
        x, B, C = xBC.split([cfg.d_inner, cfg.n_groups * cfg.d_state, cfg.n_groups * cfg.d_state], dim=-1)
        x = x.reshape(bsz, T, cfg.num_heads, cfg.head_dim).contiguous()  # the kernels want contiguous inputs
        B = B.reshape(bsz, T, cfg.n_groups, cfg.d_state).contiguous()
        C = C.reshape(bsz, T, cfg.n_groups, cfg.d_state).contiguous()
        dt = ops.pointwise.softplus(as_dtype(dt, cd) + as_dtype(self.dt_bias, cd))  # [batch, T, nheads]
        low, high = cfg.time_step_limit
        if low > 0.0 or high != float("inf"):  # softplus is already >= 0: the default limits change nothing
            dt = dt.clamp(low, high)
        A = self.decay_rate(cd)  # [nheads]
        y = (ops.mamba2_steps(ssm_states, batch, x, dt, A, B, C, self.D, self.chunked_scan) if tree is None
             else tree.recurrence(self.state_layer, ops.tree_forms.mamba2, ssm_states, x, dt, A, B, C, self.D))
        self.log_inputs(batch, xs, x, dt, B, C)
        y = gate_and_norm(ops.norm, y.view(bsz, T, cfg.d_inner), gate, self.norm_weight, cfg, self.eps, self.reduce)
        return ops.linear(y, self.out_proj, self.out_bias)

    def log_inputs(self, batch: ForwardBatch, xs, x, dt, B, C) -> None:
        """Keep this forward's inputs for log replay when the forward asks for them
        (`batch.input_log`): xs [batch, T, conv_dim], x [batch, T, nheads, headdim],
        dt [batch, T, nheads], B, C [batch, T, ngroups, d_state]."""
        if batch.input_log is not None:
            batch.input_log[self.state_layer] = MambaInputLog(xs=xs, x=x, dt=dt, B=B, C=C)

    def describe(self) -> Mamba2Desc:
        cfg = self.cfg
        return Mamba2Desc(
            in_proj=self.in_proj, in_bias=self.in_bias, in_scale=self.in_scale, conv_kernel=self.conv_kernel(),
            conv_bias=self.conv_bias, dt_bias=self.dt_bias, A=self.decay_rate(torch.float32), D=self.D,
            norm_weight=self.norm_weight, norm=cfg.norm, group_size=cfg.group_size,
            time_step_limit=tuple(cfg.time_step_limit), out_proj=self.out_proj, out_bias=self.out_bias,
            d_inner=cfg.d_inner, num_heads=cfg.num_heads, head_dim=cfg.head_dim, n_groups=cfg.n_groups,
            d_state=cfg.d_state, d_conv=cfg.d_conv, conv_dim=cfg.conv_dim, state_layer=self.state_layer,
            make_log=MambaInputLog)

    def decay_rate(self, dtype: torch.dtype) -> torch.Tensor:
        """A = -exp(A_log) in `dtype`, kept until A_log changes."""
        key = (self.A_log._version, self.A_log.data_ptr(), dtype)
        if getattr(self, "_decay_key", None) != key:
            self._decay, self._decay_key = -torch.exp(as_dtype(self.A_log, dtype)), key
        return self._decay

    def conv_kernel(self) -> torch.Tensor:
        """conv1d.weight [conv_dim, 1, d_conv] as [conv_dim, d_conv], a view kept per storage."""
        view = getattr(self, "_conv_kernel", None)
        if view is None or view.data_ptr() != self.conv_weight.data_ptr():
            view = self._conv_kernel = self.conv_weight[:, 0]
        return view

    def chunked_scan(self, ssm_states: torch.Tensor, batch: ForwardBatch, x, dt, A, B, C) -> torch.Tensor:
        """SSD over the whole batch from the head states; writes each row's final
        state to its snapshot slot at its last input. Returns y [batch, T, nheads, headdim]."""
        cd, T = dt.dtype, x.shape[1]
        rows = torch.arange(x.shape[0], device=x.device)
        is_live = torch.arange(T, device=x.device) < batch.num_tokens[:, None]  # [batch, T]
        dt = dt * is_live[..., None]  # Δ = 0 on padding: the state stays put there
        heads_per_group = self.cfg.num_heads // self.cfg.n_groups
        B, C = (t.to(cd).repeat_interleave(heads_per_group, dim=2) for t in (B, C))  # [batch, T, nheads, d_state]
        y, final = ssd_chunk_scan(x.to(cd), dt, A, B, C, self.D.to(cd), ssm_states[batch.src_slot].to(cd),
                                  min(self.cfg.chunk_size, 128))
        slots = batch.snap_slot[rows, batch.num_tokens - 1]  # [batch]
        keep = slots >= 0
        ssm_states[slots[keep]] = final[keep].to(ssm_states.dtype)
        return y.to(x.dtype)
