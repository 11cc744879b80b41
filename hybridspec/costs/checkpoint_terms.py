"""What a checkpoint policy costs per round: snapshot writes and expected replay.

Indexing follows docs/design.md "Round structure": the verify forward has inputs
0..γ; "the state after input j" is the recurrent state once inputs 0..j are
absorbed, and the round-start state is "after input −1". With n drafts
accepted the boundary is the state after input n. A policy
`snapshot_every = k` writes the state after:
    k = 1   every input 0..γ                      (γ + 1 writes)
    k > 1   inputs 0, k, 2k, ... and the last, γ  (⌊γ/k⌋ + 1, plus 1 if k ∤ γ)
    k = 0   only the last input γ                 (1 write; the round-start
                                                   state stays in its slot)
A boundary with a snapshot is restored by moving the ring head (no replay).
Otherwise the nearest earlier snapshot (or the round-start state) is advanced
by replaying the inputs after it up to n:
    k = 1   never replays
    k > 1   n < γ replays n − k⌊n/k⌋ = n mod k steps from the snapshot at k⌊n/k⌋
    k = 0   n < γ replays n + 1 steps (inputs 0..n) from the round-start state
and n = γ never replays (the last input is always snapshotted).
"""
from __future__ import annotations

from hybridspec.errors import ConfigError
from hybridspec.costs.closed_form import expected_tokens
from hybridspec.costs.validation import check_alpha, check_gamma, check_int, check_snapshot_every
from hybridspec.cache.state_specs import snapshot_inputs


def snapshot_positions(gamma: int, snapshot_every: int) -> tuple[int, ...]:
    """Verify inputs after which the policy writes a snapshot, ascending."""
    gamma, k = check_gamma(gamma), check_snapshot_every(snapshot_every)
    return snapshot_inputs(gamma + 1, k)


def snapshot_writes_per_round(gamma: int, snapshot_every: int) -> int:
    """State writes of every Mamba layer per sequence in one verify forward,
    the final state included (plain decoding writes 1 per step)."""
    return len(snapshot_positions(gamma, snapshot_every))


def replay_steps(accepted: int, gamma: int, snapshot_every: int) -> int:
    """Steps replayed to reach the boundary after `accepted` drafts (0..γ)."""
    gamma, k = check_gamma(gamma), check_snapshot_every(snapshot_every)
    accepted = check_int(accepted, "accepted", minimum=0)
    if accepted > gamma:
        raise ConfigError(f"accepted={accepted!r} is invalid: pass an integer in [0, gamma={gamma}]")
    if accepted == gamma or k == 1:
        return 0
    if k == 0:
        return accepted + 1
    return accepted % k


def expected_replay_steps(alpha: float, gamma: int, snapshot_every: int) -> float:
    """E[replayed steps per sequence per round] under capped-geometric acceptance.

    With S1 = Σ_{n<γ} n·P(n) = E[n] − γα^γ and J = ⌊(γ − 1)/k⌋:
        k = 0:  Σ_{n<γ} (n + 1)·P(n) = E[tokens] − (γ + 1)·α^γ
        k ≥ 1:  Σ_{n<γ} (n mod k)·P(n) = S1 − k·Σ_{j=1..J} (α^(jk) − α^γ)
    because Σ_{n<γ} ⌊n/k⌋·P(n) = Σ_{j≥1} P(jk ≤ n < γ) and
    P(jk ≤ n < γ) = α^(jk) − α^γ. For k = 1 the two sums cancel to 0.
    """
    alpha, gamma, k = check_alpha(alpha), check_gamma(gamma), check_snapshot_every(snapshot_every)
    if k == 1:
        return 0.0  # every boundary is snapshotted (the sums below cancel exactly)
    tokens = expected_tokens(alpha, gamma)
    all_accepted = alpha**gamma  # P(n = γ)
    if k == 0:
        return max(tokens - (gamma + 1) * all_accepted, 0.0)
    s1 = tokens - 1.0 - gamma * all_accepted
    num_blocks = (gamma - 1) // k
    floor_sum = sum(alpha ** (j * k) - all_accepted for j in range(1, num_blocks + 1))
    return max(s1 - k * floor_sum, 0.0)


def replay_probability(alpha: float, gamma: int, snapshot_every: int) -> float:
    """P(a sequence replays at least one step in a round).

        k = 0:  P(n < γ) = 1 − α^γ
        k ≥ 1:  P(n < γ) − Σ_{j=0..J} P(n = jk) = 1 − α^γ − (1 − α)·Σ_{j=0..J} α^(jk)
    """
    alpha, gamma, k = check_alpha(alpha), check_gamma(gamma), check_snapshot_every(snapshot_every)
    partial = 1.0 - alpha**gamma  # P(n < γ)
    if k == 1:
        return 0.0
    if k == 0:
        return partial
    num_blocks = (gamma - 1) // k
    hits = (1.0 - alpha) * sum(alpha ** (j * k) for j in range(num_blocks + 1))
    return max(partial - hits, 0.0)
