"""Log replay shared by the Mamba mixers (their `RecurrentLayer.replay`):
rebuild a state from a snapshot by running only the recurrence and the conv
window over logged inputs."""
from __future__ import annotations

import torch

from hybridspec.checkpoints.input_log import MambaInputLog
from hybridspec.checkpoints.state_pool import StatePool
from hybridspec.kernels.conv_window import conv_window_rebuild, conv_window_rebuild_ref
from hybridspec.kernels.dispatch import pick


class LogReplay:
    """Mixin for a mixer with `state_layer`, `A_log` and `replay_kernels`
    = (Triton launcher, torch reference) of its SSM replay."""

    replay_kernels: tuple

    def replay(self, states: StatePool, src_slot: torch.Tensor, dst_slot: torch.Tensor, first: torch.Tensor,
               num_steps: torch.Tensor, log: MambaInputLog) -> None:
        """Advance the state (SSM and conv window) in src_slot over logged
        inputs first..first+num_steps-1 and write it to dst_slot (rows with
        dst_slot = -1 untouched). All index tensors are [batch]."""
        log = log.shifted(first)
        A = -torch.exp(self.A_log.to(log.dt.dtype))
        replay = pick(*self.replay_kernels, log.x)
        replay(states.ssm_states[self.state_layer], src_slot, dst_slot, num_steps, log.x, log.dt, A, log.B, log.C)
        pick(conv_window_rebuild, conv_window_rebuild_ref, log.x)(
            states.conv_states[self.state_layer], src_slot, dst_slot, num_steps, log.xs)
