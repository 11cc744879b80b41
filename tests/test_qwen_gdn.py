"""Qwen3-Next, Qwen3.5 and Qwen3.5 MoE (gated DeltaNet hybrids): hybridspec's
runtime against HF transformers' Qwen3NextForCausalLM, Qwen3_5ForCausalLM and
Qwen3_5MoeForCausalLM.

HF's `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule` (and
its RMSNorms and routers) cast to float32 inside even a float64 model;
`oracles.float64_oracle()` keeps float64 tensors float64 through those casts
(its patched `Tensor.to` / `.float` / `softmax`), which makes HF's float64
forward a float64 oracle. `test_unpatched_hf_differs_at_float32_precision`
checks the casts are real and that we agree with HF as shipped within float32
tolerance."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.errors import ModelFilesError
from oracles import (assert_prefill_matches_hf, assert_split_forwards_match, float64_oracle, hf_greedy, qwen3_5,
                     qwen3_5_moe, qwen3_next)

FAMILIES = {"qwen3_next": qwen3_next, "qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5_moe}


def make_cache(model, max_seqs=4):
    return HybridCache(model.config, max_seqs=max_seqs, num_blocks=64, block_size=4, ring_slots=2,
                       dtype=model.dtype)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("length", [7, 37])  # the token-by-token rule; the chunked form (>= 16 inputs, 2 chunks)
def test_prefill_matches_hf_float64(family, length):
    assert_prefill_matches_hf(FAMILIES[family](seed=length), make_cache, batch=3, length=length, seed=1, atol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_unpatched_hf_differs_at_float32_precision(family):
    m = FAMILIES[family](seed=2)
    ids = torch.randint(3, 97, (2, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        shipped = m(ids, use_cache=False).logits
    target = hs.from_hf(m)
    ours = target.prefill(make_cache(target), [0, 1], ids.tolist())
    gap = (ours - shipped).abs().max().item()
    assert 1e-10 < gap < 1e-4, gap  # HF's float32 casts are real, and the only difference
    assert target.dtype == torch.float64


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_matches_hf_float32(family):
    assert_prefill_matches_hf(FAMILIES[family](seed=3, dtype=torch.float32), make_cache, batch=2, length=17, seed=2,
                              atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_prefill_extend_decode_equal_full_prefill(family):
    assert_split_forwards_match(hs.from_hf(FAMILIES[family](seed=4)), make_cache, num_extend=3)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_matches_hf_generate_ragged(family):
    m = FAMILIES[family](seed=5)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (6, 19, 3)]
    engine = hs.Engine(hs.from_hf(m), max_batch_size=4)
    outs = engine.generate(prompts, hs.SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(m, prompts, 8)


def test_config_maps_layers_attention_and_moe():
    config = hs.from_hf(qwen3_next()).config
    assert config.layer_types == ("gdn", "attention", "gdn", "gdn")
    assert config.ffn_types == ("moe", "moe", "mlp", "moe")  # mlp_only_layers=(2,)
    a, gdn, moe = config.attention, config.gdn, config.moe
    assert (a.qk_norm, a.output_gate, a.rotary_dim, a.head_dim) == (True, True, 2, 8)
    assert (gdn.num_key_heads, gdn.num_value_heads, gdn.key_head_dim, gdn.value_head_dim, gdn.d_conv) == (2, 4, 8, 8, 4)
    assert (moe.router, moe.norm_topk_prob, moe.shared_gate, moe.shared_intermediate_size) == (
        "softmax_topk", True, True, 24)
    assert not hs.from_hf(qwen3_next(norm_topk_prob=False)).config.moe.norm_topk_prob
    assert hs.from_hf(qwen3_5_moe()).config.ffn_types == ("moe",) * 3
    assert hs.from_hf(qwen3_5()).config.family == "qwen3_5"


def test_full_attention_interval_sets_the_pattern():
    from hybridspec.adapters.qwen3_next import mixer_types
    assert mixer_types({"num_hidden_layers": 8, "full_attention_interval": 4}) == ("gdn",) * 3 + ("attention",) + (
        "gdn",) * 3 + ("attention",)


def test_tied_embeddings():
    m = qwen3_5(seed=6, tie=True)
    assert_prefill_matches_hf(m, make_cache, batch=2, length=9, seed=6, atol=1e-12)


def save_with_mtp(m, path):
    """save_pretrained's layout (per-expert tensors), plus MTP tensors as the released models carry."""
    m.save_pretrained(path)
    state = load_file(str(path / "model.safetensors"))
    hidden = m.config.hidden_size
    state |= {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, dtype=m.dtype),
              "mtp.norm.weight": torch.randn(hidden, dtype=m.dtype)}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return state


