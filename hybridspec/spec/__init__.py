"""Speculative decoding: drafters (`drafters.py`), one round's data
(`round.py`) and the rounds themselves (`speculator.py`)."""
from hybridspec.spec.drafters import (Drafter, ModelDrafter, NgramDrafter, Proposal, StatelessDrafter, SuffixDrafter,
                                    as_draft)
from hybridspec.spec.round import RoundBatch, RowResult
from hybridspec.spec.speculator import RoundHook, Speculator

__all__ = ["Drafter", "ModelDrafter", "NgramDrafter", "Proposal", "RoundBatch", "RoundHook", "RowResult", "Speculator",
           "StatelessDrafter", "SuffixDrafter", "as_draft"]
