"""`AutoCheckpointPolicy` ("auto"): per round, the snapshot spacing k and the
input log that minimise the expected checkpoint and replay time of the round
within a memory budget (DESIGN.md "Checkpoint policies").

Checkpoint bytes, what the budget bounds (and what
`engine.stats.peak_checkpoint_bytes` records, `Speculator._count`):

    bytes(k, log, B) = B · (writes(γ, k) · bytes_per_slot + log · (γ + 1) · log_bytes_per_input)

- B: sequences in the round (all of them, including those it finishes);
- writes(γ, k) = `hs.sim.snapshot_writes_per_round`: snapshot slots a sequence
  holds after the verify forward (the final state included, the pinned
  round-start head not); `_count` counts the surviving ones, `len(plan.survivors)`;
- bytes_per_slot = `StatePool.bytes_per_slot`: SSM state plus conv window of
  every Mamba layer, in the compute dtype;
- log_bytes_per_input: the input log (xs, x, dt, B, C) of one verify input of
  one sequence over every Mamba layer, counted at the compute dtype's width, an
  upper bound of `MambaInputLog.nbytes()` per input (the log holds [B, T]
  inputs with T ≤ γ + 1).
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
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from hybridspec.errors import CacheFullError, ConfigError
from hybridspec.sim import (StepCosts, alpha_from_acceptance_rate, replay_probability, round_time,
                            snapshot_writes_per_round)

from .policy import CheckpointPolicy, validate_gamma

COST_FIELDS = ("snapshot_write_s", "log_write_s", "log_replay_fixed_s", "restore_s", "log_replay_step_s",
               "token_replay_fixed_s", "token_replay_step_s")
WHOLE_BATCH_FIELDS = ("snapshot_write_s", "log_write_s")
PRIOR_RATE, PRIOR_ROUNDS = 0.5, 2  # acceptance prior: two pseudo-rounds at rate 0.5


@dataclass(frozen=True)
class CheckpointFootprint:
    """Bytes one sequence keeps per snapshot slot and per logged verify input."""

    bytes_per_slot: int
    log_bytes_per_input: int

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> "CheckpointFootprint":
        """From a `HybridConfig` and the model dtype (recurrences run in at least float32)."""
        width = torch.promote_types(dtype, torch.float32).itemsize
        slot = log = 0
        for layer in config.mamba_layers:
            ssm, conv = config.state_shapes(layer)
            slot += math.prod(ssm) + math.prod(conv)
            if config.layer_types[layer] == "mamba2":
                m = config.mamba2  # xs (conv_dim), x (d_inner), dt (nheads), B and C (ngroups·d_state each)
                log += m.conv_dim + m.d_inner + m.num_heads + 2 * m.n_groups * m.d_state
            else:
                m = config.mamba1  # xs, x, dt (d_inner each), B and C (d_state each)
                log += 3 * m.d_inner + 2 * m.d_state
        return cls(width * slot, width * log)

    def checkpoint_bytes(self, batch: int, gamma: int, snapshot_every: int, log_inputs: bool) -> int:
        """bytes(k, log, B) of the module docstring."""
        writes = snapshot_writes_per_round(gamma, snapshot_every)
        return batch * (writes * self.bytes_per_slot + int(log_inputs) * (gamma + 1) * self.log_bytes_per_input)


@dataclass(frozen=True)
class CheckpointCosts:
    """Measured seconds of what a checkpoint policy changes, at the batch sizes
    `batches` (ascending), one value per batch in each field:

    snapshot_write_s: one more snapshot of every sequence in a verify forward;
    log_write_s: the input log of one verify input of every sequence;
    log_replay_fixed_s: a log-replay call, the part paid whatever rows replay;
    restore_s: each sequence that log-replays one step, on top of it;
    log_replay_step_s: each further log-replayed step of one sequence;
    token_replay_fixed_s: a token-replay forward, the part paid once;
    token_replay_step_s: each token-replayed token of one sequence.
    Between and beyond the measured batches they are interpolated linearly;
    from one measured batch, the two whole-batch fields scale with the batch.
    """

    batches: tuple[int, ...]
    snapshot_write_s: tuple[float, ...]
    log_write_s: tuple[float, ...]
    log_replay_fixed_s: tuple[float, ...]
    restore_s: tuple[float, ...]
    log_replay_step_s: tuple[float, ...]
    token_replay_fixed_s: tuple[float, ...]
    token_replay_step_s: tuple[float, ...]

    def __post_init__(self):
        batches = tuple(self.batches)
        if not batches or any(not isinstance(b, int) or b < 1 for b in batches) or list(batches) != sorted(set(batches)):
            raise ConfigError(f"CheckpointCosts.batches={self.batches!r} must be distinct ascending integers >= 1")
        for name in COST_FIELDS:
            values = tuple(float(v) for v in getattr(self, name))
            if len(values) != len(batches) or any(not math.isfinite(v) or v < 0 for v in values):
                raise ConfigError(f"CheckpointCosts.{name}={getattr(self, name)!r} must hold one finite number "
                                  f">= 0 (seconds) per batch in {batches}")
            object.__setattr__(self, name, values)
        object.__setattr__(self, "batches", batches)

    def at(self, name: str, batch: int) -> float:
        """Field `name` at `batch`, linear between the two nearest measured batches."""
        xs, ys = self.batches, getattr(self, name)
        if len(xs) == 1:
            return ys[0] * batch / xs[0] if name in WHOLE_BATCH_FIELDS else ys[0]
        i = min(max(sum(x <= batch for x in xs) - 1, 0), len(xs) - 2)
        slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
        return max(ys[i] + slope * (batch - xs[i]), 0.0)

    def step_costs(self, batch: int) -> StepCosts:
        """`hs.sim.StepCosts` at `batch`; the draft, plain and verify steps every
        policy shares are 0."""
        at = {name: self.at(name, batch) for name in COST_FIELDS if name != "log_replay_fixed_s"}
        return StepCosts(batch=batch, plain_step_s=0.0, draft_step_s=0.0, verify_s=0.0, **at)


def expected_round_s(costs: CheckpointCosts, batch: int, gamma: int, alpha: float, snapshot_every: int,
                     log_inputs: bool) -> float:
    """Expected checkpoint + replay seconds of one round (module docstring)."""
    spent = round_time(costs.step_costs(batch), gamma, alpha, snapshot_every, log_inputs)
    any_replays = 1.0 - (1.0 - replay_probability(alpha, gamma, snapshot_every)) ** batch
    launch = any_replays * costs.at("log_replay_fixed_s", batch) if log_inputs else 0.0
    return float(spent.checkpoint_s + spent.replay_s) + launch


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


def running_alpha(acceptance_history: list[float], gamma: int, window: int) -> float:
    """α of the mean acceptance rate of the last `window` rounds, shrunk towards
    PRIOR_RATE by PRIOR_ROUNDS pseudo-rounds (the first rounds have no history)."""
    recent = acceptance_history[-window:]
    rate = (sum(recent) + PRIOR_RATE * PRIOR_ROUNDS) / (len(recent) + PRIOR_ROUNDS)
    return alpha_from_acceptance_rate(min(max(rate, 0.0), 1.0), gamma)


class AutoBinding:
    """What a bound policy knows about its engine, and what it chose so far."""

    def __init__(self, engine, gamma: int, footprint: CheckpointFootprint, costs: CheckpointCosts, ring_slots: int):
        self.engine, self.gamma, self.footprint, self.costs = engine, gamma, footprint, costs
        self.ring_slots = ring_slots
        self.choices: Counter[tuple[int, bool]] = Counter()


@dataclass(frozen=True)
class AutoCheckpointPolicy(CheckpointPolicy):
    """Picks k and the input log every round (module docstring).

    memory_budget_bytes: bound on checkpoint bytes per round for the whole
        batch (None: unbounded).
    costs: measured step costs; None measures them on the target when bound.
    acceptance_window: rounds of acceptance history that give α.
    The Speculator calls `bind(engine, γ)` once, before `ring_size(γ)`.
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

    def bind(self, engine, gamma: int) -> "AutoCheckpointPolicy":
        """A copy bound to `engine` (its target's shapes, its cache's batch),
        measuring the step costs on the target at batch 1 and
        min(max_batch_size, 4) unless `costs` was given."""
        validate_gamma(gamma)
        target = engine.target
        footprint = CheckpointFootprint.of(target.config, target.dtype)
        single = footprint.checkpoint_bytes(1, gamma, 0, False)
        if self.memory_budget_bytes is not None and footprint.bytes_per_slot and self.memory_budget_bytes < single:
            raise ConfigError(f"memory_budget_bytes={self.memory_budget_bytes} is below one sequence's final-state "
                              f"snapshot ({single} bytes); raise it to at least {single}")
        costs = self.costs or measure_checkpoint_costs(target, gamma, sorted({1, min(engine.max_batch_size, 4)}),
                                                       repeats=5)
        fitting = [snapshot_writes_per_round(gamma, k) for k, log in candidates(gamma)
                   if self.memory_budget_bytes is None
                   or footprint.checkpoint_bytes(1, gamma, k, log) <= self.memory_budget_bytes]
        binding = AutoBinding(engine, gamma, footprint, costs, ring_slots=1 + max(fitting))
        return dataclasses.replace(self, binding=binding)

    def ring_size(self, gamma: int) -> int:
        """The head plus the most snapshots any k within the budget writes (γ + 2 unbound)."""
        return self.binding.ring_slots if self.binding is not None else gamma + 2

    def decide(self, acceptance_history: list[float], batch: int) -> RoundChoice:
        """The (k, log) for a round of `batch` sequences after this acceptance history."""
        bound = self._bound()
        alpha = running_alpha(acceptance_history, bound.gamma, self.acceptance_window)
        return choose(alpha, bound.gamma, batch, bound.costs, bound.footprint, self.memory_budget_bytes,
                      bound.ring_slots - 1)

    def for_round(self, acceptance_history: list[float]) -> CheckpointPolicy:
        """The concrete policy of this round, for the sequences now in the target cache."""
        bound = self._bound()
        choice = self.decide(acceptance_history, max(len(bound.engine.cache.computed_len), 1))
        bound.choices[choice.snapshot_every, choice.log_inputs] += 1
        return CheckpointPolicy(snapshot_every=choice.snapshot_every, ring_slots=bound.ring_slots,
                                log_inputs=choice.log_inputs)

    @property
    def decisions(self) -> dict[tuple[int, bool], int]:
        """Rounds per chosen (snapshot_every, log_inputs) so far."""
        return dict(self._bound().choices)

    def _bound(self) -> AutoBinding:
        if self.binding is None:
            raise ConfigError("this AutoCheckpointPolicy is not bound to an engine; pass it to hs.Engine("
                              "checkpoint=...) (which calls bind(engine, num_draft_tokens)) before using it")
        return self.binding


