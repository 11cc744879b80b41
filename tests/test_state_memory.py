"""One source for memory formulas: what `Engine` allocates and logs equals what
the `auto` policy budgets and what the simulator reports, for the same shape."""
import pytest
import torch

import hybridspec as hs
from hybridspec.costs.checkpoint_costs import CheckpointFootprint
from hybridspec.sim import HybridShape, snapshot_positions
from hybridspec.cache.paged_kv import PagedKVCache
from hybridspec.cache.state_specs import AttentionKVSpec, snapshot_inputs
from oracles import bamba, jamba


def shape_of(hf, state_bytes: int, weight_bytes: int) -> HybridShape:
    """The simulator's description of a tiny HF Bamba model."""
    c = hf.config
    return HybridShape(name="tiny", d_model=c.hidden_size, vocab_size=c.vocab_size,
                       num_mamba_layers=c.num_hidden_layers - len(c.attn_layer_indices),
                       num_attention_layers=len(c.attn_layer_indices), num_mlp_blocks=c.num_hidden_layers,
                       mlp_intermediate=c.intermediate_size, mlp_matrices=3, separate_mlp_layers=False,
                       mamba_d_state=c.mamba_d_state, mamba_headdim=c.mamba_d_head, mamba_ngroups=c.mamba_n_groups,
                       mamba_expand=c.mamba_expand, mamba_d_conv=c.mamba_d_conv, num_heads=c.num_attention_heads,
                       num_kv_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads,
                       tie_embeddings=False, weight_bytes=weight_bytes, state_bytes=state_bytes)


@pytest.mark.parametrize("dtype, state_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                                (torch.float64, None), (torch.float32, torch.float64)])
def test_simulator_state_bytes_equal_what_the_engine_allocates(dtype, state_dtype):
    hf = bamba(seed=0, n_groups=2, dtype=dtype)
    target = hs.from_hf(hf)
    engine = hs.Engine(target, draft=hs.NgramDrafter(), num_draft_tokens=3, max_batch_size=2, max_model_len=64,
                       state_dtype=state_dtype)
    states = engine.cache.states
    assert states.dtype == (state_dtype or torch.promote_types(dtype, torch.float32))
    shape = shape_of(hf, states.dtype.itemsize, dtype.itemsize)
    allocated = sum(t[0].numel() * t.element_size() for t in (*states.ssm_states, *states.conv_states))
    footprint = CheckpointFootprint.of(target.config, target.dtype, states.dtype)
    assert allocated == states.bytes_per_slot == footprint.bytes_per_slot == shape.model_cost().state_bytes
    assert footprint.log_bytes_per_input == shape.model_cost().log_bytes_per_token


@pytest.mark.parametrize("make", [lambda: bamba(seed=0, n_groups=2, dtype=torch.bfloat16),
                                  lambda: jamba(seed=0, dtype=torch.bfloat16)], ids=["mamba2", "mamba1"])
def test_input_log_bytes_equal_the_formula(make):
    """The bytes a verify forward actually logs, per input and sequence, are `log_bytes_per_input`."""
    target = hs.from_hf(make())
    engine = hs.Engine(target, max_batch_size=2, max_model_len=64)
    ids, inputs = [0, 1], [[3, 4, 5, 6], [7, 8, 9, 10]]
    target.prefill(engine.cache, ids, [[1, 2], [2, 1]], last_only=True)
    log = {}
    snap = torch.full((2, 4), -1, dtype=torch.long)
    target.extend(engine.cache, ids, inputs, snap_slot=snap, input_log=log)
    footprint = CheckpointFootprint.of(target.config, target.dtype, engine.cache.states.dtype)
    assert sum(entry.nbytes() for entry in log.values()) == 2 * 4 * footprint.log_bytes_per_input


def test_snapshot_positions_have_one_definition():
    for gamma in range(1, 9):
        for k in range(0, gamma + 2):
            policy = hs.CheckpointPolicy(snapshot_every=k)
            assert tuple(policy.snapshot_inputs(gamma + 1)) == snapshot_positions(gamma, k) == \
                snapshot_inputs(gamma + 1, k)
    assert snapshot_inputs(5, 2) == (0, 2, 4) and snapshot_inputs(6, 2) == (0, 2, 4, 5)
    assert snapshot_inputs(5, 0) == (4,) and snapshot_inputs(1, 3) == (0,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_page_bytes_equal_what_the_pages_allocate(dtype):
    """`PagedKVCache.bytes_per_block` (through `AttentionKVSpec`) is the K and V tensors' bytes per page."""
    kv = PagedKVCache(num_layers=3, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=8, dtype=dtype)
    allocated = sum(t[:, 0].numel() * t.element_size() for t in (kv.k_cache, kv.v_cache))
    assert kv.bytes_per_block == allocated == 3 * 16 * AttentionKVSpec(2, 8).bytes_per_token(dtype.itemsize)
