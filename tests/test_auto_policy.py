"""`AutoCheckpointPolicy`: never over its memory budget, picks from the
simulator's round_time, and keeps speculative output equal to plain output."""
from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hybridspec as hs
from hybridspec.checkpoints.auto import AutoCheckpointPolicy, candidates, expected_round_s, running_alpha
from hybridspec.cache.hybrid_cache import scratch_cache
from hybridspec.costs.checkpoint_costs import COST_FIELDS, CheckpointCosts, CheckpointFootprint
from hybridspec.checkpoints.measure import measure_checkpoint_costs
from hybridspec.errors import CacheFullError, ConfigError
from hybridspec.cache.state_specs import default_state_dtype
from hybridspec.sim import round_time, snapshot_writes_per_round
from oracles import bamba

GAMMA = 4
# Replay dear, snapshot writes cheap (seconds, whole batch, at batch 1 and 4).
REPLAY_DEAR = CheckpointCosts(batches=(1, 4), snapshot_write_s=(1e-5, 4e-5), log_write_s=(1e-7, 4e-7),
                              log_replay_fixed_s=(1e-3, 1.2e-3), restore_s=(1e-4, 1e-4),
                              log_replay_step_s=(2e-5, 2e-5), token_replay_fixed_s=(2e-3, 2.5e-3),
                              token_replay_step_s=(1e-4, 1e-4))


@pytest.fixture(scope="module")
def target():
    return hs.from_hf(bamba(seed=3, attn_layers=(1,), num_layers=3, dtype=torch.float32))


@pytest.fixture(scope="module")
def footprint(target):
    return CheckpointFootprint.of(target.config, target.dtype, default_state_dtype(target.dtype))


def engine_with(target, policy, draft=None, max_batch_size=4):
    draft = draft if draft is not None else target
    return hs.Engine(target, draft=draft, num_draft_tokens=GAMMA, checkpoint=policy, max_batch_size=max_batch_size)


def policy_bytes(footprint, batch, policy):
    return footprint.checkpoint_bytes(batch, GAMMA, policy.snapshot_every, policy.log_inputs)


costs_strategy = st.builds(
    lambda values: CheckpointCosts(batches=(1, 4), **{name: (values[2 * i], values[2 * i + 1])
                                                       for i, name in enumerate(COST_FIELDS)}),
    st.lists(st.floats(0.0, 1.0), min_size=2 * len(COST_FIELDS), max_size=2 * len(COST_FIELDS)))


def test_footprint_matches_the_state_pool(target, footprint):
    engine = engine_with(target, AutoCheckpointPolicy(costs=REPLAY_DEAR))
    assert footprint.bytes_per_slot == engine.cache.states.bytes_per_slot
    assert footprint.checkpoint_bytes(3, GAMMA, 1, False) == 3 * (GAMMA + 1) * footprint.bytes_per_slot


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=st.lists(st.floats(0.0, 1.0), max_size=50), slots=st.floats(0.5, 8.0), batch=st.integers(1, 8),
       costs=costs_strategy)
def test_choice_never_exceeds_the_budget(target, footprint, history, slots, batch, costs):
    budget = max(1, int(slots * batch * footprint.bytes_per_slot))
    if budget < footprint.bytes_per_slot:
        with pytest.raises(ConfigError, match="memory_budget_bytes"):
            engine_with(target, AutoCheckpointPolicy(memory_budget_bytes=budget, costs=costs))
        return
    policy = engine_with(target, AutoCheckpointPolicy(memory_budget_bytes=budget, costs=costs)).speculator.policy
    if budget < batch * footprint.bytes_per_slot:
        with pytest.raises(CacheFullError, match="memory_budget_bytes"):
            policy.decide(history, batch)
        return
    choice = policy.decide(history, batch)
    assert choice.checkpoint_bytes == footprint.checkpoint_bytes(batch, GAMMA, choice.snapshot_every,
                                                                 choice.log_inputs) <= budget
    assert snapshot_writes_per_round(GAMMA, choice.snapshot_every) <= policy.ring_size(GAMMA) - 1


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(slots=st.floats(1.0, 7.0), same_draft=st.booleans(), temperature=st.sampled_from([0.0, 1.0]),
       seed=st.integers(0, 2**16))
