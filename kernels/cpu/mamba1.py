"""The Mamba-1 recurrence of one forward on CPU in C (`cpu/mamba1.c`), the
counterpart of the Triton `mamba1_verify` for float32 CPU runs.

Why: the torch reference (`mamba1_verify_ref`) runs each input as whole-state
operations (exp of Δ ⊗ A, the update, the product with C), each reading and
writing the layer's [d_inner, d_state] state in memory; the C loop keeps a
channel's state row in registers across the inputs and touches memory only
to read the source state and write the snapshots. Same arguments and writes
as the reference. Used by the Mamba-1 mixer under the conditions of
`cpu_native.takes_forward`, for a contiguous state pool and d_state a
multiple of 8 up to 64.
"""
from __future__ import annotations

import torch

from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.kernels.slot_plan import SlotPlan


def applies(ssm_states: torch.Tensor, x: torch.Tensor, plan: SlotPlan | None) -> bool:
    d_state = ssm_states.shape[-1]
    return (d_state % 8 == 0 and 8 <= d_state <= 64 and ssm_states.is_contiguous()
            and cpu_native.takes_forward(plan, ssm_states, x))


def mamba1_steps(ssm_states, plan: SlotPlan, x, dt, A, B, C, D, parents: torch.Tensor | None = None) -> torch.Tensor:
    """ssm_states [slots, d_inner, d_state] (written in place at the plan's
    snapshot slots); x, dt [batch, T, d_inner], A [d_inner, d_state], B, C
    [batch, T, d_state], D [d_inner], all float32 -> y [batch, T, d_inner].
    `parents` [batch, T] int64: the inputs form that tree (`cpu/tree.py`).
    The caller checked `applies`."""
    batch, T, d_inner = x.shape
    d_state = A.shape[1]
    x, dt, B, C = cpu_native.unit_inner_stride(x, dt, B, C)
    A, D = A.contiguous(), D.contiguous()
    y = torch.empty(batch, T, d_inner, dtype=torch.float32)
    status = cpu_native.call(
        "mamba1_steps",
                ssm_states.data_ptr(), plan.src.data_ptr(), plan.live_snap.data_ptr(),
        x.data_ptr(), x.stride(0), x.stride(1), dt.data_ptr(), dt.stride(0), dt.stride(1),
        A.data_ptr(), B.data_ptr(), B.stride(0), B.stride(1), C.data_ptr(), C.stride(0), C.stride(1),
        D.data_ptr(), y.data_ptr(), batch, T, d_inner, d_state, 0 if parents is None else parents.data_ptr())
    if status != 0:
        raise ValueError(f"mamba1_steps: shapes not taken: x {tuple(x.shape)}, A {tuple(A.shape)}")
    if not plan.all_live:  # padding inputs: zeros, as the reference gives
        y.masked_fill_(plan.dead_inputs, 0.0)
    return y
