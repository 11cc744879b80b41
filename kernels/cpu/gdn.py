"""The gated delta rule of one forward on CPU in C (`cpu/gdn.c`), the
counterpart of the Triton `gdn_verify` for float32 CPU runs, and its log
replay through the same loop.

Why: the torch reference (`gdn_verify_ref`) runs each input as several
whole-state operations (decay, the read Sᵀk, the rank-1 update, the output
Sᵀq, the snapshot copy), so every step reads and writes every head's state
in memory several times (1 MiB per layer for 16 heads of 128 × 128); the C
loop keeps a block of one head's state in L1 across the inputs and touches
memory only to read the source state and write the snapshots. Same
arguments and writes as the reference: each input's state goes into the
slot its plan names (the ring), and o comes back [batch, T, HV, d_v].

Used by the GDN layer when every condition holds: float32 CPU tensors, a
host-side `SlotPlan` (padded rows run their padding with no snapshot there,
`cpu_native.takes_forward`), a contiguous state pool, d_v a multiple of 8
and d_k at most MAX_D_K, and the native kernels on (`cpu_native.available`).
"""
from __future__ import annotations

import torch

from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.kernels.triton.gdn_verify import check_gdn_replay_args, gdn_replay_ref
from hybridspec.kernels.slot_plan import SlotPlan

MAX_D_K = 256  # GDN_MAX_DK (cpu/kernels.h): the C loop's scratch block is d_k × 32 floats on the stack


def shapes_ok(states: torch.Tensor) -> bool:
    d_k, d_v = states.shape[-2:]
    return d_v % 8 == 0 and 1 <= d_k <= MAX_D_K and states.is_contiguous()


def applies(states: torch.Tensor, v: torch.Tensor, plan: SlotPlan | None) -> bool:
    return shapes_ok(states) and v.shape[1] > 0 and cpu_native.takes_forward(plan, states, v)


def gdn_steps(states, plan, q, k, v, g, beta, parents: torch.Tensor | None = None) -> torch.Tensor | None:
    """states [slots, HV, d_k, d_v] (written in place at the plan's snapshot
    slots); q, k [batch, T, HK, d_k] (q None: no output, a replay), v [batch,
    T, HV, d_v], g, beta [batch, T, HV], all float32 -> o [batch, T, HV, d_v]
    (None without q). `plan`: a `SlotPlan`, or anything with `src`,
    `live_snap`, `all_live`. `parents` [batch, T] int64: the inputs form that
    tree (`cpu/tree.py`). The caller checked `applies`."""
    batch, T, heads, d_v = v.shape
    key_heads, d_k = k.shape[2:]
    k, v, g, beta = cpu_native.unit_inner_stride(k, v, g, beta)
    if q is not None:
        (q,) = cpu_native.unit_inner_stride(q)
    o = None if q is None else torch.empty(batch, T, heads, d_v, dtype=torch.float32)
    status = cpu_native.call(
        "gdn_steps",
        states.data_ptr(), plan.src.data_ptr(), plan.live_snap.data_ptr(),
        *((0, 0, 0, 0) if q is None else (q.data_ptr(), q.stride(0), q.stride(1), q.stride(2))),
        k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        v.data_ptr(), v.stride(0), v.stride(1), v.stride(2),
        g.data_ptr(), g.stride(0), g.stride(1), beta.data_ptr(), beta.stride(0), beta.stride(1),
        0 if o is None else o.data_ptr(), batch, T, heads, key_heads, d_k, d_v,
        0 if parents is None else parents.data_ptr())
    if status != 0:
        raise ValueError(f"gdn_steps: shapes not taken: k {tuple(k.shape)}, v {tuple(v.shape)}")
    if o is not None and not plan.all_live:  # padding inputs: zeros, as the reference gives
        o.masked_fill_(plan.dead_inputs[..., None], 0.0)
    return o


def gdn_replay(states, src_slot, dst_slot, num_steps, k, v, g, beta) -> None:
    """`gdn_replay_ref` (same arguments, same writes) through the forward's C
    loop over the rows that replay, with a plan that writes only each row's
    last replayed input, into its destination: the state the forward would
    have snapshotted there, bit for bit. The reference where the loop does
    not take the call."""
    check_gdn_replay_args(states, src_slot, dst_slot, num_steps, k, v, g, beta)
    if not (shapes_ok(states) and cpu_native.takes(states, k, v, g, beta)):
        gdn_replay_ref(states, src_slot, dst_slot, num_steps, k, v, g, beta)
        return
    T = v.shape[1]
    src, dst = src_slot.tolist(), dst_slot.tolist()
    steps = [max(0, min(n, T)) for n in num_steps.tolist()]
    rows = [b for b, d in enumerate(dst) if d >= 0 and steps[b] > 0]
    for b, d in enumerate(dst):
        if d >= 0 and steps[b] == 0 and d != src[b]:  # no inputs: the source state as it is
            states[d] = states[src[b]]
    if not rows:
        return
    length = max(steps[b] for b in rows)
    snap = [[dst[b] if t == steps[b] - 1 else -1 for t in range(length)] for b in rows]
    plan = SlotPlan([src[b] for b in rows], snap, [length] * len(rows), states.device)
    if rows != list(range(len(dst))):
        index = torch.tensor(rows, dtype=torch.long)
        k, v, g, beta = (x.index_select(0, index) for x in (k, v, g, beta))
    gdn_steps(states, plan, None, k[:, :length], v[:, :length], g[:, :length], beta[:, :length])
