"""GraniteMoeHybrid (Granite-4.0-H): hybridspec's runtime against HF
transformers' GraniteMoeHybridForCausalLM."""
import json

import pytest
import torch
from safetensors.torch import save_file

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from oracles import assert_prefill_matches_hf, assert_split_forwards_match, float64_oracle, granite, hf_greedy

# HF transformers 5 name -> the name in Granite models on the Hub
HUB_NAMES = [("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.input_linear.weight"),
             ("block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear.weight"),
             ("block_sparse_moe.router.weight", "block_sparse_moe.router.layer.weight")]


def make_cache(model, max_seqs=4):
    return HybridCache(model.config, max_seqs=max_seqs, num_blocks=64, block_size=4, ring_slots=2,
                       dtype=model.dtype)


def max_err(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("layer_types,rope,num_experts,kv_heads,n_groups", [
    (("mamba", "attention", "mamba"), True, 4, 2, 1),
    (("attention", "mamba", "mamba", "attention"), False, 4, 1, 2),
    (("mamba", "attention"), True, 0, 4, 1),
    (("attention", "mamba"), False, 0, 2, 2)])
def test_prefill_matches_hf_float64(layer_types, rope, num_experts, kv_heads, n_groups):
    m = granite(seed=len(layer_types) + num_experts, layer_types=layer_types, rope=rope, num_experts=num_experts,
                kv_heads=kv_heads, n_groups=n_groups)
    assert_prefill_matches_hf(m, make_cache, batch=3, length=13, seed=1, atol=1e-9)


def test_prefill_matches_hf_float32():
    m = granite(dtype=torch.float32)
    assert_prefill_matches_hf(m, make_cache, batch=2, length=17, seed=2, atol=1e-4)


def test_config_carries_multipliers_and_routing():
    config = hs.from_hf(granite(multipliers=(3.0, 0.6, 0.2, 2.5))).config
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) == (3.0, 0.6, 2.5)
    assert config.attention.softmax_scale == 0.2 and config.attention.use_rope
    assert (config.moe.router, config.moe.top_k, config.moe.shared_intermediate_size) == ("topk_softmax", 2, 24)
    assert not hs.from_hf(granite(rope=False)).config.attention.use_rope


@pytest.mark.parametrize("rope", [True, False])
def test_ragged_prefill_extend_decode_equal_full_prefill(rope):
    m = granite(seed=3, layer_types=("attention", "mamba", "attention"), rope=rope)
    assert_split_forwards_match(hs.from_hf(m), make_cache, num_extend=3)


def test_shares_hf_parameters():
    m = granite()
    target = hs.from_hf(m)
    hf_layer = m.model.layers[0]
    assert target.embed.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    assert target.layers[0].mixer.in_proj.data_ptr() == hf_layer.mamba.in_proj.weight.data_ptr()
    assert target.layers[1].mixer.q_proj.data_ptr() == m.model.layers[1].self_attn.q_proj.weight.data_ptr()
    moe = target.layers[0].ffn
    assert moe.router.data_ptr() == hf_layer.block_sparse_moe.router.weight.data_ptr()
    assert moe.up.data_ptr() == hf_layer.block_sparse_moe.experts.gate_up_proj.data_ptr()
    fused = hf_layer.shared_mlp.input_linear.weight  # [2·I, hidden]: gate rows, then up rows
    assert moe.shared.gate_proj.data_ptr() == fused.data_ptr()
    assert moe.shared.up_proj.data_ptr() == fused[fused.shape[0] // 2:].data_ptr()
    assert moe.shared.down_proj.data_ptr() == hf_layer.shared_mlp.output_linear.weight.data_ptr()


@pytest.mark.parametrize("rope,num_experts", [(True, 4), (False, 0)])
def test_engine_greedy_matches_hf_generate_ragged(rope, num_experts):
    m = granite(seed=5, rope=rope, num_experts=num_experts)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (6, 11, 3)]
    engine = hs.Engine(hs.from_hf(m), max_batch_size=4)
    outs = engine.generate(prompts, hs.SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(m, prompts, 8)
    assert all(o.finish_reason == "length" for o in outs)


def test_load_hub_layout(tmp_path):
    """Experts and router under the names Granite models on the Hub use."""
    m = granite(seed=6)
    state = {}
    for name, tensor in m.state_dict().items():
        for new, old in HUB_NAMES:
            name = name.replace(new, old)
        state[name] = tensor.contiguous()
    assert any("input_linear" in n and "block_sparse_moe" in n for n in state)
    cfg = dict(m.config.to_dict(), architectures=["GraniteMoeHybridForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in state.items() if "rotary_emb" not in k}, str(tmp_path / "model.safetensors"))
    loaded = hs.load(tmp_path)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), float64_oracle():
        ref = m(ids, use_cache=False).logits
    assert max_err(loaded.prefill(make_cache(loaded), [0, 1], ids.tolist()), ref) <= 1e-9
