"""State parity: after every round of any random schedule (acceptance lengths,
stops, length limits, policies, γ, verification modes, drafters), every
layer's head SSM state, conv window and K/V up to computed_len equal a
from-scratch prefill of the committed tokens minus the pending one (float64,
atol 1e-10) — for the target and for a model drafter at its own length.
`ScriptedDrafter` fixes each round's acceptance length exactly."""
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import hybridspec as hs
from hybridspec.checkpoints.restore import RestoreDecision, decide
from hybridspec.rollback import POLICIES, ScriptedDrafter, perturbed_copy, plain_outputs, speculative_parity
from oracles import bamba, jamba, nemotron_h

FAMILIES = {"bamba": bamba, "jamba": jamba, "nemotron_h": nemotron_h}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def models(request):
    target = hs.from_hf(FAMILIES[request.param](seed=0))
    return target, {"perturbed copy": perturbed_copy(target, scale=0.03, seed=1),
                    "unrelated": hs.from_hf(FAMILIES[request.param](seed=8)),
                    "pure mamba": hs.from_hf(bamba(seed=3, attn_layers=(), num_layers=2))}


@st.composite
def schedules(draw, vocab):
    """A random batch, its sampling parameters (stops chosen later) and a drafter plan."""
    num = draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    prompts = [torch.randint(3, vocab, (draw(st.integers(1, 9)),), generator=g).tolist() for _ in range(num)]
    verify = draw(st.sampled_from(["greedy", "coupled", "rejection"]))
    params = [hs.SamplingParams(max_new_tokens=draw(st.integers(1, 16)), temperature=0.0 if verify == "greedy" else 0.9,
                                seed=draw(st.integers(0, 1000))) for _ in range(num)]
    stop_at = [draw(st.one_of(st.none(), st.integers(0, 15))) for _ in range(num)]
    drafter = draw(st.sampled_from(["scripted", "scripted", "perturbed copy", "unrelated", "pure mamba"]))
    schedule = draw(st.lists(st.integers(-1, 8), min_size=1, max_size=6))
    return dict(prompts=prompts, verify=verify, params=params, stop_at=stop_at, drafter=drafter, schedule=schedule,
                gamma=draw(st.integers(1, 7)), policy=draw(st.sampled_from(sorted(POLICIES))),
                block_size=draw(st.sampled_from([1, 3, 4, 16])))


@settings(max_examples=20, deadline=None, derandomize=True, database=None, phases=[Phase.generate, Phase.shrink],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_state_parity_random_schedule(models, data):
    target, drafters = models
    case = data.draw(schedules(target.vocab_size))
    prompts, params = case["prompts"], case["params"]
    unstopped = plain_outputs(target, prompts, params)
    stops = [(o.token_ids[i],) if i is not None and i < len(o.token_ids) else ()
             for o, i in zip(unstopped, case["stop_at"])]
    params = [replace(p, stop_token_ids=s) for p, s in zip(params, stops)]
    expected = plain_outputs(target, prompts, params)
    if case["drafter"] == "scripted":
        draft = ScriptedDrafter(prompts, [o.token_ids for o in expected], case["schedule"], target.vocab_size)
    else:
        draft = drafters[case["drafter"]]
    result = speculative_parity("state parity", target, draft, case["gamma"], POLICIES[case["policy"]], prompts,
                                params, None if case["verify"] == "rejection" else expected,
                                verify="coupled" if case["verify"] == "coupled" else "rejection", check_states=True,
                                block_size=case["block_size"])
    assert result.passed, f"{case}: {result.detail}"


@pytest.mark.parametrize("policy", ["k=0", "log off"])
def test_scripted_drafter_fixes_acceptance(models, policy):
    """Schedule 0..γ: every boundary of a round is reached once, each restored
    by the path the policy implies (checked exactly by speculative_parity)."""
    target, _ = models
    prompts = [[5, 9, 14, 20], [7, 7, 30], [40, 41, 42, 43, 44, 45]]
    params = [hs.SamplingParams(max_new_tokens=m) for m in (24, 18, 21)]
    expected = plain_outputs(target, prompts, params)
    draft = ScriptedDrafter(prompts, [o.token_ids for o in expected], [0, 1, 2, 3, 4], target.vocab_size)
    result = speculative_parity("scripted", target, draft, 4, POLICIES[policy], prompts, params, expected,
                                check_states=True)
    assert result.passed, result.detail
    assert 0.3 < result.stats["acceptance_rate"] < 0.8


def test_token_replay_from_a_snapshot_past_the_head(models):
    """k = 2 without a log: boundaries 1 and 3 are token-replayed from the
    snapshots after inputs 0 and 2 (the verify inputs up to them committed
    first), not from the head."""
    target, _ = models
    prompts = [[5, 9, 14, 20], [7, 7, 30]]
    params = [hs.SamplingParams(max_new_tokens=m) for m in (22, 17)]
    expected = plain_outputs(target, prompts, params)
    draft = ScriptedDrafter(prompts, [o.token_ids for o in expected], [1, 3, 0, 2, 4], target.vocab_size)
    policy = hs.CheckpointPolicy(snapshot_every=2, log_inputs=False)
    result = speculative_parity("token replay", target, draft, 4, policy, prompts, params, expected, check_states=True)
    assert result.passed, result.detail
    assert result.stats["token_replayed_tokens"] > 0


def test_state_check_catches_a_skipped_replay(models, monkeypatch):
    """Sabotage: commit to the nearest earlier snapshot without replaying.
    The invariant's bookkeeping still agrees; the state comparison does not."""
    target, drafters = models

    def skip_replay(plan, n, log_available):
        d = decide(plan, n, log_available)
        return d if d.path == "hit" else RestoreDecision("hit", d.src_input, d.src_slot, d.src_slot, n)

    monkeypatch.setattr("hybridspec.checkpoints.checkpointer.decide", skip_replay)
    prompts = [[5, 9, 14, 20], [7, 7, 30]]
    params = [hs.SamplingParams(max_new_tokens=12)] * 2
    result = speculative_parity("sabotaged", target, drafters["unrelated"], 3, POLICIES["k=0"], prompts, params,
                                None, check_states=True)
    assert not result.passed and "differs by" in result.detail and "SSM state" in result.detail, result.detail


def test_state_check_catches_a_drafter_left_past_the_boundary(models, monkeypatch):
    """Sabotage: the drafter is never moved back to the boundary."""
    target, drafters = models
    monkeypatch.setattr("hybridspec.spec.drafters.ModelDrafter.commit", lambda self, seq_id, committed_len: None)
    prompts = [[5, 9, 14, 20], [7, 7, 30]]
    params = [hs.SamplingParams(max_new_tokens=12)] * 2
    result = speculative_parity("sabotaged", target, drafters["unrelated"], 3, POLICIES["k=1"], prompts, params,
                                None, check_states=True)
    assert not result.passed and "drafter of sequence" in result.detail, result.detail
