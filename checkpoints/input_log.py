"""The input log of one verify forward: for each recurrent layer that keeps
one, its own log object (the Mamba kinds': `models.mamba_log.MambaInputLog`),
keyed by the layer's `state_layer`. The layer's forward fills it when the
forward asks (`batch.input_log` is a dict) and the layer's `replay` reads it
(`RecurrentLayer`); the checkpoints only hand it over, count its bytes and,
for a tree round, pick the accepted path's inputs out of it (`along`), so a
new recurrent kind brings its own log type and nothing here changes."""
from __future__ import annotations

import dataclasses
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


class PerInputTensors:
    """A dataclass log whose every field is a tensor [batch, T, ...] indexed by verify input:
    `nbytes`, `along` and `shifted` for any recurrent kind's log made this way."""

    def _tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def shifted(self, first: torch.Tensor):
        """The log with row b starting at input first[b] (tail padded with the last input)."""
        T = self._tensors()[0].shape[1]
        return self.along((first[:, None] + torch.arange(T, device=first.device)).clamp(max=T - 1))

    def along(self, inputs: torch.Tensor):
        """The log whose row b's input k is this log's input inputs[b, k] (inputs [batch, K] int64):
        a tree round's accepted path in path order, or a shifted chain."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            index = inputs.view(*inputs.shape, *([1] * (t.dim() - 2))).expand(*inputs.shape, *t.shape[2:])
            return t.gather(1, index).contiguous()

        return type(self)(*(pick(t) for t in self._tensors()))


InputLog = dict[int, LayerInputLog]  # a recurrent layer's state_layer -> its log of one verify forward
