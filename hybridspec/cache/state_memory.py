"""Memory formulas of recurrent state, defined once.

The runtime (`StatePool`, the input log), the `auto` checkpoint policy
(`CheckpointFootprint`) and the simulator (`HybridShape`) all size recurrent
state with these functions, so `hybridspec simulate` reports the bytes an
`Engine` allocates for the same shape. Glossary: docs/design.md.

Per recurrent layer and sequence (one ring slot holds both parts):
    Mamba2  SSM state  nheads·headdim·d_state        conv window  conv_dim·(d_conv − 1)
            conv_dim = d_inner + 2·ngroups·d_state (the x, B, C channels)
    Mamba1  SSM state  d_inner·d_state                conv window  d_inner·(d_conv − 1)
    GDN     SSM state  HV·d_k·d_v                     conv window  conv_dim·(d_conv − 1)
            conv_dim = 2·HK·d_k + HV·d_v (the q, k, v channels; HK key heads, HV value heads)
Input log per verify input (the Mamba kinds' `models.mamba_log.MambaInputLog`): the conv inputs xs, the SSM
input x, the time step dt and B, C:
    Mamba2  conv_dim + d_inner + 2·ngroups·d_state  activations,  nheads  dt
    Mamba1  d_inner + d_inner + 2·d_state           activations,  d_inner dt
    GDN     conv_dim (pre-conv q, k, v) + HK·d_k (k) + HV·d_v (v)  activations,  2·HV  (g, β)
            (`models.gdn_log.GdnInputLog`: xs, the normalised k, v; the gates g and β)
dt (GDN: g and β) is kept in the state dtype (the recurrence's), the rest in the model dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch


@dataclass(frozen=True)
class RecurrentStateShape:
    """What one recurrent layer keeps per sequence: its slot shapes and its log width."""

    ssm: tuple[int, ...]  # (nheads, headdim, d_state) Mamba2 | (d_inner, d_state) Mamba1 | (HV, d_k, d_v) GDN
    conv: tuple[int, ...]  # (conv_dim, d_conv - 1)
    log_activations: int = 0  # logged elements per verify input in the model dtype (xs, x, B, C)
    log_dt: int = 0  # logged dt elements (GDN: g and β) per verify input, in the state dtype

    def __post_init__(self):
        for name in ("ssm", "conv"):
            dims = tuple(getattr(self, name))
            if not dims or any(not isinstance(d, int) or d < 1 for d in dims):
                raise ValueError(f"{name} state shape {dims}: every dimension must be an integer >= 1")
            object.__setattr__(self, name, dims)

    @property
    def slot_elements(self) -> int:
        return prod(self.ssm) + prod(self.conv)


def mamba2_state_shape(num_heads: int, head_dim: int, d_state: int, n_groups: int,
                       d_conv: int) -> RecurrentStateShape:
    d_inner = num_heads * head_dim
    conv_dim = d_inner + 2 * n_groups * d_state
    return RecurrentStateShape(ssm=(num_heads, head_dim, d_state), conv=(conv_dim, d_conv - 1),
                               log_activations=conv_dim + d_inner + 2 * n_groups * d_state, log_dt=num_heads)


def mamba1_state_shape(d_inner: int, d_state: int, d_conv: int) -> RecurrentStateShape:
    return RecurrentStateShape(ssm=(d_inner, d_state), conv=(d_inner, d_conv - 1),
                               log_activations=2 * d_inner + 2 * d_state, log_dt=d_inner)


def gdn_state_shape(num_v_heads: int, num_k_heads: int, head_k_dim: int, head_v_dim: int,
                    d_conv: int) -> RecurrentStateShape:
    conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    return RecurrentStateShape(ssm=(num_v_heads, head_k_dim, head_v_dim), conv=(conv_dim, d_conv - 1),
                               log_activations=conv_dim + num_k_heads * head_k_dim + num_v_heads * head_v_dim,
                               log_dt=2 * num_v_heads)


def default_state_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The state dtype when none is set: float32, or float64 for a float64 model
    (recurrences never run below float32; deployed hybrids keep float32 states)."""
    return torch.promote_types(model_dtype, torch.float32)


def bytes_per_slot(shapes, state_bytes: int) -> int:
    """One ring slot (recurrent state plus conv window) over every recurrent layer in `shapes`."""
    return state_bytes * sum(s.slot_elements for s in shapes)


def log_bytes_per_input(shapes, activation_bytes: int, state_bytes: int) -> int:
    """The input log of one verify input of one sequence over every recurrent layer."""
    return sum(s.log_activations * activation_bytes + s.log_dt * state_bytes for s in shapes)


def snapshot_inputs(num_inputs: int, snapshot_every: int) -> tuple[int, ...]:
    """Verify-input indices (0-based, ascending) after which a policy with
    `snapshot_every = k` writes a snapshot: 0, k, 2k, … and the last input;
    k = 0 the last only (the round-start state stays in the pinned head)."""
    last = num_inputs - 1
    if snapshot_every == 0:
        return (last,)
    return tuple(sorted(set(range(0, num_inputs, snapshot_every)) | {last}))
