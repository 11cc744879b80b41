"""`HybridModel.pack_for_cpu`: linear weights laid out input-major (for CPU
one-row products) with the same values, the same outputs and ties kept;
`hs.load` packs on CPU unless told not to."""
from __future__ import annotations

import pytest
import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.models.packing import LINEAR_WEIGHTS
from oracles import bamba, float64_oracle, jamba, zamba2


def linear_weights(model):
    return {f"{m}.{n}": w for m, module in model.named_modules()
            for n, w in module.named_parameters(recurse=False) if n in LINEAR_WEIGHTS and w.dim() == 2}


def greedy(model, prompt, n=6):
    engine = hs.Engine(model, max_batch_size=1, max_model_len=len(prompt) + n + 1)
    return engine.generate([prompt], hs.SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("build", [bamba, jamba, zamba2])
def test_packing_keeps_values_and_outputs(build):
    m = build(seed=3)
    shared, packed = hs.from_hf(m), hs.from_hf(m).pack_for_cpu()
    before, after = linear_weights(shared), linear_weights(packed)
    assert before.keys() == after.keys() and before
    for name, weight in after.items():
        assert weight.t().is_contiguous(), f"{name} is not input-major"
        assert torch.equal(weight, before[name]), name
    prompt = [5, 17, 3, 42, 8, 11, 2]
    assert greedy(packed, prompt) == greedy(shared, prompt)
    ids = torch.tensor([prompt])
    with torch.no_grad(), float64_oracle():
        want = m(ids).logits[0, -1]
    cache = HybridCache(packed.config, max_seqs=1, num_blocks=4, block_size=16, dtype=packed.dtype)
    got = packed.prefill(cache, [0], [prompt], last_only=True)[0, -1]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_packing_keeps_tied_weights_tied_and_hf_untouched():
    m = bamba(seed=1)
    m.lm_head.weight = m.model.embed_tokens.weight  # tied, as tie_word_embeddings=True builds it
    m.config.tie_word_embeddings = True
    model = hs.from_hf(m)
    assert model.lm_head is model.embed
    hf_pointers = {p.data_ptr() for p in m.parameters()}
    model.pack_for_cpu()
    assert model.lm_head is model.embed and model.lm_head.t().is_contiguous()
    assert all(p.is_contiguous() for p in m.parameters())  # the HF model keeps its own layout
    assert {p.data_ptr() for p in m.parameters()} == hf_pointers
    assert model.pack_for_cpu() is model  # packing twice changes nothing


def test_load_packs_on_cpu_unless_told_not_to(tmp_path):
    bamba(seed=2).save_pretrained(tmp_path)
    assert hs.load(tmp_path).lm_head.t().is_contiguous()
    assert hs.load(tmp_path, pack=False).lm_head.is_contiguous()
