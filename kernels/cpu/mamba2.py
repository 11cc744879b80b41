"""The Mamba-2 recurrence of one forward on CPU in C (`cpu/mamba2.c`), the
counterpart of the Triton `mamba2_verify` for float32 CPU runs.

Why: the torch reference (`mamba2_verify_ref`) runs each input as a few
whole-state operations, so every step reads and writes every head's state in
memory (128 KiB per layer for 8 heads of 64 × 64); the C loop keeps one head's
state in L1 across the inputs and touches memory only to read the source
state and write the snapshots. Same arguments and writes as the reference:
each input's state goes into the slot its plan names (the ring), and y
comes back [batch, T, nheads, headdim].

Used by the Mamba-2 mixer when every condition holds: float32 CPU tensors, a
host-side `SlotPlan` (padded rows run their padding with no snapshot there,
`cpu_native.takes_forward`), a contiguous state pool, and the native
kernels on (`cpu_native.available`); it runs on the calling thread at any
torch thread count.
"""
from __future__ import annotations

import threading

import torch

from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.kernels.slot_plan import SlotPlan

_LOCAL = threading.local()  # per thread (the C call releases the GIL): one head's state, by size


def applies(ssm_states: torch.Tensor, x: torch.Tensor, plan: SlotPlan | None) -> bool:
    return ssm_states.is_contiguous() and cpu_native.takes_forward(plan, ssm_states, x)


def mamba2_steps(ssm_states, plan: SlotPlan, x, dt, A, B, C, D, parents: torch.Tensor | None = None) -> torch.Tensor:
    """ssm_states [slots, nheads, headdim, d_state] (written in place at the
    plan's snapshot slots); x [batch, T, nheads, headdim], dt [batch, T,
    nheads], A, D [nheads], B, C [batch, T, ngroups, d_state], all float32 ->
    y [batch, T, nheads, headdim]. `parents` [batch, T] int64: the inputs form
    that tree (`cpu/tree.py`). The caller checked `applies`."""
    batch, T, nheads, headdim = x.shape
    ngroups, d_state = B.shape[2:]
    x, dt, B, C = cpu_native.unit_inner_stride(x, dt, B, C)
    A, D = A.contiguous(), D.contiguous()
    head_size = headdim * d_state
    heads = getattr(_LOCAL, "heads", None)
    if heads is None:
        heads = _LOCAL.heads = {}
    scratch = heads.get(head_size)
    if scratch is None:
        scratch = heads[head_size] = torch.empty(head_size, dtype=torch.float32)
    y = torch.empty(batch, T, nheads, headdim, dtype=torch.float32)
    status = cpu_native.call(
        "mamba2_steps",
                ssm_states.data_ptr(), plan.src.data_ptr(), plan.live_snap.data_ptr(), scratch.data_ptr(),
        x.data_ptr(), x.stride(0), x.stride(1), x.stride(2),
        dt.data_ptr(), dt.stride(0), dt.stride(1),
        A.data_ptr(), D.data_ptr(),
        B.data_ptr(), B.stride(0), B.stride(1), B.stride(2),
        C.data_ptr(), C.stride(0), C.stride(1), C.stride(2),
        y.data_ptr(), batch, T, nheads, headdim, d_state, ngroups, 0 if parents is None else parents.data_ptr())
    if status != 0:
        raise ValueError(f"mamba2_steps: shapes not taken: x {tuple(x.shape)}, B {tuple(B.shape)}")
    if not plan.all_live:  # padding inputs: zeros, as the reference gives
        y.masked_fill_(plan.dead_inputs[..., None], 0.0)
    return y
