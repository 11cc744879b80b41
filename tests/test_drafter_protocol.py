"""A drafter written by a user against the `Drafter` protocol: with or without
probabilities, the round keeps its guarantees (greedy parity with plain
decoding, coupled parity with plain sampling), and a malformed proposal is a
typed error that leaves every sequence as it was."""
import pytest
import torch

import hybridspec as hs
from hybridspec.errors import InvalidRequestError
from hybridspec.rollback import witness_bookkeeping
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
