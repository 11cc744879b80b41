"""The rollback-correctness suite as a library (DESIGN.md "How correctness is
proven"), run by `tests/test_spec_*.py` and by `hybridspec check`.

Each check takes a target `HybridModel` (and a drafter) and returns a
`CheckResult` (name, passed, detail, seconds, stats):
- parity: speculative output == plain `Engine(target)` output token for token
  (greedy, or sampled with `verify="coupled"`), and the restores counted in
  `engine.stats` are exactly those the checkpoint policy implies for the
  acceptance lengths the rounds saw (snapshot hit / log replay / token replay);
- state parity (`check_states=True`): after every round, every layer's head
  state (SSM state, conv window) and K/V up to `computed_len` equal a
  from-scratch prefill of the committed tokens minus the pending one; a model
  drafter likewise at its own computed length;
- batch invariance: a request's sampled output is the same alone or in a batch;
- bad input: a typed error naming the bad value, and nothing changed;
- failed round: a round that raises while drafting, verifying, replaying or
  committing the drafter leaves every sequence exactly as it was before it.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import dataclass, field, replace
from itertools import chain

import torch

from .cache.hybrid_cache import HybridCache
from .config import AttentionConfig, HybridConfig, Mamba1Config, Mamba2Config, MLPConfig
from .engine import Engine
from .errors import ConfigError, InvalidRequestError, InvariantError
from .models.hybrid import HybridModel
from .sampling import SamplingParams
from .spec.drafters import NgramDrafter
from hybridspec.checkpoints.policy import MAX_DRAFT_TOKENS, CheckpointPolicy

POLICIES = {
    "k=1": CheckpointPolicy(snapshot_every=1),
    "k=2": CheckpointPolicy(snapshot_every=2),
    "k=0": CheckpointPolicy(snapshot_every=0),
    "ring too small": CheckpointPolicy(snapshot_every=1, ring_slots=2),
    "log off": CheckpointPolicy(snapshot_every=1, ring_slots=3, log_inputs=False),
}
GAMMAS = (1, 2, 4, 7)
FAULT_SITES = ("draft", "verify", "replay", "drafter commit")


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str
    seconds: float
    stats: dict = field(default_factory=dict)  # measured figures (acceptance, replays, checkpoint bytes)


class CheckFailure(AssertionError):
    """A check found a difference; the message says which."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailure(message)


def _run_check(name: str, body) -> CheckResult:
    """Run `body() -> (detail, stats)`; any exception is a failed check, reported by type."""
    start = time.perf_counter()
    try:
        detail, stats = body()
        passed = True
    except CheckFailure as failure:
        passed, detail, stats = False, str(failure), {}
    except Exception as error:
        passed, detail, stats = False, f"raised {type(error).__name__}: {error}", {}
    return CheckResult(name, passed, detail, time.perf_counter() - start, stats)


# -- models --------------------------------------------------------------------------------------

def tiny_model(seed: int = 0, layer_types=("mamba2", "attention", "mamba2"), dtype=torch.float64,
               vocab_size: int = 97, device="cpu") -> HybridModel:
    """A random hybrid model built in code (no HF, no files): hidden size 32,
    a SwiGLU MLP after every mixer; `layer_types` from attention (GQA, half
    rotary), mamba2 and mamba1 (Jamba-style inner norms)."""
    config = HybridConfig(
        vocab_size=vocab_size, hidden_size=32, layer_types=tuple(layer_types), ffn_types=("mlp",) * len(layer_types),
        attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, partial_rotary_factor=0.5),
        mamba2=Mamba2Config(num_heads=4, head_dim=16, d_state=8, chunk_size=8),
        mamba1=Mamba1Config(d_inner=64, d_state=8, dt_rank=4), mlp=MLPConfig(48),
        max_position_embeddings=512, family="tiny")
    g = torch.Generator().manual_seed(seed)
    weights = {name: _random_weight(name, shape, g).to(device=device, dtype=dtype)
               for name, shape in _weight_shapes(config).items()}
    return HybridModel(config, weights)