def test_engine_peak_checkpoint_bytes_stay_within_the_budget(target, footprint, slots, same_draft, temperature,
                                                              seed):
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    budget = int(slots * len(prompts) * footprint.bytes_per_slot)
    draft = target if same_draft else hs.from_hf(bamba(seed=9, attn_layers=(), num_layers=1, dtype=torch.float32))
    engine = engine_with(target, AutoCheckpointPolicy(memory_budget_bytes=budget, costs=REPLAY_DEAR), draft)
    engine.generate(prompts, hs.SamplingParams(max_new_tokens=10, temperature=temperature, seed=seed))
    assert 0 < engine.stats.peak_checkpoint_bytes <= budget


def test_high_acceptance_loose_budget_picks_k1(target):
    policy = engine_with(target, AutoCheckpointPolicy(costs=REPLAY_DEAR)).speculator.policy
    choice = policy.decide([0.85] * 20, batch=2)
    assert (choice.snapshot_every, choice.log_inputs) == (1, False)
    # why: at this α, k = 1's γ cheap writes cost less than any sparse policy's expected replay
    alpha = running_alpha([0.85] * 20, GAMMA, policy.acceptance_window)
    cost = {c: expected_round_s(REPLAY_DEAR, 2, GAMMA, alpha, *c) for c in candidates(GAMMA)}
    assert min(cost, key=cost.get) == (1, False)
    step = REPLAY_DEAR.step_costs(2)
    rounds = round_time(step, GAMMA, alpha, 0, True)  # the simulator's terms are part of the model
    assert cost[0, True] > float(rounds.checkpoint_s + rounds.replay_s)


def test_low_acceptance_tight_budget_picks_sparse_with_log(target, footprint):
    budget = policy_bytes(footprint, 2, hs.CheckpointPolicy(snapshot_every=GAMMA, log_inputs=True))
    policy = engine_with(target, AutoCheckpointPolicy(memory_budget_bytes=budget, costs=REPLAY_DEAR)).speculator.policy
    choice = policy.decide([0.1] * 20, batch=2)
    assert choice.snapshot_every != 1 and choice.log_inputs
    assert choice.checkpoint_bytes <= budget


def test_budget_of_one_slot_per_sequence_turns_the_log_off(target, footprint):
    budget = 2 * footprint.bytes_per_slot
    policy = engine_with(target, AutoCheckpointPolicy(memory_budget_bytes=budget, costs=REPLAY_DEAR)).speculator.policy
    choice = policy.decide([0.5] * 5, batch=2)
    assert (choice.snapshot_every, choice.log_inputs) == (0, False)
    assert policy.ring_size(GAMMA) == 1 + 2  # at batch 1 the budget holds k = γ: snapshots after 0 and γ


def test_ring_holds_every_k_within_budget(target, footprint):
    assert engine_with(target, AutoCheckpointPolicy(costs=REPLAY_DEAR)).cache.ring_slots == GAMMA + 2
    budget = 3 * footprint.bytes_per_slot
    engine = engine_with(target, AutoCheckpointPolicy(memory_budget_bytes=budget, costs=REPLAY_DEAR))
    assert engine.cache.ring_slots == 1 + 3  # k = 2 writes after inputs 0, 2, 4


def test_budget_too_small_for_the_batch_raises_and_leaves_no_sequence(target, footprint):
    engine = engine_with(target, AutoCheckpointPolicy(memory_budget_bytes=footprint.bytes_per_slot,
                                                      costs=REPLAY_DEAR))
    with pytest.raises(CacheFullError, match="run fewer sequences"):
        engine.generate([[1, 2, 3], [4, 5, 6]], hs.SamplingParams(max_new_tokens=6))
    assert engine.cache.computed_len == {}
    assert len(engine.generate([[1, 2, 3]], hs.SamplingParams(max_new_tokens=6))[0].token_ids) == 6


