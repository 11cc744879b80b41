"""Nemotron-H with mixture-of-experts ("E") blocks, as in Nemotron 3 Nano:
hybridspec's runtime against HF transformers' NemotronHForCausalLM."""
import json

import pytest
import torch
from safetensors.torch import save_file

import hybridspec as hs
from hybridspec.adapters import nemotron_h as adapter
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.cli.main import main
from hybridspec.errors import ConfigError, ModelFilesError, UnsupportedModelError
from hybridspec.models.ffn import sigmoid_group_topk
from oracles import assert_prefill_matches_hf, assert_split_forwards_match, float64_oracle, hf_greedy, nemotron_h_moe


def make_cache(model, max_seqs=4):
    return HybridCache(model.config, max_seqs=max_seqs, num_blocks=64, block_size=4, ring_slots=2,
                       dtype=model.dtype)


@pytest.mark.parametrize("pattern,n_group,topk_group,norm", [("ME*EM", 4, 2, True), ("E-M*E", 1, 1, False)])
def test_prefill_matches_hf_float64(pattern, n_group, topk_group, norm):
    m = nemotron_h_moe(seed=len(pattern) + n_group, pattern=pattern, n_group=n_group, topk_group=topk_group,
                       norm_topk_prob=norm)
    assert_prefill_matches_hf(m, make_cache, batch=3, length=13, seed=1, atol=1e-9)


def test_prefill_matches_hf_float32():
    m = nemotron_h_moe(dtype=torch.float32)
    assert_prefill_matches_hf(m, make_cache, batch=2, length=17, seed=2, atol=1e-4)


def test_config_maps_moe_blocks():
    config = hs.from_hf(nemotron_h_moe(pattern="ME*EM")).config
    assert config.layer_types == ("mamba2", "none", "attention", "none", "mamba2")
    assert config.ffn_types == ("none", "moe", "none", "moe", "none")
    moe = config.moe
    assert (moe.router, moe.gated, moe.activation) == ("sigmoid_group_topk", False, "relu2")
    assert (moe.num_experts, moe.top_k, moe.n_group, moe.topk_group) == (8, 3, 4, 2)
    assert (moe.routed_scaling_factor, moe.norm_topk_prob, moe.shared_intermediate_size) == (2.5, True, 24)


def test_router_keeps_to_the_chosen_groups_and_weighs_by_unbiased_scores():
    """Groups ranked by the sum of their two best biased scores; weights are the unbiased sigmoid scores."""
    cfg = hs.from_hf(nemotron_h_moe()).config.moe  # 8 experts in 4 groups of 2, top 2 groups, top_k 3
    logits = torch.tensor([[3.0, -3.0, 0.0, 0.1, 2.0, 2.0, -1.0, -1.0]], dtype=torch.float64)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 0.0], dtype=torch.float64)
    weights, ids = sigmoid_group_topk(logits, bias, cfg)
    assert sorted(ids[0].tolist()) == [4, 5, 6]  # group 3 (bias) and group 2 (4 + 5) beat group 0 (0 + 3)
    s = logits.sigmoid()[0, [4, 5, 6]]
    expected = dict(zip([4, 5, 6], (s / s.sum() * 2.5).tolist()))
    assert {i: w for i, w in zip(ids[0].tolist(), weights[0].tolist())} == pytest.approx(expected, abs=1e-15)


def test_ragged_prefill_extend_decode_equal_full_prefill():
    assert_split_forwards_match(hs.from_hf(nemotron_h_moe(seed=3, pattern="M*EME")), make_cache, num_extend=3)


def test_shares_hf_parameters():
    m = nemotron_h_moe(pattern="ME*EM")
    ffn, hf = hs.from_hf(m).layers[1].ffn, m.model.layers[1].mixer
    assert ffn.up.data_ptr() == hf.experts.up_proj.data_ptr()
    assert ffn.down.data_ptr() == hf.experts.down_proj.data_ptr()
    assert ffn.router.data_ptr() == hf.gate.weight.data_ptr()
    assert ffn.score_bias.data_ptr() == hf.gate.e_score_correction_bias.data_ptr()
    assert ffn.shared.up_proj.data_ptr() == hf.shared_experts.up_proj.weight.data_ptr()


def test_engine_greedy_matches_hf_generate_ragged():
    m = nemotron_h_moe(seed=5)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (6, 11, 3)]
    engine = hs.Engine(hs.from_hf(m), max_batch_size=4)
    outs = engine.generate(prompts, hs.SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(m, prompts, 8)


def save_hub_layout(m, path):
    """config.json with `hybrid_override_pattern`, weights under `backbone.` with one tensor per expert."""
    cfg = m.config.to_dict()
    pattern = m.config.hybrid_override_pattern
    cfg.pop("layers_block_type")
    cfg.update(hybrid_override_pattern=pattern, architectures=["NemotronHForCausalLM"])
    (path / "config.json").write_text(json.dumps(cfg))
    state = {}
    for name, t in m.state_dict().items():
        name = name.replace("model.", "backbone.", 1)
        if name.endswith(("experts.up_proj", "experts.down_proj")):
            state |= {f"{name.rsplit('.', 1)[0]}.{e}.{name.rsplit('.', 1)[1]}.weight": w.contiguous()
                      for e, w in enumerate(t)}
        else:
            state[name] = t.contiguous()
    save_file(state, str(path / "model.safetensors"))
    return state


def test_load_hub_layout_with_per_expert_tensors(tmp_path):
    m = nemotron_h_moe(seed=6)
    save_hub_layout(m, tmp_path)
    loaded = hs.load(tmp_path)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), float64_oracle():
        ref = m(ids, use_cache=False).logits
    assert (loaded.prefill(make_cache(loaded), [0, 1], ids.tolist()) - ref).abs().max().item() <= 1e-9


def test_load_is_strict_about_the_moe_tensors(tmp_path):
    m = nemotron_h_moe(seed=6)
    state = save_hub_layout(m, tmp_path)
    del state["backbone.layers.1.mixer.gate.e_score_correction_bias"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelFilesError, match="layers.1.ffn.router.e_score_correction_bias"):
        hs.load(tmp_path)
    del state["backbone.layers.3.mixer.experts.5.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelFilesError, match=r"experts \[0, 1, 2, 3, 4, 6, 7\]"):
        hs.load(tmp_path)


def test_unsupported_moe_settings_are_refused_by_name():
    cfg = nemotron_h_moe().config.to_dict()
    with pytest.raises(UnsupportedModelError, match="moe_latent_size=8"):
        adapter.config_from_dict(cfg | {"moe_latent_size": 8})
    with pytest.raises(ConfigError, match="topk_group=5"):
        adapter.config_from_dict(cfg | {"topk_group": 5})


def test_check_cli_passes_on_a_saved_model_directory(tmp_path, capsys):
    nemotron_h_moe(seed=0).save_pretrained(tmp_path)
    assert main(["check", "--quick", "--model", str(tmp_path), "--draft", "ngram"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith(("PASS", "FAIL"))]
    assert rows and all(r.startswith("PASS") for r in rows)
