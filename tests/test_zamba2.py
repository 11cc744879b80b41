"""Zamba2: hybridspec's runtime against HF transformers' Zamba2ForCausalLM
(Mamba2 layers with shared transformer blocks: shared weights, per-occurrence
KV pages, LoRA adapters and linears, input [h, embeddings])."""
import json

import pytest
import torch
from safetensors.torch import save_file

import hybridspec as hs
from hybridspec.adapters import zamba2 as adapter
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.cli.main import main
from hybridspec.errors import ModelFilesError, UnsupportedModelError
from oracles import assert_prefill_matches_hf, assert_split_forwards_match, float64_oracle, hf_greedy, zamba2


def make_cache(model, max_seqs=4):
    return HybridCache(model.config, max_seqs=max_seqs, num_blocks=64, block_size=4, ring_slots=2,
                       dtype=model.dtype)


@pytest.mark.parametrize("blocks,num_mem_blocks,adapters,rope,kv_heads", [
    (("mamba", "hybrid", "mamba", "hybrid", "hybrid"), 2, True, True, 4),
    (("hybrid", "mamba", "hybrid", "mamba"), 1, False, False, 2)])
def test_prefill_matches_hf_float64(blocks, num_mem_blocks, adapters, rope, kv_heads):
    m = zamba2(seed=len(blocks), block_types=blocks, num_mem_blocks=num_mem_blocks, adapters=adapters, rope=rope,
               kv_heads=kv_heads)
    assert_prefill_matches_hf(m, make_cache, batch=3, length=13, seed=1, atol=1e-9)


def test_prefill_matches_hf_float32():
    assert_prefill_matches_hf(zamba2(dtype=torch.float32), make_cache, batch=2, length=17, seed=2, atol=1e-4)


def test_each_occurrence_has_its_own_kv_pages_and_shares_the_block_weights():
    m = zamba2()  # hybrid layers 1, 3, 4; blocks 0, 1, 0
    target = hs.from_hf(m)
    config = target.config
    assert config.layer_types == ("mamba2",) * 5 and config.attention_layers == [1, 3, 4]
    assert [config.shared_blocks.block_of(i) for i in (1, 3, 4)] == [0, 1, 0]
    assert make_cache(target).kv.k_cache.shape[0] == 3
    occurrences = [target.layers[i].shared for i in (1, 3, 4)]
    assert [o.attention.kv_layer for o in occurrences] == [0, 1, 2]
    hf_q = m.model.layers[1].shared_transformer.self_attn.q_proj.weight
    assert occurrences[0].attention.q_proj.data_ptr() == occurrences[2].attention.q_proj.data_ptr() == hf_q.data_ptr()
    assert occurrences[1].attention.q_proj.data_ptr() != hf_q.data_ptr()
    assert occurrences[0].attention.adapters["q"].down.data_ptr() != occurrences[2].attention.adapters["q"].down.data_ptr()
    assert target.num_parameters() == sum(p.numel() for p in m.parameters())


def test_ragged_prefill_extend_decode_equal_full_prefill():
    assert_split_forwards_match(hs.from_hf(zamba2(seed=3)), make_cache, num_extend=3)


def test_engine_greedy_matches_hf_generate_ragged():
    m = zamba2(seed=5)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (6, 11, 3)]
    engine = hs.Engine(hs.from_hf(m), max_batch_size=4)
    outs = engine.generate(prompts, hs.SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(m, prompts, 8)


def reference_logits(m, ids):
    with torch.no_grad(), float64_oracle():
        return m(ids, use_cache=False).logits


def test_load_with_and_without_the_tied_copies(tmp_path):
    """save_pretrained keeps each block once; a full state_dict repeats it at every occurrence: both load."""
    m = zamba2(seed=6)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(6))
    ref = reference_logits(m, ids)
    m.save_pretrained(tmp_path / "saved")
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text((tmp_path / "saved" / "config.json").read_text())
    save_file({k: v.contiguous().clone() for k, v in m.state_dict().items()}, str(full / "model.safetensors"))
    for path in (tmp_path / "saved", full):
        loaded = hs.load(path)
        assert (loaded.prefill(make_cache(loaded), [0, 1], ids.tolist()) - ref).abs().max().item() <= 1e-9


def test_load_refuses_tied_copies_that_differ(tmp_path):
    m = zamba2(seed=6)
    m.save_pretrained(tmp_path)
    state = {k: v.contiguous().clone() for k, v in m.state_dict().items()}
    state["model.layers.4.shared_transformer.self_attn.o_proj.weight"] += 1e-3  # layer 4 runs block 0, as layer 1
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelFilesError, match=r"layers\.4\.shared_transformer\.self_attn\.o_proj\.weight differs"):
        hs.load(tmp_path)


def test_load_is_strict_about_adapters(tmp_path):
    """Without use_shared_attention_adapter the q/k/v adapters of the 3 occurrences are 18 unused tensors."""
    zamba2(seed=6).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"use_shared_attention_adapter": False}))
    with pytest.raises(ModelFilesError, match=r"18 unused: .*linear_k_adapter_list"):
        hs.load(tmp_path)


def test_unsupported_settings_are_refused_by_name():
    cfg = zamba2().config.to_dict()
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads=2"):
        adapter.config_from_dict(cfg | {"num_key_value_heads": 2})
    with pytest.raises(UnsupportedModelError, match="add_bias_linear"):
        adapter.config_from_dict(cfg | {"add_bias_linear": True})


def test_check_cli_passes_on_a_saved_model_directory(tmp_path, capsys):
    zamba2(seed=0).save_pretrained(tmp_path)
    assert main(["check", "--quick", "--model", str(tmp_path), "--draft", "ngram"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith(("PASS", "FAIL"))]
    assert rows and all(r.startswith("PASS") for r in rows)
