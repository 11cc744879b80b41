"""The rollback-correctness suite as a library (docs/design.md "How correctness is
proven"), run by `tests/test_spec_*.py` and by `hybridspec check`.

Each check takes a target `HybridModel` (and a drafter) and returns a
`CheckResult` (name, passed, detail, seconds, stats):
- parity: speculative output == plain `Engine(target)` output token for token
  (greedy, or sampled with `verify="coupled"`), and the restores counted in
  `engine.stats` are exactly those the checkpoint policy implies for the
  acceptance lengths the rounds saw (snapshot hit / log replay / token replay);
  with `force`, rejections are forced (`forcing`) so that the rounds reach
  the restore paths whatever the drafter's acceptance, and a case whose
  rounds rejected nothing fails;
- state parity (`check_states=True`): after every round, every layer's head
  state (SSM state, conv window) and K/V up to `computed_len` equal a
  from-scratch prefill of the committed tokens minus the pending one; a model
  drafter likewise at its own computed length;
- batch invariance: a request's sampled output is the same alone or in a batch;
- bad input: a typed error naming the bad value, and nothing changed;
- failed round: a round that raises while drafting, verifying, replaying or
  committing the drafter leaves every sequence exactly as it was before it.

`run_suite(tree=TreeShape(...))` is the suite's tree mode (`hybridspec check
--tree 2,1`): greedy and coupled parity with state parity under two policies
for the drafter and suffix decoding, the batch invariance of rows beside
other rows' trees, and failed tree rounds (`rollback.tree_checks`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable


from hybridspec.engine.engine import Engine
from hybridspec.errors import ConfigError, InvalidRequestError
from hybridspec.models.hybrid import HybridModel
from hybridspec.spec.drafters import NgramDrafter
from hybridspec.checkpoints.policy import MAX_DRAFT_TOKENS, CheckpointPolicy
from hybridspec.rollback.forcing import force_rejections
from hybridspec.rollback.models import (OutOfVocabDrafter, params_fingerprint, perturbed_copy,
                                        plain_outputs, sampled_params,
                     tiny_model, workload)
from hybridspec.rollback.observer import InjectedFault, RoundObserver, install_fault, restore_path, witness_bookkeeping
from hybridspec.spec.tree import TreeShape


POLICIES = {
    "k=1": CheckpointPolicy(snapshot_every=1),
    "k=2": CheckpointPolicy(snapshot_every=2),
    "k=0": CheckpointPolicy(snapshot_every=0),
    "ring too small": CheckpointPolicy(snapshot_every=1, ring_slots=2),
    "log off": CheckpointPolicy(snapshot_every=1, ring_slots=3, log_inputs=False),
}
GAMMAS = (1, 2, 4, 7)


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


def speculative_parity(name: str, target: HybridModel, draft, gamma: int, policy, prompts, params, expected=None,
                       *, verify: str = "rejection", check_states: bool = False, all_accepted: bool = False,
                       block_size: int = 4, force: tuple[int, ...] | None = None,
                       tree: TreeShape | None = None) -> CheckResult:
    """Generate speculatively and compare with `expected` (plain outputs; None:
    no output comparison, e.g. sampled rejection). Always checks the restore
    counts against the policy and the boundary invariant after every round;
    with `check_states`, every layer's state against a from-scratch prefill.
    `force` (needs `expected`): the acceptance lengths to force on greedy rows,
    round after round (`ForcedRejections`); every round must accept exactly
    what the forcing predicts, some round must reject a draft of a row it then
    restores, and (under a CheckpointPolicy) the path the policy takes after a
    rejection of d_1 of γ drafts (its site: a hit, a log or a token replay)
    must have been counted. `tree`: the Engine's `tree=` (its tree rounds pass the
    forcing through unforced and restore their accepted paths as the policy says,
    `tree_restore_path`); some round must then have been a tree round."""
    if force is not None and expected is None:
        raise ValueError("force needs `expected`, the plain outputs the forcing learns the target's tokens from")

    def body():
        engine = Engine(target, draft=draft, num_draft_tokens=gamma, checkpoint=policy, verify=verify,
                        block_size=block_size, tree=tree)
        observer = RoundObserver(engine, check_states=check_states)
        forcing = None if force is None else force_rejections(engine, prompts, [o.token_ids for o in expected],
                                                              force)
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
        if tree is not None:
            _require(observer.tree_rounds > 0, f"no round drafted a tree ({stats.rounds} rounds)")
        if all_accepted:
            _require(stats.acceptance_rate == 1.0, f"acceptance {stats.acceptance_rate:.3f}, expected 1.0")
        figures = dict(acceptance_rate=stats.acceptance_rate, rounds=stats.rounds, snapshot_hits=counted[0],
                       log_replayed_tokens=counted[1], token_replayed_tokens=counted[2],
                       peak_checkpoint_bytes=stats.peak_checkpoint_bytes, tree_rounds=observer.tree_rounds)
        detail = (f"acceptance {stats.acceptance_rate:.2f}, {stats.rounds} rounds"
                  + (f" ({observer.tree_rounds} trees)" if tree is not None else "") + f", hits {counted[0]}, "
                  f"log {counted[1]}, token {counted[2]}, peak {stats.peak_checkpoint_bytes} B")
        if forcing is not None:
            _require(not forcing.broken, "a forced rejection missed: " + "; ".join(forcing.broken[:3]))
            restored = sorted({r.accepted for r in forcing.rejections if r.live})
            _require(restored, f"no round rejected a draft of a row it then restored ({detail})")
            if isinstance(policy, CheckpointPolicy) and engine.cache.states is not None:
                site, _ = restore_path(policy, gamma, gamma + 1, 0)
                _require(counted[("hit", "log", "token").index(site)] > 0,
                         f"no restore took the policy's path after a rejection of d_1 ({site}): {detail}")
            figures["rejections"] = len(forcing.rejections)
            if forcing.own_acceptance is not None:
                figures["drafter_acceptance"] = forcing.own_acceptance
            detail += f", rejected after n ∈ {{{', '.join(map(str, restored))}}}"
        return detail, figures
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


def _expect_error(error_type, names: str, make) -> tuple[str, dict]:
    try:
        make()
    except error_type as error:
        _require(names in str(error), f"{error_type.__name__} does not name the bad value {names}: {error}")
        return f"{error_type.__name__}: {error}", {}
    raise CheckFailure(f"no {error_type.__name__} was raised")


def _draft_models(target: HybridModel, draft) -> list[HybridModel]:
    """The model an Engine's drafter runs for `draft` (an `Engine(draft=...)`
    argument), as a list: empty for a model-free drafter."""
    drafter = Engine(target, draft=draft, num_draft_tokens=1, max_batch_size=1, max_model_len=8,
                     block_size=4).speculator.drafter
    return [] if drafter.model is None else [drafter.model]


def bad_input_checks(target: HybridModel, draft, prompts, params) -> list[CheckResult]:
    """Typed errors, raised before any state changes: a witness engine's caches
    (target and drafter) and every weight are the same before and after."""
    vocab = target.vocab_size
    witness = Engine(target, draft=draft, num_draft_tokens=2, block_size=4)
    witness.generate(prompts, params)
    draft_model = witness.speculator.drafter.model
    models = [target] + ([] if draft_model is None else [draft_model])

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
                 fire_round: int = 2, expected=None, tree: TreeShape | None = None) -> CheckResult:
    """Make the round `fire_round` (or the first later one where `site` runs)
    raise at `site` (see FAULT_SITES) and compare every sequence, target and
    drafter, with its state before that round: bookkeeping, head states and
    K/V must be exactly equal. Every greedy row's d_1 is rejected (forced,
    `ForcedRejections`; `expected`: the plain outputs, computed when None), so
    every round restores a boundary short of its last input and every row
    lives one token a round: the replay and drafter-commit sites are reached
    whatever the drafter's acceptance. `tree`: the Engine's `tree=` (tree rounds are
    not forced: they fail wherever the site is)."""
    def body():
        known = [o.token_ids for o in (expected or plain_outputs(target, prompts, params))]
        engine = Engine(target, draft=draft, num_draft_tokens=gamma, checkpoint=policy, block_size=4, tree=tree)
        observer = RoundObserver(engine, capture=True)
        with observer, install_fault(engine, observer, site, fire_round):
            forcing = force_rejections(engine, prompts, known, (0,))  # after the fault's hooks: they see the drafter
            try:
                engine.generate(prompts, params)
            except InjectedFault:
                pass
        stats = engine.stats
        _require(observer.reverted is not None,
                 f"no round reached the {site!r} fault site: {observer.rounds} rounds, "
                 f"{len(forcing.rejections)} forced rejections, restores (hits, log-replayed, token-replayed) = "
                 f"({stats.snapshot_hits}, {stats.log_replayed_tokens}, {stats.token_replayed_tokens})"
                 + ("; " + "; ".join(forcing.broken[:2]) if forcing.broken else ""))
        _require(not observer.reverted, f"round {observer.rounds} changed: " + "; ".join(observer.reverted[:3]))
        return f"round {observer.rounds} raised at {site!r}; every sequence unchanged", {}
    return _run_check(name, body)


# -- the whole suite -----------------------------------------------------------------------------

def run_suite(target: HybridModel, draft, draft_name: str = "draft", quick: bool = False,
              seed: int = 0, progress: Callable[[CheckResult], None] | None = None,
              tree: TreeShape | None = None) -> list[CheckResult]:
    """Every check above against `target`, with `draft` over every (γ, policy)
    and, under every policy, the target itself, prompt lookup and (unless
    `quick`) an unrelated pure-Mamba and pure-attention drafter. The greedy
    cases force rejections after n = 0, 1, …, γ - 1 accepted drafts and none,
    round after round, and the failed rounds a rejection of d_1 every round
    (`forcing`): every restore path and fault site is reached whatever the
    drafters' acceptance. `progress`, when given, is called with each result
    as soon as its check ends. With `tree`, the suite's tree mode instead (`tree_suite`)."""
    if tree is not None:
        from hybridspec.rollback.tree_checks import tree_suite  # it builds on this module's checks
        return tree_suite(target, draft, draft_name, tree, quick, seed, progress or (lambda result: None))
    dtype, device, vocab = target.dtype, target.device, target.vocab_size
    prompts, params = workload(vocab, seed, max_new_tokens=(12, 7, 10) if quick else (24, 13, 19))
    expected = plain_outputs(target, prompts, params)
    gammas = (1, 4) if quick else GAMMAS
    draft_models = _draft_models(target, draft)
    others = {"target itself": target}
    if draft_models:  # a model-free drafter under test already covers what prompt lookup would
        others["n-gram"] = NgramDrafter()
    if not quick:
        others["pure mamba"] = tiny_model(seed + 1, ("mamba2", "mamba2"), dtype=dtype, vocab_size=vocab, device=device)
        others["pure attention"] = tiny_model(seed + 2, ("attention", "attention"), dtype=dtype, vocab_size=vocab,
                                              device=device)
    results = []

    def add(*done: CheckResult) -> None:
        for result in done:
            results.append(result)
            if progress is not None:
                progress(result)

    for gamma in gammas:
        for pname, policy in POLICIES.items():
            add(speculative_parity(f"greedy parity · {draft_name} · γ={gamma} · {pname}", target, draft,
                                   gamma, policy, prompts, params, expected, check_states=True,
                                   force=tuple(range(gamma + 1))))
    for i, (dname, other) in enumerate(others.items()):
        for j, (pname, policy) in enumerate(POLICIES.items()):
            gamma = gammas[(i + j) % len(gammas)]
            add(speculative_parity(f"greedy parity · {dname} · γ={gamma} · {pname}", target, other,
                                   gamma, policy, prompts, params, expected, check_states=True,
                                   force=tuple(range(gamma + 1))))
    for gamma, pname in ((2, "k=0"), (4, "log off"))[:1 if quick else 2]:
        add(stop_inside_accepted_run(f"stop inside accepted run · γ={gamma} · {pname}", target, gamma,
                                     POLICIES[pname], prompts, params, expected))
    sparams = sampled_params(seed + 100, (12, 7, 10, 9) if quick else (20, 14, 17, 11))
    sprompts = workload(vocab, seed + 1, max_new_tokens=[p.max_new_tokens for p in sparams])[0]
    sexpected = plain_outputs(target, sprompts, sparams)
    for gamma, pname in ((2, "k=1"), (4, "k=0"), (7, "log off"))[:2 if quick else 3]:
        add(speculative_parity(f"coupled parity · {draft_name} · γ={gamma} · {pname}", target, draft,
                               gamma, POLICIES[pname], sprompts, sparams, sexpected, verify="coupled",
                               check_states=True))
    add(batch_invariance("batch invariance · sampled plain decoding", target, sprompts, sparams))
    add(*bad_input_checks(target, draft, prompts, params))
    model_draft = draft_models[0] if draft_models else perturbed_copy(target, seed=seed)
    for site, pname in (("draft", "k=1"), ("verify", "k=2"), ("replay", "k=0"), ("replay", "log off"),
                        ("drafter commit", "k=1")):
        add(failed_round(f"failed round · {site} · {pname}", target, model_draft, 4, POLICIES[pname],
                         prompts, params, site, expected=expected))
    return results