@pytest.mark.parametrize("slots", [1.0, 2.2, None])
def test_speculative_output_equals_plain_output(target, footprint, slots):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    params = hs.SamplingParams(max_new_tokens=10, temperature=0.0)
    budget = None if slots is None else int(slots * len(prompts) * footprint.bytes_per_slot)
    draft = hs.from_hf(bamba(seed=4, attn_layers=(), num_layers=2, dtype=torch.float32))
    engine = engine_with(target, AutoCheckpointPolicy(memory_budget_bytes=budget, costs=REPLAY_DEAR), draft)
    plain = hs.Engine(target).generate(prompts, params)
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in plain]
    assert sum(engine.speculator.policy.decisions.values()) == engine.stats.rounds


def test_measured_costs_are_finite_and_bind_measures_them(target):
    costs = measure_checkpoint_costs(target, GAMMA, (1, 2), partial(scratch_cache, target), repeats=1)
    assert costs.batches == (1, 2)
    assert all(v >= 0.0 for name in COST_FIELDS for v in getattr(costs, name))
    assert costs.token_replay_fixed_s[0] + costs.token_replay_step_s[0] > 0.0  # a forward takes time
    assert costs.log_replay_fixed_s[0] + costs.restore_s[0] > 0.0  # and so does a replay
    bound = engine_with(target, "auto", max_batch_size=1).speculator.policy
    assert isinstance(bound, AutoCheckpointPolicy) and bound.binding.costs.batches == (1,)


def test_costs_interpolate_linearly_per_batch():
    costs = CheckpointCosts(batches=(1, 5), snapshot_write_s=(1.0, 5.0), log_write_s=(0.0, 0.0),
                            log_replay_fixed_s=(1.0, 3.0), restore_s=(2.0, 6.0), log_replay_step_s=(1.0, 1.0),
                            token_replay_fixed_s=(3.0, 3.0), token_replay_step_s=(0.5, 2.5))
    step = costs.step_costs(3)
    assert step.snapshot_write_s == pytest.approx(3.0) and step.restore_s == pytest.approx(4.0)
    assert costs.at("log_replay_fixed_s", 3) == pytest.approx(2.0)
    assert costs.step_costs(9).snapshot_write_s == pytest.approx(9.0)  # extrapolated from the last two
    single = CheckpointCosts(batches=(2,), **{name: (1.0,) for name in COST_FIELDS})
    assert single.at("snapshot_write_s", 6) == 3.0 and single.at("restore_s", 6) == 1.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(snapshot_every=2), "picks snapshot_every"),
    (dict(memory_budget_bytes=0), "positive integer"),
    (dict(memory_budget_bytes=True), "positive integer"),
    (dict(costs="fast"), "CheckpointCosts"),
    (dict(acceptance_window=0), "acceptance_window"),
])
def test_invalid_arguments_raise_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        AutoCheckpointPolicy(**kwargs)


def test_unbound_policy_refuses_to_pick():
    with pytest.raises(ConfigError, match="not bound"):
        AutoCheckpointPolicy().for_round([0.5], 1)
    assert AutoCheckpointPolicy().ring_size(GAMMA) == GAMMA + 2


def test_choices_are_priced_once_per_rate_grid_point(target, monkeypatch):
    """A round's choice is `choose` at the running rate rounded to 1/RATE_GRID,
    priced once per (rate, batch) and then remembered."""
    import hybridspec.checkpoints.auto as auto
    policy = engine_with(target, AutoCheckpointPolicy(costs=REPLAY_DEAR)).speculator.policy
    calls, real = [], auto.choose
    monkeypatch.setattr(auto, "choose", lambda *a: calls.append(a) or real(*a))
    histories = [[0.85] * 20, [0.85] * 19 + [0.8501], [0.3, 0.9], [0.1] * 20]
    for history in histories * 2:
        for batch in (1, 3):
            choice = policy.decide(history, batch)
            rate = round(auto.running_rate(history, policy.acceptance_window) * auto.RATE_GRID) / auto.RATE_GRID
            bound = policy.binding
            assert choice == real(hs.sim.alpha_from_acceptance_rate(rate, GAMMA), GAMMA, batch, bound.costs,
                                  bound.footprint, None, bound.ring_slots - 1)
    # the first two histories share a grid point: 3 rates × 2 batches priced, once each
    assert len(calls) == 6
