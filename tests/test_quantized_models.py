"""Models with quantized linear weights (`HybridModel.quantize`, `hs.load(dir, quantize=...)`):
which weights take which format, the typed refusals, and exactness on a quantized target:
speculative greedy output equals plain output (a quantized draft model, the target's own first layers
and prompt lookup), and a
request's tokens do not depend on the batch around it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.config import AttentionConfig, HybridConfig, Mamba2Config, MLPConfig
from hybridspec.errors import ConfigError
from hybridspec.kernels.quant.weight import QuantWeight
from hybridspec.models.quantizing import QUANTIZED
from hybridspec.rollback import (POLICIES, batch_invariance, perturbed_copy, plain_outputs, run_suite,
                                 speculative_parity, workload)
from hybridspec.rollback.models import random_model
from native_cpu import x86_with_compiler

FORMATS = ("q8_0", "q4_0", "q4_k")


def quantizable_model(seed: int = 0):
    """A float32 Mamba-2 / attention hybrid whose products take every format: hidden 256 (Q4_K's
    super-block), an MLP of 288 (not whole super-blocks: its down_proj falls back to Q8_0)."""
    config = HybridConfig(
        vocab_size=97, hidden_size=256, layer_types=("mamba2", "attention", "mamba2"), ffn_types=("mlp",) * 3,
        attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=64, partial_rotary_factor=0.5),
        mamba2=Mamba2Config(num_heads=4, head_dim=64, d_state=16, chunk_size=8), mlp=MLPConfig(288),
        max_position_embeddings=512, family="tiny")
    return random_model(config, seed, torch.float32)


def test_load_refuses_what_it_cannot_quantize_before_reading():
    target, _ = hs.embedded_paths()
    with pytest.raises(ConfigError, match="q5_k"):
        hs.load(target, quantize="q5_k")
    with pytest.raises(ConfigError, match="float32"):
        hs.load(target, quantize="q8_0", dtype=torch.float64)
    with pytest.raises(ConfigError, match="CPU"):
        hs.load(target, quantize="q8_0", device="meta")
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        hs.load(target, quantize="q8_0", tensor_parallel_size=2)


def test_quantize_refuses_a_float64_model_and_changes_nothing():
    model = random_model(quantizable_model().config, 0, torch.float64)
    with pytest.raises(ConfigError, match="float32"):
        model.quantize("q8_0")
    assert not any(isinstance(p, QuantWeight) for p in model.parameters())


@x86_with_compiler
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_decoder_layers_linear_weights_are_quantized_and_the_rest_stays_float(fmt):
    model = hs.load(hs.embedded_paths()[0], quantize=fmt)
    for layer in model.layers:
        for module in layer.modules():
            for name, weight in module.named_parameters(recurse=False):
                if name in QUANTIZED:
                    assert isinstance(weight, QuantWeight), name
                    whole = weight.in_features % (256 if fmt == "q4_k" else 32) == 0
                    assert weight.fmt.name == (fmt if whole else "q8_0"), (name, weight)
                else:
                    assert weight.dtype.is_floating_point, name
    assert isinstance(model.lm_head, QuantWeight) and model.lm_head.fmt.name == "q8_0"
    # the embedded target's embedding is untied: it takes the format asked (its rows whole blocks of it)
    assert isinstance(model.embed, QuantWeight) and model.embed is not model.lm_head
    assert model.embed.fmt.name == (fmt if model.embed.in_features % model.embed.fmt.block == 0 else "q8_0")
    assert model.final_norm.weight.dtype is torch.float32
    assert model.num_parameters() == hs.load(hs.embedded_paths()[0]).num_parameters()


@x86_with_compiler
def test_mtp_drafts_on_a_target_whose_embedding_is_quantized():
    """The MTP layer shares the target's embedding, here a Q4_0 table: it loads (checked by the
    table's value shape) and its drafts leave the output plain decoding's."""
    model = hs.load(hs.embedded_paths()[0], quantize="q4_0")
    assert isinstance(model.embed, QuantWeight)
    params = hs.SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = list(b"Once upon a time")
    plain = hs.Engine(model).generate([prompt], params)[0].token_ids
    engine = hs.Engine(model, draft="mtp", num_draft_tokens=3)
    assert engine.generate([prompt], params)[0].token_ids == plain and engine.stats.acceptance_rate > 0


@x86_with_compiler
def test_a_tied_embedding_is_the_quantized_lm_head_and_decodes_as_it_dequantizes():
    """Tied: one Q8_0 table for the LM head and the lookup, whose rows are the table's dequantized
    rows; speculative output still equals plain output."""
    config = dataclasses.replace(quantizable_model().config, tie_word_embeddings=True)
    model = random_model(config, 3, torch.float32)
    assert model.embed is model.lm_head
    model.quantize("q4_0")
    assert model.embed is model.lm_head and isinstance(model.lm_head, QuantWeight) and model.lm_head.fmt.name == "q8_0"
    ids = torch.tensor([5, 0, 96, 5])
    assert torch.equal(model.embed_tokens(ids), model.lm_head.dequantize()[ids])
    prompts, params = workload(model.vocab_size, seed=6, max_new_tokens=(9, 7))
    expected = plain_outputs(model, prompts, params)
    result = speculative_parity("tied q4_0", model, hs.NgramDrafter(), 3, POLICIES["k=1"], prompts, params, expected)
    assert result.passed, result.detail


@x86_with_compiler
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_native_blocks_and_whole_forward_multiply_the_same_values_as_torch(fmt):
    """The blocks and the whole forward take quantized weights (`cpu_native.quant_header`); their
    logits are the torch backend's on the same rounded activations and dequantized weights, but
    for float rounding that can move an activation across a step of its int8 grid."""
    model = hs.load(hs.embedded_paths()[0], quantize=fmt)
    assert all(layer.blocks.mlp is not None for layer in model.layers) and model.whole is not None
    tokens = [list(b"Once upon a time there was")]

    def logits():
        cache = HybridCache(model.config, max_seqs=1, num_blocks=4, block_size=16, ring_slots=2,
                            dtype=model.dtype, device=model.device)
        return model.prefill(cache, [0], tokens)
    native = logits()
    model.bind_backend("torch")
    reference = logits()
    assert (native - reference).abs().max() < 0.1 and native.abs().max() > 1


@x86_with_compiler
@pytest.mark.parametrize("fmt", FORMATS)
def test_speculative_equals_plain_on_a_quantized_target(fmt):
    target = quantizable_model().quantize(fmt)
    draft = perturbed_copy(quantizable_model(), scale=0.03, seed=1).quantize(fmt)
    prompts, params = workload(target.vocab_size, seed=5, max_new_tokens=(14, 9, 11))
    expected = plain_outputs(target, prompts, params)
    for drafter, gamma, policy in ((draft, 4, "k=1"), (draft, 2, "k=0"), (hs.NgramDrafter(), 4, "log off"),
                                   ("layers:1", 3, "k=1")):
        # no state check against a fresh prefill: rounding activations to int8 turns a last-place
        # difference between the chunked scan and the steps into a step of the rounding grid
        result = speculative_parity(f"{fmt} γ={gamma} {policy}", target, drafter, gamma, POLICIES[policy], prompts,
                                    params, expected)
        assert result.passed, result.detail
    result = batch_invariance(f"{fmt} batch", target, prompts, params)
    assert result.passed, result.detail


@x86_with_compiler
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_embedded_pair_quantized_decodes_speculatively_as_plainly(fmt):
    target_dir, draft_dir = hs.embedded_paths()
    target, draft = hs.load(target_dir, quantize=fmt), hs.load(draft_dir, quantize=fmt)
    params = hs.SamplingParams(max_new_tokens=24)
    prompts = ["Once upon a time", "def main():\n    return"]
    plain = [o.text for o in hs.LLM(target, draft=None).generate(prompts, params)]
    for drafter in (draft, "ngram"):
        assert [o.text for o in hs.LLM(target, draft=drafter).generate(prompts, params)] == plain
    alone = [hs.LLM(target, draft=draft).generate([p], params)[0].text for p in prompts]
    assert alone == plain


@x86_with_compiler
def test_the_rollback_suite_passes_on_a_quantized_target():
    """Every restore path, forced rejection, failed round and bad input of `rollback.run_suite` (quick)
    on a Q4_K target with a Q4_K draft model."""
    target = quantizable_model().quantize("q4_k")
    draft = perturbed_copy(quantizable_model(), scale=0.03, seed=1).quantize("q4_k")
    failed = [f"{r.name}: {r.detail}" for r in run_suite(target, draft, quick=True) if not r.passed]
    assert not failed, failed


@x86_with_compiler
@pytest.mark.parametrize("path", ("avx2", "avx512vnni"))
def test_q4_k_products_are_interleaved_on_either_path_with_the_same_logits(path):
    """Quantizing (and packing) lays Q4_K product weights out interleaved (`QuantWeight.interleave_`),
    which AVX512-VNNI's 16-column tiles and AVX2's 8-column ones read, but never the embedding the
    lookup reads; the logits are the bits of the same weights in GGUF's order."""
    from hybridspec.kernels.cpu import quant as cpu_quant
    first = cpu_quant.vector_path()
    try:
        cpu_quant.vector_path(path)
    except ValueError:
        pytest.skip(f"this CPU has no {path}")
    try:
        interleaved_logits_equal_plain(path)
    finally:
        cpu_quant.vector_path(first)


def interleaved_logits_equal_plain(path: str) -> None:
    model = quantizable_model().quantize("q4_k")
    q4k = [p for p in model.parameters() if isinstance(p, QuantWeight) and p.fmt.name == "q4_k"]
    assert q4k and not getattr(model.embed, "interleaved", False)
    assert all(p.interleaved for p in q4k if p.can_interleave()) and any(p.interleaved for p in q4k), path
    tokens = [[5, 17, 3, 90, 41, 8, 8, 2], [60, 1]]

    def logits(m):
        cache = HybridCache(m.config, max_seqs=2, num_blocks=8, block_size=16, ring_slots=2, dtype=m.dtype)
        return m.prefill(cache, [0, 1], tokens)
    interleaved = logits(model)
    for module in model.modules():
        for name, weight in list(module.named_parameters(recurse=False)):
            if isinstance(weight, QuantWeight) and weight.interleaved:
                setattr(module, name, QuantWeight(weight.blocks(), weight.fmt, weight.out_features, weight.in_features))
    model.bind_backend(model.backend_name)
    assert not any(getattr(p, "interleaved", False) for p in model.parameters())
    assert torch.equal(logits(model), interleaved), path
