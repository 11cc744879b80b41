"""The input log of one verify forward: for each recurrent layer that keeps
one, its own log object (the Mamba kinds': `models.mamba_log.MambaInputLog`),
keyed by the layer's `state_layer`. The layer's forward fills it when the
forward asks (`batch.input_log` is a dict) and the layer's `replay` reads it
(`RecurrentLayer`); the checkpoints only hand it over, count its bytes and,
for a tree round, pick the accepted path's inputs out of it (`along`), so a
new recurrent kind brings its own log type and nothing here changes."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class LayerInputLog(Protocol):
    """What the checkpoints ask of one layer's log of one verify forward."""

    def nbytes(self) -> int:
        """The bytes it holds (the round's checkpoint memory counts them)."""
        ...

    def along(self, inputs: torch.Tensor) -> "LayerInputLog":
        """The log whose row b's input k is this log's input inputs[b, k] (inputs [batch, K]
        int64): a tree round's accepted path, in path order, for the layer's `replay`."""
        ...


InputLog = dict[int, LayerInputLog]  # a recurrent layer's state_layer -> its log of one verify forward
