"""`Engine`: plain and speculative generation over a `HybridModel`.

`Engine(target)` is plain autoregressive decoding through the same runtime:
the baseline every benchmark compares against. With `draft=` it runs
speculative rounds (`hybridspec.spec.speculator`): draft → verify → commit.
The Engine builds the pieces a `Speculator` receives (drafter, bound
checkpoint policy, target cache) and applies what each round or plain step
returns to the requests, in one place (`_apply`); docs/design.md draws the
whole.
"""
from __future__ import annotations

import functools
import os
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from collections.abc import Iterator
from typing import Callable, Literal

import torch
from tqdm.auto import tqdm

from hybridspec.checkpoints.auto import resolve_policy
from hybridspec.checkpoints.policy import ring_halves_by_default
from hybridspec.cache.state_specs import default_state_dtype

from hybridspec.cache.hybrid_cache import HybridCache, scratch_cache
from hybridspec.cache.prefix_cache import PrefixStore, as_prefix_settings
from hybridspec.errors import ConfigError, InvalidRequestError, PeerRankError
from hybridspec.sampling.logprobs import TokenLogprob, prompt_logprobs
from hybridspec.cache.memory import EngineMemory, cache_memory
from hybridspec.models.graphs import ForwardGraphs, graphed
from hybridspec.models.hybrid import HybridModel
from hybridspec.sampling.grammar import GrammarCompiler, GrammarState
from hybridspec.sampling.next_token import sample_next
from hybridspec.engine.config import EngineConfig, engine_config
from hybridspec.engine.prompt_logits import prefill_logits
from hybridspec.engine.requests import normalize_requests
from hybridspec.engine.scheduler import Scheduler
from hybridspec.sampling.sampler import RowParams, SamplingParams, derived_seed
from hybridspec.spec.drafters import Drafter, as_draft, as_drafter
from hybridspec.spec.gamma import GammaController
from hybridspec.spec.tree_auto import DECLINED_SCALE, TreeAuto, tree_outcome
from hybridspec.spec.round import RowResult
from hybridspec.spec.speculator import Speculator
from hybridspec.engine.startup_costs import startup_round_costs
from hybridspec.engine.stats import EngineStats
from hybridspec.sampling.stopping import Cut, StopRule


@dataclass
class Output:
    """What `Engine.generate` returns for one prompt (and sample).

    prompt_token_ids: the prompt as given.
    token_ids: the generated tokens only, the stop token (if any) included.
    finish_reason: "stop" (a stop token, EOS or stop string), "length"
        (max_new_tokens reached) or "abort" (`Engine.abort`).
    stop_reason: the stop token id or stop string that ended it; None for EOS
        and for "length" (vLLM's convention).
    logprobs: with `SamplingParams(logprobs=k)`, one `TokenLogprob` per
        generated token; None otherwise.
    sample_index: which of the prompt's n samples this is (0 for n=1).
    prompt_logprobs: with `SamplingParams(prompt_logprobs=k)`, one entry per
        prompt token: None for the first, then a `TokenLogprob` (its rank
        set) under the target's raw distribution after the tokens before it
        (`hybridspec.sampling.logprobs`); None otherwise.
    """

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated tokens only
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    sample_index: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class StepOutput:
    """What one sequence gained in an `Engine.step`: the tokens its round
    committed (after the stop rules) and whether it has ended. `request_id`
    is the id `add_request` returned (`Engine.stream`: the prompt's index).
    A request stopped by `Engine.abort` gets one last report (no tokens,
    finish_reason "abort") from the next `step`."""

    request_id: int
    token_ids: list[int]
    finished: bool
    sample_index: int = 0
    finish_reason: Literal["stop", "length", "abort"] | None = None  # with `finished`: why it ended
    stop_reason: int | str | None = None  # with `finished`: as `Output.stop_reason`
    logprobs: list[TokenLogprob] | None = None  # with `SamplingParams(logprobs=k)`: one per token of token_ids
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with `prompt_logprobs=k`: in the first report only


