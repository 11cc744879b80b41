"""Bamba: hybridspec's runtime against HF transformers' BambaForCausalLM."""
import pytest
import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from oracles import assert_prefill_matches_hf, assert_split_forwards_match, bamba, hf_greedy


def make_cache(model, max_seqs=4):
    return HybridCache(model.config, max_seqs=max_seqs, num_blocks=64, block_size=4, ring_slots=2,
                       dtype=model.dtype)


@pytest.mark.parametrize("attn_layers,num_layers,kv_heads,n_groups", [
    ((1,), 3, 2, 1), ((0, 3), 4, 1, 2), ((), 2, 4, 1), ((0, 1), 2, 4, 1)])
def test_prefill_matches_hf_float64(attn_layers, num_layers, kv_heads, n_groups):
    m = bamba(seed=num_layers, attn_layers=attn_layers, num_layers=num_layers, kv_heads=kv_heads,
              n_groups=n_groups)
    assert_prefill_matches_hf(m, make_cache, batch=3, length=13, seed=1, atol=1e-9)


def test_prefill_matches_hf_float32():
    m = bamba(dtype=torch.float32)
    assert_prefill_matches_hf(m, make_cache, batch=2, length=17, seed=2, atol=1e-4)


def test_ragged_prefill_extend_decode_equal_full_prefill():
    m = bamba(seed=3, attn_layers=(0, 2), num_layers=3)
    assert_split_forwards_match(hs.from_hf(m), make_cache, num_extend=2)


def test_shares_hf_parameters():
    m = bamba()
    target = hs.from_hf(m)
    assert target.embed.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    mixer = target.layers[0].mixer
    assert mixer.in_proj.data_ptr() == m.model.layers[0].mamba.in_proj.weight.data_ptr()


def test_engine_greedy_matches_hf_generate_ragged():
    m = bamba(seed=5, attn_layers=(1,), num_layers=3)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (6, 11, 3)]
    engine = hs.Engine(hs.from_hf(m), max_batch_size=4)
    outs = engine.generate(prompts, hs.SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(m, prompts, 10)
    assert all(o.finish_reason == "length" for o in outs)
