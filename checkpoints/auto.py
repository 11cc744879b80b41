"""`AutoCheckpointPolicy` ("auto"): per round, the snapshot spacing k and the
input log that minimise the expected checkpoint and replay time of the round
within a memory budget (docs/design.md "Checkpoint policies").

Checkpoint bytes, what the budget bounds (and what
`engine.stats.peak_checkpoint_bytes` records, `Checkpointer.held_bytes`):

    bytes(k, log, B) = B · (writes(γ, k) · bytes_per_slot + log · (γ + 1) · log_bytes_per_input)

- B: sequences in the round (all of them, including those it finishes);
- writes(γ, k) = `hs.sim.snapshot_writes_per_round`: snapshot slots a sequence
  holds after the verify forward (the final state included, the pinned
  round-start head not); `held_bytes` counts the surviving ones, `len(plan.survivors)`;
- bytes_per_slot, log_bytes_per_input: `hybridspec.cache.state_specs` (the formulas
  `StatePool` and `MambaInputLog` allocate by), in the state and model dtypes.
A round whose sequences draft fewer than γ tokens holds less. The ring itself
(`ring_size(γ)` slots per sequence, allocated once with the cache) is the pool
these bytes come from; it is sized for the largest k the budget allows at batch 1.

Expected time of a round under (k, log), docs/simulator.md §4:

    `hs.sim.round_time`: checkpoint = (writes − 1)·snapshot_write + [log] (γ + 1)·log_write
                         replay     = B·p_k·restore + [log] B·E_k·log_replay_step
                                      + [no log] (1 − (1 − p_k)^B)·token_replay_fixed + B·E_k·token_replay_step
    plus [log] (1 − (1 − p_k)^B)·log_replay_fixed

with p_k = `replay_probability`, E_k = `expected_replay_steps` at the α of the
running acceptance rate (`alpha_from_acceptance_rate`). The last term is not in
`round_time`: a log replay is one batched call per Mamba layer, whose fixed cost
(launches; in the torch reference, every row of the batch) is paid once per
round when any sequence replays, as a token replay's weight read is. Draft and
verify time are the same for every (k, log) and left out. The step costs are
measured on the target itself (`measure_checkpoint_costs`) when the speculator
binds the policy, unless given.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections import Counter
from dataclasses import dataclass, field


from hybridspec.errors import CacheFullError, ConfigError
from hybridspec.costs.checkpoint_terms import replay_probability, snapshot_writes_per_round
from hybridspec.costs.closed_form import alpha_from_acceptance_rate
from hybridspec.costs.round_time import RoundTime, round_time

from hybridspec.costs.checkpoint_costs import CheckpointCosts, CheckpointFootprint
from hybridspec.checkpoints.measure import measure_checkpoint_costs
from hybridspec.checkpoints.policy import CheckpointPolicy, validate_gamma

PRIOR_RATE, PRIOR_ROUNDS = 0.5, 2  # acceptance prior: two pseudo-rounds at rate 0.5
MEMO_SIZE = 4096  # remembered (rate, batch) choices per bound policy; cleared when full
RATE_GRID = 256  # a round is priced at the running acceptance rate's nearest multiple of 1 / RATE_GRID


def expected_round_s(costs: CheckpointCosts, batch: int, gamma: int, alpha: float, snapshot_every: int,
                     log_inputs: bool) -> float:
    """Expected checkpoint + replay seconds of one round (module docstring)."""
    spent = round_time(costs.step_costs(batch), gamma, alpha, snapshot_every, log_inputs)
    return float(spent.checkpoint_s) + _with_launch(spent, costs, batch, gamma, alpha, snapshot_every, log_inputs)


def expected_replay_s(costs: CheckpointCosts, batch: int, gamma: int, alpha: float, snapshot_every: int,
                      log_inputs: bool) -> float:
    """Expected replay seconds of one round (module docstring), the log replay's launch included."""
    spent = round_time(costs.step_costs(batch), gamma, alpha, snapshot_every, log_inputs)
    return _with_launch(spent, costs, batch, gamma, alpha, snapshot_every, log_inputs)


def _with_launch(spent: RoundTime, costs: CheckpointCosts, batch: int, gamma: int, alpha: float,
                 snapshot_every: int, log_inputs: bool) -> float:
    """`spent`'s replay seconds plus the log replay's launch, paid once per round when any sequence replays."""
    any_replays = 1.0 - (1.0 - replay_probability(alpha, gamma, snapshot_every)) ** batch
    launch = any_replays * costs.at("log_replay_fixed_s", batch) if log_inputs else 0.0
    return float(spent.replay_s) + launch


