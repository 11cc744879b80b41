"""`CheckpointPolicy`: which Mamba states a verify forward snapshots, how big
the ring is, and whether the input log is kept (memory versus replay).

For γ drafts a verify forward has γ+1 inputs (the pending token and the
drafts). `snapshot_every = k`:
- k = 1: a snapshot after every input — every boundary is a head move;
- k > 1: after inputs 0, k, 2k, … and after the last — other boundaries are
  log-replayed from the nearest earlier snapshot (fewer than k steps);
- k = 0: only the final state (the round-start state is the pinned head) —
  any partial acceptance is log-replayed from the round start.
The ring holds `ring_slots` slots per sequence: the head (pinned during a
round) and `ring_slots - 1` snapshot slots; with too few, later snapshots
overwrite the oldest. `log_inputs=False` drops the input log, so a boundary
without a snapshot is token-replayed through the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridspec.errors import ConfigError
from hybridspec.kernels import backend as backends
from hybridspec.cache.state_specs import snapshot_inputs

MAX_DRAFT_TOKENS = 32  # verify forwards and input logs are sized for at most 33 inputs


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where a verify forward snapshots the target's recurrent state (module docstring).

    snapshot_every: k (default 1), in verify inputs: 1 snapshots after every
        input, k > 1 after inputs 0, k, 2k, … and the last, 0 only the last.
    ring_slots: slots per sequence and Mamba layer, head included (>= 2);
        default None: enough for k and γ (`slots_needed`), doubled into ring
        halves where the torch recurrence runs (CPU: see `ring_size`). Each
        slot holds one SSM state and conv window (`hybridspec.cache.state_specs`).
    log_inputs: keep the verify forward's mixer inputs (default True), so a
        boundary without a snapshot is log-replayed instead of token-replayed.
    """

    snapshot_every: int = 1
    ring_slots: int | None = None  # None: enough for the policy and γ (`ring_size`)
    log_inputs: bool = True

    def __post_init__(self):
        if not isinstance(self.snapshot_every, int) or self.snapshot_every < 0:
            raise ConfigError(f"snapshot_every={self.snapshot_every!r} must be an integer >= 0 "
                              "(1: every position, k > 1: sparse, 0: round start and final only)")
        if self.ring_slots is not None and (not isinstance(self.ring_slots, int) or self.ring_slots < 2):
            raise ConfigError(f"ring_slots={self.ring_slots!r} must be an integer >= 2 (the head and the final "
                              "snapshot) or None to size the ring from the policy")

    def bind(self, model, gamma: int, *, max_batch_size: int, state_dtype, new_cache) -> "CheckpointPolicy":
        """The policy an engine uses for `model` with γ = `gamma`, up to
        `max_batch_size` sequences whose states are kept in `state_dtype`;
        adaptive policies measure the model here, on caches from
        `new_cache(max_seqs, ring_slots)`. Fixed policies are their own binding."""
        return self

    def snapshot_inputs(self, num_inputs: int) -> list[int]:
        """Verify-input indices (0-based) after which a snapshot is taken."""
        return list(snapshot_inputs(num_inputs, self.snapshot_every))

    def slots_needed(self, gamma: int) -> int:
        """Ring slots that hold every snapshot of a γ-draft round plus the head."""
        return len(self.snapshot_inputs(gamma + 1)) + 1

    def ring_size(self, gamma: int, halves: bool = False) -> int:
        """`ring_slots`, or by default the fewest that hold a round's snapshots
        and the head (`slots_needed`) — or with `halves` two slots per
        snapshot, the ring halves of `plan_snapshots`: a batch's snapshot
        slots then line up and the torch recurrence computes in them instead of
        copying each state (the Triton kernels write in place either way)."""
        if self.ring_slots is not None:
            return self.ring_slots
        needed = self.slots_needed(gamma)
        return max(needed, 2 * (needed - 1)) if halves else needed

    def spacing_at(self, alpha: float, batch: int) -> tuple[int, bool]:
        """(k, log_inputs) of a round at acceptance α (fixed policies do not adapt)."""
        return self.snapshot_every, self.log_inputs

    def for_round(self, acceptance_history: list[float], batch: int) -> "CheckpointPolicy":
        """The policy of a round of `batch` sequences after rounds with these
        acceptance rates (fixed policies do not adapt)."""
        return self


def ring_halves_by_default(device) -> bool:
    """Whether an engine on `device` sizes rings in halves (`ring_size(γ, halves=True)`):
    where the torch references run, which write snapshots in place only on aligned slots;
    the Triton kernels write them from registers whatever the slots."""
    return not backends.select(device, torch.float32).writes_any_slot


def validate_gamma(gamma: int) -> None:
    if not isinstance(gamma, int) or gamma < 1:
        raise ConfigError(f"num_draft_tokens={gamma!r} must be an integer >= 1")
    if gamma > MAX_DRAFT_TOKENS:
        raise ConfigError(f"num_draft_tokens={gamma} exceeds the {MAX_DRAFT_TOKENS} positions a verify forward's "
                          f"ring and input log are sized for; use num_draft_tokens <= {MAX_DRAFT_TOKENS}")
