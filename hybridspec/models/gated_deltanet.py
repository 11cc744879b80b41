"""Gated DeltaNet mixer (Yang, Kautz & Hatamizadeh 2025, "Gated Delta
Networks"), as Qwen3-Next and Qwen3.5 run it ("linear attention" layers).

Symbols (kernels/triton/gdn_verify.py has the rule itself): HK key heads and HV value
heads (HV a multiple of HK), head sizes d_k and d_v; per token
    [q | k | v] = silu(causal_conv(W_qkv · x))      the conv window keeps d_conv − 1 inputs
    q ← q / ‖q‖ · d_k^-1/2,  k ← k / ‖k‖             (L2 norm with eps 1e-6 under the root)
    g = −exp(A_log) · softplus(a + dt_bias),  β = sigmoid(b),  z = W_z · x
    S ← exp(g)·S + k ⊗ β(v − exp(g)·Sᵀk),  o = Sᵀq  (per value head, state [d_k, d_v])
    out = W_out · (w ⊙ RMSNorm(o) ⊙ silu(z))        (the norm per value head)

The four input projections are one weight, `in_proj` [q | k | v | z | b | a]
(the adapters fuse Qwen3-Next's interleaved and Qwen3.5's split ones), so a
decode step runs one product. Every forward advances the state from the ring
head over the batch's inputs (`gdn_steps`), writing the snapshots the
ForwardBatch asks for: prefill (from a zeroed slot), extend and decode are the
same code path; a forward that keeps only final states of at least
`SSD_MIN_TOKENS` inputs takes the chunked form (`gdn_chunk`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridspec.cache.state_pool import StatePool
from hybridspec.kernels.descriptors import GdnDesc

from hybridspec.config import GdnConfig
from hybridspec.cache.forward_batch import ForwardBatch
from hybridspec.models.common import Kernelled, as_dtype, compute_dtype, param
from hybridspec.models.gdn_chunk import gdn_chunk_scan
from hybridspec.models.gdn_log import GdnInputLog

L2_EPS = 1e-6  # under the root of q's and k's L2 norms (FLA's and HF's l2norm)
CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim, as HF's `l2norm`."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def norm_then_gate(norm, o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w ⊙ RMSNorm(o) ⊙ silu(z) per value head: o [batch, T, HV, d_v], z [batch, T, HV·d_v],
    w [d_v] -> [batch, T, HV·d_v]."""
    cd = compute_dtype(o.dtype)
    normed = as_dtype(norm.rms(o, None, eps), cd)
    gated = as_dtype(weight, cd) * normed * F.silu(as_dtype(z.view_as(o), cd))
    return as_dtype(gated, o.dtype).reshape(*z.shape)