# -- measuring the step costs -----------------------------------------------------------------

def measure_checkpoint_costs(model, gamma: int, batches=(1,), repeats: int = 9,
                             clock=time.perf_counter) -> CheckpointCosts:
    """Time the operations of `CheckpointCosts` on `model` with a scratch cache
    at each batch size b, side by side (fastest of `repeats`, interleaved):
    verify forwards of γ + 1 inputs writing only the final state, a snapshot
    after every input, or the input log; a one-token forward; log replays of
    one step for row 0 only and for every row, and of γ + 1 steps for every
    row. Each cost is a difference of two of these times, e.g. a snapshot
    write is (every input − final only) / γ. `clock`: the timer
    (`time.process_time` on a CPU shared with other work)."""
    validate_gamma(gamma)
    batches = sorted(set(batches))
    rows = [_measure_at(model, gamma, b, repeats, clock) for b in batches]
    return CheckpointCosts(batches=tuple(batches), **{name: tuple(r[name] for r in rows) for name in COST_FIELDS})


def _measure_at(model, gamma: int, batch: int, repeats: int, clock) -> dict[str, float]:
    from hybridspec.cache.hybrid_cache import HybridCache

    if not model.config.mamba_layers:
        return dict.fromkeys(COST_FIELDS, 0.0)
    prompt_len, num_inputs, vocab, device = 8, gamma + 1, model.vocab_size, model.device
    cache = HybridCache(model.config, max_seqs=batch, block_size=16, ring_slots=gamma + 2, dtype=model.dtype,
                        device=device, num_blocks=batch * (2 + (prompt_len + num_inputs) // 16))
    ids = list(range(batch))
    model.prefill(cache, ids, [[(7 * b + i) % vocab for i in range(prompt_len)] for b in ids], last_only=True)
    start, heads = [cache.computed_len[s] for s in ids], [cache.head(s) for s in ids]
    spare = [[slot for slot in cache.states.ring_slots(s) if slot != h] for s, h in zip(ids, heads)]
    tokens = [[(3 * b + 5 * i + 1) % vocab for i in range(num_inputs)] for b in ids]

    def forward(count: int, every_input: bool = False, input_log: dict | None = None) -> None:
        snap = torch.full((batch, count), -1, dtype=torch.long, device=device)  # [batch, count]
        for b in ids:
            if every_input:
                snap[b] = torch.tensor(spare[b][:count])
            else:
                snap[b, -1] = spare[b][-1]
        model.extend(cache, ids, [t[:count] for t in tokens], last_only=True, snap_slot=snap, input_log=input_log)
        for s, length, head in zip(ids, start, heads):
            cache.commit(s, length, head)  # back to the round start: KV truncated, head untouched

    log: dict = {}
    forward(num_inputs, input_log=log)
    src = torch.tensor(heads, device=device)  # [batch]
    every_dst = torch.tensor([slots[0] for slots in spare], device=device)  # [batch]
    first_dst = torch.full_like(every_dst, -1)  # [batch]: only row 0 replays
    first_dst[0] = every_dst[0]
    first = torch.zeros(batch, dtype=torch.long, device=device)  # [batch]

    def replay(dst: torch.Tensor, steps: int) -> None:
        num_steps = torch.full((batch,), steps, dtype=torch.long, device=device)  # [batch]
        for layer in model.config.mamba_layers:
            mixer = model.layers[layer].mixer
            mixer.replay(cache, src, dst, first, num_steps, log[mixer.state_layer])

    t = _fastest({
        "final": lambda: forward(num_inputs),
        "every": lambda: forward(num_inputs, every_input=True),
        "log": lambda: forward(num_inputs, input_log={}),
        "one": lambda: forward(1),
        "replay_row0": lambda: replay(first_dst, 1),
        "replay_rows": lambda: replay(every_dst, 1),
        "replay_long": lambda: replay(every_dst, num_inputs),
    }, repeats, device, clock)

    def extra(name: str, base: str) -> float:
        return max(t[name] - t[base], 0.0)

    restore = extra("replay_rows", "replay_row0") / (batch - 1) if batch > 1 else 0.0
    token_step = extra("final", "one") / (gamma * batch)
    return {
        "snapshot_write_s": extra("every", "final") / gamma,
        "log_write_s": extra("log", "final") / num_inputs,
        "log_replay_fixed_s": max(t["replay_row0"] - restore, 0.0),
        "restore_s": restore,
        "log_replay_step_s": extra("replay_long", "replay_rows") / (gamma * batch),
        "token_replay_fixed_s": max(t["one"] - batch * token_step, 0.0),
        "token_replay_step_s": token_step,
    }


def _fastest(fns: dict, repeats: int, device: torch.device, clock) -> dict[str, float]:
    """Fastest of `repeats` calls of each function (the cost without
    interference), interleaved call by call after one warm-up round so that a
    load change on a shared machine hits all alike."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = dict.fromkeys(fns, math.inf)
    for round_index in range(repeats + 1):
        for name, fn in fns.items():
            sync()
            begin = clock()
            fn()
            sync()
            if round_index:
                best[name] = min(best[name], clock() - begin)
    return best
