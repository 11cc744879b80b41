"""Round costs measured when an Engine with `num_draft_tokens="auto"` is built:
every term of `hs.sim.RoundTerms` for a plain step and for rounds drafting G,
at each measured batch size, by running the engine's own code over scratch
requests on scratch caches:

- a plain step: `HybridCache.align_heads` + `HybridModel.decode` (forward),
  `sample_next` (sampling), the rows' `RowResult`s (host), then undone;
- a round drafting G per row: `Speculator.round` with a scratch drafter over
  the same model as the engine's; its phase timers give draft, forward
  ("verify"), sampling and commit, and what the round took beyond them is
  host; the rows then take its tokens, as an engine's do.

The scratch rows are caught up (one warm-up round absorbs their prompts in
the drafter first), as most rows of a running batch are; the policy is the
engine's, so snapshot writes are in the forward and replays in the commit.
Rows are greedy, and a second set samples (temperature 1), timed at the
corners of the batch and token grid for the sampling and draft terms that
sampling changes (the rejection kernel, the drafter's q). What start-up
cannot see (filters and penalties, a loaded machine) the controller learns
online (`spec/gamma.py`).

An engine times a few batch sizes (`anchor_batches`) and reads the rest of
its table between and past them (`startup_round_costs`); the costs it timed
are kept on disk for its next start (`hybridspec.engine.cost_cache`).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import time

from tqdm.auto import tqdm

from hybridspec.checkpoints.auto import AutoCheckpointPolicy, ReplayPrice
from hybridspec.costs.checkpoint_costs import interpolate
from hybridspec.checkpoints.measure import ScratchForwards, device_sync, fastest
from hybridspec.checkpoints.policy import ring_halves_by_default
from hybridspec.costs.round_terms import TERMS, RoundTerms

from hybridspec.cache.hybrid_cache import scratch_cache
from hybridspec.sampling.next_token import sample_next
from hybridspec.sampling.sampler import RowParams, SamplingParams
from hybridspec.costs.round_costs import RoundCosts, anchor_batches, measured_batches
from hybridspec.engine import cost_cache
from hybridspec.spec.model_drafter import ModelDrafter
from hybridspec.spec.round import RowResult
from hybridspec.spec.speculator import Speculator
from hybridspec.engine.stats import EngineStats

PROMPT_LEN = 64  # tokens each scratch row holds before the measured rounds: attention reads a typical context
REPEATS = 3  # runs of each kind of call per batch (`_measure_batch`)
WARM_CALLS = {False: 1, True: 4}  # untimed calls before a timed round (False) or plain step (True)
ABSORB_LEN = 16  # tokens per row of the measured absorption (a drafter's backlog forward)

log = logging.getLogger(__name__)


def startup_round_costs(target, drafter, policy, gamma_max: int, max_batch_size: int, state_dtype, new_cache,
                        new_request) -> RoundCosts:
    """The `RoundCosts` of an engine of `max_batch_size` rows, at
    `measured_batches(max_batch_size)`: the costs kept for this engine's key
    (`cost_cache`), else timed now at `anchor_batches` (said in a log line,
    with a progress bar on a terminal) and kept; read between and past the
    timed batches (`RoundCosts.resampled`). Arguments as `measure_round_costs`'s;
    `drafter`: the engine's, `state_dtype`: its states'."""
    anchors = anchor_batches(max_batch_size)
    key = cost_cache.cost_key(target, drafter.model, drafter, policy, gamma_max, state_dtype)
    kept = cost_cache.load(key, anchors[-1])
    if kept is not None:
        costs, checkpoint_costs = kept
        replay = ReplayPrice(policy, checkpoint_costs) if checkpoint_costs is not None else \
            ReplayPrice.of(policy, target, gamma_max, anchors, new_cache)
        costs = dataclasses.replace(costs, replay=replay)
    else:
        began = time.perf_counter()
        log.info("timing rounds for num_draft_tokens='auto' at batch sizes %s (kept for later starts in %s)",
                 ", ".join(map(str, anchors)), cost_cache.cache_dir())
        with tqdm(desc="timing rounds", unit="batch", disable=None, leave=False) as bar:  # a bar on a terminal only
            draft = drafter.model if drafter.model is not None else drafter if hasattr(drafter, "scratch") else None
            costs = measure_round_costs(target, draft, policy, gamma_max, anchors, new_cache, new_request,
                                        progress=bar)
        log.info("rounds timed in %.1f s", time.perf_counter() - began)
        own = costs.replay is not None and not isinstance(policy, AutoCheckpointPolicy)  # an auto policy has its own
        cost_cache.store(key, costs, costs.replay.costs if own else None)
    return costs.resampled(measured_batches(max_batch_size))


def token_grid(gamma_max: int) -> list[int]:
    """Token counts T = G + 1 measured: 1, 2, 3, ⌈(γ_max + 1)/2⌉ and γ_max + 1."""
    return sorted({1, 2, 3, (gamma_max + 2) // 2, gamma_max + 1} & set(range(1, gamma_max + 2)))


def scratch_len(gamma_max: int, repeats: int = REPEATS) -> int:
    """Tokens a scratch row can reach: its prompt, the warm-up round, and
    every measured round advancing it by at most G + 1 (a plain step is undone)."""
    rounds = repeats * (WARM_CALLS[False] + 1) * sum(T for T in token_grid(gamma_max) if T > 1)
    return PROMPT_LEN + (gamma_max + 1) + rounds + 1


def measure_round_costs(target, draft_model, policy, gamma_max: int, batches, new_cache, new_request,
                        repeats: int = REPEATS, clock=time.perf_counter, progress=None) -> RoundCosts:
    """`RoundCosts` of G = T − 1 drafts per row for T in the token grid (1, 2, 3,
    ⌈(γ_max + 1)/2⌉, γ_max + 1) at each batch size, in seconds of `clock`
    (wall, as the engine's phase timers; `time.process_time` on a CPU other
    work shares): the median over `repeats` runs of calls of one kind
    (`_measure_batch`), the runs of each (batch, G) alternating with the
    others of its batch; rows that sample, at the corners of the batch and
    token grid (`_sampled_terms`). `new_cache(max_seqs, ring_slots, max_len=64)`:
    a scratch cache of the target holding `max_len` tokens per row; `draft_model`:
    the drafter's model, or a drafter that makes scratch copies of itself
    (`scratch(cache_kwargs)`: an MTP layer, an EAGLE-3 head), or None (a
    drafter whose proposals are host work learned online); `policy`: the engine's checkpoint policy;
    `new_request(seq_id, params, prompt, first_token)`: an engine request
    that has emitted its first token (`hybridspec.engine.engine.scratch_request`);
    `progress`: None, or a tqdm bar each timed set of rows advances (its total set here)."""
    batches, tokens = sorted(set(batches)), token_grid(gamma_max)
    corners = sorted({batches[0], batches[-1]})  # the least and most batch
    replay = ReplayPrice.of(policy, target, gamma_max, batches, new_cache, clock)  # None: the policy never replays
    scratch = functools.partial(ScratchRounds, target, draft_model, policy, gamma_max, new_cache=new_cache,
                                new_request=new_request, max_len=scratch_len(gamma_max, repeats), replay=replay)
    if progress is not None:
        progress.reset(total=len(batches) + len(corners))
    advance = progress.update if progress is not None else lambda: None
    greedy = []
    for b in batches:
        greedy.append(_measure_batch(scratch(b), tokens, repeats, clock))
        advance()
    extra = {}  # rows that sample, at the corners of the batch and token grid
    for b in corners:
        measured = _measure_batch(scratch(b, temperature=1.0), sorted({1, tokens[-1]}), repeats, clock)
        advance()
        extra[b] = _extra_of_sampling(greedy[batches.index(b)], measured)
    sampled = [_sampled_terms(row, b, extra, tokens) for b, row in zip(batches, greedy)]
    table = {name: tuple(tuple(row[T].as_dict()[name] for T in tokens) for row in greedy) for name in TERMS}
    of_sampled = {name: tuple(tuple(row[T].as_dict()[name] for T in tokens) for row in sampled)
                  for name in SAMPLED_TERMS}
    draft_step = tuple(row[min(2, tokens[-1])].draft_s for row in greedy)  # one step (G = 1), catch-up included
    row_draft_at = {b: _row_draft_s(target, b, tokens[-1], new_cache, repeats, clock)  # per row: linear in between
                    for b in corners}
    row_draft = tuple(interpolate(list(row_draft_at), list(row_draft_at.values()), b) for b in batches)
    absorb = (None if draft_model is None or hasattr(draft_model, "scratch")  # a drafter's backlog: learned online
              else tuple(_absorb_s(draft_model, b, repeats, clock) for b in batches))
    return RoundCosts(tuple(batches), tuple(tokens), table["forward_s"], draft_step, row_draft,
                      draft_s=table["draft_s"], sampling_s=table["sampling_s"], commit_s=table["commit_s"],
                      host_s=table["host_s"], absorb_s=absorb, sampled_sampling_s=of_sampled["sampling_s"],
                      sampled_draft_s=of_sampled["draft_s"], replay=replay)


SAMPLED_TERMS = ("sampling_s", "draft_s")  # what rows that sample change in a round


def _extra_of_sampling(greedy: dict[int, RoundTerms], sampled: dict[int, RoundTerms]) -> dict[int, dict[str, float]]:
    """{T: {term: seconds rows that sample add over greedy ones}} where both were measured."""
    return {T: {name: getattr(sampled[T], name) - getattr(greedy[T], name) for name in SAMPLED_TERMS}
            for T in sampled}


def _sampled_terms(greedy: dict[int, RoundTerms], batch: int, extra: dict, tokens) -> dict[int, RoundTerms]:
    """{T: terms of `batch` rows that all sample} over the token grid: the
    greedy terms plus the extra sampling and draft seconds measured at the
    corners of the grid (`extra`: batch -> T -> term -> seconds, at the least
    and most batch and token counts), linear in the batch and in T between
    them (the extra is work per distribution: per row and per token; a
    measured extra below 0 is noise, taken as 0)."""
    out = {}
    for T in tokens:
        values = greedy[T].as_dict()
        for name in SAMPLED_TERMS:
            per_batch = [interpolate(list(by_T), [terms[name] for terms in by_T.values()], T) for by_T in extra.values()]
            added = interpolate(list(extra), per_batch, batch)
            values[name] = 0.0 if name == "draft_s" and T == 1 else values[name] + added
        out[T] = RoundTerms(**values)
    return out


def _measure_batch(scratch: "ScratchRounds", tokens, repeats, clock) -> dict[int, RoundTerms]:
    """{T: RoundTerms of G = T − 1} at the batch of `scratch`.

    Each T is timed as the engine runs it, at the end of a run of calls of its
    kind (a plain engine's steps follow one another, as a fixed γ's rounds
    do): a call right after a call of another kind pays for what the other
    evicted, which the steady state does not, and a small model's plain step
    takes several steps to recover from a round (`WARM_CALLS`). The runs of
    the T alternate `repeats` times, so a load change hits all alike; each
    term is the median of its timed calls, the cost a typical round pays (the
    fastest call would be an optimistic one)."""
    samples = {T: {} for T in tokens}  # T -> term -> timed values
    for _ in range(repeats):
        for T in tokens:
            for _ in range(WARM_CALLS[T == 1]):
                _call(scratch, T, clock)
            for name, value in _call(scratch, T, clock).items():
                samples[T].setdefault(name, []).append(value)
    return {T: RoundTerms(**{name: statistics.median(values) for name, values in samples[T].items()})
            for T in tokens}


def _call(scratch: "ScratchRounds", T: int, clock) -> dict[str, float]:
    """One plain step (T = 1) or round of T − 1 drafts per row, its terms."""
    return scratch.plain_step(clock) if T == 1 else scratch.round(T - 1, clock)


def _row_draft_s(target, batch: int, top: int, new_cache, repeats: int, clock) -> float:
    """What one more draft of one row adds beyond the padded forward: its snapshot writes."""
    if top < 2:
        return 0.0
    verify = ScratchForwards(target, batch, top, new_cache)
    t = fastest({"every": lambda: verify.forward(top, every_input=True, last_only=False),
                 "final": lambda: verify.forward(top, last_only=False)}, repeats, target.device, clock)
    return max(t["every"] - t["final"], 0.0) / (top - 1) / batch


def _absorb_s(draft_model, batch: int, repeats: int, clock) -> float:
    """Seconds per token of a drafter's backlog forward (`ModelDrafter._absorb_backlog`):
    ABSORB_LEN tokens per row at `batch`, the final state only."""
    new_cache = functools.partial(scratch_cache, draft_model, max_len=PROMPT_LEN + ABSORB_LEN)
    scratch = ScratchForwards(draft_model, batch, ABSORB_LEN, new_cache)
    t = fastest({"absorb": lambda: scratch.forward(ABSORB_LEN)}, repeats, draft_model.device, clock)
    return t["absorb"] / (batch * ABSORB_LEN)


class ScratchRounds:
    """`batch` scratch requests, greedy or sampling at `temperature`, on scratch
    caches of the target and (with `draft_model`) a drafter, caught up, of up
    to `max_len` tokens per row; `plain_step` times one plain step and undoes
    it, `round` times one round and commits it as an engine does (the next
    round writes new positions and slots: a round repeated on the same ones
    finds them in cache, which an engine's rounds do not)."""

    def __init__(self, target, draft_model, policy, gamma_max: int, batch: int, new_cache, new_request,
                 max_len: int, temperature: float = 0.0, replay: ReplayPrice | None = None):
        halves = ring_halves_by_default(target.device)
        self.target = target
        self.cache = new_cache(batch, policy.ring_size(gamma_max, halves=halves), max_len=max_len)
        self.new_cache, self.gamma_max, self.replay = new_cache, gamma_max, replay
        pages = -(-max_len // 16)
        sizes = dict(max_seqs=batch, num_blocks=batch * pages, block_size=16)
        self.drafter = (None if draft_model is None else draft_model.scratch(sizes) if hasattr(draft_model, "scratch")
                        else ModelDrafter(draft_model, gamma_max, sizes))
        vocab = target.vocab_size
        params = SamplingParams(max_new_tokens=1 << 20, temperature=temperature, ignore_eos=True)
        prompts = [[(7 * b + i) % vocab for i in range(PROMPT_LEN)] for b in range(batch)]
        self.requests = [new_request(b, params, prompt, (5 * b) % vocab) for b, prompt in enumerate(prompts)]
        self.ids = [r.seq_id for r in self.requests]
        self.rows = RowParams.of([params] * batch, [r.seed for r in self.requests], target.device)
        self.speculator = None  # made before the prefill: a drafter reading hidden states records the prompts'
        if self.drafter is not None:
            self.speculator = Speculator(target, self.drafter, gamma_max, policy, self.cache)
        target.prefill(self.cache, self.ids, [r.output.prompt_token_ids for r in self.requests], last_only=True)
        if self.drafter is not None:
            self.drafter.start(self.requests)
            warm_up = self.speculator.round(self.requests, self.rows, EngineStats(), [gamma_max] * batch)
            for request, result in zip(self.requests, warm_up.results):  # the drafter has absorbed the prompts
                request.emit(result)

    def plain_step(self, clock) -> dict[str, float]:
        """A plain decode step as `Engine._decode_step` runs it, undone afterwards."""
        starts = [self.cache.computed_len[s] for s in self.ids]
        sync = device_sync(self.target.device)
        began = clock()
        self.cache.align_heads(self.ids)
        logits = self.target.decode(self.cache, self.ids, [r.last_token for r in self.requests])  # [batch, vocab]
        sync()
        forward_end = clock()
        tokens, logprobs = sample_next(logits, self.rows, self.requests)
        sampled = clock()
        [RowResult.of(r, [t], lp) for r, t, lp in zip(self.requests, tokens, logprobs)]
        ended = clock()
        for s, length in zip(self.ids, starts):
            self.cache.rewind_to(s, length, self.cache.head(s))
        return {"forward_s": forward_end - began, "sampling_s": sampled - forward_end, "host_s": ended - sampled}

    def round(self, G: int, clock) -> dict[str, float]:
        """One `Speculator.round` of G drafts per row, its terms; the rows take what it gave."""
        if self.speculator is None:
            return {"forward_s": self._verify_only(G + 1, clock)}
        stats = EngineStats()
        stats.clock = clock  # the phases on the clock the whole round is timed with
        began = clock()
        round = self.speculator.round(self.requests, self.rows, stats, [G] * len(self.ids))
        device_sync(self.target.device)()
        total = clock() - began
        for request, result in zip(self.requests, round.results):
            request.emit(result)
        phases = stats.seconds  # the backlog is none: the warm-up round absorbed the prompts, rounds keep up
        return {"forward_s": phases["verify"], "draft_s": phases["draft"], "sampling_s": phases["sampling"],
                "commit_s": max(phases["commit"] - self._replayed_s(stats), 0.0),
                "host_s": max(total - sum(phases.values()), 0.0)}

    def _replayed_s(self, stats: EngineStats) -> float:
        """What the round's own replays cost (`ReplayPrice.spent`): the replay
        term prices them at the acceptance a batch has, so the commit term
        leaves them out."""
        if self.replay is None:
            return 0.0
        rows = len(self.ids) - stats.snapshot_hits
        return self.replay.spent(rows, stats.log_replayed_tokens, stats.token_replayed_tokens, len(self.ids))

    def _verify_only(self, num_inputs: int, clock) -> float:
        """Without a draft model: the forward of `num_inputs` inputs per row alone."""
        if getattr(self, "_forwards", None) is None:
            self._forwards = ScratchForwards(self.target, len(self.ids), self.gamma_max + 1, self.new_cache)
        began = clock()
        self._forwards.forward(num_inputs, every_input=True, last_only=False)
        return clock() - began