@dataclass(frozen=True)
class ReplayPrice:
    """The replay term of a round (`hs.sim.RoundTerms.replay_s`) under an
    engine's checkpoint policy, from step costs measured on its target."""

    policy: CheckpointPolicy
    costs: CheckpointCosts

    @classmethod
    def of(cls, policy: CheckpointPolicy, model, gamma: int, batches, new_cache,
           clock=time.perf_counter) -> "ReplayPrice | None":
        """None where the policy never replays (a snapshot after every input);
        an `auto` policy's own measured costs, else measured now on `model`
        at the least and most of `batches`."""
        if isinstance(policy, AutoCheckpointPolicy):
            return cls(policy, policy._bound().costs)
        if policy.snapshot_every == 1:
            return None
        batches = sorted({min(batches), max(batches)})
        return cls(policy, measure_checkpoint_costs(model, gamma, batches, new_cache, repeats=5, clock=clock))

    def seconds(self, batch: int, G: int, alpha: float) -> float:
        """Expected replay seconds of a round of `batch` rows drafting G at acceptance α."""
        if G == 0:
            return 0.0
        k, log_inputs = self.policy.spacing_at(alpha, batch)
        return 0.0 if k == 1 else expected_replay_s(self.costs, batch, G, alpha, k, log_inputs)

    def spent(self, replaying_rows: int, log_steps: int, token_steps: int, batch: int) -> float:
        """Seconds of the replays a round made (`replaying_rows` rows, so many
        log-replayed and token-replayed steps), at this policy's step costs."""
        at = functools.partial(self.costs.at, batch=batch)
        seconds = replaying_rows * at("restore_s") + log_steps * at("log_replay_step_s") \
            + token_steps * at("token_replay_step_s")
        if log_steps:
            seconds += at("log_replay_fixed_s")
        if token_steps:
            seconds += at("token_replay_fixed_s")
        return seconds


@dataclass(frozen=True)
class RoundChoice:
    snapshot_every: int
    log_inputs: bool
    checkpoint_bytes: int
    expected_s: float  # checkpoint + replay seconds of the round


def candidates(gamma: int) -> list[tuple[int, bool]]:
    """Every distinct (k, log): k > γ snapshots what k = γ does; k = 1 never replays, so never logs."""
    return [(1, False)] + [(k, log) for k in (*range(2, gamma + 1), 0) for log in (True, False)]


def choose(alpha: float, gamma: int, batch: int, costs: CheckpointCosts, footprint: CheckpointFootprint,
           budget: int | None, max_snapshots: int) -> RoundChoice:
    """The (k, log) of least expected checkpoint + replay time whose bytes fit
    `budget` and whose snapshots fit `max_snapshots` ring slots; fewer bytes on ties."""
    options = []
    for k, log in candidates(gamma):
        held = footprint.checkpoint_bytes(batch, gamma, k, log)
        if snapshot_writes_per_round(gamma, k) > max_snapshots or (budget is not None and held > budget):
            continue
        options.append(RoundChoice(k, log, held, expected_round_s(costs, batch, gamma, alpha, k, log)))
    if not options:
        least = footprint.checkpoint_bytes(batch, gamma, 0, False)
        raise CacheFullError(f"memory_budget_bytes={budget} cannot hold the final state of {batch} sequences "
                             f"({least} bytes); raise the budget to at least {least} or run fewer sequences")
    return min(options, key=lambda c: (c.expected_s, c.checkpoint_bytes))


def running_rate(acceptance_history: list[float], window: int) -> float:
    """The mean acceptance rate of the last `window` rounds, shrunk towards
    PRIOR_RATE by PRIOR_ROUNDS pseudo-rounds (the first rounds have no history)."""
    recent = acceptance_history[-window:]
    rate = (sum(recent) + PRIOR_RATE * PRIOR_ROUNDS) / (len(recent) + PRIOR_ROUNDS)
    return min(max(rate, 0.0), 1.0)


def running_alpha(acceptance_history: list[float], gamma: int, window: int) -> float:
    """α of `running_rate`."""
    return alpha_from_acceptance_rate(running_rate(acceptance_history, window), gamma)


class AutoBinding:
    """What a bound policy knows about its model, and what it chose so far."""

    def __init__(self, gamma: int, footprint: CheckpointFootprint, costs: CheckpointCosts, ring_slots: int):
        self.gamma, self.footprint, self.costs = gamma, footprint, costs
        self.ring_slots = ring_slots
        self.choices: Counter[tuple[int, bool]] = Counter()
        # (acceptance rate, batch) -> RoundChoice: pricing every candidate through the cost model is a
        # large share of a small round's host time, and rounds repeat their rate on its grid (RATE_GRID)
        self.memo: dict[tuple[float, int], RoundChoice] = {}