def _weight_shapes(cfg: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Canonical weight names (as the adapters produce them) and shapes."""
    H, V, I = cfg.hidden_size, cfg.vocab_size, cfg.mlp.intermediate_size
    a, m2, m1 = cfg.attention, cfg.mamba2, cfg.mamba1
    mixers = {
        "attention": {"q_proj.weight": (a.num_heads * a.head_dim, H),
                      "k_proj.weight": (a.num_kv_heads * a.head_dim, H),
                      "v_proj.weight": (a.num_kv_heads * a.head_dim, H),
                      "o_proj.weight": (H, a.num_heads * a.head_dim)},
        "mamba2": {"in_proj.weight": (m2.d_inner + m2.conv_dim + m2.num_heads, H),  # gate, conv inputs, dt
                   "conv1d.weight": (m2.conv_dim, 1, m2.d_conv), "conv1d.bias": (m2.conv_dim,),
                   "dt_bias": (m2.num_heads,), "A_log": (m2.num_heads,), "D": (m2.num_heads,),
                   "norm.weight": (m2.d_inner,), "out_proj.weight": (H, m2.d_inner)},
        "mamba1": {"in_proj.weight": (2 * m1.d_inner, H), "conv1d.weight": (m1.d_inner, 1, m1.d_conv),
                   "conv1d.bias": (m1.d_inner,), "x_proj.weight": (m1.dt_rank + 2 * m1.d_state, m1.d_inner),
                   "dt_proj.weight": (m1.d_inner, m1.dt_rank), "dt_proj.bias": (m1.d_inner,),
                   "A_log": (m1.d_inner, m1.d_state), "D": (m1.d_inner,), "out_proj.weight": (H, m1.d_inner),
                   "dt_norm.weight": (m1.dt_rank,), "b_norm.weight": (m1.d_state,), "c_norm.weight": (m1.d_state,)},
    }
    shapes = {"embed_tokens.weight": (V, H), "final_norm.weight": (H,), "lm_head.weight": (V, H)}
    for i, kind in enumerate(cfg.layer_types):
        layer = {"input_norm.weight": (H,), "ffn_norm.weight": (H,), "ffn.gate_proj.weight": (I, H),
                 "ffn.up_proj.weight": (I, H), "ffn.down_proj.weight": (H, I)}
        layer.update({f"mixer.{name}": shape for name, shape in mixers[kind].items()})
        shapes.update({f"layers.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def _random_weight(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Non-trivial values: decays exp(A_log) in (e^-1, e), softplus(dt bias) steps
    in (0.13, 0.69), norms near 1, projections ~ N(0, 0.25 / fan_in)."""
    if name.endswith("A_log"):
        return torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1
    if name.endswith(("dt_bias", "dt_proj.bias")):
        return torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 2
    if "norm" in name:
        return 1 + 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)
    return torch.randn(shape, generator=g, dtype=torch.float64) * 0.5 / shape[-1] ** 0.5


def perturbed_copy(model: HybridModel, scale: float = 0.03, seed: int = 0) -> HybridModel:
    """A copy of `model` with every weight w replaced by w·(1 + scale·ε),
    ε ~ N(0, 1): a drafter that agrees with the target often, not always."""
    copy = deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():  # a tied weight is listed once
            p.mul_(1 + scale * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.device, p.dtype))
    return copy


def params_fingerprint(models) -> list[tuple[float, float]]:
    """(sum, sum of |w|) of every weight: equal before and after means untouched."""
    return [(p.double().sum().item(), p.double().abs().sum().item()) for m in models for p in m.parameters()]


# -- workloads -----------------------------------------------------------------------------------

