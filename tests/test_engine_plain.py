"""Plain decoding through `Engine(target)`: bad input, stops, sampling
reproducibility, and page accounting."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hybridspec as hs
from hybridspec.errors import InvalidRequestError, NumericalError
from oracles import bamba


@pytest.fixture(scope="module")
def target():
    return hs.from_hf(bamba(seed=11, attn_layers=(1,), num_layers=2))


@pytest.fixture(scope="module")
def engine(target):
    return hs.Engine(target, max_batch_size=4, max_model_len=64, block_size=4)


@pytest.mark.parametrize("prompts,params,error", [
    ([[]], hs.SamplingParams(), InvalidRequestError),
    ([[5, 97]], hs.SamplingParams(), InvalidRequestError),
    ([[5, -1]], hs.SamplingParams(), InvalidRequestError),
    ([[5] * 60], hs.SamplingParams(max_new_tokens=5), InvalidRequestError),
    ([[5]] * 5, hs.SamplingParams(), InvalidRequestError),
    ([[5]], hs.SamplingParams(stop_token_ids=(1000,)), InvalidRequestError),
])
def test_bad_requests_raise_before_any_state_changes(engine, prompts, params, error):
    before = engine.cache.bookkeeping()
    with pytest.raises(error):
        engine.generate(prompts, params)
    assert engine.cache.bookkeeping() == before


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=math.nan), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(top_k=-1), dict(min_p=2.0), dict(max_new_tokens=-1),
                                    dict(seed=-3)])
def test_bad_sampling_params(kwargs):
    with pytest.raises(InvalidRequestError):
        hs.SamplingParams(**kwargs)


def test_nan_logits_raise_and_leave_caches_unchanged(target):
    engine = hs.Engine(target, max_batch_size=2, max_model_len=64, block_size=4)
    before = engine.cache.bookkeeping()
    saved = target.final_norm.weight.data.clone()
    target.final_norm.weight.data[0] = math.nan
    try:
        with pytest.raises(NumericalError):
            engine.generate([[3, 4, 5]], hs.SamplingParams(max_new_tokens=3))
    finally:
        target.final_norm.weight.data.copy_(saved)
    assert engine.cache.bookkeeping() == before


def test_finite_logits_whose_sum_overflows_pass_the_finite_check():
    from hybridspec.models.hybrid import check_finite
    huge = torch.full((2, 3, 4), 3e38, dtype=torch.float32)  # every value finite, their sum is not
    check_finite(huge, torch.tensor([3, 3]), last_only=False)
    check_finite(huge[:, :1], torch.tensor([1, 1]), last_only=True)
    huge[1, 2, 0] = math.inf
    with pytest.raises(NumericalError, match=r"batch rows \[1\]"):
        check_finite(huge, torch.tensor([3, 3]), last_only=False)
    check_finite(huge, torch.tensor([3, 2]), last_only=False)  # the inf sits in row 1's padding


def test_a_request_longer_than_the_whole_pool_is_refused_at_submission(target):
    engine = hs.Engine(target, max_batch_size=4, max_model_len=64, block_size=4, num_blocks=6)
    before = engine.cache.bookkeeping()
    with pytest.raises(InvalidRequestError, match=r"prompt 1: 20 prompt tokens \+ max_new_tokens=8 need 7 KV pages "
                                                  r"of 4 tokens but the whole pool holds 6"):
        engine.generate([[3] * 10, [4] * 20], hs.SamplingParams(max_new_tokens=8))
    assert engine.cache.bookkeeping() == before and not engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="whole pool holds 6"):
        engine.add_request([4] * 20, hs.SamplingParams(max_new_tokens=8))
    assert not engine.has_unfinished_requests()


def test_a_batch_larger_than_the_pool_waits_its_turn(target):
    """Two prompts of 5 pages each in a 6-page pool run one after the other."""
    prompts, params = [[3] * 10, [4] * 10], hs.SamplingParams(max_new_tokens=8)
    small = hs.Engine(target, max_batch_size=4, max_model_len=64, block_size=4, num_blocks=6)
    outs = small.generate(prompts, params)
    alone = [hs.Engine(target, max_model_len=64, block_size=4).generate([p], params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in outs] == alone
    assert small.cache.kv.num_free_blocks == 6 and small.cache.computed_len == {}


def test_stop_tokens_and_lengths_finish_independently(engine):
    greedy = engine.generate([[3, 4, 5], [6, 7]], hs.SamplingParams(max_new_tokens=8))
    stop = greedy[0].token_ids[2]
    outs = engine.generate([[3, 4, 5], [6, 7]], [hs.SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)),
                                                 hs.SamplingParams(max_new_tokens=5)])
    first = greedy[0].token_ids.index(stop)
    assert outs[0].token_ids == greedy[0].token_ids[:first + 1] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == greedy[1].token_ids[:5] and outs[1].finish_reason == "length"


def test_seeded_sampling_is_independent_of_batch_composition(engine):
    params = hs.SamplingParams(max_new_tokens=10, temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=1234)
    alone = engine.generate([[8, 9, 10]], params)[0].token_ids
    other = hs.SamplingParams(max_new_tokens=6, temperature=1.0, seed=7)
    together = engine.generate([[5, 6], [8, 9, 10], [11]], [other, params, other])[1].token_ids
    assert alone == together
    assert engine.generate([[8, 9, 10]], params)[0].token_ids == alone
    different = engine.generate([[8, 9, 10]], hs.SamplingParams(**{**params.__dict__, "seed": 99}))[0].token_ids
    assert different != alone


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 7)), min_size=1, max_size=3), st.integers(0, 2 ** 20))
def test_every_page_returns_to_the_pool(engine, shapes, seed):
    total = engine.cache.kv.num_free_blocks
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n, _ in shapes]
    params = [hs.SamplingParams(max_new_tokens=k, temperature=1.0, seed=seed, ignore_eos=True) for _, k in shapes]
    outs = engine.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [k for _, k in shapes]
    assert engine.cache.kv.num_free_blocks == total
    assert engine.cache.computed_len == {} and engine.cache.states.num_free_rings == engine.cache.max_seqs


def test_stream_receives_every_emitted_token_in_order(engine):
    chunks = {0: [], 1: []}
    outs = engine.generate([[3, 4, 5], [6, 7]], hs.SamplingParams(max_new_tokens=6),
                           stream=lambda i, tokens: chunks[i].extend(tokens))
    assert [chunks[0], chunks[1]] == [o.token_ids for o in outs]


@pytest.mark.parametrize("batch", [1, 2])
def test_narrower_state_dtype_tracks_the_full_precision_states(target, batch):
    """float32 state slots under a float64 model: every decode step still writes
    the state it computed (a step can compute straight into a slot only of its
    own dtype; otherwise it writes a cast copy), so the logits follow the
    float64 states' to float32 precision instead of drifting from stale states."""
    prompts = [[5, 9, 2, 7][: 3 + b] for b in range(batch)]
    tokens = [o.token_ids for o in hs.Engine(target, max_batch_size=2, max_model_len=32, block_size=4).generate(
        prompts, hs.SamplingParams(max_new_tokens=12, ignore_eos=True))]
    sizes = dict(max_batch_size=2, max_model_len=32, block_size=4)
    narrow, exact = hs.Engine(target, state_dtype=torch.float32, **sizes).cache, hs.Engine(target, **sizes).cache
    assert narrow.states.ssm_states[0].dtype == torch.float32
    ids = list(range(batch))
    target.prefill(narrow, ids, prompts, last_only=True), target.prefill(exact, ids, prompts, last_only=True)
    for step in zip(*tokens):
        logits, reference = target.decode(narrow, ids, list(step)), target.decode(exact, ids, list(step))
        assert torch.allclose(logits, reference, atol=1e-4, rtol=0), (logits - reference).abs().max()