@dataclass(frozen=True)
class AutoCheckpointPolicy(CheckpointPolicy):
    """Picks k and the input log every round (module docstring).

    memory_budget_bytes: bound on checkpoint bytes per round for the whole
        batch (None: unbounded).
    costs: measured step costs; None measures them on the target when bound.
    acceptance_window: rounds of acceptance history that give α.
    The Engine calls `bind(model, γ, ...)` once, before `ring_size(γ)`.
    """

    memory_budget_bytes: int | None = None
    costs: CheckpointCosts | None = None
    acceptance_window: int = 32
    binding: AutoBinding | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if (self.snapshot_every, self.ring_slots, self.log_inputs) != (1, None, True):
            raise ConfigError("AutoCheckpointPolicy picks snapshot_every, ring_slots and log_inputs itself; "
                              "pass only memory_budget_bytes (and costs)")
        budget = self.memory_budget_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ConfigError(f"memory_budget_bytes={budget!r} must be a positive integer or None (unbounded)")
        if self.costs is not None and not isinstance(self.costs, CheckpointCosts):
            raise ConfigError(f"costs must be a CheckpointCosts (see measure_checkpoint_costs), "
                              f"got {type(self.costs).__name__}")
        if not isinstance(self.acceptance_window, int) or self.acceptance_window < 1:
            raise ConfigError(f"acceptance_window={self.acceptance_window!r} must be an integer >= 1")

    def bind(self, model, gamma: int, *, max_batch_size: int, state_dtype, new_cache) -> "AutoCheckpointPolicy":
        """A copy bound to `model` (its shapes), measuring the step costs on it
        at batch 1 and min(max_batch_size, 4) on caches from `new_cache`
        unless `costs` was given."""
        validate_gamma(gamma)
        footprint = CheckpointFootprint.of(model.config, model.dtype, state_dtype)
        single = footprint.checkpoint_bytes(1, gamma, 0, False)
        if self.memory_budget_bytes is not None and footprint.bytes_per_slot and self.memory_budget_bytes < single:
            raise ConfigError(f"memory_budget_bytes={self.memory_budget_bytes} is below one sequence's final-state "
                              f"snapshot ({single} bytes); raise it to at least {single}")
        costs = self.costs or measure_checkpoint_costs(model, gamma, sorted({1, min(max_batch_size, 4)}), new_cache,
                                                       repeats=5)
        fitting = [snapshot_writes_per_round(gamma, k) for k, log in candidates(gamma)
                   if self.memory_budget_bytes is None
                   or footprint.checkpoint_bytes(1, gamma, k, log) <= self.memory_budget_bytes]
        binding = AutoBinding(gamma, footprint, costs, ring_slots=1 + max(fitting))
        return dataclasses.replace(self, binding=binding)

    def ring_size(self, gamma: int, halves: bool = False) -> int:
        """The head plus the most snapshots any k within the budget writes (γ + 2
        unbound); `halves` is not taken: the ring stays within the memory budget."""
        return self.binding.ring_slots if self.binding is not None else gamma + 2

    def decide(self, acceptance_history: list[float], batch: int) -> RoundChoice:
        """The (k, log) for a round of `batch` sequences after this acceptance history."""
        bound = self._bound()
        # the rate on a grid of 1 / RATE_GRID: choices differ only where two policies' expected times tie
        # within it; α (a root of the acceptance curve) and `choose` then run once per grid point and batch
        rate = round(running_rate(acceptance_history, self.acceptance_window) * RATE_GRID) / RATE_GRID
        choice = bound.memo.get((rate, batch))
        if choice is None:
            choice = self._choice(alpha_from_acceptance_rate(rate, bound.gamma), batch)
            if len(bound.memo) >= MEMO_SIZE:
                bound.memo.clear()
            bound.memo[rate, batch] = choice
        return choice

    def spacing_at(self, alpha: float, batch: int) -> tuple[int, bool]:
        """(k, log_inputs) this policy picks for a round of `batch` sequences at acceptance α."""
        choice = self._choice(alpha, batch)
        return choice.snapshot_every, choice.log_inputs

    def _choice(self, alpha: float, batch: int) -> RoundChoice:
        """`choose` at acceptance α for `batch` sequences, within this binding's costs, memory and ring."""
        bound = self._bound()
        return choose(alpha, bound.gamma, batch, bound.costs, bound.footprint, self.memory_budget_bytes,
                      bound.ring_slots - 1)

    def for_round(self, acceptance_history: list[float], batch: int) -> CheckpointPolicy:
        """The concrete policy of a round of `batch` sequences."""
        bound = self._bound()
        choice = self.decide(acceptance_history, max(batch, 1))
        bound.choices[choice.snapshot_every, choice.log_inputs] += 1
        return CheckpointPolicy(snapshot_every=choice.snapshot_every, ring_slots=bound.ring_slots,
                                log_inputs=choice.log_inputs)

    @property
    def decisions(self) -> dict[tuple[int, bool], int]:
        """Rounds per chosen (snapshot_every, log_inputs) so far."""
        return dict(self._bound().choices)

    def _bound(self) -> AutoBinding:
        if self.binding is None:
            raise ConfigError("this AutoCheckpointPolicy is not bound to a model; pass it to hs.Engine("
                              "checkpoint=...) (which calls bind(...)) before using it")
        return self.binding


def resolve_policy(checkpoint) -> CheckpointPolicy:
    """The policy an `Engine(checkpoint=...)` argument names: None (the default,
    a snapshot after every input), "auto", or a `CheckpointPolicy`."""
    if checkpoint is None:
        return CheckpointPolicy()
    if isinstance(checkpoint, str):
        if checkpoint != "auto":
            raise ConfigError(f"checkpoint={checkpoint!r} must be a CheckpointPolicy or 'auto'")
        return AutoCheckpointPolicy()
    if not isinstance(checkpoint, CheckpointPolicy):
        raise ConfigError(f"checkpoint must be a CheckpointPolicy or 'auto', got {type(checkpoint).__name__}")
    return checkpoint
