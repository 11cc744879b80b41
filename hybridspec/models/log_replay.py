"""Log replay shared by the Mamba mixers: rebuild a state from a snapshot by
running only the recurrence and the conv window over logged inputs."""
from __future__ import annotations

import torch

from ..kernels.conv_window import conv_window_rebuild, conv_window_rebuild_ref
from .batch import MambaInputLog


class LogReplay:
    """Mixin for a mixer with `state_layer`, `A_log` and `replay_kernels`
    = (Triton launcher, torch reference) of its SSM replay."""

    replay_kernels: tuple

    def replay(self, cache, src_slot: torch.Tensor, dst_slot: torch.Tensor, first: torch.Tensor,
               num_steps: torch.Tensor, log: MambaInputLog) -> None:
        """Advance the state (SSM and conv window) in src_slot over logged
        inputs first..first+num_steps-1 and write it to dst_slot (rows with
        dst_slot = -1 untouched). All index tensors are [batch]."""
        log = log.shifted(first)
        on_gpu = log.x.is_cuda
        A = -torch.exp(self.A_log.to(log.dt.dtype))
        replay = self.replay_kernels[0 if on_gpu else 1]
        replay(cache.states.ssm_states[self.state_layer], src_slot, dst_slot, num_steps, log.x, log.dt, A, log.B, log.C)
        (conv_window_rebuild if on_gpu else conv_window_rebuild_ref)(
            cache.states.conv_states[self.state_layer], src_slot, dst_slot, num_steps, log.xs)
