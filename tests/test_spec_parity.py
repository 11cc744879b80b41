"""Greedy parity: speculative output == plain `Engine(target)` output token for
token, for every γ, checkpoint policy and drafter, on tiny float64 Bamba,
Jamba, Nemotron-H, Nemotron-H MoE, Falcon-H1 (parallel attention + Mamba2) and
Zamba2 (shared transformer blocks, KV per occurrence) models; the restore paths counted in engine.stats are
exactly those the policy implies (`hybridspec.rollback.speculative_parity`), and
each path runs where the policy says it must."""
import pytest

import hybridspec as hs
from hybridspec.rollback import (GAMMAS, POLICIES, perturbed_copy, plain_outputs, speculative_parity,
                                       stop_inside_accepted_run, workload)
from oracles import bamba, falcon_h1, jamba, nemotron_h, nemotron_h_moe, zamba2

FAMILIES = {
    "bamba": lambda seed: bamba(seed=seed),
    "jamba": lambda seed: jamba(seed=seed),
    "nemotron_h": lambda seed: nemotron_h(seed=seed),
    "nemotron_h_moe": lambda seed: nemotron_h_moe(seed=seed),
    "falcon_h1": lambda seed: falcon_h1(seed=seed),
    "zamba2": lambda seed: zamba2(seed=seed + 1),  # seed 0 emits EOS inside test_max_new_tokens_ends_mid_round
}
# the restore path each policy must use when a round is partly accepted
EXPECTED_PATH = {"k=1": "snapshot_hits", "k=2": "log_replayed_tokens", "k=0": "log_replayed_tokens",
                 "ring too small": "log_replayed_tokens", "log off": "token_replayed_tokens"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """(name, target, drafters, prompts, params, plain outputs) of one family."""
    target = hs.from_hf(FAMILIES[request.param](0))
    drafters = {
        "target itself": target,
        "perturbed copy": perturbed_copy(target, scale=0.03, seed=1),
        "unrelated": hs.from_hf(FAMILIES[request.param](7)),
        "n-gram": hs.NgramDrafter(),
        "pure mamba": hs.from_hf(bamba(seed=3, attn_layers=(), num_layers=2)),
        "pure attention": hs.from_hf(bamba(seed=4, attn_layers=(0, 1), num_layers=2)),
    }
    prompts, params = workload(target.vocab_size, seed=5, max_new_tokens=(20, 11, 15))
    return request.param, target, drafters, prompts, params, plain_outputs(target, prompts, params)


def test_perturbed_copy_every_gamma_and_policy(family):
    name, target, drafters, prompts, params, expected = family
    totals = {p: dict.fromkeys(("snapshot_hits", "log_replayed_tokens", "token_replayed_tokens"), 0) for p in POLICIES}
    acceptance = []
    for gamma in GAMMAS:
        for pname, policy in POLICIES.items():
            result = speculative_parity(f"{name} γ={gamma} {pname}", target, drafters["perturbed copy"], gamma, policy,
                                        prompts, params, expected, check_states=gamma in (2, 7))
            assert result.passed, f"{result.name}: {result.detail}"
            for key in totals[pname]:
                totals[pname][key] += result.stats[key]
            acceptance.append(result.stats["acceptance_rate"])
    assert 0.2 < sum(acceptance) / len(acceptance) < 0.95, f"perturbed copy acceptance {acceptance}"
    for pname, path in EXPECTED_PATH.items():
        assert totals[pname][path] > 0, f"{pname}: the {path} path never ran ({totals[pname]})"
    assert totals["k=1"]["log_replayed_tokens"] == totals["k=1"]["token_replayed_tokens"] == 0
    assert totals["log off"]["log_replayed_tokens"] == 0


@pytest.mark.parametrize("drafter", ["target itself", "unrelated", "n-gram", "pure mamba", "pure attention"])
def test_drafter_under_every_policy(family, drafter):
    """Each drafter under every policy, γ rotating so that every (drafter, γ)
    and (policy, γ) pair occurs across the parametrization."""
    name, target, drafters, prompts, params, expected = family
    offset = ["target itself", "unrelated", "n-gram", "pure mamba", "pure attention"].index(drafter)
    acceptance = []
    for j, (pname, policy) in enumerate(POLICIES.items()):
        gamma = GAMMAS[(offset + j) % len(GAMMAS)]
        result = speculative_parity(f"{name} {drafter} γ={gamma} {pname}", target, drafters[drafter], gamma, policy,
                                    prompts, params, expected, all_accepted=drafter == "target itself")
        assert result.passed, f"{result.name}: {result.detail}"
        acceptance.append(result.stats["acceptance_rate"])
    if drafter == "unrelated":
        assert max(acceptance) < 0.5, f"an unrelated random drafter should be mostly rejected: {acceptance}"


@pytest.mark.parametrize("gamma,policy", [(2, "k=0"), (4, "log off"), (7, "k=2")])
def test_stop_token_inside_accepted_run(family, gamma, policy):
    name, target, drafters, prompts, params, expected = family
    result = stop_inside_accepted_run(f"{name} stop γ={gamma} {policy}", target, gamma, POLICIES[policy], prompts,
                                      params, expected)
    assert result.passed, result.detail


def test_max_new_tokens_ends_mid_round(family):
    """Limits that are not 1 + a multiple of γ + 1 and a one-token request:
    γ is clamped near the limit and no request overshoots."""
    name, target, drafters, prompts, _, _ = family
    params = [hs.SamplingParams(max_new_tokens=m) for m in (1, 8, 6)]
    expected = plain_outputs(target, prompts, params)
    for gamma in (4, 7):
        result = speculative_parity(f"{name} γ={gamma} short", target, drafters["target itself"], gamma,
                                    POLICIES["k=0"], prompts, params, expected, all_accepted=True, check_states=True)
        assert result.passed, result.detail
        assert [len(o.token_ids) for o in expected] == [1, 8, 6]
