"""The recurrent layers a `HybridShape` holds. Each kind answers the same
questions: its weights, its per-sequence state and input log
(a `hybridspec.cache.state_specs` spec, the formulas `Engine` allocates by), and the
FLOPs per token of its recurrence and of its short causal conv.

Mamba2 (Dao & Gu 2024): d_inner = nheads·headdim; B and C shared per group;
conv_dim = d_inner + 2·ngroups·d_state (the x, B, C channels).
GDN, the gated delta rule (Yang et al. 2025, Qwen3-Next's `linear_*` keys):
HK key heads of width d_k (q and k), HV value heads of width d_v; the
matrix state of a value head is [d_k, d_v];
conv_dim = 2·HK·d_k + HV·d_v (the q, k, v channels).
Norms, biases, A/A_log, D and dt_bias are left out (well under 0.1% of the weights).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hybridspec.cache.state_specs import GdnStateSpec, Mamba2StateSpec

# FLOPs per state element per token of the Mamba2 scan: decay (1), input (1), add (1), readout C·h (2)
SCAN_FLOPS_PER_STATE_ELEMENT = 5
# FLOPs per state element per token of the gated delta rule, S [d_k, d_v] per value head:
# decay g·S (1), kv = Sᵀk (2), S += k ⊗ β(v − kv) (2), readout Sᵀq (2)
GDN_FLOPS_PER_STATE_ELEMENT = 7


@dataclass(frozen=True)
class Mamba2Mixer:
    """A Mamba2 layer: in_proj (z, x, B, C, dt), depthwise conv, out_proj."""

    d_inner: int
    head_dim: int
    d_state: int
    n_groups: int
    d_conv: int
    kind: ClassVar[str] = "Mamba2"

    @property
    def num_heads(self) -> int:
        return self.d_inner // self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.state_spec().conv_window.channels

    def params(self, d_model: int) -> int:
        in_proj = d_model * (self.d_inner + self.conv_dim + self.num_heads)
        return in_proj + self.conv_dim * self.d_conv + self.d_inner * d_model

    def state_spec(self) -> Mamba2StateSpec:
        return Mamba2StateSpec(self.num_heads, self.head_dim, self.d_state, self.n_groups, self.d_conv)

    def scan_flops_per_token(self) -> int:
        return SCAN_FLOPS_PER_STATE_ELEMENT * self.num_heads * self.head_dim * self.d_state

    def conv_flops_per_token(self) -> int:
        return 2 * self.conv_dim * self.d_conv


@dataclass(frozen=True)
class GdnMixer:
    """A gated-DeltaNet layer (Qwen3-Next, Qwen3.5): in_proj_qkvz (q, k, v and
    the output gate z), in_proj_ba (β and the decay input, one each per value
    head), depthwise conv over q, k, v, out_proj."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    d_conv: int = 4
    kind: ClassVar[str] = "GDN"

    @property
    def key_dim(self) -> int:
        return self.state_spec().key_dim

    @property
    def value_dim(self) -> int:
        return self.state_spec().value_dim

    @property
    def conv_dim(self) -> int:
        return self.state_spec().conv_window.channels

    def params(self, d_model: int) -> int:
        qkvz = d_model * (2 * self.key_dim + 2 * self.value_dim)
        ba = d_model * 2 * self.num_v_heads
        return qkvz + ba + self.conv_dim * self.d_conv + self.value_dim * d_model

    def state_spec(self) -> GdnStateSpec:
        return GdnStateSpec(self.num_v_heads, self.num_k_heads, self.head_k_dim, self.head_v_dim, self.d_conv)

    def scan_flops_per_token(self) -> int:
        return GDN_FLOPS_PER_STATE_ELEMENT * self.num_v_heads * self.head_k_dim * self.head_v_dim

    def conv_flops_per_token(self) -> int:
        return 2 * self.conv_dim * self.d_conv
