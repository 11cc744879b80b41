"""Nemotron-H with mixture-of-experts layers (Nemotron 3 Nano) as GGUF, in llama.cpp's
`nemotron_h_moe` layout: stacked experts, router, correction bias and shared expert under llama.cpp's
names and keys; the file loads with HF's logits and greedy output; quantized, it multiplies what
`hs.load(dir, quantize=...)` does; loading names a missing expert tensor."""
from __future__ import annotations

import pytest
import torch

import hybridspec as hs
from hybridspec.adapters.gguf.reader import metadata, open_file
from hybridspec.adapters.gguf.writer import canonical_weights, stored_tensors, write_file, write_gguf
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.errors import ModelFilesError, UnsupportedModelError
from hybridspec.kernels.quant.weight import QuantWeight
from native_cpu import x86_with_compiler
from oracles import hf_greedy, nemotron_h_moe

pytest.importorskip("gguf")
IDS = torch.randint(3, 97, (2, 13), generator=torch.Generator().manual_seed(4))


def logits(model) -> torch.Tensor:
    cache = HybridCache(model.config, max_seqs=2, num_blocks=16, block_size=4, ring_slots=2, dtype=model.dtype)
    return model.prefill(cache, [0, 1], IDS.tolist())


@pytest.fixture
def written(tmp_path):
    """(HF model, its directory, its float GGUF): pattern ME*EM, 8 experts in 4 groups, top 2 groups."""
    m = nemotron_h_moe(seed=2, dtype=torch.float32)
    m.save_pretrained(tmp_path / "hf")
    return m, tmp_path / "hf", write_gguf(tmp_path / "hf", tmp_path / "model.gguf")


def test_the_file_holds_llama_cpps_names_and_keys(written):
    _, _, path = written
    opened = open_file(path)
    meta, names = metadata(opened), {t.name: tuple(reversed(t.shape.tolist())) for t in opened.tensors}
    assert meta["general.architecture"] == "nemotron_h_moe"
    assert meta["nemotron_h_moe.feed_forward_length"] == [0, 16, 0, 16, 0]
    assert (meta["nemotron_h_moe.expert_count"], meta["nemotron_h_moe.expert_used_count"]) == (8, 3)
    assert (meta["nemotron_h_moe.expert_group_count"], meta["nemotron_h_moe.expert_group_used_count"]) == (4, 2)
    assert meta["nemotron_h_moe.expert_shared_feed_forward_length"] == 24
    assert names["blk.1.ffn_up_exps.weight"] == (8, 16, 32) and names["blk.1.ffn_down_exps.weight"] == (8, 32, 16)
    assert names["blk.1.ffn_gate_inp.weight"] == (8, 32) and names["blk.1.exp_probs_b.bias"] == (8,)
    assert names["blk.3.ffn_up_shexp.weight"] == (24, 32) and "blk.3.attn_norm.weight" in names


def test_the_file_has_hfs_logits_and_greedy_output(written):
    m, directory, path = written
    model = hs.load(path)
    with torch.no_grad():
        reference = m(IDS, use_cache=False).logits
    got, expected = logits(model), logits(hs.load(directory))
    assert (got - expected).abs().max() <= 1e-6 * expected.abs().max()
    assert (got - reference).abs().max().item() <= 1e-4
    prompts = [IDS[0, :n].tolist() for n in (5, 11)]
    outs = hs.Engine(model, max_batch_size=2).generate(prompts, hs.SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(m, prompts, 8)


@x86_with_compiler
def test_a_q8_0_file_multiplies_what_load_quantize_does(written, tmp_path):
    _, directory, _ = written
    write_gguf(directory, tmp_path / "q8.gguf", "q8_0")
    model = hs.load(tmp_path / "q8.gguf")
    assert isinstance(model.layers[1].ffn.shared.up_proj, QuantWeight)
    assert torch.equal(logits(model), logits(hs.load(directory, quantize="q8_0")))


def test_a_missing_expert_tensor_is_named(written, tmp_path):
    _, directory, path = written
    config, weights = canonical_weights(directory)
    tensors = stored_tensors(config, weights, None)
    tensors.pop("blk.3.ffn_down_exps.weight")
    meta = {k: v for k, v in metadata(open_file(path)).items() if k != "general.architecture"}
    write_file(tmp_path / "broken.gguf", "nemotron_h_moe", meta, tensors)
    with pytest.raises(ModelFilesError, match=r"missing 1: blk\.3\.ffn_down_exps\.weight"):
        hs.load(tmp_path / "broken.gguf")


def test_a_multi_token_prediction_block_appended_is_set_aside(written, tmp_path):
    """Nemotron 3 Nano's converter appends its MTP head as one more block (attention and experts),
    counted in block_count and the per-layer arrays, and says so in nextn_predict_layers."""
    _, directory, path = written
    config, weights = canonical_weights(directory)
    tensors = stored_tensors(config, weights, None)
    tensors |= {name.replace("blk.3.", "blk.5."): value for name, value in tensors.items() if name.startswith("blk.3.")}
    meta = {k: v for k, v in metadata(open_file(path)).items() if k != "general.architecture"}
    key = "nemotron_h_moe."
    meta |= {key + "block_count": 6, key + "nextn_predict_layers": 1,
             key + "attention.head_count_kv": meta[key + "attention.head_count_kv"] + [2],
             key + "feed_forward_length": meta[key + "feed_forward_length"] + [16]}
    write_file(tmp_path / "mtp.gguf", "nemotron_h_moe", meta, tensors)
    model = hs.load(tmp_path / "mtp.gguf")
    assert model.config.num_layers == 5 and torch.equal(logits(model), logits(hs.load(path)))


def test_mlp_and_expert_layers_together_are_refused_by_name(tmp_path):
    nemotron_h_moe(pattern="M-E*", dtype=torch.float32).save_pretrained(tmp_path / "hf")
    with pytest.raises(UnsupportedModelError, match=r"both MLP \('-'\) and expert \('E'\) layers"):
        write_gguf(tmp_path / "hf", tmp_path / "model.gguf")