@pytest.mark.parametrize("family", FAMILIES)
def test_load_matches_hf_and_reports_mtp_unused(family, tmp_path):
    m = FAMILIES[family](seed=7)
    save_with_mtp(m, tmp_path)
    loaded = hs.load(tmp_path)
    assert sorted(loaded.load_report.unused) == ["mtp.fc.weight", "mtp.norm.weight"]
    assert "MTP" in str(loaded.load_report)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [type(m).__name__]
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), float64_oracle():
        ref = m(ids, use_cache=False).logits
    assert (loaded.prefill(make_cache(loaded), [0, 1], ids.tolist()) - ref).abs().max().item() <= 1e-12


@pytest.mark.parametrize("family,name", [("qwen3_next", "model.layers.0.linear_attn.in_proj_ba.weight"),
                                         ("qwen3_5", "model.layers.2.linear_attn.in_proj_z.weight"),
                                         ("qwen3_5_moe", "model.layers.0.self_attn.q_norm.weight")])
def test_load_is_strict(family, name, tmp_path):
    state = save_with_mtp(FAMILIES[family](seed=8), tmp_path)
    del state[name]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFilesError, match="missing"):
        hs.load(tmp_path)


def test_load_rejects_an_unknown_tensor(tmp_path):
    state = save_with_mtp(qwen3_5(seed=9), tmp_path)
    state["model.layers.0.linear_attn.extra.weight"] = torch.zeros(2, dtype=torch.float64)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFilesError, match="unused"):
        hs.load(tmp_path)


@pytest.mark.parametrize("family", ["qwen3_5_moe"])  # the richest of the three (MoE, shared expert, split GDN
# projections); the parity and state checks run on every family in test_gdn_spec.py
def test_check_cli_on_a_saved_model_directory(family, tmp_path, capsys):
    from hybridspec.cli.main import main
    FAMILIES[family](seed=10).save_pretrained(tmp_path / "target")
    assert main(["check", "--quick", "--model", str(tmp_path / "target"), "--draft", "perturbed"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert family in out and "gdn" in out and rows and all(r.startswith("PASS") for r in rows)


@pytest.mark.parametrize("moe", [False, True])
def test_multimodal_model_runs_its_text_model(moe, tmp_path):
    """The released layout (Qwen3_5(Moe)ForConditionalGeneration): the text model's logits equal HF's on
    text input, from the HF object and from its saved directory; the vision encoder is named unused."""
    from oracles import qwen3_5_multimodal
    m = qwen3_5_multimodal(seed=11, moe=moe)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(11))
    with torch.no_grad(), float64_oracle():
        ref = m(input_ids=ids, use_cache=False).logits
    m.save_pretrained(tmp_path)
    for target in (hs.from_hf(m), hs.load(tmp_path)):
        assert target.config.ffn_types == (("moe",) if moe else ("mlp",)) * 3
        assert (target.prefill(make_cache(target), [0, 1], ids.tolist()) - ref).abs().max().item() <= 1e-12
        unused = target.load_report.unused
        assert unused and all(name.startswith("model.visual.") for name in unused)
        assert "vision encoder" in str(target.load_report)


def test_bf16_weights_loaded_as_float32_form_the_norms_like_hf(tmp_path):
    """Zero-centred norm weights: 1 + w is formed from the widened w (HF's float32 1 + w), not rounded to
    bfloat16 first, which would move the logits by ~1e-3."""
    m = qwen3_5(seed=12, dtype=torch.bfloat16)
    m.save_pretrained(tmp_path)
    hf32 = m.to(torch.float32)
    loaded = hs.load(tmp_path, dtype=torch.float32)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        ref = hf32(ids, use_cache=False).logits
    assert (loaded.prefill(make_cache(loaded), [0, 1], ids.tolist()) - ref).abs().max().item() <= 1e-4
