"""Bad input raises a typed error (hybridspec.errors) before any state
changes; a round that raises anywhere — drafting, verifying, replaying,
committing the drafter — leaves every sequence exactly as it was before the
round: cache bookkeeping, head states and K/V of the target and the drafter."""
import pytest

import hybridspec as hs
from hybridspec.errors import ConfigError, InvalidRequestError
from hybridspec.rollback import (FAULT_SITES, POLICIES, OutOfVocabDrafter, RoundObserver, bad_input_checks,
                                       failed_round, perturbed_copy, tiny_model, witness_bookkeeping, workload)
from oracles import bamba


@pytest.fixture(scope="module")
def target():
    return hs.from_hf(bamba(seed=0))


@pytest.fixture(scope="module")
def draft(target):
    return perturbed_copy(target, seed=1)


@pytest.fixture(scope="module")
def batch(target):
    return workload(target.vocab_size, seed=2, max_new_tokens=(14, 9, 12))


@pytest.mark.parametrize("drafter", ["model", "n-gram"])
def test_bad_input_checks(target, draft, batch, drafter):
    results = bad_input_checks(target, draft if drafter == "model" else hs.NgramDrafter(), *batch)
    assert len(results) == 7
    for r in results:
        assert r.passed, f"{r.name}: {r.detail}"


def test_draft_vocabulary_differs(target):
    other = hs.from_hf(bamba(seed=1, vocab=101))
    with pytest.raises(ConfigError, match="101"):
        hs.Engine(target, draft=other)


@pytest.mark.parametrize("gamma", [0, -1, 33, 100])
def test_num_draft_tokens_out_of_range(target, gamma):
    with pytest.raises(ConfigError, match=f"num_draft_tokens={gamma}"):
        hs.Engine(target, draft=hs.NgramDrafter(), num_draft_tokens=gamma)


@pytest.mark.parametrize("kwargs", [dict(snapshot_every=-1), dict(ring_slots=1), dict(ring_slots=0)])
def test_invalid_policy(kwargs):
    with pytest.raises(ConfigError):
        hs.CheckpointPolicy(**kwargs)


@pytest.mark.parametrize("bad_token", [-1, 97, 102])
def test_drafter_token_outside_vocabulary_changes_nothing(target, batch, bad_token):
    engine = hs.Engine(target, draft=OutOfVocabDrafter(bad_token), num_draft_tokens=3, block_size=4)
    observer = RoundObserver(engine, capture=True)
    with observer, pytest.raises(InvalidRequestError, match=str(bad_token)):
        engine.generate(*batch)
    assert observer.reverted == [], observer.reverted
    assert engine.cache.bookkeeping()["computed_len"] == {}  # generate returned every sequence's pages and slots


def test_prompt_token_outside_vocabulary_changes_nothing(target, draft, batch):
    engine = hs.Engine(target, draft=draft, num_draft_tokens=3, block_size=4)
    engine.generate(*batch)
    before = witness_bookkeeping(engine)
    with pytest.raises(InvalidRequestError, match="97"):
        engine.generate([[5, 6], [4, 97]], batch[1][:2])
    assert witness_bookkeeping(engine) == before


@pytest.mark.parametrize("site,policy", [(s, p) for s in FAULT_SITES for p in ("k=1", "k=0", "log off")
                                         if (s, p) != ("replay", "k=1")])  # k=1 never replays
def test_round_that_raises_leaves_every_sequence_unchanged(target, draft, batch, site, policy):
    result = failed_round(f"{site} {policy}", target, draft, 4, POLICIES[policy], *batch, site=site)
    assert result.passed, result.detail


@pytest.mark.parametrize("layer_types", [("mamba2", "mamba2"), ("attention", "attention"), ("mamba1", "attention")])
def test_round_that_raises_with_pure_mamba_or_attention(layer_types, batch):
    """Targets without attention or without Mamba layers, and a Mamba1 target, revert too."""
    target = tiny_model(5, layer_types)
    for site in ("verify", "drafter commit"):
        result = failed_round(site, target, perturbed_copy(target), 3, POLICIES["k=0"], *batch, site=site)
        assert result.passed, result.detail


@pytest.mark.parametrize("site,policy", [("draft", "k=1"), ("verify", "k=2"), ("replay", "k=0"),
                                         ("replay", "log off"), ("drafter commit", "k=1")])
def test_round_that_raises_where_the_whole_forward_is_one_native_call(site, policy):
    """The embedded pair in float32 runs each forward as one C call, so no layer's
    forward is called: the fault comes after the model call that did the work,
    and the round still leaves every sequence unchanged."""
    from hybridspec.kernels.cpu import native as cpu_native
    if not cpu_native.available():
        pytest.skip("native CPU kernels not built here")
    from hybridspec.adapters.embedded import embedded_paths
    target, draft = (hs.load(path) for path in embedded_paths())
    batch = workload(target.vocab_size, seed=2, max_new_tokens=(12, 7, 10))
    result = failed_round(f"{site} {policy}", target, draft, 4, POLICIES[policy], *batch, site=site)
    assert result.passed, result.detail


def test_engine_works_after_a_failed_round(target, draft, batch):
    """The failed round's engine generates the plain output afterwards."""
    engine = hs.Engine(target, draft=draft, num_draft_tokens=4, block_size=4)
    layer = target.layers[-1]
    calls = []

    def fail_second_verify(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # prefill, round 1, round 2
            raise RuntimeError("injected")
        return type(layer).forward(layer, *args, **kwargs)

    layer.forward = fail_second_verify
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.generate(*batch)
    finally:
        del layer.forward
    assert engine.cache.bookkeeping()["computed_len"] == {}
    expected = [o.token_ids for o in hs.Engine(target).generate(*batch)]
    assert [o.token_ids for o in engine.generate(*batch)] == expected
