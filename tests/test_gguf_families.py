"""GGUF files of Falcon-H1 (`falcon-h1`) and Jamba (`jamba`) in llama.cpp's layout: a tiny HF model
written as GGUF (Falcon-H1's µP multipliers folded into its weights, as llama.cpp's converter does)
loads with HF's logits and greedy tokens; a Q8_0 file loads quantized and runs; loading is strict."""
from __future__ import annotations

import pytest
import torch

import hybridspec as hs
import oracles
from hybridspec.adapters.gguf.reader import as_float, metadata, open_file
from hybridspec.adapters.gguf.writer import canonical_weights, stored_tensors, write_file, write_gguf
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.cli.main import main
from hybridspec.errors import ModelFilesError, UnsupportedModelError
from hybridspec.kernels.quant.weight import QuantWeight
from native_cpu import x86_with_compiler

pytest.importorskip("gguf")
TOKENS = [5, 7, 9, 11, 3, 2, 40, 50, 60, 61, 62, 17]
# llama.cpp's graph normalises the Mamba-2 output after the gate: Falcon-H1 with mamba_norm_before_gate=False
FAMILIES = {
    "falcon-h1": lambda: oracles.falcon_h1(norm_before_gate=False, dtype=torch.float32),
    "jamba": lambda: oracles.jamba(dtype=torch.float32),
}


def logits(model) -> torch.Tensor:
    cache = HybridCache(model.config, max_seqs=1, num_blocks=4, block_size=16, ring_slots=2, dtype=model.dtype,
                        device=model.device)
    return model.prefill(cache, [0], [TOKENS])[0]  # [len, vocab]


def hf_logits(m) -> torch.Tensor:
    with torch.no_grad():
        return m(torch.tensor([TOKENS]), use_cache=False).logits[0]


