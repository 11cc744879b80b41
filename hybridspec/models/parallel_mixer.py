"""The parallel mixer of Falcon-H1 (Zuo et al. 2025): attention and a Mamba2
mixer read the same normed input and their outputs are added,

    mixer(x) = m_ssm_out · Mamba2(x) + m_attn_out · Attention(m_attn_in · x)

(the µP multipliers of the config; 1 elsewhere). The layer owns KV pages
(its attention, `kv_layer`) and recurrent state (its Mamba2, `state_layer`):
a forward writes both for the same inputs, and the runtime commits, rolls
back and replays them at the same boundary, as it does for layers holding one.
"""
from __future__ import annotations

import torch
from torch import nn

from hybridspec.kernels.descriptors import ComposedMixerDesc

from hybridspec.config import HybridConfig, ParallelMixerConfig
from hybridspec.models.attention import Attention
from hybridspec.cache.forward_batch import ForwardBatch
from hybridspec.models.common import take
from hybridspec.models.mamba2 import Mamba2Mixer


class ParallelMixer(nn.Module):
    """weights: attention.* (as Attention) and mamba.* (as Mamba2Mixer)."""

    def __init__(self, cfg: HybridConfig, weights: dict[str, torch.Tensor], index: int, inv_freq):
        super().__init__()
        self.attention = Attention(cfg.attention, take(weights, "attention"), cfg.attention_layers.index(index),
                                   inv_freq)
        self.mamba = Mamba2Mixer(cfg.mamba2, take(weights, "mamba"), cfg.mamba_layers.index(index), cfg.rms_norm_eps)
        self.multipliers = cfg.parallel or ParallelMixerConfig()

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        """h [batch, T, hidden] -> [batch, T, hidden]."""
        m = self.multipliers
        mamba = self.mamba(h, batch, cache) * m.mamba_out_multiplier
        attention = self.attention(h * m.attention_in_multiplier, batch, cache) * m.attention_out_multiplier
        return mamba + attention

    def describe(self) -> ComposedMixerDesc:
        return ComposedMixerDesc((self.attention.describe(), self.mamba.describe()))
