"""Cache specs: what one layer keeps per sequence, one small frozen spec per
layer kind (as vLLM keeps a `KVCacheSpec` per layer kind), and the memory
formulas over them, each defined once.

The runtime (`StatePool`, the input log, `PagedKVCache`), the `auto`
checkpoint policy (`CheckpointFootprint`) and the simulator (`HybridShape`)
all size their memory with these specs, so `hybridspec simulate` reports the
bytes an `Engine` allocates for the same shape. Glossary: docs/design.md.

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
Per attention layer and cached token (paged K/V, in the model dtype): K and V, 2·num_kv_heads·head_dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch


def _check_dims(name: str, dims: tuple[int, ...]) -> None:
    if not dims or any(not isinstance(d, int) or d < 1 for d in dims):
        raise ValueError(f"{name} state shape {dims}: every dimension must be an integer >= 1")


class RecurrentStateSpec:
    """What one recurrent layer keeps per sequence. Every kind defines `ssm`
    and `conv` (one ring slot's shapes) and `log_activations` (logged elements
    per verify input in the model dtype) and `log_dt` (logged dt elements, GDN:
    g and β, in the state dtype); the sizes below follow from those alone."""

    __slots__ = ()

    def _check(self) -> None:
        _check_dims("ssm", self.ssm)
        _check_dims("conv", self.conv)

    @property
    def slot_elements(self) -> int:
        return prod(self.ssm) + prod(self.conv)

    def bytes_per_slot(self, state_bytes: int) -> int:
        """One ring slot: SSM state plus conv window."""
        return state_bytes * self.slot_elements

    def log_bytes_per_input(self, activation_bytes: int, state_bytes: int) -> int:
        """The input log of one verify input."""
        return self.log_activations * activation_bytes + self.log_dt * state_bytes


@dataclass(frozen=True)
class RecurrentStateShape(RecurrentStateSpec):
    """A recurrent layer given by its slot shapes alone (and, if logged, its log widths)."""

    ssm: tuple[int, ...]
    conv: tuple[int, ...]
    log_activations: int = 0
    log_dt: int = 0

    def __post_init__(self):
        object.__setattr__(self, "ssm", tuple(self.ssm))
        object.__setattr__(self, "conv", tuple(self.conv))
        self._check()


@dataclass(frozen=True)
class ConvWindowSpec:
    """The short causal conv's window: the last d_conv − 1 inputs of `channels` channels."""

    channels: int
    d_conv: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.channels, self.d_conv - 1)


@dataclass(frozen=True)
class Mamba2StateSpec(RecurrentStateSpec):
    """Mamba2 (Dao & Gu 2024): a [headdim, d_state] state per head; B and C shared per group."""

    num_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    d_conv: int

    def __post_init__(self):
        self._check()

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_window(self) -> ConvWindowSpec:
        return ConvWindowSpec(self.d_inner + 2 * self.n_groups * self.d_state, self.d_conv)  # x, B, C

    @property
    def ssm(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.d_state)

    @property
    def conv(self) -> tuple[int, int]:
        return self.conv_window.shape

    @property
    def log_activations(self) -> int:
        return self.conv_window.channels + self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def log_dt(self) -> int:
        return self.num_heads


@dataclass(frozen=True)
class Mamba1StateSpec(RecurrentStateSpec):
    """Mamba1 (Jamba's mixer): a d_state state per inner channel."""

    d_inner: int
    d_state: int
    d_conv: int

    def __post_init__(self):
        self._check()

    @property
    def conv_window(self) -> ConvWindowSpec:
        return ConvWindowSpec(self.d_inner, self.d_conv)

    @property
    def ssm(self) -> tuple[int, int]:
        return (self.d_inner, self.d_state)

    @property
    def conv(self) -> tuple[int, int]:
        return self.conv_window.shape

    @property
    def log_activations(self) -> int:
        return 2 * self.d_inner + 2 * self.d_state

    @property
    def log_dt(self) -> int:
        return self.d_inner


@dataclass(frozen=True)
class GdnStateSpec(RecurrentStateSpec):
    """Gated DeltaNet: a [d_k, d_v] state per value head; HK key heads (q, k), HV value heads."""

    num_v_heads: int
    num_k_heads: int
    head_k_dim: int
    head_v_dim: int
    d_conv: int

    def __post_init__(self):
        self._check()

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_window(self) -> ConvWindowSpec:
        return ConvWindowSpec(2 * self.key_dim + self.value_dim, self.d_conv)  # q, k, v

    @property
    def ssm(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    @property
    def conv(self) -> tuple[int, int]:
        return self.conv_window.shape

    @property
    def log_activations(self) -> int:
        return self.conv_window.channels + self.key_dim + self.value_dim

    @property
    def log_dt(self) -> int:
        return 2 * self.num_v_heads


@dataclass(frozen=True)
class AttentionKVSpec:
    """An attention layer's paged K/V: K and V of `num_kv_heads` heads of `head_dim` per cached token."""

    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, kv_bytes: int) -> int:
        return 2 * self.num_kv_heads * self.head_dim * kv_bytes


def default_state_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The state dtype when none is set: float32, or float64 for a float64 model
    (recurrences never run below float32; deployed hybrids keep float32 states)."""
    return torch.promote_types(model_dtype, torch.float32)


def bytes_per_slot(specs, state_bytes: int) -> int:
    """One ring slot (recurrent state plus conv window) over every recurrent layer in `specs`."""
    return sum(s.bytes_per_slot(state_bytes) for s in specs)


def log_bytes_per_input(specs, activation_bytes: int, state_bytes: int) -> int:
    """The input log of one verify input of one sequence over every recurrent layer."""
    return sum(s.log_bytes_per_input(activation_bytes, state_bytes) for s in specs)


def snapshot_inputs(num_inputs: int, snapshot_every: int) -> tuple[int, ...]:
    """Verify-input indices (0-based, ascending) after which a policy with
    `snapshot_every = k` writes a snapshot: 0, k, 2k, … and the last input;
    k = 0 the last only (the round-start state stays in the pinned head)."""
    last = num_inputs - 1
    if snapshot_every == 0:
        return (last,)
    return tuple(sorted(set(range(0, num_inputs, snapshot_every)) | {last}))
