"""Watching rounds from outside the engine: per-round state comparison with a
from-scratch prefill (`RoundObserver`) and fault injection at each step of a
round (`install_fault`)."""
from __future__ import annotations

from contextlib import contextmanager
from itertools import chain

import torch

from hybridspec.checkpoints.policy import CheckpointPolicy

from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.engine.engine import Engine
from hybridspec.errors import InvariantError
from hybridspec.models.hybrid import HybridModel
from hybridspec.spec.tree import input_parents, spine_inputs

FAULT_SITES = ("draft", "verify", "replay", "drafter commit")


def _atol(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-10, torch.float32: 1e-4}.get(dtype, 5e-2)


def _layer_states(cache: HybridCache, seq_id: int, length: int) -> dict[str, torch.Tensor]:
    """Every layer's state of one sequence: SSM state and conv window in the
    head slot, K and V at positions < `length` (read through the block table)."""
    out = {}
    if cache.states is not None:
        head = cache.head(seq_id)
        for i, layer in enumerate(cache.config.mamba_layers):
            # [nheads, headdim, d_state] (Mamba2) | [d_inner, d_state] (Mamba1)
            out[f"layer {layer} SSM state"] = cache.states.ssm_states[i][head]
            out[f"layer {layer} conv window"] = cache.states.conv_states[i][head]  # [conv_dim, d_conv - 1]
    if cache.kv is not None:
        kv = cache.kv
        positions = torch.arange(length, device=kv.k_cache.device)
        table = torch.tensor(kv.block_table(seq_id), dtype=torch.long, device=positions.device)
        pages, offsets = table[positions // kv.block_size], positions % kv.block_size
        for i, layer in enumerate(cache.config.attention_layers):
            out[f"layer {layer} K"] = kv.k_cache[i, pages, offsets]  # [length, kv_heads, head_dim]
            out[f"layer {layer} V"] = kv.v_cache[i, pages, offsets]
    return out


def _state_problems(model: HybridModel, cache: HybridCache, seq_id: int, tokens: list[int], who: str) -> list[str]:
    """How `cache`'s state of `seq_id` differs from a from-scratch prefill of `tokens`."""
    n = len(tokens)
    if cache.computed_len[seq_id] != n:
        return [f"{who}: computed_len {cache.computed_len[seq_id]}, expected {n}"]
    if cache.kv is not None and len(cache.kv.block_table(seq_id)) != -(-n // cache.block_size):
        return [f"{who}: holds {len(cache.kv.block_table(seq_id))} KV pages for {n} computed tokens"]
    if n == 0:
        return []
    fresh = HybridCache(model.config, max_seqs=1, num_blocks=-(-n // cache.block_size), block_size=cache.block_size,
                        ring_slots=2, dtype=model.dtype, device=model.device)
    model.prefill(fresh, [0], [tokens], last_only=True)
    want, atol, problems = _layer_states(fresh, 0, n), _atol(model.dtype), []
    for label, got in _layer_states(cache, seq_id, n).items():
        error = (got - want[label]).abs().max().item() if got.numel() else 0.0
        if not error <= atol:
            problems.append(f"{who}: {label} differs by {error:.1e} from a prefill of its {n} computed tokens")
    return problems


def _sequence_states(engine: Engine, requests) -> dict:
    """Copies of everything a round may change for `requests`: each cache's
    bookkeeping, each sequence's head states and K/V, the outputs."""
    caches = {"target": engine.cache}
    if engine.speculator.drafter.cache is not None:
        caches["drafter"] = engine.speculator.drafter.cache
    out = {}
    for who, cache in caches.items():
        out.update({f"{who} {key}": value for key, value in cache.bookkeeping().items()})
        for r in requests:
            if cache.has_sequence(r.seq_id):
                states = _layer_states(cache, r.seq_id, cache.computed_len[r.seq_id])
                out.update({f"{who} sequence {r.seq_id} {label}": t.clone() for label, t in states.items()})
    out.update({f"output of sequence {r.seq_id}": (list(r.output.token_ids), r.output.finish_reason)
                for r in requests})
    return out


def _differences(before: dict, after: dict) -> list[str]:
    def same(a, b):
        return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    return sorted(k for k in before.keys() | after.keys()
                  if k not in before or k not in after or not same(before[k], after[k]))


class RoundObserver:
    """Watches the rounds of `engine`'s speculator inside a `with` block, as
    one of its `hooks` (removed on exit; nothing else about the engine changes).

    It records, per round, (verify inputs, accepted) of every row the commit
    keeps live; checks the boundary invariant after every round (target and
    drafter) and, with `check_states`, every layer's state (`problems`), of
    the committed tokens the round's results make (the Engine emits them
    after the round). With `capture` it copies every sequence's state before
    each round; if a round raises, `reverted` lists what differs afterwards
    (None: nothing raised)."""

    def __init__(self, engine: Engine, check_states: bool = False, capture: bool = False):
        self.engine, self.spec = engine, engine.speculator
        self.check_states, self.capture = check_states, capture
        self.rounds, self.phase = 0, None  # phase: "draft" | "verify" | "commit" inside a round
        self.tree_rounds = 0  # rounds that verified a tree (`Proposal.parents`)
        self.commits: list[list[tuple[int, int]]] = []
        self.tree_commits: list[tuple[list[int], list[int]]] = []  # (input parents, accepted path) per live row
        self.problems: list[str] = []
        self.reverted: list[str] | None = None
        self._before: dict | None = None

    def __enter__(self) -> "RoundObserver":
        self.spec.hooks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.spec.hooks.remove(self)

    # -- RoundHook ----------------------------------------------------------------------------

    def round_started(self, round) -> None:
        self.rounds += 1
        self._before = _sequence_states(self.engine, round.requests) if self.capture else None

    def phase_started(self, phase: str) -> None:
        self.phase = phase

    def committed(self, round) -> None:
        if round.parents is not None:
            self.tree_rounds += 1
            self.tree_commits += [(input_parents(round.parents[b]), round.paths[b]) for b in round.live]
            return
        inputs = round.verify_inputs
        self.commits.append([(len(inputs[b]), round.accepted[b]) for b in round.live])

    def round_ended(self, round, error: BaseException | None) -> None:
        self.phase = None
        if error is not None:
            if self._before is not None:
                self.reverted = _differences(self._before, _sequence_states(self.engine, round.requests))
            return
        for b in round.live:
            r = round.requests[b]
            self.problems += self._check(r, r.output.prompt_token_ids + r.output.token_ids + round.results[b].tokens)

    def _check(self, request, committed: list[int]) -> list[str]:
        s, drafter = request.seq_id, self.spec.drafter
        boundary = len(committed) - 1
        try:
            self.engine.cache.check_invariant(s, boundary)
            drafter.check_invariant(s, boundary)
        except InvariantError as error:
            return [str(error)]
        problems = []
        if self.check_states and drafter.model is not None and drafter.cache is not None:
            # a model drafter's state against its prefill (an MTP layer or EAGLE-3 head holds K/V only, whose
            # length `check_invariant` checked)
            problems += _state_problems(drafter.model, drafter.cache, s, committed[:drafter.cache.computed_len[s]],
                                        f"drafter of sequence {s}")
        if self.check_states:
            problems += _state_problems(self.engine.target, self.engine.cache, s, committed[:-1], f"sequence {s}")
        return problems

    def expected_restores(self, policy: CheckpointPolicy) -> tuple[int, int, int]:
        """(snapshot hits, log-replayed tokens, token-replayed tokens) that
        `restore_path` implies for the rounds seen."""
        if self.engine.cache.states is None:
            return 0, 0, 0
        hits = log = token = 0
        for num_inputs, n in chain.from_iterable(self.commits):
            path, steps = restore_path(policy, self.spec.gamma, num_inputs, n)
            hits, log, token = hits + (path == "hit"), log + steps * (path == "log"), token + steps * (path == "token")
        for parents, accepted in self.tree_commits:
            path, steps = tree_restore_path(policy, self.engine.cache.ring_slots, parents, accepted)
            hits, log, token = hits + (path == "hit"), log + steps * (path == "log"), token + steps * (path == "token")
        return hits, log, token


def restore_path(policy: CheckpointPolicy, gamma: int, num_inputs: int, n: int) -> tuple[str, int]:
    """How docs/design.md's policy semantics restore a row of `num_inputs`
    verify inputs (γ = `gamma` sizes the ring) to boundary n: ("hit", 0), or
    ("log" | "token", steps replayed). Snapshots follow inputs 0, k, 2k, … and
    the last (k = 0: the last only); the ring keeps the latest `ring_slots - 1`
    of them (the head is pinned); any other boundary n is replayed from the
    nearest earlier one j (or the head) in n - j steps."""
    def snapshots(inputs):
        every = range(0, inputs, policy.snapshot_every) if policy.snapshot_every else ()
        return sorted({inputs - 1, *every})

    keep = (policy.ring_slots or len(snapshots(gamma + 1)) + 1) - 1
    kept = snapshots(num_inputs)[-keep:]
    if n in kept:
        return "hit", 0
    steps = n - max((j for j in kept if j <= n), default=-1)
    return ("log" if policy.log_inputs else "token"), steps


def tree_restore_path(policy: CheckpointPolicy, ring_slots: int, parents: list[int],
                      path: list[int]) -> tuple[str, int]:
    """How docs/design.md's policy semantics restore a tree round's row (verify inputs'
    `parents`, a ring of `ring_slots`) to the last input of its accepted `path`: ("hit", 0)
    or ("log" | "token", steps replayed along the path). The inputs at the policy's depths
    (0, k, 2k, … and the deepest; k = 0: the deepest only) are snapshotted, the spine's
    first, then the others in input order, as many as the ring holds beside the head."""
    depths = [0] * len(parents)
    for t, p in enumerate(parents):
        depths[t] = depths[p] + 1 if p >= 0 else 0
    deepest, k = max(depths), policy.snapshot_every
    wanted = {deepest, *(range(0, deepest + 1, k) if k else ())}
    spine = spine_inputs(parents)
    ranked = [t for t in spine if depths[t] in wanted] + [t for t in range(len(parents))
                                                           if depths[t] in wanted and t not in spine]
    kept = set(ranked[:ring_slots - 1])
    if path[-1] in kept:
        return "hit", 0
    steps = len(path) - 1 - max((j for j, t in enumerate(path) if t in kept), default=-1)
    return ("log" if policy.log_inputs else "token"), steps


class InjectedFault(RuntimeError):
    """Raised on purpose inside a round by `install_fault`."""


@contextmanager
def install_fault(engine: Engine, observer: RoundObserver, site: str, fire_round: int):
    """Raise InjectedFault once, in round `fire_round` or later, at `site`:
    - "draft": the drafter's second forward of the round (its catch-up done),
      or a prompt-lookup drafter's lookup;
    - "verify": the target's verify forward, its writes made;
    - "replay": the target's last Mamba layer's log replay, or a token replay's
      forward;
    - "drafter commit": the drafter's commit of a second row (the target's
      rows already committed).
    The forward sites go through `HybridModel.forward_done`, which every
    compute path calls once a forward's writes are made and before they are
    committed (the layers one by one, one native call, the greedy chain's
    forwards), so a fault lands at the same point whatever computed it."""
    spec, target, fired = engine.speculator, engine.target, []
    model_drafter = spec.drafter.model is not None

    def armed(phase: str) -> bool:
        return observer.phase == phase and observer.rounds >= fire_round and not fired

    def fire():
        fired.append(site)
        raise InjectedFault(f"injected at {site!r} in round {observer.rounds}")

    def hook(obj, name: str, phase: str, skip: int = 0, count=lambda *args: 1):
        """Fire inside `obj.name` once more than `skip` calls (or forwards: `count`) ran while armed."""
        original, calls = getattr(obj, name), []

        def hooked(*args, **kwargs):
            if armed(phase):
                calls.extend([1] * count(*args, **kwargs))
                if len(calls) > skip:
                    fire()
            return original(*args, **kwargs)
        setattr(obj, name, hooked)
        return obj, name

    def forwards(forwards: int = 1) -> int:  # `forward_done`'s count
        return forwards

    hooks = []
    if site == "draft":
        if model_drafter:
            hooks.append(hook(spec.drafter.model, "forward_done", "draft", skip=1, count=forwards))
        else:
            hooks.append(hook(spec.drafter, "lookup", "draft"))
    elif site == "verify":
        hooks.append(hook(target, "forward_done", "verify"))
    elif site == "replay":
        hooks.append(hook(target, "forward_done", "commit"))
        if target.recurrent_layers:
            hooks.append(hook(target.recurrent_layers[-1], "replay", "commit"))
    elif site == "drafter commit" and model_drafter:
        hooks.append(hook(spec.drafter.cache, "commit", "commit", skip=1))
    else:
        raise ValueError(f"fault site {site!r} must be one of {FAULT_SITES} (drafter commit: a model drafter)")
    try:
        yield
    finally:
        for obj, name in hooks:
            delattr(obj, name)


# -- parity --------------------------------------------------------------------------------------


def witness_bookkeeping(engine: Engine) -> tuple:
    drafter = engine.speculator.drafter if engine.speculator else None
    drafter_cache = None if drafter is None else drafter.cache
    return engine.cache.bookkeeping(), (None if drafter_cache is None else drafter_cache.bookkeeping())


