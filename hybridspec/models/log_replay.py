"""Log replay shared by the Mamba mixers (their `RecurrentLayer.replay`):
rebuild a state from a snapshot by running only the recurrence and the conv
window over logged inputs, through the backend's replay op of the mixer's
kind (`kernels.ops.LogReplay`; on a native backend the forward's own C loops,
so the state is the snapshot the forward would have written, bit for bit)."""
from __future__ import annotations

import torch

from hybridspec.cache.state_pool import StatePool
from hybridspec.models.mamba_log import MambaInputLog


class LogReplay:
    """Mixin for a mixer with `state_layer`, `A_log`, `D`, `conv_weight`,
    `conv_bias`, `ops` (its backend) and `replay_op`: the name of the
    backend's replay op for its kind."""

    replay_op: str

    def replay(self, states: StatePool, src_slot: torch.Tensor, dst_slot: torch.Tensor, first: torch.Tensor,
               num_steps: torch.Tensor, log: MambaInputLog) -> None:
        """Advance the state (SSM and conv window) in src_slot over logged
        inputs first..first+num_steps-1 and write it to dst_slot (rows with
        dst_slot = -1 untouched). All index tensors are [batch]."""
        A = -torch.exp(self.A_log.to(log.dt.dtype))
        ssm, conv = states.ssm_states[self.state_layer], states.conv_states[self.state_layer]
        getattr(self.ops, self.replay_op)(ssm, conv, src_slot, dst_slot, first, num_steps, log, A, self.D,
                                          self.conv_weight[:, 0], self.conv_bias)
