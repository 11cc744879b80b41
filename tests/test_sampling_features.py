"""EOS, logprobs, n samples and penalties: the same under speculative and
plain decoding, and speculative sampling with penalties stays unbiased."""
import dataclasses
import itertools
import types

import pytest
import torch
from scipy import stats

import hybridspec as hs
from hybridspec.cache.hybrid_cache import scratch_cache
from hybridspec.errors import InvalidRequestError
from hybridspec.sampling.penalties import penalty_context
from hybridspec.rollback import perturbed_copy
from hybridspec.sampling.sampler import RowParams, process_logits
from oracles import bamba

PENALTIES = dict(repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.4)


@pytest.fixture(scope="module")
def target():
    return hs.from_hf(bamba(seed=3, attn_layers=(1,), num_layers=2))


@pytest.fixture(scope="module")
def engines(target):
    sizes = dict(max_batch_size=8, max_model_len=64)
    return hs.Engine(target, **sizes), hs.Engine(target, draft=perturbed_copy(target, 0.05, seed=1),
                                                 num_draft_tokens=3, **sizes)


def full_logits(target, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The target's logits over prompt + output from scratch: row j predicts output[j]. -> [len(output), vocab]"""
    cache = scratch_cache(target, max_seqs=1, ring_slots=2)
    logits = target.prefill(cache, [0], [prompt + output])[0]
    return logits[len(prompt) - 1:len(prompt) - 1 + len(output)]


def test_eos_stops_by_default_and_ignore_eos_runs_on(engines):
    plain, spec = engines
    free = plain.generate([[5, 6, 7]], hs.SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    eos = free[4]
    for engine in engines:
        engine.eos_token_ids = frozenset((eos,))
        try:
            out = engine.generate([[5, 6, 7]], hs.SamplingParams(max_new_tokens=12))[0]
            assert out.token_ids == free[:free.index(eos) + 1]
            assert out.finish_reason == "stop" and out.stop_reason is None
            assert engine.generate([[5, 6, 7]], hs.SamplingParams(max_new_tokens=12, ignore_eos=True))[0] \
                .token_ids == free
        finally:
            engine.eos_token_ids = frozenset()


def test_logprobs_match_plain_decoding_and_log_softmax(engines, target):
    plain, spec = engines
    params = hs.SamplingParams(max_new_tokens=10, logprobs=3, ignore_eos=True)
    prompt = [9, 4, 9, 4, 9]
    a, b = (e.generate([prompt], params)[0] for e in engines)
    assert a.token_ids == b.token_ids and spec.stats.drafted_tokens > 0
    direct = torch.log_softmax(full_logits(target, prompt, a.token_ids), dim=-1)  # [10, vocab]
    for j, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
        assert x.token_id == y.token_id == a.token_ids[j]
        assert x.logprob == pytest.approx(y.logprob, abs=1e-10)
        assert x.logprob == pytest.approx(direct[j, x.token_id].item(), abs=1e-10)
        assert [t for t, _ in x.top] == [t for t, _ in y.top] == direct[j].topk(3).indices.tolist()
        assert [v for _, v in y.top] == pytest.approx(direct[j].topk(3).values.tolist(), abs=1e-10)
    assert plain.generate([prompt], hs.SamplingParams(max_new_tokens=3))[0].logprobs is None


def test_logprobs_are_of_the_processed_distribution(engines):
    plain, spec = engines
    params = hs.SamplingParams(max_new_tokens=6, temperature=0.7, top_k=5, seed=4, logprobs=5, ignore_eos=True)
    a, b = (e.generate([[3, 8, 3, 8]], params)[0] for e in engines)
    for lp in a.logprobs:  # top-5 of a top-k=5 distribution: the whole support, mass 1
        assert sum(torch.tensor([v for _, v in lp.top]).exp()) == pytest.approx(1.0)
    coupled = hs.Engine(spec.target, draft=spec.speculator.drafter, verify="coupled", max_batch_size=4,
                        max_model_len=64)
    c = coupled.generate([[3, 8, 3, 8]], params)[0]
    assert c.token_ids == a.token_ids
    assert [x.logprob for x in c.logprobs] == pytest.approx([x.logprob for x in a.logprobs], abs=1e-10)
    assert len(b.logprobs) == len(b.token_ids)


def test_n_samples_are_distinct_and_reproducible(engines):
    plain, spec = engines
    params = hs.SamplingParams(max_new_tokens=8, temperature=1.0, seed=11, n=4, ignore_eos=True)
    for engine in engines:
        outs = engine.generate([[5, 6], [7]], params)
        assert [o.sample_index for o in outs] == [0, 1, 2, 3] * 2
        first = [tuple(o.token_ids) for o in outs[:4]]
        assert len(set(first)) == 4
        again = engine.generate([[5, 6], [7]], params)
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]
        alone = engine.generate([[5, 6]], hs.SamplingParams(max_new_tokens=8, temperature=1.0, seed=11,
                                                           ignore_eos=True))[0]
        assert tuple(alone.token_ids) == first[0]  # sample 0 keeps the request's seed
    nine = plain.generate([[5]], hs.SamplingParams(max_new_tokens=4, temperature=1.0, seed=3, n=9))
    assert [o.sample_index for o in nine] == list(range(9))  # more than max_batch_size=8: they queue
    with pytest.raises(InvalidRequestError, match="identical greedy"):
        hs.SamplingParams(n=2)


def test_a_sample_is_reproduced_alone_with_its_derived_seed(engines):
    """`hs.derived_seed(seed, i)` is the seed sample i of a request with n > 1
    samples with: the request with n=1 and that seed gives sample i's tokens."""
    params = hs.SamplingParams(max_new_tokens=8, temperature=1.0, seed=11, n=3, ignore_eos=True)
    for engine in engines:
        samples = engine.generate([[5, 6]], params)
        for i, sample in enumerate(samples):
            alone = engine.generate([[5, 6]], dataclasses.replace(params, n=1, seed=hs.derived_seed(11, i)))
            assert alone[0].token_ids == sample.token_ids
    assert hs.derived_seed(11, 0) == 11 and len({hs.derived_seed(11, i) for i in range(3)}) == 3


def test_penalised_greedy_and_coupled_outputs_match_plain(engines):
    plain, spec = engines
    coupled = hs.Engine(spec.target, draft=spec.speculator.drafter, num_draft_tokens=3, verify="coupled",
                        max_batch_size=4, max_model_len=64)
    prompts = [[9, 4, 9, 4, 9], [3, 3, 3]]
    for params in (hs.SamplingParams(max_new_tokens=16, ignore_eos=True, **PENALTIES),
                   hs.SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.9, seed=2, **PENALTIES)):
        want = [o.token_ids for o in plain.generate(prompts, params)]
        assert [o.token_ids for o in coupled.generate(prompts, params)] == want
        if params.is_greedy:
            assert [o.token_ids for o in spec.generate(prompts, params)] == want
    unpenalised = plain.generate(prompts, hs.SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in unpenalised] != want  # the penalties do change the output


