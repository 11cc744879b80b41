"""Measuring what a checkpoint policy costs on one model (`measure_checkpoint_costs`
→ `hybridspec.costs.checkpoint_costs.CheckpointCosts`): scratch forwards
(`ScratchForwards`) timed side by side (`fastest`). The engine's start-up
measurement of a whole round (`engine/startup_costs.py`) uses the same tools."""
from __future__ import annotations

import math
import time

import torch

from hybridspec.checkpoints.policy import CheckpointPolicy, ring_halves_by_default, validate_gamma
from hybridspec.checkpoints.ring import plan_snapshots
from hybridspec.costs.checkpoint_costs import COST_FIELDS, CheckpointCosts


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
