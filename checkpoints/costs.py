"""What a checkpoint policy costs on one model: the bytes a round holds
(`CheckpointFootprint`) and the measured seconds of snapshot writes, input
logging and replays (`CheckpointCosts`, `measure_checkpoint_costs`). The
`auto` policy (`checkpoints/auto.py`) chooses k and logging from these."""
from __future__ import annotations

import math
import time
from bisect import bisect_right
from dataclasses import dataclass

import torch

from hybridspec.checkpoints.policy import CheckpointPolicy, ring_halves_by_default, validate_gamma
from hybridspec.checkpoints.ring import plan_snapshots
from hybridspec.errors import ConfigError
from hybridspec.sim import StepCosts, snapshot_writes_per_round
from hybridspec.state_memory import bytes_per_slot, log_bytes_per_input

COST_FIELDS = ("snapshot_write_s", "log_write_s", "log_replay_fixed_s", "restore_s", "log_replay_step_s",
               "token_replay_fixed_s", "token_replay_step_s")
WHOLE_BATCH_FIELDS = ("snapshot_write_s", "log_write_s")


@dataclass(frozen=True)
class CheckpointFootprint:
    """Bytes one sequence keeps per snapshot slot and per logged verify input."""

    bytes_per_slot: int
    log_bytes_per_input: int

    @classmethod
    def of(cls, config, dtype: torch.dtype, state_dtype: torch.dtype) -> "CheckpointFootprint":
        """From a `HybridConfig`, the model dtype and the state dtype."""
        shapes = config.recurrent_state_shapes()
        return cls(bytes_per_slot(shapes, state_dtype.itemsize),
                   log_bytes_per_input(shapes, dtype.itemsize, state_dtype.itemsize))

    def checkpoint_bytes(self, batch: int, gamma: int, snapshot_every: int, log_inputs: bool) -> int:
        """bytes(k, log, B) of the module docstring."""
        writes = snapshot_writes_per_round(gamma, snapshot_every)
        return batch * (writes * self.bytes_per_slot + int(log_inputs) * (gamma + 1) * self.log_bytes_per_input)


def interpolate(xs, ys, x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs ascending), extended linearly past
    the ends and clamped at 0; one point is a constant."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return max(ys[i] + slope * (x - xs[i]), 0.0)


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
        if len(xs) == 1 and name in WHOLE_BATCH_FIELDS:
            return ys[0] * batch / xs[0]
        return interpolate(xs, ys, batch)

    def step_costs(self, batch: int) -> StepCosts:
        """`hs.sim.StepCosts` at `batch`; the draft, plain and verify steps every
        policy shares are 0."""
        at = {name: self.at(name, batch) for name in COST_FIELDS if name != "log_replay_fixed_s"}
        return StepCosts(batch=batch, plain_step_s=0.0, draft_step_s=0.0, verify_s=0.0, **at)


# -- measuring the step costs -----------------------------------------------------------------

def measure_checkpoint_costs(model, gamma: int, batches, new_cache, repeats: int = 9,
                             clock=time.perf_counter) -> CheckpointCosts:
    """Time the operations of `CheckpointCosts` on `model` with a scratch cache
    at each batch size b, side by side (fastest of `repeats`, interleaved):
    verify forwards of γ + 1 inputs writing only the final state, a snapshot
    after every input, or the input log; a one-token forward; log replays of
    one step for row 0 only and for every row, and of γ + 1 steps for every
    row. Each cost is a difference of two of these times, e.g. a snapshot
    write is (every input − final only) / γ. `new_cache(max_seqs, ring_slots)`
    makes the scratch caches (a `HybridCache` for `model`); `clock`: the timer
    (`time.process_time` on a CPU shared with other work)."""
    validate_gamma(gamma)
    batches = sorted(set(batches))
    rows = [_measure_at(model, gamma, b, new_cache, repeats, clock) for b in batches]
    return CheckpointCosts(batches=tuple(batches), **{name: tuple(r[name] for r in rows) for name in COST_FIELDS})


