"""Roofline CostModel, round_time, crossover_batch and the presets."""
import re

import numpy as np
import pytest

from hybridspec.errors import ConfigError
from hybridspec.sim import (
    BAMBA_9B,
    H200,
    NEMOTRON_H_8B,
    PRESETS,
    CostModel,
    Hardware,
    ModelCost,
    StepCosts,
    crossover_batch,
    expected_replay_steps,
    expected_tokens,
    replay_probability,
    round_time,
    speedup,
)

TOY_HARDWARE = Hardware("toy", memory_bandwidth=1e12, peak_flops=1e14, memory_bytes=1e11)


def _toy_model(name, param_bytes, state_bytes=0.0, log_bytes=0.0, replay_flops=0.0):
    return ModelCost(
        name=name,
        param_bytes=param_bytes,
        flops_per_token=param_bytes,  # 2 FLOPs per bf16 weight
        attention_flops_per_context_token=1e4,
        kv_bytes_per_token=1e4,
        state_bytes=state_bytes,
        log_bytes_per_token=log_bytes,
        replay_flops_per_token=replay_flops,
    )


def test_forward_time_is_the_roofline_max():
    model = CostModel(TOY_HARDWARE, _toy_model("t", 1e10, state_bytes=1e6), None, context_len=1000)
    # batch 1, 1 token: bytes = 1e10 + (1000 + 1)·1e4 + 2e6; flops ≈ 1e10 → memory-bound
    moved = 1e10 + 1001 * 1e4 + 2e6
    assert model.forward_time(model.target, 1, 1) == pytest.approx(moved / 1e12, rel=1e-12)
    # batch 4096, 8 tokens: flops = 4096·8·(1e10 + 1004.5·1e4) → compute-bound
    flops = 4096 * 8 * (1e10 + 1004.5 * 1e4)
    moved = 1e10 + 4096 * (1008 * 1e4 + 2e6)
    assert flops / 1e14 > moved / 1e12
    assert model.forward_time(model.target, 4096, 8) == pytest.approx(flops / 1e14, rel=1e-12)


@pytest.mark.parametrize("batch", (1, 16, 256, 2048))
def test_without_hybrid_terms_the_cost_model_reduces_to_speedup(batch):
    model = CostModel(TOY_HARDWARE, _toy_model("t", 1e10), _toy_model("d", 5e8), context_len=512)
    costs = model.step_costs(batch, 4)
    c = costs.draft_step_s / costs.plain_step_s
    verify_cost = costs.verify_s / costs.plain_step_s
    for k, log in ((1, False), (0, True), (2, True)):
        assert model.speedup(batch, 4, 0.75, k, log) == pytest.approx(speedup(0.75, 4, c, verify_cost), rel=1e-9)


def _unit_costs(batch):
    return StepCosts(
        batch=batch, plain_step_s=1.0, draft_step_s=0.1, verify_s=1.5, snapshot_write_s=0.2, log_write_s=0.01,
        restore_s=0.03, log_replay_step_s=0.002, token_replay_fixed_s=0.9, token_replay_step_s=0.004,
    )


def test_round_time_charges_each_policy_term():
    alpha, gamma, batch = 0.7, 4, 8
    p0, e0 = replay_probability(alpha, gamma, 0), expected_replay_steps(alpha, gamma, 0)
    every = round_time(_unit_costs(batch), gamma, alpha, snapshot_every=1, log_inputs=False)
    assert (every.draft_s, every.verify_s) == pytest.approx((0.4, 1.5))
    assert every.checkpoint_s == pytest.approx(4 * 0.2) and every.replay_s == 0.0
    logged = round_time(_unit_costs(batch), gamma, alpha, snapshot_every=0, log_inputs=True)
    assert logged.checkpoint_s == pytest.approx(5 * 0.01)
    assert logged.replay_s == pytest.approx(batch * p0 * 0.03 + batch * e0 * 0.002)
    tokens = round_time(_unit_costs(batch), gamma, alpha, snapshot_every=0, log_inputs=False)
    any_replays = 1 - (1 - p0) ** batch
    assert tokens.replay_s == pytest.approx(batch * p0 * 0.03 + any_replays * 0.9 + batch * e0 * 0.004)
    assert tokens.total_s == pytest.approx(tokens.draft_s + tokens.verify_s + tokens.checkpoint_s + tokens.replay_s)


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("alpha", (0.5, 0.7, 0.8))
@pytest.mark.parametrize("k, log", ((1, False), (2, True), (0, True), (0, False)))
def test_crossover_batch_lies_where_the_sign_changes(name, alpha, k, log):
    model = PRESETS[name].cost_model()
    batch = crossover_batch(model, alpha, 4, k, log, max_batch=4096)
    if batch is None:  # still a gain at every batch searched
        assert np.all(model.speedup(np.arange(1, 4097), 4, alpha, k, log) > 1.0)
        return
    assert model.speedup(batch, 4, alpha, k, log) <= 1.0
    assert batch == 1 or model.speedup(batch - 1, 4, alpha, k, log) > 1.0


def test_crossover_batch_edges():
    model = PRESETS["bamba-9b"].cost_model()
    found = crossover_batch(model, 0.7, 4)
    assert found is not None and found > 8
    assert crossover_batch(model, 0.7, 4, max_batch=found - 1) is None  # still pays up to max_batch
    assert crossover_batch(model, 0.0, 4) == 1  # one token per round never pays


