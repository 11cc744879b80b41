"""The causal conv window of one forward on CPU in C (`cpu/conv.c`), the
counterpart of the Triton `conv_window_update` for float32 CPU runs.

Why: the torch reference (`conv_window_update_ref`) concatenates the window
and the inputs, unfolds, multiplies, sums, adds the bias, applies SiLU and
writes the windows, each a whole-tensor operation; one C loop over rows and
channels does it with the window in registers. Same arguments and writes as
the reference. Used by the Mamba mixers under the conditions of
`cpu_native.takes_forward`, for a contiguous window pool and a contiguous
[conv_dim, d_conv] float32 weight.
"""
from __future__ import annotations

import torch

from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.kernels.triton.conv_window import conv_window_update_ref
from hybridspec.kernels.slot_plan import SlotPlan

ACTIVATIONS = {"silu": 1, None: 0}


def applies(conv_states: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, bias, activation,
            plan: SlotPlan | None) -> bool:
    return (activation in ACTIVATIONS and conv_states.is_contiguous() and weight.is_contiguous()
            and xs.stride(2) == 1 and cpu_native.takes_forward(plan, conv_states, xs, weight,
                                                                *(() if bias is None else (bias,))))


def conv_window_steps(conv_states, plan: SlotPlan, xs, weight, bias, activation,
                      parents: torch.Tensor | None = None) -> torch.Tensor:
    """conv_states [slots, conv_dim, d_conv - 1] (written at the plan's snapshot
    slots), xs [batch, T, conv_dim], weight [conv_dim, d_conv], bias [conv_dim]
    or None -> out [batch, T, conv_dim]. `parents` [batch, T] int64: the inputs
    form that tree (`cpu/tree.py`). The caller checked `applies`."""
    batch, T, conv_dim = xs.shape
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(batch, T, conv_dim, dtype=torch.float32)
    status = cpu_native.call(
        "conv_window_steps",
                conv_states.data_ptr(), plan.src.data_ptr(), plan.live_snap.data_ptr(), xs.data_ptr(), xs.stride(0),
        xs.stride(1), weight.data_ptr(), None if bias is None else bias.data_ptr(), ACTIVATIONS[activation],
        out.data_ptr(), batch, T, conv_dim, weight.shape[1], 0 if parents is None else parents.data_ptr())
    if status != 0:
        raise ValueError(f"conv_window_steps: shapes not taken: xs {tuple(xs.shape)}, weight {tuple(weight.shape)}")
    if not plan.all_live:  # padding inputs: zeros, as the reference gives
        out.masked_fill_(plan.dead_inputs, 0.0)
    return out


def conv_window_update_cpu(conv_states, xs, weight, bias, activation, plan: SlotPlan | None) -> torch.Tensor:
    """The conv window update of a forward on CPU: the C loop where it applies,
    else `conv_window_update_ref` over the plan."""
    if applies(conv_states, xs, weight, bias, activation, plan):
        return conv_window_steps(conv_states, plan, xs, weight, bias, activation)
    return conv_window_update_ref(conv_states, None, None, xs, weight, bias, None, activation, plan=plan)