def workload(vocab_size: int, seed: int = 0, max_new_tokens=(24, 13, 19),
             prompt_lens=(6, 3, 9, 5)) -> tuple[list[list[int]], list[SamplingParams]]:
    """A ragged greedy batch: one prompt per entry of `max_new_tokens` (lengths
    cycling through `prompt_lens`), each a repeated random motif so that prompt
    lookup finds matches; the limits end rounds at different points."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(len(max_new_tokens)):
        motif = torch.randint(3, vocab_size, (3,), generator=g).tolist()
        prompts.append((motif * 4)[:prompt_lens[i % len(prompt_lens)]])
    return prompts, [SamplingParams(max_new_tokens=m) for m in max_new_tokens]


def sampled_params(seed: int, max_new_tokens=(20, 14, 17, 11)) -> list[SamplingParams]:
    """Seeded sampled requests (temperature 0.8-1.0, with and without top-k,
    top-p, min-p) and one greedy request, mixed in one batch."""
    kinds = [dict(temperature=0.9), dict(temperature=1.0, top_k=20), dict(temperature=0.8, top_p=0.9, min_p=0.05),
             dict(temperature=0.0)]
    return [SamplingParams(max_new_tokens=m, seed=seed + i, **kinds[i % len(kinds)])
            for i, m in enumerate(max_new_tokens)]


def plain_outputs(target: HybridModel, prompts, params) -> list:
    """What plain decoding (`Engine(target)`) emits: the reference of every parity check."""
    return Engine(target).generate(prompts, params)


class ScriptedDrafter(NgramDrafter):
    """Proposes a known continuation (the target's own plain output) with
    scripted acceptance: each proposal is the next `a` true tokens and then one
    wrong token, `a` cycling through `schedule` (a >= γ: all true; a < 0: no
    proposal). Under greedy or coupled verification this fixes every round's
    acceptance length."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], schedule: list[int], vocab_size: int):
        super().__init__()
        self.known = [(list(p), list(o)) for p, o in zip(prompts, outputs)]
        self.schedule, self.vocab_size, self.calls = list(schedule), vocab_size, 0

    def lookup(self, context: list[int], gamma: int) -> list[int]:
        a = self.schedule[self.calls % len(self.schedule)]
        self.calls += 1
        for prompt, output in self.known:
            done = len(context) - len(prompt)
            if done >= 0 and context[:len(prompt)] == prompt and context[len(prompt):] == output[:done]:
                truth = output[done:done + gamma]
                if a < 0 or not truth:
                    return []
                wrong = [(truth[a] + 1) % self.vocab_size] if a < len(truth) else []
                return truth[:a] + wrong
        return []


# -- watching rounds -----------------------------------------------------------------------------

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
    if hasattr(engine.speculator.drafter, "cache"):
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
    """Watches the rounds of `engine`'s speculator inside a `with` block by
    wrapping its `propose`, `round` and `commit` methods on the instance
    (removed on exit; nothing else about the engine changes).

    It records, per round, (verify inputs, accepted) of every row the commit
    keeps live; checks the boundary invariant after every round (target and
    drafter) and, with `check_states`, every layer's state (`problems`). With
    `capture` it copies every sequence's state before each round; if a round
    raises, `reverted` lists what differs afterwards (None: nothing raised)."""

    def __init__(self, engine: Engine, check_states: bool = False, capture: bool = False):
        self.engine, self.spec = engine, engine.speculator
        self.check_states, self.capture = check_states, capture
        self.rounds, self.phase = 0, None  # phase: "draft" | "verify" | "commit" inside a round
        self.commits: list[list[tuple[int, int]]] = []
        self.problems: list[str] = []
        self.reverted: list[str] | None = None

    def __enter__(self) -> "RoundObserver":
        spec = self.spec
        self._propose, self._round, self._commit = spec.propose, spec.round, spec.commit
        spec.propose, spec.round, spec.commit = self.propose, self.round, self.commit
        return self

    def __exit__(self, *exc) -> None:
        for name in ("propose", "round", "commit"):
            delattr(self.spec, name)

    def propose(self, requests, rows):
        self.phase = "draft"
        drafts = self._propose(requests, rows)
        self.phase = "verify"
        return drafts

    def commit(self, requests, plans, inputs, start, accepted, live, input_log):
        self.phase = "commit"
        self.commits.append([(len(inputs[b]), accepted[b]) for b in live])
        return self._commit(requests, plans, inputs, start, accepted, live, input_log)

    def round(self, requests, rows):
        self.rounds += 1
        before = _sequence_states(self.engine, requests) if self.capture else None
        try:
            emitted = self._round(requests, rows)
        except BaseException:
            if before is not None:
                self.reverted = _differences(before, _sequence_states(self.engine, requests))
            raise
        finally:
            self.phase = None
        for r in requests:
            if not r.finished:
                self.problems += self._check(r)
        return emitted

    def _check(self, request) -> list[str]:
        committed = request.output.prompt_token_ids + request.output.token_ids
        s, drafter = request.seq_id, self.spec.drafter
        try:
            self.engine.cache.check_invariant(s, len(committed))
            if hasattr(drafter, "cache"):
                drafter.cache.check_invariant(s, drafter.cache.computed_len[s] + 1)
        except InvariantError as error:
            return [str(error)]
        problems = []
        if hasattr(drafter, "cache") and drafter.cache.computed_len[s] > len(committed) - 1:
            problems.append(f"drafter of sequence {s} absorbed {drafter.cache.computed_len[s]} tokens, past the "
                            f"boundary {len(committed) - 1}")
        elif self.check_states and hasattr(drafter, "cache"):
            problems += _state_problems(drafter.model, drafter.cache, s, committed[:drafter.cache.computed_len[s]],
                                        f"drafter of sequence {s}")
        if self.check_states:
            problems += _state_problems(self.engine.target, self.engine.cache, s, committed[:-1], f"sequence {s}")
        return problems

    def expected_restores(self, policy: CheckpointPolicy) -> tuple[int, int, int]:
        """(snapshot hits, log-replayed tokens, token-replayed tokens) that
        DESIGN.md's policy semantics imply for the rounds seen: snapshots after
        inputs 0, k, 2k, … and the last (k = 0: the last only); the ring keeps the
        latest `ring_slots - 1` of them (the head is pinned); any other boundary n
        is replayed from the nearest earlier one (or the head) in n - j steps."""
        if self.engine.cache.states is None:
            return 0, 0, 0

        def snapshots(num_inputs):
            every = range(0, num_inputs, policy.snapshot_every) if policy.snapshot_every else ()
            return sorted({num_inputs - 1, *every})

        keep = (policy.ring_slots or len(snapshots(self.spec.gamma + 1)) + 1) - 1
        hits = log = token = 0
        for num_inputs, n in chain.from_iterable(self.commits):
            kept = snapshots(num_inputs)[-keep:]
            if n in kept:
                hits += 1
                continue
            steps = n - max((j for j in kept if j <= n), default=-1)
            log, token = (log + steps, token) if policy.log_inputs else (log, token + steps)
        return hits, log, token


class InjectedFault(RuntimeError):
    """Raised on purpose inside a round by `install_fault`."""


@contextmanager
def install_fault(engine: Engine, observer: RoundObserver, site: str, fire_round: int):
    """Raise InjectedFault once, in round `fire_round` or later, at `site`:
    - "draft": the drafter's second forward of the round (its catch-up done),
      or a prompt-lookup drafter's lookup;
    - "verify": the target's last layer in the verify forward (the others wrote);
    - "replay": the target's last Mamba layer's log replay, or its last layer
      in a token replay;
    - "drafter commit": the drafter's commit of a second row (the target's
      rows already committed)."""
    spec, target, fired = engine.speculator, engine.target, []
    model_drafter = hasattr(spec.drafter, "model")

    def hook(obj, name: str, phase: str, skip: int = 0):
        original, calls = getattr(obj, name), []

        def hooked(*args, **kwargs):
            if observer.phase == phase and observer.rounds >= fire_round and not fired:
                calls.append(1)
                if len(calls) > skip:
                    fired.append(site)
                    raise InjectedFault(f"injected at {site!r} in round {observer.rounds}")
            return original(*args, **kwargs)
        setattr(obj, name, hooked)
        return obj, name

    hooks = []
    if site == "draft":
        hooks.append(hook(spec.drafter.model.layers[-1], "forward", "draft", skip=1) if model_drafter
                     else hook(spec.drafter, "lookup", "draft"))
    elif site == "verify":
        hooks.append(hook(target.layers[-1], "forward", "verify"))
    elif site == "replay":
        hooks.append(hook(target.layers[-1], "forward", "commit"))
        if target.config.mamba_layers:
            hooks.append(hook(target.layers[target.config.mamba_layers[-1]].mixer, "replay", "commit"))
    elif site == "drafter commit" and model_drafter:
        hooks.append(hook(spec.drafter, "commit", "commit", skip=1))
    else:
        raise ValueError(f"fault site {site!r} must be one of {FAULT_SITES} (drafter commit: a model drafter)")
    try:
        yield
    finally:
        for obj, name in hooks:
            delattr(obj, name)


# -- parity --------------------------------------------------------------------------------------

def speculative_parity(name: str, target: HybridModel, draft, gamma: int, policy, prompts, params, expected=None,
                       *, verify: str = "rejection", check_states: bool = False, all_accepted: bool = False,
                       block_size: int = 4) -> CheckResult:
    """Generate speculatively and compare with `expected` (plain outputs; None:
    no output comparison, e.g. sampled rejection). Always checks the restore
    counts against the policy and the boundary invariant after every round;
    with `check_states`, every layer's state against a from-scratch prefill."""
    def body():
        engine = Engine(target, draft=draft, num_draft_tokens=gamma, checkpoint=policy, verify=verify,
                        block_size=block_size)
        observer = RoundObserver(engine, check_states=check_states)
        try:
            with observer:
                outputs = engine.generate(prompts, params)
        finally:  # a wrong state found before a crash is its likely cause: report it first
            _require(not observer.problems, f"by round {observer.rounds}: " + "; ".join(observer.problems[:3]))
        if expected is not None:
            for i, (want, got) in enumerate(zip(expected, outputs)):
                _require(want.token_ids == got.token_ids and want.finish_reason == got.finish_reason,
                         f"request {i}: speculative {got.token_ids} ({got.finish_reason}) != plain "
                         f"{want.token_ids} ({want.finish_reason})")
        stats = engine.stats
        counted = (stats.snapshot_hits, stats.log_replayed_tokens, stats.token_replayed_tokens)
        if isinstance(policy, CheckpointPolicy):
            predicted = observer.expected_restores(policy)
            _require(counted == predicted, f"stats count (hits, log-replayed, token-replayed) = {counted}, the "
                                           f"policy implies {predicted} for the acceptance lengths seen")
        _require(stats.emitted_tokens == sum(len(o.token_ids) for o in outputs),
                 f"stats.emitted_tokens={stats.emitted_tokens} but {sum(len(o.token_ids) for o in outputs)} "
                 "tokens were generated")
        if all_accepted:
            _require(stats.acceptance_rate == 1.0, f"acceptance {stats.acceptance_rate:.3f}, expected 1.0")
        figures = dict(acceptance_rate=stats.acceptance_rate, rounds=stats.rounds, snapshot_hits=counted[0],
                       log_replayed_tokens=counted[1], token_replayed_tokens=counted[2],
                       peak_checkpoint_bytes=stats.peak_checkpoint_bytes)
        return (f"acceptance {stats.acceptance_rate:.2f}, {stats.rounds} rounds, hits {counted[0]}, "
                f"log {counted[1]}, token {counted[2]}, peak {stats.peak_checkpoint_bytes} B"), figures
    return _run_check(name, body)


def stop_inside_accepted_run(name: str, target: HybridModel, gamma: int, policy, prompts, params,
                             expected) -> CheckResult:
    """With the target as its own drafter (every draft accepted, γ+1 tokens a
    round), give each request a stop token that plain decoding first emits at
    draft d_1..d_{γ-1} of a full round (d_1 for γ = 1): the stop cuts the
    accepted run, so later accepted drafts (and the bonus) are dropped."""
    stops = []
    for out in expected:
        tokens = out.token_ids
        full = 1 + (gamma + 1) * ((len(tokens) - 1) // (gamma + 1))  # tokens from the prefill and full rounds
        at = [i for i in range(1, full)
              if (i - 1) % (gamma + 1) < max(gamma - 1, 1) and tokens[i] not in tokens[:i]]
        stops.append((tokens[at[len(at) // 2]],) if at else ())
    if not any(stops):
        return CheckResult(name, False, "no request emits a fresh token at a draft position", 0.0)
    stopped = [replace(p, stop_token_ids=s) for p, s in zip(params, stops)]
    want = plain_outputs(target, prompts, stopped)
    if not all(o.finish_reason == "stop" for o, s in zip(want, stops) if s):
        return CheckResult(name, False, "plain decoding did not stop at the chosen stop tokens", 0.0)
    result = speculative_parity(name, target, target, gamma, policy, prompts, stopped, want, check_states=True)
    if result.passed and gamma > 1 and not result.stats["acceptance_rate"] < 1.0:  # cut drafts are not counted
        result.passed, result.detail = False, "no stop token cut an accepted run: " + result.detail
    return result


def batch_invariance(name: str, target: HybridModel, prompts, params) -> CheckResult:
    """Plain sampled output of each request alone == in the batch == in the reversed batch."""
    def body():
        together = [o.token_ids for o in plain_outputs(target, prompts, params)]
        backwards = [o.token_ids for o in plain_outputs(target, prompts[::-1], params[::-1])][::-1]
        alone = [plain_outputs(target, [p], [q])[0].token_ids for p, q in zip(prompts, params)]
        for i, (a, b, c) in enumerate(zip(alone, together, backwards)):
            _require(a == b == c, f"request {i}: alone {a}, in the batch {b}, in the reversed batch {c}")
        return f"{len(prompts)} requests, {sum(map(len, alone))} tokens", {}
    return _run_check(name, body)


# -- bad input and failed rounds -----------------------------------------------------------------

class OutOfVocabDrafter(NgramDrafter):
    """Proposes one token id outside the vocabulary (a broken drafter)."""

    def __init__(self, bad_token: int):
        super().__init__()
        self.bad_token = bad_token

    def lookup(self, context: list[int], gamma: int) -> list[int]:
        return [self.bad_token]


def _expect_error(error_type, names: str, make) -> tuple[str, dict]:
    try:
        make()
    except error_type as error:
        _require(names in str(error), f"{error_type.__name__} does not name the bad value {names}: {error}")
        return f"{error_type.__name__}: {error}", {}
    raise CheckFailure(f"no {error_type.__name__} was raised")


def bad_input_checks(target: HybridModel, draft, prompts, params) -> list[CheckResult]:
    """Typed errors, raised before any state changes: a witness engine's caches
    (target and drafter) and every weight are the same before and after."""
    vocab = target.vocab_size
    witness = Engine(target, draft=draft, num_draft_tokens=2, block_size=4)
    witness.generate(prompts, params)
    models = [target] + ([draft] if isinstance(draft, HybridModel) else [])

    def unchanged(check):
        def body():
            before = (witness_bookkeeping(witness), params_fingerprint(models))
            detail, stats = check()
            _require((witness_bookkeeping(witness), params_fingerprint(models)) == before,
                     "a cache or a weight changed")
            return detail, stats
        return body

    other_vocab = tiny_model(1, ("mamba2",), dtype=target.dtype, vocab_size=vocab + 5, device=target.device)
    cases = {
        "draft vocabulary differs": lambda: _expect_error(
            ConfigError, str(vocab + 5), lambda: Engine(target, draft=other_vocab)),
        "num_draft_tokens=0": lambda: _expect_error(
            ConfigError, "0", lambda: Engine(target, draft=draft, num_draft_tokens=0)),
        f"num_draft_tokens={MAX_DRAFT_TOKENS + 1}": lambda: _expect_error(
            ConfigError, str(MAX_DRAFT_TOKENS + 1), lambda: Engine(target, draft=draft,
                                                                   num_draft_tokens=MAX_DRAFT_TOKENS + 1)),
        "snapshot_every=-1": lambda: _expect_error(ConfigError, "-1", lambda: CheckpointPolicy(snapshot_every=-1)),
        "ring_slots=1": lambda: _expect_error(ConfigError, "ring_slots=1", lambda: CheckpointPolicy(ring_slots=1)),
        "prompt token outside the vocabulary": lambda: _expect_error(
            InvalidRequestError, str(vocab), lambda: witness.generate([[3, vocab]], params[0])),
        "drafter token outside the vocabulary": lambda: _out_of_vocab_round(target, prompts, params),
    }
    return [_run_check(f"bad input · {case}", unchanged(check)) for case, check in cases.items()]


def witness_bookkeeping(engine: Engine) -> tuple:
    drafter = engine.speculator.drafter if engine.speculator else None
    return engine.cache.bookkeeping(), (drafter.cache.bookkeeping() if hasattr(drafter, "cache") else None)


def _out_of_vocab_round(target, prompts, params):
    bad = target.vocab_size + 5
    engine = Engine(target, draft=OutOfVocabDrafter(bad), num_draft_tokens=2, block_size=4)
    observer = RoundObserver(engine, capture=True)
    with observer:
        detail = _expect_error(InvalidRequestError, str(bad), lambda: engine.generate(prompts, params))
    _require(observer.reverted is not None, "the error was not raised inside a round")
    _require(not observer.reverted, "the failed round changed: " + "; ".join(observer.reverted[:3]))
    return detail


def failed_round(name: str, target: HybridModel, draft, gamma: int, policy, prompts, params, site: str,
                 fire_round: int = 2) -> CheckResult:
    """Make the round `fire_round` (or the first later one where `site` runs)
    raise at `site` (see FAULT_SITES) and compare every sequence, target and
    drafter, with its state before that round: bookkeeping, head states and
    K/V must be exactly equal."""
    def body():
        engine = Engine(target, draft=draft, num_draft_tokens=gamma, checkpoint=policy, block_size=4)
        observer = RoundObserver(engine, capture=True)
        with observer, install_fault(engine, observer, site, fire_round):
            try:
                engine.generate(prompts, params)
            except InjectedFault:
                pass
        _require(observer.reverted is not None, f"no round reached the {site!r} fault site")
        _require(not observer.reverted, f"round {observer.rounds} changed: " + "; ".join(observer.reverted[:3]))
        return f"round {observer.rounds} raised at {site!r}; every sequence unchanged", {}
    return _run_check(name, body)


# -- the whole suite -----------------------------------------------------------------------------

def run_suite(target: HybridModel, draft, draft_name: str = "draft", quick: bool = False,
              seed: int = 0) -> list[CheckResult]:
    """Every check above against `target`, with `draft` over every (γ, policy)
    and, under every policy, the target itself, prompt lookup and (unless
    `quick`) an unrelated pure-Mamba and pure-attention drafter."""
    dtype, device, vocab = target.dtype, target.device, target.vocab_size
    prompts, params = workload(vocab, seed, max_new_tokens=(12, 7, 10) if quick else (24, 13, 19))
    expected = plain_outputs(target, prompts, params)
    gammas = (1, 4) if quick else GAMMAS
    others = {"target itself": target} if isinstance(draft, NgramDrafter) else {"target itself": target,
                                                                               "n-gram": NgramDrafter()}
    if not quick:
        others["pure mamba"] = tiny_model(seed + 1, ("mamba2", "mamba2"), dtype=dtype, vocab_size=vocab, device=device)
        others["pure attention"] = tiny_model(seed + 2, ("attention", "attention"), dtype=dtype, vocab_size=vocab,
                                              device=device)
    results = []
    for gamma in gammas:
        for pname, policy in POLICIES.items():
            results.append(speculative_parity(f"greedy parity · {draft_name} · γ={gamma} · {pname}", target, draft,
                                              gamma, policy, prompts, params, expected, check_states=True))
    for i, (dname, other) in enumerate(others.items()):
        for j, (pname, policy) in enumerate(POLICIES.items()):
            gamma = gammas[(i + j) % len(gammas)]
            results.append(speculative_parity(f"greedy parity · {dname} · γ={gamma} · {pname}", target, other,
                                              gamma, policy, prompts, params, expected, check_states=True,
                                              all_accepted=other is target))
    for gamma, pname in ((2, "k=0"), (4, "log off"))[:1 if quick else 2]:
        results.append(stop_inside_accepted_run(f"stop inside accepted run · γ={gamma} · {pname}", target, gamma,
                                                POLICIES[pname], prompts, params, expected))
    sparams = sampled_params(seed + 100, (12, 7, 10, 9) if quick else (20, 14, 17, 11))
    sprompts = workload(vocab, seed + 1, max_new_tokens=[p.max_new_tokens for p in sparams])[0]
    sexpected = plain_outputs(target, sprompts, sparams)
    for gamma, pname in ((2, "k=1"), (4, "k=0"), (7, "log off"))[:2 if quick else 3]:
        results.append(speculative_parity(f"coupled parity · {draft_name} · γ={gamma} · {pname}", target, draft,
                                          gamma, POLICIES[pname], sprompts, sparams, sexpected, verify="coupled",
                                          check_states=True))
    results.append(batch_invariance("batch invariance · sampled plain decoding", target, sprompts, sparams))
    results += bad_input_checks(target, draft, prompts, params)
    model_draft = draft if isinstance(draft, HybridModel) else perturbed_copy(target, seed=seed)
    for site, pname in (("draft", "k=1"), ("verify", "k=2"), ("replay", "k=0"), ("replay", "log off"),
                        ("drafter commit", "k=1")):
        results.append(failed_round(f"failed round · {site} · {pname}", target, model_draft, 4, POLICIES[pname],
                                    prompts, params, site))
    return results
