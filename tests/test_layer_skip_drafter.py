"""The layer-skip draft (`draft="layers:N"`, `HybridModel.first_layers`): the target's own first N
layers, final norm and LM head, no weight copied. Its logits are HF's final norm and LM head on
HF's stream after layer N − 1; building it changes none of the target's bits; speculative output
equals plain output with it on Mamba-2, gated-DeltaNet and Zamba2 (shared blocks) targets and under
the rollback suite; typed refusals before anything is built."""
import pytest
import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.errors import ConfigError
from hybridspec.rollback import POLICIES, plain_outputs, run_suite, speculative_parity, workload
from oracles import bamba, float64_oracle, qwen3_next, zamba2

FAMILIES = {"bamba": lambda: bamba(seed=2, attn_layers=(1,), num_layers=4),
            "qwen3_next": lambda: qwen3_next(seed=2),
            "zamba2": lambda: zamba2(seed=2)}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """family -> (our float64 model, the HF model)."""
    out = {}
    for name, make in FAMILIES.items():
        m = make()
        path = tmp_path_factory.mktemp(name)
        m.save_pretrained(path)
        out[name] = (hs.load(path, dtype=torch.float64), m)
    return out


def prefill_logits(model, ids: list[list[int]]) -> torch.Tensor:
    cache = HybridCache(model.config, max_seqs=len(ids), num_blocks=32, block_size=4, ring_slots=2,
                        dtype=model.dtype)
    return model.prefill(cache, list(range(len(ids))), ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_draft_is_hf_s_head_on_the_stream_after_its_last_layer(family, loaded):
    target, m = loaded[family]
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad(), float64_oracle():
        hidden = m(torch.tensor(ids), output_hidden_states=True).hidden_states
    for n in range(1, target.config.num_layers):
        draft = target.first_layers(n)
        assert draft.config.num_layers == n and draft.config.layer_types == target.config.layer_types[:n]
        with torch.no_grad(), float64_oracle():
            ref = m.lm_head(m.model.final_layernorm(hidden[n]) if hasattr(m.model, "final_layernorm")
                            else m.model.norm(hidden[n]))
        got = prefill_logits(draft, ids)
        assert torch.allclose(got, ref, atol=1e-10, rtol=0), (n, (got - ref).abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_building_it_shares_every_weight_and_changes_no_target_bit(family, loaded):
    target, _ = loaded[family]
    ids = [[5, 9, 14, 3, 77, 21], [8, 8, 40]]
    before = prefill_logits(target, ids)
    draft = target.first_layers(target.config.num_layers - 1)
    owned = {p.data_ptr() for p in target.parameters()}
    assert all(p.data_ptr() in owned for p in draft.parameters())
    assert sum(p.numel() for p in draft.parameters()) < sum(p.numel() for p in target.parameters())
    assert torch.equal(prefill_logits(target, ids), before)


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_equals_plain_with_a_layer_skip_draft(family, loaded):
    target, _ = loaded[family]
    prompts, params = workload(target.vocab_size, seed=7, max_new_tokens=(12, 9))
    expected = plain_outputs(target, prompts, params)
    for n, gamma, policy in ((1, 4, "k=1"), (target.config.num_layers - 1, 3, "k=0")):
        result = speculative_parity(f"{family} layers:{n} γ={gamma}", target, f"layers:{n}", gamma,
                                    POLICIES[policy], prompts, params, expected)
        assert result.passed, result.detail


def test_the_rollback_suite_passes_with_a_layer_skip_draft(loaded):
    target, _ = loaded["bamba"]
    failed = [f"{r.name}: {r.detail}" for r in run_suite(target, "layers:2", "layers:2", quick=True)
              if not r.passed]
    assert not failed, failed


def test_bad_counts_are_refused_before_anything_is_built(loaded):
    target, _ = loaded["bamba"]
    layers = target.config.num_layers
    for bad in ("layers:0", "layers:x", "layers:", "layers:-1"):
        with pytest.raises(ConfigError, match="layers:N"):
            hs.Engine(target, draft=bad)
    with pytest.raises(ConfigError, match=f"1 to {layers - 1}"):
        hs.Engine(target, draft=f"layers:{layers}")
    for bad in (0, layers, True, 1.0):
        with pytest.raises(ConfigError, match="first_layers"):
            target.first_layers(bad)