class GatedDeltaNet(Kernelled, nn.Module):
    def __init__(self, cfg: GdnConfig, weights: dict[str, torch.Tensor], state_layer: int, eps: float):
        super().__init__()
        self.state_spec = cfg.state_spec()
        self.cfg, self.state_layer, self.eps = cfg, state_layer, eps
        self.in_proj = param(weights["in_proj.weight"])
        self.conv_weight = param(weights["conv1d.weight"])  # [conv_dim, 1, d_conv]
        self.dt_bias, self.A_log = param(weights["dt_bias"]), param(weights["A_log"])
        self.norm_weight = param(weights["norm.weight"])
        self.out_proj = param(weights["out_proj.weight"])

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        cfg = self.cfg
        bsz, T, _ = h.shape
        ops = self.ops
        HV = cfg.num_value_heads
        projected = ops.linear(h, self.in_proj)  # [batch, T, conv_dim + HV·d_v + 2·HV]
        xs, z, b, a = projected.split([cfg.conv_dim, cfg.value_dim, HV, HV], dim=-1)
        states = cache.states.ssm_states[self.state_layer]
        conv_states = cache.states.conv_states[self.state_layer]
        xs = xs.contiguous()  # [batch, T, conv_dim]
        tree = batch.tree  # a tree of inputs: each input's state from its parent's (`cache.tree_batch`)
        qkv = (ops.conv_window(conv_states, batch, xs, self.conv_kernel(), None, "silu") if tree is None
               else tree.window(self.state_layer, ops.tree_forms.conv_window, conv_states, xs, self.conv_kernel(),
                                None, "silu"))
        q, k, v = qkv.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        q, k = self.normalize(q, k, h.dtype)  # [batch, T, HK, d_k]
        v = v.reshape(bsz, T, HV, cfg.value_head_dim).contiguous()
        g, beta = self.gates(a, b, states.dtype)  # [batch, T, HV]
        o = (ops.gdn_steps(states, batch, q, k, v, g, beta, self.chunked_scan) if tree is None
             else tree.recurrence(self.state_layer, ops.tree_forms.gdn, states, q, k, v, g, beta))
        # o: [batch, T, HV, d_v]
        if batch.input_log is not None:
            batch.input_log[self.state_layer] = GdnInputLog(xs=xs, k=k, v=v, g=g, beta=beta)
        return ops.linear(norm_then_gate(ops.norm, o, z, self.norm_weight, self.eps), self.out_proj)

    def normalize(self, q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """L2-normalised q (scaled by d_k^-1/2) and k [batch, T, HK, d_k], normed in the compute dtype and
        kept in the model dtype, so that the logged k is exactly what the forward used."""
        cfg = self.cfg
        cd = compute_dtype(dtype)
        shape = (*q.shape[:2], cfg.num_key_heads, cfg.key_head_dim)
        q = l2_normalize(as_dtype(q.reshape(shape), cd)) * (cfg.key_head_dim ** -0.5)
        k = l2_normalize(as_dtype(k.reshape(shape), cd))
        return as_dtype(q, dtype).contiguous(), as_dtype(k, dtype).contiguous()

    def gates(self, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """g = −exp(A_log)·softplus(a + dt_bias) and β = sigmoid(b) [batch, T, HV] in the state dtype."""
        cd = torch.promote_types(compute_dtype(a.dtype), dtype)
        pointwise = self.ops.pointwise
        g = self.decay_rate(cd) * pointwise.softplus(as_dtype(a, cd) + as_dtype(self.dt_bias, cd))
        return g.contiguous(), pointwise.sigmoid(as_dtype(b, cd)).contiguous()

    def decay_rate(self, dtype: torch.dtype) -> torch.Tensor:
        """−exp(A_log) [HV] in `dtype`, kept until A_log changes."""
        key = (self.A_log._version, self.A_log.data_ptr(), dtype)
        if getattr(self, "_decay_key", None) != key:
            self._decay, self._decay_key = -torch.exp(as_dtype(self.A_log, dtype)), key
        return self._decay

    def replay(self, states: StatePool, src_slot: torch.Tensor, dst_slot: torch.Tensor, first: torch.Tensor,
               num_steps: torch.Tensor, log: GdnInputLog) -> None:
        """Advance the state (rule state and conv window) in src_slot over logged
        inputs first..first+num_steps-1 and write it to dst_slot (rows with
        dst_slot = -1 untouched). All index tensors are [batch]."""
        self.ops.gdn_replay(states.ssm_states[self.state_layer], states.conv_states[self.state_layer], src_slot,
                            dst_slot, first, num_steps, log)

    def describe(self) -> GdnDesc:
        cfg = self.cfg
        return GdnDesc(in_proj=self.in_proj, conv_kernel=self.conv_kernel(), dt_bias=self.dt_bias, A_log=self.A_log,
                       norm_weight=self.norm_weight, out_proj=self.out_proj, num_key_heads=cfg.num_key_heads,
                       num_value_heads=cfg.num_value_heads, key_head_dim=cfg.key_head_dim,
                       value_head_dim=cfg.value_head_dim, d_conv=cfg.d_conv, conv_dim=cfg.conv_dim,
                       state_layer=self.state_layer, make_log=GdnInputLog)

    def conv_kernel(self) -> torch.Tensor:
        """conv1d.weight [conv_dim, 1, d_conv] as [conv_dim, d_conv], a view kept per storage."""
        view = getattr(self, "_conv_kernel", None)
        if view is None or view.data_ptr() != self.conv_weight.data_ptr():
            view = self._conv_kernel = self.conv_weight[:, 0]
        return view

    def chunked_scan(self, states: torch.Tensor, batch: ForwardBatch, q, k, v, g, beta) -> torch.Tensor:
        """The chunked rule over the whole batch from the head states; writes each
        row's final state to its snapshot slot at its last input. Returns o
        [batch, T, HV, d_v] (padding inputs' rows are not zeroed: nothing reads them)."""
        HV, T = v.shape[2], v.shape[1]
        cd = torch.promote_types(states.dtype, v.dtype)
        rows = torch.arange(v.shape[0], device=v.device)
        is_live = (torch.arange(T, device=v.device) < batch.num_tokens[:, None])[..., None]  # [batch, T, 1]
        g, beta = g.to(cd) * is_live, beta.to(cd) * is_live  # no decay and no write on padding
        q, k = (x.to(cd).repeat_interleave(HV // x.shape[2], dim=2) for x in (q, k))
        o, final = gdn_chunk_scan(q, k, v.to(cd), g, beta, states[batch.src_slot].to(cd), CHUNK_SIZE)
        slots = batch.snap_slot[rows, batch.num_tokens - 1]  # [batch]
        keep = slots >= 0
        states[slots[keep]] = final[keep].to(states.dtype)
        return o.to(v.dtype)
