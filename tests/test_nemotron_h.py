"""Nemotron-H: hybridspec's runtime against HF transformers' NemotronHForCausalLM."""
import json

import pytest
import torch
from safetensors.torch import save_file

import hybridspec as hs
from hybridspec.adapters import nemotron_h as adapter
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.errors import ConfigError, UnsupportedModelError
from oracles import assert_prefill_matches_hf, assert_split_forwards_match, float64_oracle, hf_greedy, nemotron_h


def make_cache(model, max_seqs=4):
    return HybridCache(model.config, max_seqs=max_seqs, num_blocks=64, block_size=4, ring_slots=2,
                       dtype=model.dtype)


def max_err(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("pattern,kv_heads,n_groups", [
    ("M*M-", 2, 2), ("-*MM*-", 4, 1), ("MM-M", 2, 2), ("*-*", 1, 1)])
def test_prefill_matches_hf_float64(pattern, kv_heads, n_groups):
    m = nemotron_h(seed=len(pattern), pattern=pattern, kv_heads=kv_heads, n_groups=n_groups)
    assert_prefill_matches_hf(m, make_cache, batch=3, length=13, seed=1, atol=1e-9)


def test_prefill_matches_hf_float32():
    m = nemotron_h(dtype=torch.float32)
    assert_prefill_matches_hf(m, make_cache, batch=2, length=17, seed=2, atol=1e-4)


def test_config_maps_blocks_to_mixer_and_ffn():
    config = hs.from_hf(nemotron_h(pattern="M*M-")).config
    assert config.layer_types == ("mamba2", "attention", "mamba2", "none")
    assert config.ffn_types == ("none", "none", "none", "mlp")
    assert not config.attention.use_rope  # HF's NemotronHAttention applies no positional embedding
    assert (config.mlp.activation, config.mlp.gated) == ("relu2", False)


def test_dt_clamp_reads_time_step_limit():
    """Δ is clamped at `time_step_limit` (or its alias `mamba_dt_limit`), as in HF's mixer; `time_step_min`
    only initialises dt_bias."""
    cfg = nemotron_h(time_step_min=0.5).config.to_dict()
    assert adapter.config_from_dict(cfg).mamba2.time_step_limit == (0.0, float("inf"))
    cfg["time_step_limit"] = [0.25, 4]
    assert adapter.config_from_dict(cfg).mamba2.time_step_limit == (0.25, 4.0)
    cfg["mamba_dt_limit"] = [0.125, 2.0]  # HF's config takes this name over time_step_limit
    assert adapter.config_from_dict(cfg).mamba2.time_step_limit == (0.125, 2.0)
    for bad in ([0.1], [0.5, 0.1], ["0", 1], -1.0):
        cfg["mamba_dt_limit"] = bad
        with pytest.raises(ConfigError, match="mamba_dt_limit"):
            adapter.config_from_dict(cfg)


def test_ragged_prefill_extend_decode_equal_full_prefill():
    m = nemotron_h(seed=3, pattern="M*-M*")
    assert_split_forwards_match(hs.from_hf(m), make_cache, num_extend=3)


def test_shares_hf_parameters():
    m = nemotron_h(pattern="M*M-")
    target = hs.from_hf(m)
    assert target.embed.data_ptr() == m.model.embeddings.weight.data_ptr()
    assert target.layers[0].mixer.in_proj.data_ptr() == m.model.layers[0].mixer.in_proj.weight.data_ptr()
    assert target.layers[0].input_norm.weight.data_ptr() == m.model.layers[0].norm.weight.data_ptr()
    assert target.layers[1].mixer.k_proj.data_ptr() == m.model.layers[1].mixer.k_proj.weight.data_ptr()
    assert target.layers[3].ffn.up_proj.data_ptr() == m.model.layers[3].mixer.up_proj.weight.data_ptr()
    assert target.layers[3].ffn_norm.weight.data_ptr() == m.model.layers[3].norm.weight.data_ptr()
    assert target.lm_head.data_ptr() == m.lm_head.weight.data_ptr()


def test_engine_greedy_matches_hf_generate_ragged():
    m = nemotron_h(seed=5, pattern="M*M-")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (6, 11, 3)]
    engine = hs.Engine(hs.from_hf(m), max_batch_size=4)
    outs = engine.generate(prompts, hs.SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(m, prompts, 8)
    assert all(o.finish_reason == "length" for o in outs)


def test_load_hub_layout(tmp_path):
    """config.json with `hybrid_override_pattern` and weights under `backbone.`, as on the Hub."""
    m = nemotron_h(seed=6, pattern="M-*M")
    cfg = m.config.to_dict()
    cfg.pop("layers_block_type")
    cfg.update(hybrid_override_pattern="M-*M", architectures=["NemotronHForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({k.replace("model.", "backbone.", 1): v.contiguous() for k, v in m.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    loaded = hs.load(tmp_path)
    assert loaded.config.layer_types == ("mamba2", "none", "attention", "mamba2")
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), float64_oracle():
        ref = m(ids, use_cache=False).logits
    assert max_err(loaded.prefill(make_cache(loaded), [0, 1], ids.tolist()), ref) <= 1e-9


def test_unknown_layer_characters_are_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="'X'"):
        adapter.config_from_dict({"hybrid_override_pattern": "MX*", "vocab_size": 97, "hidden_size": 32,
                                  "num_attention_heads": 4})