def penalised_probs(target, prompt, outputs: list[list[int]], params) -> torch.Tensor:
    """p(next | prompt + output) under the penalties, for each output. -> [len(outputs), vocab]"""
    cache = scratch_cache(target, max_seqs=len(outputs), ring_slots=2)
    logits = target.prefill(cache, list(range(len(outputs))), [prompt + o for o in outputs], last_only=True)[:, 0]
    requests = [types.SimpleNamespace(params=params, output=types.SimpleNamespace(prompt_token_ids=prompt,
                                                                                  token_ids=o)) for o in outputs]
    rows = RowParams.of([params] * len(outputs), [0] * len(outputs), logits.device)
    return process_logits(logits, rows, penalty_context(requests, target.vocab_size, logits.device))


def test_penalties_keep_rejection_sampling_unbiased():
    """Tokens 2 and 3 of a request come from one speculative round (γ = 2) whose
    second draft and verify distribution see the first draft in their penalty
    context; their joint frequency over many seeds matches the exact penalised
    target distribution (chi-square), and differs from the unpenalised one."""
    vocab, prompt = 5, [1, 2, 1]
    target = hs.from_hf(bamba(seed=5, vocab=vocab, num_layers=2))
    draft = hs.from_hf(bamba(seed=6, vocab=vocab, num_layers=2))
    params = hs.SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True, **PENALTIES)
    engine = hs.Engine(target, draft=draft, num_draft_tokens=2, max_batch_size=40, max_model_len=16)
    counts = torch.zeros(vocab, vocab)
    for call in range(60):
        batch = [hs.SamplingParams(**{**params.__dict__, "seed": 1000 * call + i}) for i in range(40)]
        for out in engine.generate([prompt] * 40, batch):
            counts[out.token_ids[1], out.token_ids[2]] += 1
    assert engine.total_stats.drafted_tokens > 0 and engine.total_stats.acceptance_rate < 0.95

    def exact(p) -> torch.Tensor:  # P(t2, t3) = sum over t1 of P(t1) P(t2 | t1) P(t3 | t1, t2)
        first = penalised_probs(target, prompt, [[]], p)[0]
        second = penalised_probs(target, prompt, [[t] for t in range(vocab)], p)
        pairs = list(itertools.product(range(vocab), repeat=2))
        third = penalised_probs(target, prompt, [list(t) for t in pairs], p).view(vocab, vocab, vocab)
        return torch.einsum("a,ab,abc->bc", first, second, third)

    expected = exact(params).flatten() * counts.sum()
    keep = expected >= 5
    observed = counts.flatten()
    pvalue = stats.chisquare(observed[keep].numpy(), (expected[keep] / expected[keep].sum()
                                                       * observed[keep].sum()).numpy()).pvalue
    assert pvalue > 1e-3, pvalue
    plain = exact(hs.SamplingParams(max_new_tokens=4, temperature=1.0)).flatten() * counts.sum()
    assert (plain - expected).abs().sum() / counts.sum() / 2 > 0.05  # the penalties matter here


@pytest.mark.parametrize("kwargs,match", [
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(presence_penalty=float("inf")), "presence_penalty"),
    (dict(logprobs=-1), "logprobs"), (dict(n=0), "n=0"), (dict(stop=[""]), "stop"), (dict(stop=5), "stop"),
    (dict(ignore_eos=1), "ignore_eos")])
def test_bad_new_parameters(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        hs.SamplingParams(**kwargs)


def test_stop_strings_need_a_detokenizer(engines):
    plain, _ = engines
    with pytest.raises(InvalidRequestError, match="decode="):
        plain.generate([[5]], hs.SamplingParams(max_new_tokens=4, stop=["x"]))


def test_stats_are_per_call_and_total_accumulates(engines):
    _, spec = engines
    spec.total_stats.reset()
    params = hs.SamplingParams(max_new_tokens=5, ignore_eos=True)
    spec.generate([[1, 2]], params)
    first = spec.stats.emitted_tokens
    spec.generate([[1, 2], [3]], params)
    assert first == 5 and spec.stats.emitted_tokens == 10 and spec.total_stats.emitted_tokens == 15
    assert spec.total_stats.sequences == 3