def test_speculation_pays_at_batch_one_and_loses_when_compute_bound():
    model = PRESETS["bamba-9b"].cost_model()
    assert model.speedup(1, 4, 0.8) > 2.0
    assert model.speedup(4096, 4, 0.8) < 1.0
    batches = np.arange(1, 1025)  # [1024]
    gains = model.speedup(batches, 4, 0.8)  # [1024]
    assert gains.shape == (1024,) and gains[0] == pytest.approx(model.speedup(1, 4, 0.8))


def test_checkpoint_policies_trade_memory_for_replay():
    model = PRESETS["nemotron-h-8b"].cost_model()
    fits = [model.max_batch(4, k, log) for k, log in ((1, False), (2, True), (0, True))]
    assert fits[0] < fits[1] < fits[2]
    every = model.round_time(64, 4, 0.8, 1, False)
    sparse = model.round_time(64, 4, 0.8, 0, True)
    assert every.checkpoint_s > sparse.checkpoint_s and every.replay_s == 0.0 < sparse.replay_s


def test_presets_match_the_published_shapes():
    assert (BAMBA_9B.num_layers, BAMBA_9B.num_mamba_layers, BAMBA_9B.num_attention_layers) == (32, 29, 3)
    assert (NEMOTRON_H_8B.num_layers, NEMOTRON_H_8B.num_mamba_layers, NEMOTRON_H_8B.num_attention_layers) == (52, 24, 4)
    assert 9.5e9 < BAMBA_9B.total_params() < 10.0e9  # "9B", 9.78B published
    assert 7.8e9 < NEMOTRON_H_8B.total_params() < 8.4e9  # "8B"
    # ~4 MiB per Bamba Mamba layer with float32 states (2 MiB in bf16), ~120 MiB per sequence, log ~1/100 per token
    assert 4.0 < BAMBA_9B.state_bytes_per_layer() / 2**20 < 4.2
    assert 116 < BAMBA_9B.model_cost().state_bytes / 2**20 < 122
    assert 1 / 200 < BAMBA_9B.log_bytes_per_token_per_layer() / BAMBA_9B.state_bytes_per_layer() < 1 / 50
    assert "assumed" in H200.source and all("assumed" in p.target.source for p in PRESETS.values())


def test_preset_draft_costs_about_a_twentieth_of_the_target():
    for preset in PRESETS.values():
        costs = preset.cost_model().step_costs(1, 4)
        upper = 0.15 if preset.target.num_moe_blocks else 0.1  # a MoE target reads only ~3.6B active weights
        if preset.all_reduce is not None:  # the target on 8 devices, the drafter whole on one of them
            upper = 0.25
        assert 0.02 < costs.draft_step_s / costs.plain_step_s < upper


@pytest.mark.parametrize(
    "build, name",
    [
        (lambda: Hardware("x", memory_bandwidth=0.0, peak_flops=1.0, memory_bytes=1.0), "memory_bandwidth=0.0"),
        (lambda: _toy_model("t", -1.0), "t.param_bytes=-1.0"),
        (lambda: _toy_model("t", 1e9, state_bytes=float("inf")), "t.state_bytes=inf"),
        (lambda: CostModel(TOY_HARDWARE, _toy_model("t", 1e9), None, context_len=-1), "context_len=-1"),
        (lambda: CostModel(TOY_HARDWARE, _toy_model("t", 1e9), None).speedup(0, 4, 0.5), "batch=0"),
        (lambda: crossover_batch(PRESETS["bamba-9b"].cost_model(), 0.5, 4, max_batch=0), "max_batch=0"),
        (lambda: round_time(_unit_costs(1), 4, 0.5, snapshot_every=-2), "snapshot_every=-2"),
    ],
)
def test_invalid_cost_inputs_raise_config_error(build, name):
    with pytest.raises(ConfigError, match=re.escape(name)):
        build()


def test_expected_tokens_scale_the_round_speedup():
    model = PRESETS["bamba-9b"].cost_model()
    costs = model.step_costs(32, 4)
    rounds = model.round_time(32, 4, 0.8)
    assert model.speedup(32, 4, 0.8) == pytest.approx(expected_tokens(0.8, 4) * costs.plain_step_s / rounds.total_s)


def test_tensor_parallel_adds_two_all_reduces_per_layer_to_the_target():
    """Under an AllReduceLink every target forward pays, per layer, two ring all-reduces of
    hidden·B·T activations; the drafter runs whole on one rank and pays none."""
    from dataclasses import replace

    from hybridspec.sim import AllReduceLink
    from hybridspec.sim.presets import H200, H200_X8, NVLINK_H200_X8
    preset = PRESETS["qwen3-next-80b-a3b-tp8"]
    model = preset.cost_model()
    free = replace(model, all_reduce=None)
    target = model.target
    for batch, tokens in ((1, 1), (64, 5)):
        nbytes = target.hidden_size * batch * tokens * target.activation_bytes
        one = NVLINK_H200_X8.latency + 2 * 7 / 8 * nbytes / NVLINK_H200_X8.bandwidth
        expected = target.num_layers * 2 * one
        assert model.all_reduce_time(target, batch, tokens) == pytest.approx(expected)
        assert model.forward_time(target, batch, tokens) - free.forward_time(target, batch, tokens) == \
            pytest.approx(expected)
    alone = CostModel(hardware=H200, target=model.draft, draft=None, context_len=model.context_len)
    assert model.step_costs(4, 4).draft_step_s == pytest.approx(alone.forward_time(model.draft, 4, 1))
    assert free.hardware is H200_X8
    with pytest.raises(ConfigError, match="ranks"):
        AllReduceLink(ranks=1, bandwidth=1e9, latency=0.0)
