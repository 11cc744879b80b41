"""Simulator presets of the families added for issue 14 (Nemotron 3 Nano MoE,
Falcon-H1, Zamba2): their shapes add up to the published parameter counts,
and the terms those families add (routed experts read per forward, parallel
mixers, shared blocks) enter the cost model."""
import numpy as np
import pytest

from hybridspec.sim import PRESETS
from hybridspec.sim.presets import FALCON_H1_7B, NEMOTRON_3_NANO_30B, ZAMBA2_7B


def test_nemotron_3_nano_shape_matches_the_published_counts():
    shape = NEMOTRON_3_NANO_30B
    assert (shape.num_layers, shape.num_mamba_layers, shape.num_attention_layers, shape.num_moe_blocks) == \
        (52, 23, 6, 23)
    assert 31.0e9 < shape.total_params() < 32.0e9  # "31.6B total"
    active = shape.active_block_params() + 2 * shape.vocab_size * shape.d_model
    assert 3.3e9 < active < 3.9e9  # "~3.6B active with embeddings"
    assert shape.d_inner == 4096 and shape.mamba_nheads == 64


def test_a_forward_reads_the_experts_its_tokens_touch():
    cost = NEMOTRON_3_NANO_30B.model_cost()
    all_experts = cost.expert_bytes * cost.num_experts
    one_token = cost.experts_read_bytes(1)
    assert one_token == pytest.approx(cost.expert_bytes * 6)  # top-6 of 128
    reads = cost.experts_read_bytes(np.array([1, 8, 64, 512]))
    assert np.all(np.diff(reads) > 0) and reads[-1] < all_experts and reads[-1] > 0.99 * all_experts
    assert cost.resident_bytes == pytest.approx(cost.param_bytes + all_experts)


def test_falcon_h1_layers_are_attention_and_mamba_at_once():
    shape = FALCON_H1_7B
    assert (shape.num_layers, shape.num_mamba_layers, shape.num_attention_layers) == (44, 44, 44)
    assert 7.0e9 < shape.total_params() < 8.0e9  # "7B"
    cost = shape.model_cost()
    assert cost.kv_bytes_per_token == 2 * 44 * 2 * 128 * 2  # K and V of every layer, 2 KV heads, bf16
    assert cost.state_bytes == 44 * shape.state_bytes_per_layer()


def test_zamba2_shared_blocks_are_read_per_occurrence_and_held_once():
    shape = ZAMBA2_7B
    assert (shape.num_layers, shape.num_mamba_layers, shape.num_attention_layers) == (81, 81, 13)
    assert 7.0e9 < shape.total_params() < 7.8e9  # "7B"
    cost = shape.model_cost()
    block = shape.attention_params() + shape.mlp_params()
    assert cost.param_bytes - cost.resident_bytes == pytest.approx(11 * block * shape.weight_bytes)  # 13 runs, 2 held
    assert cost.kv_bytes_per_token == 2 * 13 * 32 * 224 * 2  # K and V per occurrence


def test_moe_verification_reads_more_experts_than_a_decode_step():
    """At batch 1 a verify forward of γ+1 tokens touches ~(γ+1)·k experts, a decode step k: a low acceptance
    does not pay for that, a high one does; at large batches every expert is read either way."""
    model = PRESETS["nemotron-3-nano-30b-a3b"].cost_model()
    costs = model.step_costs(1, 4)
    assert costs.verify_s > 2 * costs.plain_step_s
    assert model.speedup(1, 4, 0.5) < 1.0 < model.speedup(1, 4, 0.9)
    wide = model.step_costs(256, 4)
    assert wide.verify_s < 1.5 * wide.plain_step_s
