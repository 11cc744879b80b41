"""Simulator presets of the families added for issue 14 (Nemotron 3 Nano MoE,
Falcon-H1, Zamba2) and issue 36 (Qwen3-Next, gated-DeltaNet layers): their
shapes add up to the published parameter counts, and the terms those families
add (routed experts read per forward, parallel mixers, shared blocks, GDN
state and input log) enter the cost model."""
import numpy as np
import pytest

from hybridspec.checkpoints.auto import choose
from hybridspec.costs.checkpoint_costs import COST_FIELDS, CheckpointCosts, CheckpointFootprint
from hybridspec.errors import ConfigError
from hybridspec.sim import PRESETS, GdnMixer, HybridShape
from hybridspec.sim.presets import FALCON_H1_7B, NEMOTRON_3_NANO_30B, QWEN3_NEXT_80B, ZAMBA2_7B


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


def test_qwen3_next_shape_matches_the_published_counts():
    shape = QWEN3_NEXT_80B
    assert (shape.num_layers, shape.num_mamba_layers, shape.num_attention_layers, shape.num_moe_blocks) == \
        (48, 36, 12, 48)
    assert shape.recurrent.kind == "GDN"
    assert 79.0e9 < shape.total_params() < 81.0e9  # "80B in total"
    assert 78.5e9 < shape.total_params() - 2 * shape.vocab_size * shape.d_model < 79.5e9  # "79B non-embedding"
    assert 2.9e9 < shape.active_block_params() < 3.6e9  # "3B activated"
    # gated attention: q_proj [2048 -> 2·16·256] (queries and their gate), k, v [2048 -> 2·256], o [16·256 -> 2048]
    assert shape.attention_params() == 2048 * 2 * 4096 + 2 * 2048 * 512 + 4096 * 2048


def test_gdn_state_and_log_follow_the_state_memory_formulas():
    """Per layer and sequence: SSM state HV·d_k·d_v and conv window conv_dim·(d_conv − 1) in float32;
    per verify input, conv_dim + HK·d_k + HV·d_v bf16 activations and 2·HV float32 (g, β)."""
    shape = QWEN3_NEXT_80B
    conv_dim = 2 * 16 * 128 + 32 * 128
    assert shape.state_bytes_per_layer() == 4 * (32 * 128 * 128 + conv_dim * 3)
    assert shape.log_bytes_per_token_per_layer() == 2 * (conv_dim + 16 * 128 + 32 * 128) + 4 * 2 * 32
    cost = shape.model_cost()
    assert cost.state_bytes == 36 * shape.state_bytes_per_layer()
    assert cost.kv_bytes_per_token == 2 * 12 * 2 * 256 * 2  # K and V of the 12 attention layers, bf16
    assert shape.state_bytes_per_layer() > 70 * shape.log_bytes_per_token_per_layer()  # a large state, small inputs


def roofline_checkpoint_costs(model, batch: int, gamma: int) -> CheckpointCosts:
    """The cost model's step costs as the `auto` policy's measured costs (a log replay has no fixed part)."""
    costs = model.step_costs(batch, gamma)
    fields = {name: (float(getattr(costs, name)),) for name in COST_FIELDS if name != "log_replay_fixed_s"}
    return CheckpointCosts(batches=(batch,), log_replay_fixed_s=(0.0,), **fields)


@pytest.mark.parametrize("alpha", [0.5, 0.6, 0.8, 0.9])
def test_auto_policy_logs_and_replays_gdn_states(alpha):
    """A GDN snapshot (75 MiB per sequence) costs ~76 verify inputs' logs: on the preset's roofline the
    auto policy's own choice never snapshots every input and never replays tokens; from α = 0.6 on it
    keeps the final state only and replays the log, holding under a quarter of k = 1's bytes."""
    gamma, preset = 4, PRESETS["qwen3-next-80b-a3b"]
    model, cost = preset.cost_model(4096), preset.target.model_cost()
    footprint = CheckpointFootprint(int(cost.state_bytes), int(cost.log_bytes_per_token))
    for batch in (1, 64):
        choice = choose(alpha, gamma, batch, roofline_checkpoint_costs(model, batch, gamma), footprint, None,
                        gamma + 1)
        assert choice.log_inputs and choice.snapshot_every != 1
        if alpha >= 0.6:
            assert choice.snapshot_every == 0
            assert 4 * choice.checkpoint_bytes < footprint.checkpoint_bytes(batch, gamma, 1, False)


def test_a_shape_holds_mamba2_or_gdn_layers():
    mamba2 = dict(mamba_d_state=16, mamba_headdim=16, mamba_ngroups=1, mamba_expand=2, mamba_d_conv=4)
    common = dict(name="x", d_model=64, vocab_size=100, num_mamba_layers=2, num_attention_layers=1,
                  num_mlp_blocks=3, mlp_intermediate=128, mlp_matrices=3, separate_mlp_layers=False, num_heads=4,
                  num_kv_heads=2, head_dim=16, tie_embeddings=True)
    assert HybridShape(**common, **mamba2).recurrent.kind == "Mamba2"
    gdn = GdnMixer(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)
    assert HybridShape(**common, gdn=gdn).recurrent is gdn
    with pytest.raises(ConfigError, match="leave"):
        HybridShape(**common, **mamba2, gdn=gdn)
    with pytest.raises(ConfigError, match="mamba_d_conv"):
        HybridShape(**common, **{k: v for k, v in mamba2.items() if k != "mamba_d_conv"})
