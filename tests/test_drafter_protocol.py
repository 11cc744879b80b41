"""A drafter written by a user against the `Drafter` protocol: with or without
probabilities, the round keeps its guarantees (greedy parity with plain
decoding, coupled parity with plain sampling), and a malformed proposal is a
typed error that leaves every sequence as it was. The protocol is all the
Engine asks: a drafter of no class of ours that answers it with a model,
cache and prefix store is run like a model drafter; one that lacks part of it
is refused. `Engine(draft=...)` takes what `LLM(draft=...)` takes."""

import pytest
import torch

import hybridspec as hs
from hybridspec.errors import ConfigError, InvalidRequestError
from hybridspec.rollback import perturbed_copy, witness_bookkeeping
from hybridspec.costs.round_costs import RoundCosts
from hybridspec.spec.gamma import GammaController
from oracles import bamba


class RepeatLast(hs.StatelessDrafter):
    """Proposes the last committed token again, with no probabilities (one-hot)."""

    def propose(self, requests, gammas, rows, coupled):
        return hs.Proposal([[r.last_token] * g for r, g in zip(requests, gammas)], None)


class UniformGuess(hs.StatelessDrafter):
    """Proposes (last token + i) mod vocab with a uniform q over the vocabulary."""

    def __init__(self, vocab: int, probs_shape=None):
        self.vocab, self.probs_shape = vocab, probs_shape

    def propose(self, requests, gammas, rows, coupled):
        tokens = [[(r.last_token + i + 1) % self.vocab for i in range(g)] for r, g in zip(requests, gammas)]
        shape = self.probs_shape or (len(requests), max(gammas), self.vocab)
        return hs.Proposal(tokens, torch.full(shape, 1.0 / self.vocab, dtype=torch.float64))


@pytest.fixture(scope="module")
def target():
    return hs.from_hf(bamba(seed=0))


PROMPTS = [[5, 6, 7, 5, 6], [9, 3], [4, 4, 4, 8, 2, 11]]


@pytest.mark.parametrize("make", [lambda v: RepeatLast(), lambda v: UniformGuess(v)], ids=["one-hot", "with q"])
def test_user_drafters_keep_greedy_and_coupled_parity(target, make):
    greedy = hs.SamplingParams(max_new_tokens=12, ignore_eos=True)
    sampled = hs.SamplingParams(max_new_tokens=12, temperature=0.9, seed=3, ignore_eos=True)
    plain = hs.Engine(target, max_batch_size=4)
    for params, verify in ((greedy, "rejection"), (sampled, "coupled")):
        spec = hs.Engine(target, draft=make(target.vocab_size), num_draft_tokens=3, verify=verify, max_batch_size=4)
        got = [o.token_ids for o in spec.generate(PROMPTS, params)]
        assert got == [o.token_ids for o in plain.generate(PROMPTS, params)]
        assert spec.stats.drafted_tokens > 0


