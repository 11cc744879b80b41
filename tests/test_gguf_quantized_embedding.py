"""A GGUF file's quantized token embedding (`adapters.gguf.reader`, `QuantWeight.rows`, the whole C
forward's lookup in `cpu/forward.c`): it stays its blocks, a lookup dequantizes the rows it reads to
exactly the values of `formats.dequantize`, so the logits equal those of the same file with the
embedding stored as those float values, bit for bit, on the torch path and the native whole forward;
tied to the LM head, the head stays a quantized product."""
from __future__ import annotations

import pytest
import torch

import hybridspec as hs
import oracles
from hybridspec.adapters.gguf.archs import arch_of
from hybridspec.adapters.gguf.vocab import vocab_metadata
from hybridspec.adapters.gguf.writer import canonical_weights, stored_tensors, write_file
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.kernels.quant import formats
from hybridspec.kernels.quant.weight import QuantWeight
from native_cpu import x86_with_compiler

pytest.importorskip("gguf")
TOKENS = [[5, 7, 9, 11, 3, 2, 40, 50, 60, 61, 62, 17, 96, 0]]


def granite_directory(path, tied: bool, vocab_size: int = 97):
    """A Granite-4.0-H of hidden 256 (Q4_K's super-block) as a model directory."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    cfg = GraniteMoeHybridConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=64, shared_intermediate_size=64, num_hidden_layers=2,
        layer_types=["mamba", "attention"], num_attention_heads=4, num_key_value_heads=2, num_local_experts=0,
        mamba_n_heads=4, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=8, embedding_multiplier=2.0,
        residual_multiplier=0.5, attention_multiplier=0.125, logits_scaling=4.0, max_position_embeddings=512,
        tie_word_embeddings=tied, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(3)
    oracles.randomize_(GraniteMoeHybridForCausalLM(cfg), 3).float().eval().save_pretrained(path)
    return path


def write_metadata(directory, config) -> tuple[str, dict]:
    """(the architecture's name, the metadata `write_gguf` writes for the model directory)."""
    arch = arch_of(config)
    metadata = {f"{arch.name}.{key}": value for key, value in arch.metadata(config).items()}
    return arch.name, metadata | vocab_metadata(directory, config) | {"general.name": directory.name}


def write_with_embedding(directory, out, embedding) -> None:
    """The directory as a float32 GGUF file (`write_gguf`'s layout) but token_embd stored as
    `embedding`: float32 values, or (uint8 blocks, GGML type)."""
    config, weights = canonical_weights(directory)
    write_file(out, *write_metadata(directory, config),
               {**stored_tensors(config, weights, None), "token_embd.weight": embedding})


def files(tmp_path, fmt: str, tied: bool):
    """(the file with token_embd in `fmt`, the same with it as the float32 values of those blocks)."""
    directory = granite_directory(tmp_path / "hf", tied)
    _, weights = canonical_weights(directory)
    blocks = QuantWeight.quantize(weights["embed_tokens.weight"].float(), fmt).detach()
    quantized, dequantized = tmp_path / "quantized.gguf", tmp_path / "dequantized.gguf"
    write_with_embedding(directory, quantized, (blocks.numpy(), formats.FORMATS[fmt].ggml_type))
    write_with_embedding(directory, dequantized, formats.dequantize(blocks, formats.FORMATS[fmt]).numpy())
    return quantized, dequantized


def logits(model) -> torch.Tensor:
    cache = HybridCache(model.config, max_seqs=1, num_blocks=4, block_size=16, ring_slots=2, dtype=model.dtype,
                        device=model.device)
    return model.prefill(cache, [0], TOKENS)


def both_paths(model) -> tuple[torch.Tensor, torch.Tensor]:
    """(the native whole forward's logits, the torch backend's)."""
    assert model.whole is not None
    native = logits(model)
    model.bind_backend("torch")
    return native, logits(model)


@x86_with_compiler
@pytest.mark.parametrize("fmt", ("q8_0", "q4_0", "q4_k", "q6_k"))
def test_a_quantized_embedding_looks_up_the_values_of_its_dequantized_table_bit_for_bit(fmt, tmp_path):
    quantized, dequantized = files(tmp_path, fmt, tied=False)
    model, reference = hs.load(quantized), hs.load(dequantized)
    assert isinstance(model.embed, QuantWeight) and model.embed.fmt.name == fmt
    assert model.embed.nbytes == 97 * formats.row_bytes(model.embed.fmt, 256)
    ids = torch.tensor(TOKENS[0])
    assert torch.equal(model.embed_tokens(ids), reference.embed_tokens(ids))
    for got, expected in zip(both_paths(model), both_paths(reference)):
        assert torch.equal(got, expected)


@x86_with_compiler
def test_a_quantized_embedding_tied_to_the_head_is_also_its_quantized_product(tmp_path):
    """llama.cpp's Q4_K_M files store a tied embedding in Q6_K."""
    quantized, dequantized = files(tmp_path, "q6_k", tied=True)
    model, reference = hs.load(quantized), hs.load(dequantized)
    assert model.lm_head is model.embed and isinstance(model.embed, QuantWeight)
    # the reference: a float table of the same values to look up, the same blocks as its head
    reference.lm_head = model.embed
    reference.bind_backend(reference.backend_name)
    for got, expected in zip(both_paths(model), both_paths(reference)):
        assert torch.equal(got, expected)
