"""`Eagle3Drafter`: drafting with an EAGLE-3 head (`models/eagle3.py`) through
the `Drafter` protocol.

It is the MTP drafter's round (`spec/mtp_drafter.py`: catch-up of the
positions the target committed, with the target's hidden states, then drafts
on the head's own output, the drafts' K/V rolled back at commit), with two
differences: the head reads the target's hidden states at three points
(low, middle, high), fused by its fc as they are taken, and it drafts over
its own, smaller vocabulary. The head scatters its logits into the target's
vocabulary (-inf off the draft vocabulary), so q is a distribution over the
target's tokens that is zero outside the draft vocabulary: verification stays
lossless, such tokens are simply never drafted. Its trees (`tree=`) are the MTP
drafter's: the alternatives come from q, so they lie in the draft vocabulary.
"""
from __future__ import annotations

import torch

from hybridspec.cache.hidden_states import HiddenStates
from hybridspec.models.eagle3 import Eagle3Head
from hybridspec.spec.mtp_drafter import MTPDrafter
from hybridspec.spec.tree import TreeShape


class Eagle3Drafter(MTPDrafter):
    """An `Eagle3Head` as drafter; `cache_kwargs` size its K/V cache as the target's."""

    def __init__(self, head: Eagle3Head, cache_kwargs: dict, tree: TreeShape | None = None):
        super().__init__(head, cache_kwargs, tree)
        self.hidden = HiddenStates(head.points, head.target[0].config.num_layers)
        recorded = self.hidden.points  # sorted, each once: two equal capture points read the same row
        self.slots = torch.tensor([recorded.index(p) for p in head.points])  # [3] rows of low, middle, high

    def features(self, rows: torch.Tensor) -> torch.Tensor:
        """g = fc([h_low ; h_mid ; h_high]) from the target's rows [n, k, target_hidden]: [n, hidden]."""
        return self.layer.fuse(rows[:, self.slots.to(rows.device)])
