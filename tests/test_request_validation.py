"""Requests: token ids may be ints, numpy integers or 0-d integer tensors and a
prompt a list, tuple, 1-D numpy array or 1-D integer tensor; anything else, a
malformed SamplingParams or Engine size, is a typed error raised before any
state changes (fuzzed), and the engine then generates as before."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hybridspec as hs
from hybridspec.errors import ConfigError, InvalidRequestError
from hybridspec.rollback import tiny_model, witness_bookkeeping

VOCAB = 97
PARAMS = hs.SamplingParams(max_new_tokens=3)


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, ("mamba2", "attention"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def engine(target):
    return hs.Engine(target, max_batch_size=3, max_model_len=32, block_size=4)


@pytest.fixture(scope="module")
def expected(engine):
    return engine.generate([[1, 2, 3]], PARAMS)[0].token_ids


@pytest.mark.parametrize("prompt", [np.array([1, 2, 3]), np.array([1, 2, 3], dtype=np.int32), (1, 2, 3),
                                    torch.tensor([1, 2, 3]), [np.int64(1), torch.tensor(2), np.uint8(3)],
                                    list(torch.tensor([1, 2, 3]))])
def test_integer_ids_of_every_kind_are_token_ids(engine, expected, prompt):
    out = engine.generate([prompt], PARAMS)[0]
    assert out.token_ids == expected and out.prompt_token_ids == [1, 2, 3]
    assert all(type(t) is int for t in out.prompt_token_ids)


@pytest.mark.parametrize("prompts,fragment", [
    ([1, 2, 3], r"holds bare token ids where prompts are expected; pass a list of prompts, e\.g\. \[\[1, 2, 3\]\]"),
    ("hello", "prompts must be a list of prompts, got a str"),
    (np.array([[1, 2, 3]]), "prompts must be a list of prompts, got a ndarray"),
    ([], "prompts is empty"),
    (["hello"], "prompt 0 is a str"),
    ([[1, 2.0]], r"prompt 0 holds 2\.0 \(float\), not a token id"),
    ([[True, 2]], r"prompt 0 holds True \(bool\), not a token id"),
    ([[1, None]], "prompt 0 holds None"),
    ([np.array([[1, 2]])], "prompt 0 is a 2-D ndarray"),
    ([np.array([1.0, 2.0])], "prompt 0 is a 1-D ndarray of float64"),
    ([torch.tensor([1.0, 2.0])], "prompt 0 is a 1-D Tensor of torch.float32"),
    ([[1, 2], []], "prompt 1 is empty"),
    ([[1, VOCAB]], f"token id {VOCAB} outside the vocabulary"),
    ([[1, -1]], "token id -1 outside the vocabulary"),
    ([[1], [2], [3], "x"], "prompt 3 is a str"),
    ([list(range(1, 31))], "exceed the model limit max_model_len=32"),
])
def test_malformed_prompts(engine, prompts, fragment):
    with pytest.raises(InvalidRequestError, match=fragment):
        engine.generate(prompts, PARAMS)


@pytest.mark.parametrize("params,fragment", [
    ({"max_new_tokens": 3}, r"params must be a SamplingParams .* got a dict; build one with hs\.SamplingParams"),
    (3, "params must be a SamplingParams"),
    ([PARAMS, {"max_new_tokens": 3}], "params holds a dict"),
    ([PARAMS, PARAMS], "2 SamplingParams for 1 prompts"),
    (hs.SamplingParams(max_new_tokens=3, stop_token_ids=(VOCAB,)), f"stop token id {VOCAB} is outside the vocabulary"),
])
def test_malformed_params(engine, params, fragment):
    with pytest.raises(InvalidRequestError, match=fragment):
        engine.generate([[1, 2]], params)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(stop_token_ids="12"), "stop_token_ids='12' is not a collection of token ids"),
    (dict(stop_token_ids=12), "stop_token_ids=12 is not a collection"),
    (dict(stop_token_ids=(1.5,)), "stop_token_ids holds 1.5, not a token id"),
    (dict(stop_token_ids=(True,)), "stop_token_ids holds True"),
    (dict(max_new_tokens=True), "max_new_tokens=True must be an integer >= 0, not a bool"),
    (dict(max_new_tokens=2.0), "max_new_tokens=2.0 must be an integer"),
    (dict(max_new_tokens=-1), "max_new_tokens=-1 must be an integer >= 0"),
    (dict(temperature="0.7"), "temperature='0.7' must be a number"),
    (dict(temperature=float("inf")), "temperature=inf must be finite"),
    (dict(top_p=None), "top_p=None must be a number"),
    (dict(top_p=0.0), r"top_p=0\.0 must be in \(0, 1\]"),
    (dict(min_p=2), r"min_p=2\.0 must be in \[0, 1\]"),
    (dict(top_k=1.5), "top_k=1.5 must be an integer >= 0"),
    (dict(seed="1"), "seed='1' must be an integer"),
    (dict(seed=2 ** 63), r"seed=9223372036854775808 must be an integer in \[0, 2\*\*63\)"),
])
def test_sampling_params_are_checked_at_construction(kwargs, fragment):
    with pytest.raises(InvalidRequestError, match=fragment):
        hs.SamplingParams(**kwargs)


def test_sampling_params_normalise_numbers():
    p = hs.SamplingParams(max_new_tokens=np.int64(4), temperature=1, seed=np.int32(5),
                          stop_token_ids=np.array([2, 3]))
    assert (p.max_new_tokens, p.temperature, p.seed, p.stop_token_ids) == (4, 1.0, 5, (2, 3))
    assert type(p.max_new_tokens) is int and type(p.temperature) is float and type(p.stop_token_ids[0]) is int


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(block_size=0), "block_size=0 must be an integer >= 1"),
    (dict(block_size=2.5), "block_size=2.5 must be an integer"),
    (dict(num_blocks=0), "num_blocks=0 must be an integer >= 1"),
    (dict(max_model_len=0), r"max_model_len=0 must be an integer >= 1 \(the model allows up to 512\)"),
    (dict(max_model_len=-5), "max_model_len=-5 must be an integer >= 1"),
    (dict(max_model_len=513), "max_model_len=513 exceeds the model's limit max_position_embeddings=512"),
    (dict(max_batch_size=0), "max_batch_size=0 must be an integer >= 1"),
    (dict(max_batch_size=True), "max_batch_size=True must be an integer >= 1, not a bool"),
])
def test_engine_sizes_are_checked(target, kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        hs.Engine(target, **kwargs)


def test_engine_sizes_default_to_the_model_limit(target):
    engine = hs.Engine(target, max_batch_size=2, block_size=8)
    assert engine.max_model_len == 512 and engine.cache_kwargs["num_blocks"] == 2 * 64


# -- fuzz: malformed requests leave the engine as it was --------------------------------------------------------

BAD_TOKENS = st.one_of(st.integers(max_value=-1), st.integers(min_value=VOCAB), st.floats(), st.booleans(),
                       st.none(), st.text(max_size=3), st.just(np.float32(1.0)), st.just(torch.tensor([1])),
                       st.just(torch.tensor(1.0)), st.lists(st.integers(0, 5), max_size=2))
GOOD_TOKENS = st.one_of(st.integers(0, VOCAB - 1), st.integers(0, VOCAB - 1).map(np.int64),
                        st.integers(0, VOCAB - 1).map(torch.tensor))


@st.composite
def malformed_requests(draw):
    """(prompts, params) with at least one thing wrong."""
    prompt = draw(st.lists(GOOD_TOKENS, min_size=1, max_size=5))
    kind = draw(st.sampled_from(["bad token", "bad prompt", "bad prompts", "bad params"]))
    if kind == "bad token":
        prompt.insert(draw(st.integers(0, len(prompt))), draw(BAD_TOKENS))
    elif kind == "bad prompt":
        prompt = draw(st.one_of(st.just([]), st.text(max_size=4), st.integers(0, 5), st.floats(),
                                st.just(np.zeros((2, 2), dtype=np.int64)), st.just(np.ones(3)),
                                st.just(torch.ones(2, dtype=torch.bool)), st.just({"ids": [1]})))
    if kind == "bad prompts":
        prompts = draw(st.one_of(st.just([]), st.just([1, 2]), st.text(max_size=3), st.just(np.ones((1, 3), int)),
                                 st.just([[1], [2], "x"])))
    else:
        prompts = [prompt]
    params = PARAMS
    if kind == "bad params":
        params = draw(st.one_of(st.just({"max_new_tokens": 2}), st.integers(), st.text(max_size=3),
                                st.just([PARAMS, PARAMS]), st.just([None])))
    return prompts, params


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=malformed_requests())
def test_malformed_requests_change_nothing(engine, expected, request):
    before = witness_bookkeeping(engine)
    with pytest.raises(InvalidRequestError):
        engine.generate(*request)
    assert witness_bookkeeping(engine) == before


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 200), st.floats(allow_nan=True), st.text(max_size=3),
                   st.lists(st.integers(-2, 120), max_size=3), st.just("12"), st.just((1.5,)))
FIELDS = ["max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop_token_ids"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kwargs=st.dictionaries(st.sampled_from(FIELDS), VALUES, min_size=1, max_size=3))
def test_random_sampling_params_are_refused_or_run(engine, kwargs):
    """Any mix of values: a typed error at construction or at generate, or a
    generation as long as asked for; the engine is unchanged in both cases."""
    before = witness_bookkeeping(engine)
    try:
        params = hs.SamplingParams(**kwargs)
        out = engine.generate([[1, 2, 3]], params)[0]
    except InvalidRequestError:
        assert witness_bookkeeping(engine) == before
        return
    # max_new_tokens=0 is a scoring request (prompt log-probs alone): no token, finish "length"
    assert min(1, params.max_new_tokens) <= len(out.token_ids) <= params.max_new_tokens
    assert out.finish_reason in ("stop", "length")
    assert witness_bookkeeping(engine) == before


def test_engine_generates_as_before_after_refusals(engine, expected):
    for bad in ([1, 2], [["x"]], [[VOCAB]]):
        with pytest.raises(InvalidRequestError):
            engine.generate(bad, PARAMS)
    assert engine.generate([[1, 2, 3]], PARAMS)[0].token_ids == expected