@dataclass
class Request:
    """One sequence being generated: committed tokens = prompt + output."""

    seq_id: int
    params: SamplingParams
    seed: int
    output: Output
    stops: StopRule
    on_emit: Callable[[list[int]], None] | None = None  # called with the tokens each emit keeps
    request_id: int = -1  # the `add_request` id; the n samples of one prompt share it
    grammar: GrammarState | None = None  # with `params.structured`: its matcher, holding the output tokens

    @property
    def committed_len(self) -> int:
        return len(self.output.prompt_token_ids) + len(self.output.token_ids)

    @property
    def last_token(self) -> int:
        return self.output.token_ids[-1] if self.output.token_ids else self.output.prompt_token_ids[-1]

    def cut(self, tokens: list[int]) -> Cut:
        """What emitting `tokens` (Python ints) would do: how many it keeps (up to and including
        the token that ends the request: stop token, EOS, stop string,
        max_new_tokens, the grammar's end) and whether, and why, the request ends."""
        cut = self.stops.cut(self.output.token_ids, tokens)
        if self.grammar is None:
            return cut
        end = self.grammar.end_in(tokens[:cut.kept])
        return cut if end is None or (end == cut.kept and cut.finished) else Cut(end, "stop")

    def emit(self, result: RowResult) -> None:
        """Append what a round or a plain step gave this request (its tokens
        after the stop rules, their logprobs); set finish_reason and
        stop_reason when it ends. An ended (e.g. aborted) request keeps nothing."""
        if self.finished:
            return
        tokens = result.tokens
        if self.grammar is not None and not result.cut.finished:
            self.grammar.advance(tokens)
        self.output.token_ids.extend(tokens)
        if result.logprobs is not None:
            self.output.logprobs = (self.output.logprobs or []) + result.logprobs
        if self.on_emit is not None and tokens:
            self.on_emit(tokens)
        if result.cut.finished:
            self.output.finish_reason, self.output.stop_reason = result.cut.finish_reason, result.cut.stop_reason

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None



def scratch_request(seq_id: int, params: SamplingParams, prompt: list[int], first_token: int) -> Request:
    """A request that has emitted its first token and never stops, for start-up
    measurements (`hybridspec.engine.startup_costs`); seeded by its id."""
    stops = StopRule(params.max_new_tokens, frozenset(), frozenset())
    return Request(seq_id, params, seq_id, Output(list(prompt), [first_token]), stops)


def check_tensor_parallel(target: HybridModel, size: int | None):
    """The target's TensorParallel group (None: one device), checked against
    the `tensor_parallel_size` asked for (None: whatever the target is)."""
    tp = target.tensor_parallel
    have = 1 if tp is None else tp.size
    if size is not None and size != have:
        held = f"one shard over {have} ranks" if tp else "not sharded"
        raise ConfigError(f"tensor_parallel_size={size} but the target is {held}; load it with hs.load(path, "
                          f"tensor_parallel_size={size}) (or hs.from_hf(model, tensor_parallel_size={size})) in each "
                          f"of the {size} processes")
    return tp


def step_output(request: Request, start: int) -> StepOutput:
    """What `request` gained since its output had `start` tokens (its prompt
    log-probs in its first report: the one from no tokens)."""
    out = request.output
    return StepOutput(request.request_id, out.token_ids[start:], request.finished, out.sample_index,
                      out.finish_reason, out.stop_reason, None if out.logprobs is None else out.logprobs[start:],
                      out.prompt_logprobs if start == 0 else None)