def hf_greedy(m, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's greedy continuation of one prompt, each step a whole forward without a cache (HF's cached
    generate falls back to slow reference kernels on CPU)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(m(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def written(family, tmp_path, fmt=None):
    m = FAMILIES[family]()
    m.save_pretrained(tmp_path / "hf")
    write_gguf(tmp_path / "hf", tmp_path / "model.gguf", fmt)
    return m, tmp_path / "hf", tmp_path / "model.gguf"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_float_gguf_has_hf_logits_and_greedy_tokens(family, tmp_path):
    m, _, path = written(family, tmp_path)
    model, expected = hs.load(path), hf_logits(m)
    assert (logits(model) - expected).abs().max() <= 1e-5 * expected.abs().max()
    out = hs.Engine(model, max_batch_size=1).generate([TOKENS[:7]], hs.SamplingParams(max_new_tokens=5,
                                                                                      ignore_eos=True))
    assert out[0].token_ids == hf_greedy(m, TOKENS[:7], 5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_tensor_names_are_those_gguf_py_maps_the_hf_names_to(family, tmp_path):
    """As llama.cpp's converter names them: gguf-py's map of each HF name (dt_bias renamed dt_proj.bias,
    per-expert weights stacked under the merged `mlp.experts.{gate,up,down}_proj` names)."""
    import gguf
    from safetensors.torch import load_file
    m, directory, path = written(family, tmp_path)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.FALCON_H1 if family == "falcon-h1" else gguf.MODEL_ARCH.JAMBA,
                                     m.config.num_hidden_layers)
    expected = set()
    for name in load_file(str(directory / "model.safetensors")):
        if ".experts." in name:
            layer = name.split(".")[2]
            expected |= {names.get_name(f"model.layers.{layer}.mlp.experts.{p}.weight", try_suffixes=(".weight",))
                         for p in ("gate_proj", "up_proj", "down_proj")}
        else:
            expected.add(names.get_name(name.replace(".dt_bias", ".dt_proj.bias"), try_suffixes=(".weight", ".bias")))
    assert {t.name for t in open_file(path).tensors} == expected


def test_falcon_h1_multipliers_are_folded_into_the_weights_as_llama_cpp_stores_them(tmp_path):
    m, _, path = written("falcon-h1", tmp_path)
    stored = {t.name: as_float(t) for t in open_file(path).tensors}
    c, hf = m.config, m.model.layers[0]
    expected = {"token_embd.weight": m.model.embed_tokens.weight * c.embedding_multiplier,
                "output.weight": m.lm_head.weight * c.lm_head_multiplier,
                "blk.0.attn_k.weight": hf.self_attn.k_proj.weight * (c.key_multiplier * c.attention_in_multiplier),
                "blk.0.attn_output.weight": hf.self_attn.o_proj.weight * c.attention_out_multiplier,
                "blk.0.ssm_in.weight": hf.mamba.in_proj.weight * hf.mamba.mup_vector.reshape(-1, 1) * c.ssm_in_multiplier,
                "blk.0.ffn_gate.weight": hf.feed_forward.gate_proj.weight * c.mlp_multipliers[0],
                "blk.0.ffn_norm": hf.pre_ff_layernorm.weight}  # no .weight suffix, as gguf-py names it
    for name, tensor in expected.items():
        torch.testing.assert_close(stored[name], tensor.detach(), rtol=1e-6, atol=0, msg=name)
    config = hs.load(path).config  # read back, every multiplier is 1
    assert (config.embedding_multiplier, config.logits_scaling, config.mlp.gate_multiplier) == (1.0, 1.0, 1.0)
    assert config.attention.softmax_scale == config.attention.head_dim ** -0.5


@pytest.mark.parametrize("layout", [
    # M M A M M / mlp moe mlp moe mlp (Jamba-v0.1's periods); M M, dense MLPs only (no key but head_count_kv's)
    dict(num_layers=5, attn_period=4, attn_offset=2, expert_period=2, expert_offset=1, kv_heads=4),
    dict(num_layers=2, attn_period=4, attn_offset=3, num_experts=1)])
def test_jamba_layer_pattern_round_trips_through_per_layer_keys(layout, tmp_path):
    m = oracles.jamba(**layout, dtype=torch.float32)
    m.save_pretrained(tmp_path / "hf")
    write_gguf(tmp_path / "hf", tmp_path / "model.gguf")
    meta = metadata(open_file(tmp_path / "model.gguf"))
    expected, got = hs.load(tmp_path / "hf"), hs.load(tmp_path / "model.gguf")
    assert meta["jamba.attention.head_count_kv"] == [4 if t == "attention" else 0 for t in expected.config.layer_types]
    assert (got.config.layer_types, got.config.ffn_types) == (expected.config.layer_types, expected.config.ffn_types)
    assert torch.equal(logits(got), logits(expected))


@x86_with_compiler
def test_a_q8_0_jamba_round_trips_bit_for_bit(tmp_path):
    _, directory, path = written("jamba", tmp_path, "q8_0")
    model = hs.load(path)
    assert isinstance(model.layers[0].mixer.in_proj, QuantWeight)
    assert torch.equal(logits(model), logits(hs.load(directory, quantize="q8_0")))


@x86_with_compiler
def test_hybridspec_quantize_writes_a_q8_0_falcon_h1_that_runs(tmp_path):
    """Its weights are quantized after folding, so its blocks are not those of `hs.load(dir, quantize=)`:
    its error from HF's logits is of the same size."""
    m = FAMILIES["falcon-h1"]()
    m.save_pretrained(tmp_path / "hf")
    assert main(["quantize", str(tmp_path / "hf"), str(tmp_path / "model.gguf"), "--type", "q8_0"]) == 0
    model = hs.load(tmp_path / "model.gguf")
    assert isinstance(model.layers[0].mixer.mamba.in_proj, QuantWeight)
    assert isinstance(model.layers[0].mixer.attention.q_proj, QuantWeight)
    expected = hf_logits(m)
    error = (logits(model) - expected).abs().max()
    assert error <= 2 * (logits(hs.load(tmp_path / "hf", quantize="q8_0")) - expected).abs().max()


def without(family, tmp_path, name) -> str:
    """The family's float GGUF written again without the tensor `name`."""
    _, directory, path = written(family, tmp_path)
    meta = metadata(open_file(path))
    config, weights = canonical_weights(directory)
    tensors = stored_tensors(config, weights, None)
    tensors.pop(name)
    out = tmp_path / "changed.gguf"
    write_file(out, family, {k: v for k, v in meta.items() if k != "general.architecture"}, tensors)
    return str(out)


@pytest.mark.parametrize("family, name", [("falcon-h1", "blk.1.ssm_out.weight"), ("falcon-h1", "blk.2.ffn_norm"),
                                          ("jamba", "blk.2.ssm_x.weight"), ("jamba", "blk.0.ffn_up_exps.weight")])
def test_loading_is_strict_and_names_the_missing_tensor(family, name, tmp_path):
    with pytest.raises(ModelFilesError, match=r"missing 1: " + name.replace(".", r"\.")):
        hs.load(without(family, tmp_path, name))


def test_a_falcon_h1_llama_cpp_cannot_hold_is_not_written(tmp_path):
    oracles.falcon_h1(norm_before_gate=True, dtype=torch.float32).save_pretrained(tmp_path / "hf")
    with pytest.raises(UnsupportedModelError, match="mamba_norm_before_gate=True"):
        write_gguf(tmp_path / "hf", tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()
