"""Forced rejections (`hybridspec.rollback.forcing`): the drafter wrapper makes
the greedy verifier reject exactly where it is told, on any family and with
any drafter, without changing the output; and the suite, which forces the
rejections its cases need, reaches every case's site on a Qwen3.5-MoE-like
model whose perturbed drafter agrees with it almost always (no round of it
would otherwise reject anything)."""
import pytest
import torch

import hybridspec as hs
from hybridspec.rollback import (POLICIES, failed_round, force_rejections, perturbed_copy, plain_outputs, run_suite,
                                 speculative_parity, tiny_model, workload)
from hybridspec.spec.speculator import RoundHook  # its other calls do nothing
from oracles import QWEN_GDN, bamba


def hf_init_qwen3_5_moe(dtype=torch.float32) -> hs.HybridModel:
    """A tiny Qwen3.5 MoE with transformers' own initialisation (std 0.02 weights): nearly flat logits whose
    argmax a 3 % weight perturbation hardly ever moves."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    cfg = Qwen3_5MoeTextConfig(**QWEN_GDN, num_hidden_layers=3,
                               layer_types=["full_attention", "linear_attention", "linear_attention"],
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                               shared_expert_intermediate_size=24, experts_implementation="eager")
    torch.manual_seed(0)
    return hs.from_hf(Qwen3_5MoeForCausalLM(cfg).to(dtype).eval())


FAMILIES = {"tiny hybrid": lambda: tiny_model(0), "bamba": lambda: hs.from_hf(bamba(seed=0)),
            "qwen3_5_moe": hf_init_qwen3_5_moe}


class AcceptedCounts(RoundHook):
    """A round hook keeping every round's (seq_id, drafts, accepted) of the rows asked for drafts."""

    def __init__(self):
        self.rows = []

    def round_ended(self, round, error):
        self.rows += [(s, d, n) for s, g, d, n in zip(round.seq_ids, round.gammas, round.drafts, round.accepted) if g]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("drafter", ["target itself", "perturbed", "n-gram"])
def test_forced_rejection_lands_at_the_requested_position(family, drafter):
    target = FAMILIES[family]()
    draft = {"target itself": target, "perturbed": perturbed_copy(target, seed=1), "n-gram": hs.NgramDrafter()}[drafter]
    prompts, params = workload(target.vocab_size, seed=3, max_new_tokens=(14, 9, 12))
    expected = plain_outputs(target, prompts, params)
    gamma, schedule = 4, (2, 0, 3, 1, 4)  # reject d_3, d_1, d_4, d_2; then force nothing
    engine = hs.Engine(target, draft=draft, num_draft_tokens=gamma, checkpoint=POLICIES["k=0"], block_size=4)
    forcing = force_rejections(engine, prompts, [o.token_ids for o in expected], schedule)
    counts = AcceptedCounts()
    engine.speculator.hooks.append(counts)
    outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert forcing.broken == []
    rounds_of = {}
    for s, drafts, accepted in counts.rows:
        k = rounds_of[s] = rounds_of.get(s, -1) + 1
        want = schedule[k % len(schedule)]
        assert accepted <= want  # never past the forced position, whatever the drafter proposed
        if want < len(drafts) and drafter != "perturbed":  # drafts the target agrees with up to the forced one
            assert accepted == want, (s, k, drafts)
    forced = {r.accepted for r in forcing.rejections}
    assert 0 in forced and (drafter == "perturbed" or forced >= {0, 1, 2, 3})


def test_suite_reaches_every_site_on_a_qwen3_5_moe_whose_drafter_always_agrees():
    target = hf_init_qwen3_5_moe()
    draft = perturbed_copy(target)
    results = run_suite(target, draft, "perturbed", quick=True)
    failed = [f"{r.name}: {r.detail}" for r in results if not r.passed]
    assert not failed, failed
    greedy = [r for r in results if r.name.startswith("greedy parity")]
    own = [r.stats["drafter_acceptance"] for r in greedy if r.name.startswith("greedy parity · perturbed")]
    assert min(own) > 0.9  # the drafter alone would leave the rejection sites unreached
    assert greedy and all(r.stats["rejections"] > 0 for r in greedy)
    for name, counted in (("k=0", "log_replayed_tokens"), ("ring too small", "log_replayed_tokens"),
                          ("k=1", "snapshot_hits")):
        assert all(r.stats[counted] > 0 for r in greedy if r.name.endswith(f"· {name}")), name
    assert all(r.stats["token_replayed_tokens"] > 0 for r in greedy if r.name.endswith("γ=4 · log off"))
    faults = [r for r in results if r.name.startswith("failed round")]
    assert len(faults) == 5 and all("raised at" in r.detail for r in faults)


def test_a_case_that_rejects_nothing_fails():
    """Forcing nothing (n = γ every round) with the target as its own drafter: no rejection, no site."""
    target = tiny_model(0)
    prompts, params = workload(target.vocab_size, seed=3, max_new_tokens=(9, 6))
    expected = plain_outputs(target, prompts, params)
    result = speculative_parity("unforced", target, target, 3, POLICIES["k=0"], prompts, params, expected, force=(3,))
    assert not result.passed and "no round rejected a draft" in result.detail, result.detail
    result = failed_round("replay k=1", target, perturbed_copy(target), 3, POLICIES["k=1"], prompts, params, "replay")
    assert not result.passed and "no round reached the 'replay' fault site" in result.detail, result.detail
    assert "forced rejections" in result.detail  # what the rounds did instead