class Engine:
    """Plain or speculative generation of token ids over a `HybridModel`
    (`hs.LLM` is the text-level front end built on it).

    target: the model whose distribution is sampled (`hs.from_hf`, `hs.load`).
    draft: None (default: plain decoding, the baseline), a HybridModel sharing
        the target's vocabulary, a draft model directory (loaded in the
        target's dtype, on its device), "ngram" or `hs.NgramDrafter(...)`
        (prompt lookup), "suffix" or `hs.SuffixDrafter(...)` (suffix
        decoding), "mtp" / "eagle3:DIR" (over the target's hidden states),
        "layers:N" (a layer-skip draft: the target's first N layers, its
        final norm and LM head, `HybridModel.first_layers`), or any `hybridspec.spec.Drafter` (`as_draft`: what
        `hs.LLM(draft=...)` takes).
    config: an `hs.EngineConfig` holding the settings below; or the settings
        as keyword arguments (`hs.Engine(target, max_batch_size=32)`). Both:
        the keyword settings must agree with the config (else ConfigError).

    Settings (`EngineConfig`'s fields):
    num_draft_tokens: γ, drafts per sequence per round (default 4; >= 1), or
        "auto": γ per sequence per round in 0 … max_draft_tokens, chosen for
        the most expected tokens per second from acceptance estimates and
        costs measured on this engine (`hybridspec.spec.gamma`; timed when
        the Engine is built, at a few batch sizes, and kept on disk for the
        next start of the same engine on this machine:
        `hybridspec.engine.cost_cache`).
    max_draft_tokens: γ_max of "auto" (default 8).
    checkpoint: how the target's recurrent state is snapshotted during
        verification: a `CheckpointPolicy`, "auto" (`AutoCheckpointPolicy`),
        or None (default: a snapshot after every verify input).
    verify: "rejection" (default) or "coupled". "coupled": every sampled
        request's output is token-identical to plain decoding with its seed.
        "rejection": requests without a seed are verified by lossless
        rejection sampling (it accepts the most drafts), and requests given a
        seed coupled, so that a seed gives the same tokens alone or beside any
        others, at any γ (`Speculator.coupled_rows`). Both are lossless.
    max_batch_size: most sequences running at once, samples counted (default
        16); more requests wait in the scheduler's queue.
    max_model_len: most tokens (prompt + generated) per sequence (default: the
        model's limit, at most 4096).
    block_size: tokens per KV page (default 16); num_blocks: KV pages in the
        pool (default: max_model_len tokens for every sequence).
    state_dtype: dtype of SSM states and conv windows (default None: float32,
        float64 for a float64 model).
    eos_token_ids: token ids that end a request unless its `ignore_eos` is set
        (default None: the target config's `eos_token_id`, if any).
    decode: token ids -> text, needed by requests with `stop` strings (default
        None; `hs.LLM` passes its tokenizer's).
    tokenizer: the target's HF tokenizer, which structured output
        (`SamplingParams(structured=...)`) reads to map token ids to bytes
        (default None: token id = byte value, for a 256-token byte-level
        model; `hs.LLM` passes its tokenizer).
    prefix_cache: reuse cached prefixes across requests and `generate` calls
        (attention K/V pages shared, recurrent state from the nearest saved
        state, the tail replayed; `hybridspec.cache.prefix_cache`): True
        for the defaults, an `hs.PrefixCache(...)` for settings, or None / False
        (default: off). A model drafter gets a prefix cache of its own.
    cuda_graphs: capture the few-input forwards (decode, drafting,
        verification) of the target and a model drafter as CUDA graphs and
        replay them (`hybridspec.models.graphs`). True needs the models on a
        CUDA device, no MoE layers and no float64 attention (else
        ConfigError); False: never; None (default): the environment's
        `HYBRIDSPEC_CUDA_GRAPHS` ("1": for each model that can be captured,
        the others eager; unset or "0": never). Prefill and forwards of more
        than 8 inputs run as usual.
    tensor_parallel_size: None (default) takes the target as it is; N checks
        that the target is one shard over N ranks (`hs.load(path,
        tensor_parallel_size=N)`, `hybridspec.tp`). Every rank runs the same
        Engine over the same requests; choices made from timings (adaptive γ,
        `CheckpointPolicy.auto`'s costs) are rank 0's.
    tree: None (default: chains of drafts) or an `hs.TreeShape`: the drafter
        then proposes a tree of up to γ nodes per row (a shorter chain and, at
        each depth, its next most likely tokens beside it: a draft model's,
        the MTP layer's or an EAGLE-3 head's distribution, suffix decoding's
        most frequent continuations, prompt lookup's other matches), verified
        in one target forward (`hybridspec.spec.tree`); greedy and coupled
        output stay plain decoding's. "auto" (with num_draft_tokens="auto"):
        chain or tree, and the tree's shape and budget, chosen per round from
        the batch's measured costs and the learned acceptance and rescue rate
        (`hybridspec.spec.tree_auto`). Needs a drafter that branches (else
        ConfigError).

    Requests: `generate` (a list in, a list out), `stream` (an iterator of
    new tokens), or `add_request` / `step` / `abort` for a server's own loop;
    `hybridspec.engine.scheduler` decides who runs each step (admission by free KV
    pages, preemption of the newest request when the pool runs out).

    After each `generate`, `stats` (`EngineStats`) describes that call alone
    (`step` adds to it); `total_stats` adds up every step of this Engine.
    """

    def __init__(self, target: HybridModel, draft=None, config: EngineConfig | None = None, **settings):
        if not isinstance(target, HybridModel):
            raise ConfigError(f"target must be a HybridModel (from hs.from_hf or hs.load), got {type(target).__name__}")
        self.config = config = engine_config(config, settings)
        self.tensor_parallel = check_tensor_parallel(target, config.tensor_parallel_size)
        self.eos_token_ids = config.eos_ids(target.config)
        sizes = config.sizes(target.config)
        draft = as_draft(draft, target.dtype, target.device)
        prefix_settings = as_prefix_settings(config.prefix_cache)
        self.target = target
        self.max_model_len = sizes.max_model_len
        self.max_batch_size = sizes.max_batch_size
        self.state_dtype = config.state_dtype or default_state_dtype(target.dtype)
        self.cache_kwargs = dict(max_seqs=sizes.max_batch_size, block_size=sizes.block_size,
                                 num_blocks=sizes.num_blocks, dtype=target.dtype, device=target.device)
        self.stats = EngineStats()
        self.total_stats = EngineStats()
        self.check_invariants = os.environ.get("HYBRIDSPEC_CHECK", "0") not in ("", "0")
        self.speculator: Speculator | None = None
        self.gamma_controller: GammaController | None = None
        num_draft_tokens = config.gamma_max
        auto_tree = config.tree == "auto"
        drafter = as_drafter(draft, target, num_draft_tokens, self.cache_kwargs, prefix_settings,
                             None if auto_tree else config.tree)
        if auto_tree and not hasattr(drafter, "tree"):
            raise ConfigError(f"tree='auto': the drafter {type(drafter).__name__} does not branch; pass a draft "
                              "model, 'mtp', 'eagle3:DIR', 'suffix' or 'ngram' (or tree=None for chains)")
        self.tree_auto: TreeAuto | None = None
        graphed_models = graphed(config.cuda_graphs, [target] + _drafter_models(drafter))
        if drafter is None:
            self.cache = self._new_cache(ring_slots=2)
        else:
            policy = resolve_policy(config.checkpoint).bind(  # "auto" measures step costs here
                target, num_draft_tokens, max_batch_size=self.max_batch_size, state_dtype=self.state_dtype,
                new_cache=functools.partial(scratch_cache, target, state_dtype=self.state_dtype))
            if self.tensor_parallel is not None:  # measured costs differ by rank: every rank takes rank 0's
                policy = self.tensor_parallel.broadcast(policy)
            halves = ring_halves_by_default(target.device)  # CPU: batched snapshot writes in place
            self.cache = self._new_cache(ring_slots=policy.ring_size(num_draft_tokens, halves=halves))
            self.speculator = Speculator(target, drafter, num_draft_tokens, policy, self.cache,
                                         coupled=config.verify == "coupled", check_invariants=self.check_invariants)
            if config.adaptive:
                self.gamma_controller = self._gamma_controller(drafter, num_draft_tokens)
                if auto_tree:  # a tree forward's prior price: the chain's where the whole native forward takes it
                    native = target.backend.whole_forward
                    self.tree_auto = TreeAuto(self.gamma_controller, 1.0 if native else DECLINED_SCALE)
        self.prefix = None if prefix_settings is None else PrefixStore(target, self.cache, prefix_settings)
        caches, stores, models = [self.cache], [self.prefix], [target]
        if drafter is not None and drafter.cache is not None:
            caches.append(drafter.cache)
            stores.append(drafter.prefix)
            models.append(drafter.model)
        for model, cache in zip(models, caches):
            if model in graphed_models:
                cache.graphs = ForwardGraphs(model, cache, self.max_batch_size, self.max_model_len)
        reclaim = None if self.prefix is None else functools.partial(make_room, dict(zip(map(id, caches), stores)))
        self.scheduler = Scheduler(caches, self.max_batch_size, self._release, reclaim)
        self._requests: dict[int, Request] = {}  # seq_id -> every queued or running sequence
        self._rows_cache: tuple[tuple[int, ...], RowParams] | None = None
        self._preemptions_seen = 0
        self._aborted: list[StepOutput] = []  # the final reports of aborted sequences, for the next step
        self._batch: dict[int, tuple[Request, int]] = {}  # `step_request_ids`
        self._next_seq_id = 0
        self._next_request_id = 0

    def _gamma_controller(self, drafter: Drafter, gamma_max: int) -> GammaController:
        """γ per round from costs timed on scratch caches of this engine's models (now, or
        at an earlier start of the same engine on this machine: `hybridspec.engine.cost_cache`)."""
        new_cache = functools.partial(scratch_cache, self.target, state_dtype=self.state_dtype)
        costs = startup_round_costs(self.target, drafter, self.speculator.policy, gamma_max, self.max_batch_size,
                                    self.state_dtype, new_cache, scratch_request)
        return GammaController(gamma_max, costs)

    def _new_cache(self, ring_slots: int) -> HybridCache:
        """The target's cache with this engine's sizes (plain steps take turns between two ring offsets)."""
        return HybridCache(self.target.config, ring_slots=ring_slots, state_dtype=self.state_dtype, spare="pair",
                           **self.cache_kwargs)

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, prompt, params: SamplingParams | None = None) -> int:
        """Queue one prompt; returns its request id. With `params.n` > 1 the
        request runs n sequences (samples), reported under the same id with
        their `sample_index`. Nothing runs until `step`. Raises
        InvalidRequestError (a bad prompt or params, or a request longer than
        the whole KV pool could ever hold) before anything is queued."""
        [prompt], [params] = self._normalize([prompt], None if params is None else [params])
        return self._submit([prompt], [params], None)[0]

    def step(self, first_tokens: Callable[[list[StepOutput]], None] | None = None) -> list[StepOutput]:
        """One engine step: admit waiting requests the caches can take and
        prefill them (each emits its first token), then one round (a
        speculative round, or a plain decode step) of every running sequence.
        Returns what each sequence gained this step, in batch order;
        `finished` marks its last report. Requests that finished or were
        aborted leave every cache before it returns. If it raises,
        `step_request_ids` names the requests of its batch.

        first_tokens: called with the admitted requests' first tokens as soon
        as their prefill has emitted them, before the round (a server streams
        them without waiting for the round); what it was given is not
        repeated in the returned list."""
        step_stats = EngineStats()
        before = self._batch = {}  # seq_id -> (request, its output length when it joined the step)
        tp = self.tensor_parallel
        if tp is not None:
            tp.begin_step()
        # torch's own work of the step (sampling, acceptance) on one thread beside the native kernels' threads:
        # OpenMP workers spinning after it held the core the next kernel's helper needed
        with self.target.backend.torch_beside_kernels():
            try:
                admitted = self.scheduler.admit(self._round_tokens)
                for r in admitted:
                    before.setdefault(r.seq_id, (r, len(r.output.token_ids)))
                if admitted:
                    self._prefill(admitted, step_stats)
                self._agree(tp)
                if admitted:
                    if first_tokens is not None:
                        first_tokens(self._report_early([before[r.seq_id] for r in admitted]))
                self.scheduler.reserve(self._round_tokens)
                running = [r for r in self.scheduler.running if not r.finished]
                for r in running:
                    before.setdefault(r.seq_id, (r, len(r.output.token_ids)))
                if running:
                    self._round(self._in_ring_order(running), step_stats, after_prefill=bool(admitted))
                self._agree(tp, rest_of_step=True)
            except BaseException:
                if tp is not None:  # peers waiting in a sum for this rank fail now; every agreement says so
                    tp.abort()
                    tp.end_step(False)
                raise
            finally:
                if self.prefix is not None:
                    self.prefix.move_counts(step_stats)
                step_stats.preemptions = self.scheduler.preemptions - self._preemptions_seen
                self._preemptions_seen = self.scheduler.preemptions
                ended = [r for r in self.scheduler.running if r.finished]
                self.scheduler.finish(ended)
                for r in ended:
                    self._requests.pop(r.seq_id, None)
                self.stats.add(step_stats)
                self.total_stats.add(step_stats)
        self._batch = {}  # only a step that raised leaves its batch for `step_request_ids`
        aborted, self._aborted = self._aborted, []
        return aborted + [step_output(r, start) for r, start in before.values()
                          if start is not None and (len(r.output.token_ids) > start or r.finished)]

    @staticmethod
    def _agree(tp, rest_of_step: bool = False) -> None:
        """Tensor parallel: the step goes on only if every rank's part so far
        went well (`hybridspec.tp.group`): the step's next agreement, or with
        `rest_of_step` those it has left (none where the round made them); one
        process: nothing."""
        if tp is not None and not (tp.end_step(True) if rest_of_step else tp.agree(True)):
            raise PeerRankError("another tensor-parallel rank's step raised; this rank's step failed too")

    def _report_early(self, entries: list[tuple[Request, int]]) -> list[StepOutput]:
        """The StepOutputs of `entries` (request, output length when it joined
        the step) now; the step's batch then counts them from here, and one
        that finished is not reported again (its start becomes None)."""
        outputs = [step_output(r, start) for r, start in entries if len(r.output.token_ids) > start or r.finished]
        for r, _ in entries:
            self._batch[r.seq_id] = (r, None if r.finished else len(r.output.token_ids))
        return outputs

    def step_request_ids(self) -> list[int]:
        """The ids of the requests in the batch of the `step` running now or of
        the last one, if it raised (those it admitted and those its round ran;
        empty once a step returned). After a step raised, a server fails and
        `abort`s these (their pages and rings return); the requests still
        waiting were not touched by it and run on."""
        return list(dict.fromkeys(r.request_id for r, _ in self._batch.values()))

    def abort(self, request_id: int) -> None:
        """Stop a request (every sample of it) now: its pages and rings return to
        the pools at once; its output so far keeps finish_reason "abort". The
        other sequences are untouched; the next `step` reports each of its
        sequences finished (finish_reason "abort"). Unknown or finished ids are ignored."""
        self._end(request_id, report=True)

    def _end(self, request_id: int, report: bool) -> None:
        ended = [r for r in self._requests.values() if r.request_id == request_id]
        for r in ended:
            if not r.finished:
                r.output.finish_reason = "abort"
                if report:
                    self._aborted.append(StepOutput(r.request_id, [], True, r.output.sample_index, "abort"))
            self._requests.pop(r.seq_id, None)
        self.scheduler.finish(ended)

    def has_unfinished_requests(self) -> bool:
        """Whether a `step` has anything to run or report."""
        return self.scheduler.has_work or bool(self._aborted)

    def memory(self) -> EngineMemory:
        """What the target's and a model drafter's pools hold now (pages, rings, prefix cache)."""
        drafter = None if self.speculator is None else self.speculator.drafter
        return EngineMemory(cache_memory(self.cache, self.prefix),
                            None if drafter is None or drafter.cache is None
                            else cache_memory(drafter.cache, drafter.prefix))

    def stream(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[StepOutput]:
        """Generate for `prompts` and yield each sequence's new tokens as its
        rounds commit: `StepOutput(index, token_ids, finished, sample_index)`
        with `index` the prompt's position in `prompts`. Closing the iterator
        early aborts what is still running."""
        ids = self._submit(*self._normalize(prompts, params), None)
        index = {request_id: i for i, request_id in enumerate(ids)}
        live = Counter(r.request_id for r in self._requests.values() if r.request_id in index)  # sequences left
        try:
            while live:
                for out in self.step():
                    if out.request_id in index:
                        yield replace(out, request_id=index[out.request_id])
                        if out.finished:
                            live[out.request_id] -= 1
                            if not live[out.request_id]:
                                del live[out.request_id]
        finally:
            for request_id in live:
                self._end(request_id, report=False)  # the caller left: nobody reads a report

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool | str = False, stream: Callable[[int, list[int]], None] | None = None) -> list[Output]:
        """Generate for every prompt; returns one Output per prompt, in order, or
        with `n` > 1 n consecutive Outputs per prompt (HF's
        `num_return_sequences` order), sample i seeded `derived_seed(seed, i)`.
        Any number of prompts: at most `max_batch_size` sequences run at once
        and the rest wait their turn (continuous batching). Requests queued
        earlier with `add_request` run alongside; their step reports are not
        returned here (their tokens still reach their outputs).

        prompts: token-id lists (or 1-D integer arrays / tensors).
        params: one SamplingParams for all prompts, one per prompt, or None (the
            defaults: 64 greedy tokens).
        progress: a tqdm bar on stderr (a string labels it); default off.
        stream: when given, `stream(i, token_ids)` is called as tokens of
            output i are emitted (once per round, after its commit).
        Raises InvalidRequestError before anything runs; if a step fails, every
        request of the call is aborted (its pages and rings freed) and the
        error is raised."""
        prompts, params = self._normalize(prompts, params)
        self.stats.reset()
        ids = self._submit(prompts, params, stream)
        own = set(ids)
        requests = [r for r in self._requests.values() if r.request_id in own]
        bar = tqdm(total=sum(r.params.max_new_tokens for r in requests), disable=not progress, unit="tok",
                   desc=progress if isinstance(progress, str) else None, leave=False)
        try:
            while any(not r.finished for r in requests):
                for out in self.step():
                    bar.update(len(out.token_ids))
        finally:
            for request_id in ids:
                self._end(request_id, report=False)
            bar.close()
        return [r.output for r in requests]

    def _normalize(self, prompts, params) -> tuple[list[list[int]], list[SamplingParams]]:
        return normalize_requests(prompts, params, self.target.vocab_size, self.max_model_len)

    def _submit(self, prompts: list[list[int]], params: list[SamplingParams], stream) -> list[int]:
        """Queue one request per prompt (n sequences each, fresh sequence ids);
        returns the request ids. Checks everything first: nothing is queued
        if any prompt is refused."""
        if self.config.decode is None and any(p.stop for p in params):
            raise InvalidRequestError("stop strings need a detokenizer: use hs.LLM for text, or build the Engine "
                                      "with decode=tokenizer.decode (or pass stop_token_ids instead)")
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            self.scheduler.check_fits(len(prompt), p.max_new_tokens, f"prompt {i}")
        for p in params:
            if p.structured is not None:
                self.grammars.compile(p.structured)
        ids, requests, output_index = [], [], 0
        for prompt, p in zip(prompts, params):
            request_id = self._next_request_id
            self._next_request_id += 1
            ids.append(request_id)
            seed = p.resolved_seed()
            stops = StopRule(p.max_new_tokens, frozenset(p.stop_token_ids),
                             frozenset() if p.ignore_eos else self.eos_token_ids, p.stop, self.config.decode)
            for sample_index in range(p.n):
                on_emit = None if stream is None else (lambda tokens, i=output_index: stream(i, tokens))
                output_index += 1
                output = Output(list(prompt), logprobs=None if p.logprobs is None else [], sample_index=sample_index)
                grammar = None if p.structured is None else self.grammars.state(p.structured)
                request = Request(self._next_seq_id, p, derived_seed(seed, sample_index), output, stops, on_emit,
                                  request_id=request_id, grammar=grammar)
                self._next_seq_id += 1
                requests.append(request)
        for r in requests:
            self._requests[r.seq_id] = r
        self.scheduler.add(requests)
        return ids

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """The compiler of structured requests' grammars over the target's
        vocabulary (built at the first one: ConfigError without the grammar engine)."""
        return GrammarCompiler(self.target.vocab_size, self.config.tokenizer, tuple(sorted(self.eos_token_ids)))

    def _round_tokens(self, request: Request) -> int:
        """Positions the next round of `request` writes at most (verify inputs: γ_max + 1)."""
        remaining = request.params.max_new_tokens - len(request.output.token_ids)
        gamma = 0 if self.speculator is None else self.speculator.gamma  # γ_max with "auto"
        return max(1, min(gamma + 1, remaining))

    def _release(self, requests: list[Request]) -> None:
        """Free the sequences of `requests` in the target's cache and the drafter;
        with the prefix cache on, what each computed stays indexed first."""
        ids = [r.seq_id for r in requests]
        if self.prefix is not None:
            self.prefix.release(ids, [r.output.prompt_token_ids + r.output.token_ids for r in requests])
        self.cache.free_sequences(ids)
        if self.speculator is not None:
            self.speculator.drafter.release(ids)
        if self.gamma_controller is not None:
            self.gamma_controller.forget(ids)

    def _rows(self, requests: list[Request]) -> RowParams:
        """The batch's sampling parameters as tensors (rebuilt when the batch changes)."""
        key = tuple(r.seq_id for r in requests)
        if self._rows_cache is None or self._rows_cache[0] != key:
            rows = RowParams.of([r.params for r in requests], [r.seed for r in requests], self.target.device)
            self._rows_cache = (key, rows)
        return self._rows_cache[1]

    def _prefill(self, requests: list[Request], stats: EngineStats) -> None:
        """Absorb the prompts of newly admitted requests, record the prompt
        log-probs of those asking (once: a request resuming has them) and emit
        each first token from the last prompt logits; a preempted request
        resumes: its committed tokens but the pending last one are absorbed
        again (nothing is sampled)."""
        ids = [r.seq_id for r in requests]
        committed = [r.output.prompt_token_ids + r.output.token_ids for r in requests]
        absorbed = [c[:r.committed_len - (1 if r.output.token_ids else 0)] for c, r in zip(committed, requests)]
        fresh = [b for b, r in enumerate(requests) if not r.output.token_ids]
        scored = [r.params.prompt_logprobs is not None and r.output.prompt_logprobs is None for r in requests]
        if self.prefix is None:
            logits, every = prefill_logits(self.target, self.cache, ids, absorbed, scored)  # [batch, vocab]
            logits = logits[torch.tensor(fresh, dtype=torch.long, device=logits.device)]  # [fresh, vocab]
            stats.prefill_computed_tokens += sum(map(len, absorbed))
        else:  # a resumed sequence may be restored whole from its own cached tokens
            logits, every = self.prefix.prefill_scoring(ids, absorbed, [r.params.save_states_at for r in requests],
                                                        [not r.output.token_ids for r in requests], scored)
        for r, rows in zip(requests, every):
            if rows is not None:  # rows [len(prompt), vocab]
                r.output.prompt_logprobs = prompt_logprobs(rows, r.output.prompt_token_ids, r.params.prompt_logprobs)
        if self.speculator is not None:
            self.speculator.drafter.start(requests)
        stats.sequences += len(fresh)
        if fresh:
            self._emit_first([requests[b] for b in fresh], logits, stats)

    def _emit_first(self, requests: list[Request], logits: torch.Tensor, stats: EngineStats) -> None:
        """Each new request's first token, sampled from its last prompt logits
        [batch, vocab]; a request asking for none (max_new_tokens=0) ends here
        without one."""
        done = [r for r in requests if r.params.max_new_tokens == 0]
        self._apply(done, [RowResult.of(r, [], None if r.params.logprobs is None else []) for r in done])
        if done:
            keep = [b for b, r in enumerate(requests) if r.params.max_new_tokens > 0]
            requests = [requests[b] for b in keep]
            logits = logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]  # [kept, vocab]
        if requests:
            self._apply(requests, self._sample(requests, logits, self._rows(requests), stats))

    def _sample(self, requests: list[Request], logits: torch.Tensor, rows: RowParams,
                stats: EngineStats) -> list[RowResult]:
        """A plain step's token per request from logits [batch, vocab] (`sample_next`)."""
        with stats.phase("sampling"):
            tokens, logprobs = sample_next(logits, rows, requests)
        stats.emitted_tokens += len(requests)
        return [RowResult.of(r, [t], lp) for r, t, lp in zip(requests, tokens, logprobs)]

    @staticmethod
    def _apply(requests: list[Request], results: list[RowResult]) -> None:
        """Emit what a round or a plain step gave each request: the one place
        the requests' outputs grow."""
        for r, result in zip(requests, results):
            r.emit(result)

    def _in_ring_order(self, requests: list[Request]) -> list[Request]:
        """The batch by state ring: consecutive rings make each step's slots one
        span of the pool (states computed in place; `kernels/slot_plan.py`).
        Tokens do not depend on row order (batch invariance)."""
        states = self.cache.states
        return requests if states is None else sorted(requests, key=lambda r: states.ring_index(r.seq_id))

    def _round(self, requests: list[Request], stats: EngineStats, after_prefill: bool = False) -> None:
        """One round of the running batch: speculative, or a plain decode step
        (plain engines, and adaptive rounds that give every row γ = 0);
        `after_prefill`: a prefill ran just before it (its forward runs cold)."""
        began = time.perf_counter()
        rows, ids = self._rows(requests), [r.seq_id for r in requests]
        controller, gammas = self.gamma_controller, None
        if controller is not None:
            sampled = 0 if rows.flags.all_greedy else sum(not r.params.is_greedy for r in requests)
            gammas = controller.choose(ids, [r.params.max_new_tokens - len(r.output.token_ids) - 1 for r in requests],
                                       self.speculator.drafter.backlog(requests), sampled)
            shape = None  # chain or tree (`tree="auto"`): the drafter proposes this round's shape
            if self.tree_auto is not None:
                gammas, shape = self.tree_auto.choose(ids, gammas, sampled)
            if self.tensor_parallel is not None:  # chosen from timings, which differ by rank: rank 0's
                gammas, shape = self.tensor_parallel.broadcast((gammas, shape))
            if self.tree_auto is not None:
                self.speculator.drafter.tree = shape
        before = dict(stats.seconds)
        backlog_s, backlog_tokens = 0.0, 0  # the drafter's one-off absorption in this round
        tree = None  # a tree round's outcome
        if self.speculator is not None and (gammas is None or any(gammas)):
            round = self.speculator.round(requests, rows, stats, gammas)
            results = round.results
            drafted, accepted, asked = [len(d) for d in round.drafts], round.accepted, round.gammas
            backlog_s, backlog_tokens = round.backlog_seconds, round.backlog_tokens
            if round.parents is not None:
                tree = tree_outcome(round.parents, round.paths)
        else:
            results = self._decode_step(requests, rows, stats)
            self._agree(self.tensor_parallel)
            drafted = accepted = asked = [0] * len(requests)
            if self.speculator is not None:  # the drafter catches up in the next round that drafts
                stats.gamma_counts[0] = stats.gamma_counts.get(0, 0) + len(requests)
        self._apply(requests, results)
        if controller is not None:
            seconds = {phase: stats.seconds[phase] - before.get(phase, 0.0) for phase in stats.seconds}
            seconds["round"] = time.perf_counter() - began
            seconds["draft"] -= backlog_s  # a prompt's one-off absorption is not what a round costs ...
            seconds["round"] -= backlog_s
            seconds["backlog"] = backlog_s  # ... it is learned per token and amortised (spec/gamma.py)
            controller.observe(ids, drafted, accepted, asked, seconds, backlog_tokens, after_prefill, sampled, tree)
            if self.tree_auto is not None:
                self.tree_auto.observe(len(ids), tree, seconds, after_prefill, sampled)

    def _decode_step(self, requests: list[Request], rows: RowParams, stats: EngineStats) -> list[RowResult]:
        """One target step per sequence, sampled as plain decoding does; what
        each request gains (not yet applied)."""
        with stats.phase("verify"):
            ids = [r.seq_id for r in requests]
            self.cache.align_heads(ids)  # one span of sources and of spare slots: the torch step runs in place
            logits = self.target.decode(self.cache, ids, [r.last_token for r in requests])
        results = self._sample(requests, logits, rows, stats)
        if self.check_invariants:  # the step's boundary: the committed length before its token
            for r, result in zip(requests, results):
                if not result.finished:
                    self.cache.check_invariant(r.seq_id, r.committed_len)
        stats.rounds += 1
        stats.sequence_rounds += len(requests)
        return results


def _drafter_models(drafter: Drafter | None) -> list[HybridModel]:
    """The model a drafter runs, as a list (none for plain decoding or a model-free drafter)."""
    return [] if drafter is None or drafter.model is None else [drafter.model]


def make_room(stores: dict, cache: HybridCache, num_pages: int) -> None:
    """The scheduler's `reclaim`: cached prefixes of `cache` give up pages until
    `num_pages` are free (`stores`: id(cache) -> its PrefixStore)."""
    stores[id(cache)].make_room(num_pages)
