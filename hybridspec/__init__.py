"""hybridspec: lossless speculative decoding for hybrid Mamba/attention models.

    import hybridspec as hs
    target = hs.from_hf(hf_model)            # or hs.load("checkpoint/dir")
    engine = hs.Engine(target, draft=hs.from_hf(hf_draft), num_draft_tokens=4)
    outs = engine.generate([[1, 2, 3]], hs.SamplingParams(max_new_tokens=32))
"""
from hybridspec.checkpoints.auto import AutoCheckpointPolicy
from hybridspec.checkpoints.policy import CheckpointPolicy

from . import errors, sim
from .adapters import from_hf, load
from .config import HybridConfig
from .engine import Engine, Output
from .models.hybrid import HybridModel
from .sampling import SamplingParams
from .spec.drafters import Drafter, NgramDrafter, Proposal, StatelessDrafter

__all__ = ["AutoCheckpointPolicy", "CheckpointPolicy", "Drafter", "Engine", "HybridConfig", "HybridModel",
           "NgramDrafter", "Output", "Proposal", "SamplingParams", "StatelessDrafter", "errors", "from_hf", "load",
           "sim"]