def test_probabilities_of_the_wrong_shape_are_refused_before_any_change(target):
    engine = hs.Engine(target, draft=UniformGuess(target.vocab_size, probs_shape=(3, 3, 5)), num_draft_tokens=3,
                       max_batch_size=4)
    before = witness_bookkeeping(engine)
    with pytest.raises(InvalidRequestError, match=r"probabilities have shape \(3, 3, 5\)"):
        engine.generate(PROMPTS, hs.SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert witness_bookkeeping(engine) == before


class Forwarding:
    """No subclass of any hybridspec drafter: every call of the protocol goes to `inner`."""

    def __init__(self, inner):
        self.inner = inner
        self.model, self.cache, self.prefix = inner.model, inner.cache, inner.prefix

    def start(self, requests):
        self.inner.start(requests)

    def backlog(self, requests):
        return self.inner.backlog(requests)

    def propose(self, requests, gammas, rows, coupled):
        return self.inner.propose(requests, gammas, rows, coupled)

    def commit(self, seq_ids, boundaries):
        self.inner.commit(seq_ids, boundaries)

    def revert(self, seq_ids):
        self.inner.revert(seq_ids)

    def release(self, seq_ids):
        self.inner.release(seq_ids)

    def check_invariant(self, seq_id, boundary):
        self.inner.check_invariant(seq_id, boundary)


class MethodsOnly:
    """The protocol's methods but `backlog`, and none of `model`, `cache`, `prefix`."""

    def start(self, requests):
        pass

    def propose(self, requests, gammas, rows, coupled):
        return hs.Proposal([[] for _ in requests], None)

    def commit(self, seq_ids, boundaries):
        pass

    def revert(self, seq_ids):
        pass

    def release(self, seq_ids):
        pass

    def check_invariant(self, seq_id, boundary):
        pass


def test_a_drafter_is_run_by_what_it_answers_not_by_its_class(target):
    """A model drafter behind `Forwarding`: its cache is admitted and preempted
    with (too few pages for every row), its prefix store reclaimed from, its model
    measured for adaptive γ, its invariant checked after every commit; the
    output is plain greedy decoding's."""
    sizes = dict(max_batch_size=3, num_blocks=7, block_size=4, prefix_cache=True)
    params = hs.SamplingParams(max_new_tokens=10, ignore_eos=True)
    inner = hs.Engine(target, draft=perturbed_copy(target, 0.05, seed=2), num_draft_tokens="auto",
                      max_draft_tokens=3, **sizes).speculator.drafter
    engine = hs.Engine(target, draft=Forwarding(inner), num_draft_tokens="auto", max_draft_tokens=3, **sizes)
    engine.check_invariants = engine.speculator.check = True
    assert engine.scheduler.caches[1] is inner.cache
    measured = engine.gamma_controller.costs
    assert all(s > 0 for s in measured.draft_step_s)
    # the drafter is as large as the target, so no γ pays and "auto" would run plain steps only: its
    # steps priced at nothing and every forward alike (timed forwards, on a loaded machine, could still
    # price every draft out), the rounds draft and exercise the protocol
    flat = tuple((1e-3,) * len(measured.tokens) for _ in measured.batches)
    zeros = (0.0,) * len(measured.batches)
    engine.gamma_controller = GammaController(3, RoundCosts(measured.batches, measured.tokens, flat, zeros, zeros))
    got = [o.token_ids for o in engine.generate(PROMPTS + PROMPTS, params)]
    assert got == [o.token_ids for o in hs.Engine(target, **sizes).generate(PROMPTS + PROMPTS, params)]
    assert engine.stats.drafted_tokens > 0 and engine.stats.preemptions > 0
    assert inner.prefix.counts.prefix_evictions > 0  # its prefix store gave pages back when the scheduler needed room


def test_a_drafter_lacking_part_of_the_protocol_is_refused(target):
    with pytest.raises(ConfigError, match=r"\(MethodsOnly\) is not a drafter.*model, cache, prefix, start, backlog"):
        hs.Engine(target, draft=MethodsOnly())
    with pytest.raises(ConfigError, match=r"draft=42 \(int\) is not a drafter"):
        hs.Engine(target, draft=42)
    stateless = RepeatLast()
    assert (stateless.model, stateless.cache, stateless.prefix) == (None, None, None)
    assert stateless.backlog(["a", "b"]) == [0, 0]


def test_the_engine_takes_what_the_llm_takes(target, tmp_path):
    """"ngram" is prompt lookup; a directory is a draft model, loaded in the target's dtype."""
    params = hs.SamplingParams(max_new_tokens=10, ignore_eos=True)
    plain = [o.token_ids for o in hs.Engine(target, max_batch_size=4).generate(PROMPTS, params)]
    by_name = hs.Engine(target, draft="ngram", num_draft_tokens=3, max_batch_size=4)
    assert [o.token_ids for o in by_name.generate(PROMPTS, params)] == plain
    assert by_name.stats.drafted_tokens > 0
    bamba(seed=4).save_pretrained(tmp_path)
    from_dir = hs.Engine(target, draft=str(tmp_path), num_draft_tokens=3, max_batch_size=4)
    assert from_dir.speculator.drafter.model.dtype == target.dtype
    assert [o.token_ids for o in from_dir.generate(PROMPTS, params)] == plain
    assert from_dir.stats.drafted_tokens > 0
