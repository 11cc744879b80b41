"""The input log of the Mamba kinds (Mamba-1 and Mamba-2): the per-input mixer
inputs of one layer for one verify forward, enough to log-replay the
recurrence and the conv window to any boundary without the model
(docs/design.md, "input log"). Its size per input is
`hybridspec.cache.state_specs.log_bytes_per_input`. The checkpoints see it only as
a `LayerInputLog` (`nbytes`); the layer's own replay reads its fields."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridspec.checkpoints.input_log import PerInputTensors


@dataclass
class MambaInputLog(PerInputTensors):
    xs: torch.Tensor  # [batch, T, conv_dim] conv inputs (model dtype)
    x: torch.Tensor  # [batch, T, nheads, headdim] | [batch, T, d_inner] SSM inputs after conv + activation
    dt: torch.Tensor  # [batch, T, nheads | d_inner] processed time steps (state dtype)
    B: torch.Tensor  # [batch, T, (ngroups,) d_state]
    C: torch.Tensor  # [batch, T, (ngroups,) d_state]
