"""Coupled parity: with `verify="coupled"` the sampled speculative output
equals plain sampled output with the same seeds (temperature 0.8-1.0, with
and without top-k / top-p / min-p, a greedy row mixed in), whatever the
drafter, γ or checkpoint policy; and plain sampled output of a request does
not depend on the batch it runs in."""
from dataclasses import replace

import pytest

import hybridspec as hs
from hybridspec.rollback import (POLICIES, batch_invariance, perturbed_copy, plain_outputs, sampled_params,
                                       speculative_parity, workload)
from oracles import bamba, falcon_h1, jamba, nemotron_h, nemotron_h_moe, zamba2

CASES = [  # (seed, drafter, γ, policy)
    (11, "perturbed copy", 1, "k=1"),
    (12, "perturbed copy", 4, "k=0"),
    (13, "perturbed copy", 7, "log off"),
    (14, "target itself", 4, "ring too small"),
    (15, "unrelated", 2, "k=2"),
    (16, "n-gram", 4, "k=1"),
]


@pytest.fixture(scope="module")
def bamba_models():
    target = hs.from_hf(bamba(seed=0))
    return target, {"perturbed copy": perturbed_copy(target, seed=2), "target itself": target,
                    "unrelated": hs.from_hf(bamba(seed=9)), "n-gram": hs.NgramDrafter()}


def sampled_batch(vocab, seed):
    params = sampled_params(seed, max_new_tokens=(18, 12, 15, 9))
    prompts = workload(vocab, seed, max_new_tokens=[p.max_new_tokens for p in params])[0]
    return prompts, params


@pytest.mark.parametrize("seed,drafter,gamma,policy", CASES)
def test_coupled_equals_plain_sampling(bamba_models, seed, drafter, gamma, policy):
    target, drafters = bamba_models
    prompts, params = sampled_batch(target.vocab_size, seed)
    expected = plain_outputs(target, prompts, params)
    result = speculative_parity(f"coupled seed={seed}", target, drafters[drafter], gamma, POLICIES[policy], prompts,
                                params, expected, verify="coupled", check_states=True,
                                all_accepted=drafter == "target itself")
    assert result.passed, result.detail


def test_coupled_sampling_differs_across_seeds(bamba_models):
    """The seeds matter: the same prompts sampled with other seeds give other tokens."""
    target, _ = bamba_models
    prompts, params = sampled_batch(target.vocab_size, 11)
    reseeded = [replace(p, seed=p.seed + 1000) for p in params]
    a, b = plain_outputs(target, prompts, params), plain_outputs(target, prompts, reseeded)
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    assert any(a[i].token_ids != b[i].token_ids for i in sampled)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    assert all(a[i].token_ids == b[i].token_ids for i in greedy)


@pytest.mark.parametrize("build", [jamba, nemotron_h, nemotron_h_moe, falcon_h1, zamba2],
                         ids=["jamba", "nemotron_h", "nemotron_h_moe", "falcon_h1", "zamba2"])
def test_coupled_parity_other_families(build):
    target = hs.from_hf(build(seed=0))
    prompts, params = sampled_batch(target.vocab_size, 21)
    expected = plain_outputs(target, prompts, params)
    for gamma, policy in ((3, "k=2"), (5, "log off")):
        result = speculative_parity(f"coupled γ={gamma} {policy}", target, perturbed_copy(target, seed=3), gamma,
                                    POLICIES[policy], prompts, params, expected, verify="coupled")
        assert result.passed, result.detail


@pytest.mark.parametrize("seed", [31, 32])
def test_plain_sampling_independent_of_batch(bamba_models, seed):
    target, _ = bamba_models
    prompts, params = sampled_batch(target.vocab_size, seed)
    result = batch_invariance("batch invariance", target, prompts, params)
    assert result.passed, result.detail
