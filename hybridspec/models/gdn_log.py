"""The input log of a gated DeltaNet layer: per verify input, what log replay
needs to rebuild the state and the conv window without the model
(docs/design.md, "input log"): the conv inputs xs and the rule's k, v, g, β.
The state does not depend on q, so q is not kept. Its size per input is
`GdnStateSpec.log_bytes_per_input` (`hybridspec.cache.state_specs`). The
checkpoints see it only as a `LayerInputLog` (`nbytes`); the layer's replay
(`kernels.ops.GdnLogReplay`) reads its fields."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridspec.checkpoints.input_log import PerInputTensors


@dataclass
class GdnInputLog(PerInputTensors):
    xs: torch.Tensor  # [batch, T, conv_dim] conv inputs [q | k | v] before the conv (model dtype)
    k: torch.Tensor  # [batch, T, HK, d_k] L2-normalised keys (model dtype)
    v: torch.Tensor  # [batch, T, HV, d_v] values (model dtype)
    g: torch.Tensor  # [batch, T, HV] log decays (state dtype)
    beta: torch.Tensor  # [batch, T, HV] write strengths (state dtype)
