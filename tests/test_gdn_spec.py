"""Speculative decoding on gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5
MoE; tiny float64 models from HF): the greedy-parity, coupled-parity,
state-parity and prefix-cache suites the Mamba families run (their test functions, collected
here with this module's fixtures), and the rounds that corrupt GDN state
elsewhere: zero-draft rounds right after fully accepted ones (vllm#52942),
boundaries on page boundaries, token replays through the real attention
caches (GDN layers after an attention layer), k = 0 with and without a log,
and the "auto" policy."""
import pytest

import hybridspec as hs
from hybridspec.checkpoints.policy import CheckpointPolicy
from hybridspec.rollback import (POLICIES, ScriptedDrafter, perturbed_copy, plain_outputs, speculative_parity,
                                 workload)
from oracles import bamba, qwen3_5, qwen3_5_moe, qwen3_next
from test_spec_coupled import (test_coupled_equals_plain_sampling,  # noqa: F401 (collected here)
                               test_plain_sampling_independent_of_batch)
from test_prefix_cache import (test_a_resumed_sequence_is_restored_whole,  # noqa: F401 (collected here)
                               test_a_tiny_budget_evicts_saved_states_and_outputs_stay_equal,
                               test_branch_point_saved_state_serves_the_next_question,
                               test_plain_outputs_equal_with_the_cache_on,
                               test_prefix_inside_a_page_past_the_last_grid_point_hits_with_replay,
                               test_same_prompt_twice_hits_on_the_second_send,
                               test_speculative_outputs_equal_with_the_cache_on,
                               test_speculative_rounds_never_write_cached_pages_or_saved_states,
                               test_state_parity_at_every_tail_length,
                               test_whole_prompt_cached_still_computes_the_last_token)
from test_spec_parity import (test_drafter_under_every_policy, test_max_new_tokens_ends_mid_round,  # noqa: F401
                              test_perturbed_copy_every_gamma_and_policy, test_stop_token_inside_accepted_run)
from test_spec_state_parity import (test_scripted_drafter_fixes_acceptance,  # noqa: F401
                                    test_state_parity_random_schedule, test_token_replay_from_a_snapshot_past_the_head)

FAMILIES = {"qwen3_next": qwen3_next, "qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5_moe}
EXTRA_POLICIES = {"k=0 log off": CheckpointPolicy(snapshot_every=0, log_inputs=False), "auto": "auto"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """test_spec_parity's fixture for the GDN families: (name, target, drafters, prompts, params, plain outputs)."""
    target = hs.from_hf(FAMILIES[request.param](seed=0))
    drafters = {
        "target itself": target,
        "perturbed copy": perturbed_copy(target, scale=0.03, seed=1),
        "unrelated": hs.from_hf(FAMILIES[request.param](seed=7)),
        "n-gram": hs.NgramDrafter(),
        "pure mamba": hs.from_hf(bamba(seed=3, attn_layers=(), num_layers=2)),
        "pure attention": hs.from_hf(bamba(seed=4, attn_layers=(0, 1), num_layers=2)),
    }
    prompts, params = workload(target.vocab_size, seed=5, max_new_tokens=(20, 11, 15))
    return request.param, target, drafters, prompts, params, plain_outputs(target, prompts, params)


@pytest.fixture(scope="module")
def models(family):
    """test_spec_state_parity's fixture: (target, drafters)."""
    name, target, drafters, *_ = family
    return target, {"perturbed copy": drafters["perturbed copy"], "unrelated": drafters["unrelated"],
                    "pure mamba": drafters["pure mamba"]}


@pytest.fixture(scope="module")
def bamba_models(family):
    """test_spec_coupled's fixture (named for the family it was written on): (target, drafters)."""
    name, target, drafters, *_ = family
    return target, {kind: drafters[kind] for kind in ("perturbed copy", "target itself", "unrelated", "n-gram")}


@pytest.fixture(scope="module")
def target(family):
    """test_prefix_cache's fixture: the target."""
    return family[1]


@pytest.mark.parametrize("pname", sorted(EXTRA_POLICIES))
@pytest.mark.parametrize("drafter", ["perturbed copy", "n-gram"])
def test_k0_without_log_and_auto(family, pname, drafter):
    name, target, drafters, prompts, params, expected = family
    for gamma in (1, 3):
        result = speculative_parity(f"{name} {drafter} γ={gamma} {pname}", target, drafters[drafter], gamma,
                                    EXTRA_POLICIES[pname], prompts, params, expected, check_states=True)
        assert result.passed, f"{result.name}: {result.detail}"


@pytest.mark.parametrize("pname", ["k=1", "k=2", "k=0", "log off", "k=0 log off"])
@pytest.mark.parametrize("block_size", [1, 4])
def test_zero_drafts_right_after_fully_accepted_rounds(family, pname, block_size):
    """A drafter that proposes γ true tokens (all accepted, bonus too), then nothing, then a partial run:
    the zero-draft round must start from the state the full round committed, not a stale snapshot.
    block_size 1 puts every boundary on a page boundary."""
    name, target, _, prompts, params, expected = family
    policy = {**POLICIES, **EXTRA_POLICIES}[pname]
    for gamma, schedule in ((3, [3, -1, -1, 1]), (4, [8, -1, 2, 8, 8, -1])):
        draft = ScriptedDrafter(prompts[:1], [expected[0].token_ids], schedule, target.vocab_size)
        result = speculative_parity(f"{name} γ={gamma} {pname} {schedule}", target, draft, gamma, policy,
                                    prompts[:1], params[:1], expected[:1], check_states=True, block_size=block_size)
        assert result.passed, f"{result.name}: {result.detail}"
        assert result.stats["rounds"] > 2


def test_ngram_on_repetitive_prompts_and_coupled_sampling(family):
    """The n-gram drafter where it finds matches (rounds with and without drafts mixed), greedy and coupled."""
    name, target, drafters, prompts, params, _ = family
    sampled = [hs.SamplingParams(max_new_tokens=p.max_new_tokens, temperature=0.9, seed=i, ignore_eos=True)
               for i, p in enumerate(params)]
    expected = plain_outputs(target, prompts, sampled)
    for pname in ("k=2", "log off"):
        result = speculative_parity(f"{name} n-gram coupled {pname}", target, hs.NgramDrafter(), 4, POLICIES[pname],
                                    prompts, sampled, expected, verify="coupled", check_states=True)
        assert result.passed, f"{result.name}: {result.detail}"