class ScratchForwards:
    """Repeatable forwards of `model` for measurements: a scratch cache
    (`new_cache(batch, ring_slots)`, the ring an engine would give k = 1 with
    γ = num_inputs - 1) of `batch` sequences that absorbed an 8-token prompt
    each, and `num_inputs` verify inputs per row. Each `forward` is undone
    afterwards (KV truncated, head untouched), so every call starts from the
    same state, as a verify forward does."""

    def __init__(self, model, batch: int, num_inputs: int, new_cache):
        vocab = model.vocab_size
        self.model, self.batch = model, batch
        ring_slots = CheckpointPolicy().ring_size(num_inputs - 1, halves=ring_halves_by_default(model.device))
        self.cache = new_cache(batch, ring_slots)
        self.ids = list(range(batch))
        model.prefill(self.cache, self.ids, [[(7 * b + i) % vocab for i in range(8)] for b in self.ids],
                      last_only=True)
        self.start = [self.cache.computed_len[s] for s in self.ids]
        self.heads = [self.cache.head(s) for s in self.ids]
        self.inputs = [[(3 * b + 5 * i + 1) % vocab for i in range(num_inputs)] for b in self.ids]

    def snapshot_slots(self, count: int) -> list[list[int]]:
        """Per row, the slot after each of `count` inputs, placed as a round would (`plan_snapshots`)."""
        states = self.cache.states
        return [plan_snapshots(states.ring_slots(s), h, list(range(count)), count).snap_slot
                for s, h in zip(self.ids, self.heads)]

    def forward(self, count: int, every_input: bool = False, input_log: dict | None = None,
                last_only: bool = True) -> None:
        """The first `count` inputs of every row, with a snapshot after every
        input or the final state only (into the slot of the last snapshot)."""
        snap = None
        if self.cache.states is not None:
            snap = torch.tensor(self.snapshot_slots(count), dtype=torch.long, device=self.model.device)
            if not every_input:
                snap[:, :-1] = -1  # [batch, count]: the final state only
        self.model.extend(self.cache, self.ids, [t[:count] for t in self.inputs], last_only=last_only,
                          snap_slot=snap, input_log=input_log)
        for s, length, head in zip(self.ids, self.start, self.heads):
            self.cache.rewind_to(s, length, head)  # back to the start: KV truncated, head untouched


def _measure_at(model, gamma: int, batch: int, new_cache, repeats: int, clock) -> dict[str, float]:
    if not model.recurrent_layers:
        return dict.fromkeys(COST_FIELDS, 0.0)
    num_inputs, device = gamma + 1, model.device
    scratch = ScratchForwards(model, batch, num_inputs, new_cache)
    cache, heads, forward = scratch.cache, scratch.heads, scratch.forward
    log: dict = {}
    forward(num_inputs, input_log=log)
    src = torch.tensor(heads, device=device)  # [batch]
    every_dst = torch.tensor([slots[0] for slots in scratch.snapshot_slots(num_inputs)], device=device)  # [batch]
    first_dst = torch.full_like(every_dst, -1)  # [batch]: only row 0 replays
    first_dst[0] = every_dst[0]
    first = torch.zeros(batch, dtype=torch.long, device=device)  # [batch]

    def replay(dst: torch.Tensor, steps: int) -> None:
        num_steps = torch.full((batch,), steps, dtype=torch.long, device=device)  # [batch]
        for layer in model.recurrent_layers:
            layer.replay(cache.states, src, dst, first, num_steps, log[layer.state_layer])

    t = fastest({
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


def device_sync(device: torch.device):
    """What waits for `device`'s queued work before a clock is read (nothing on a CPU)."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def fastest(fns: dict, repeats: int, device: torch.device, clock) -> dict[str, float]:
    """Fastest of `repeats` calls of each function (the cost without
    interference), interleaved call by call after one warm-up round so that a
    load change on a shared machine hits all alike."""
    sync = device_sync(device)
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
