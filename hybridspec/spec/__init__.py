"""Speculative decoding: drafters and the round loop."""
from .drafters import ModelDrafter, NgramDrafter

__all__ = ["ModelDrafter", "NgramDrafter"]
