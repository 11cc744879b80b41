"""Falcon-H1: hybridspec's runtime against HF transformers' FalconH1ForCausalLM
(attention and Mamba2 in parallel in every layer, µP multipliers)."""
import json

import pytest
import torch

import hybridspec as hs
from hybridspec.adapters import falcon_h1 as adapter
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.cli.main import main
from hybridspec.errors import ModelFilesError, UnsupportedModelError
from oracles import assert_prefill_matches_hf, assert_split_forwards_match, falcon_h1, float64_oracle, hf_greedy


def make_cache(model, max_seqs=4):
    return HybridCache(model.config, max_seqs=max_seqs, num_blocks=64, block_size=4, ring_slots=2,
                       dtype=model.dtype)


@pytest.mark.parametrize("rms_norm,norm_before_gate,kv_heads,n_groups", [
    (True, True, 2, 2), (True, False, 4, 1), (False, True, 1, 2)])
def test_prefill_matches_hf_float64(rms_norm, norm_before_gate, kv_heads, n_groups):
    m = falcon_h1(seed=kv_heads + n_groups, rms_norm=rms_norm, norm_before_gate=norm_before_gate, kv_heads=kv_heads,
                  n_groups=n_groups)
    assert_prefill_matches_hf(m, make_cache, batch=3, length=13, seed=1, atol=1e-9)


def test_prefill_matches_hf_float32():
    assert_prefill_matches_hf(falcon_h1(dtype=torch.float32), make_cache, batch=2, length=17, seed=2, atol=1e-4)


def test_every_layer_holds_kv_pages_and_recurrent_state():
    target = hs.from_hf(falcon_h1(num_layers=3))
    config = target.config
    assert config.layer_types == ("parallel",) * 3 and config.ffn_types == ("mlp",) * 3
    assert config.attention_layers == config.mamba_layers == [0, 1, 2]
    cache = make_cache(target)
    assert cache.kv.k_cache.shape[0] == 3 and len(cache.states.ssm_states) == 3
    assert [layer.state_layer for layer in target.recurrent_layers] == [0, 1, 2]
    assert [layer.mixer.attention.kv_layer for layer in target.layers] == [0, 1, 2]


def test_multipliers_map_onto_the_config():
    config = hs.from_hf(falcon_h1()).config
    assert config.embedding_multiplier == 1.7 and config.logits_scaling == pytest.approx(1 / 0.6)
    assert config.attention.softmax_scale == pytest.approx(1.3 * 8 ** -0.5)
    assert config.mamba2.in_proj_multipliers == pytest.approx((0.9 * 1.2, 0.9 * 0.8, 0.9 * 0.6, 0.9 * 1.5, 0.9 * 0.7))
    assert (config.mlp.gate_multiplier, config.mlp.down_multiplier) == (0.7, 1.4)
    p = config.parallel
    assert (p.attention_in_multiplier, p.attention_out_multiplier, p.mamba_out_multiplier) == (0.8, 1.2, 1.1)
    assert config.mamba2.d_inner == 48 and config.mamba2.norm == "norm_then_gate"


def test_ragged_prefill_extend_decode_equal_full_prefill():
    assert_split_forwards_match(hs.from_hf(falcon_h1(seed=3)), make_cache, num_extend=3)


def test_shares_hf_parameters():
    m = falcon_h1()
    layer, hf = hs.from_hf(m).layers[1], m.model.layers[1]
    assert layer.mixer.mamba.in_proj.data_ptr() == hf.mamba.in_proj.weight.data_ptr()
    assert layer.mixer.attention.k_proj.data_ptr() == hf.self_attn.k_proj.weight.data_ptr()
    assert layer.ffn.gate_proj.data_ptr() == hf.feed_forward.gate_proj.weight.data_ptr()
    assert layer.input_norm.weight.data_ptr() == hf.input_layernorm.weight.data_ptr()


def test_engine_greedy_matches_hf_generate_ragged():
    m = falcon_h1(seed=5)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (6, 11, 3)]
    engine = hs.Engine(hs.from_hf(m), max_batch_size=4)
    outs = engine.generate(prompts, hs.SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(m, prompts, 8)


def test_load_saved_model_directory(tmp_path):
    m = falcon_h1(seed=6)
    m.save_pretrained(tmp_path)
    loaded = hs.load(tmp_path)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), float64_oracle():
        ref = m(ids, use_cache=False).logits
    assert (loaded.prefill(make_cache(loaded), [0, 1], ids.tolist()) - ref).abs().max().item() <= 1e-9


def test_load_is_strict_about_the_norm_variant(tmp_path):
    """A config without mamba_rms_norm implies no Mamba norm weight: the saved ones are unused tensors."""
    falcon_h1(seed=6, rms_norm=True).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"mamba_rms_norm": False}))
    with pytest.raises(ModelFilesError, match=r"unused: .*layers\.0\.mixer\.mamba\.norm\.weight"):
        hs.load(tmp_path)


def test_unsupported_settings_are_refused_by_name():
    cfg = falcon_h1().config.to_dict()
    with pytest.raises(UnsupportedModelError, match="projectors_bias=True"):
        adapter.config_from_dict(cfg | {"projectors_bias": True})


def test_check_cli_passes_on_a_saved_model_directory(tmp_path, capsys):
    falcon_h1(seed=0).save_pretrained(tmp_path)
    assert main(["check", "--quick", "--model", str(tmp_path), "--draft", "ngram"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith(("PASS", "FAIL"))]
    assert rows and all(r.startswith("PASS") for r in rows)
