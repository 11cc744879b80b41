"""GGUF files with Q6_K tensors, as llama.cpp's Q4_K_M files hold their LM head and some layers'
attn_v and ssm_out: the reader keeps them quantized (their values gguf's dequantized ones, bit for
bit), the native products multiply them (`cpu/quant_q6k.h`) with the torch backend's values, and the
logits are those of the file with those tensors stored as their float values, but for the int8
rounding of the activations the products multiply."""
from __future__ import annotations

import pytest
import torch

import hybridspec as hs
from hybridspec.adapters.gguf.writer import canonical_weights, stored_tensors
from hybridspec.kernels.quant import formats
from hybridspec.kernels.quant.weight import QuantWeight
from native_cpu import x86_with_compiler
from test_gguf_quantized_embedding import both_paths, granite_directory, write_file, write_metadata

pytest.importorskip("gguf")
# GGUF name -> the model's weight: what llama.cpp's Q4_K_M keeps in Q6_K (inputs whole super-blocks)
Q6_K_TENSORS = {"output.weight": lambda m: m.lm_head, "blk.1.attn_v.weight": lambda m: m.layers[1].mixer.v_proj,
                "blk.0.ssm_out.weight": lambda m: m.layers[0].mixer.out_proj}


def files(tmp_path, vocab_size: int = 97):
    """(a file of Q4_K products but the Q6_K tensors above, the same with those as float32 values)."""
    directory = granite_directory(tmp_path / "hf", tied=False, vocab_size=vocab_size)
    config, weights = canonical_weights(directory)
    tensors = stored_tensors(config, weights, "q4_k")
    six = {name: QuantWeight.quantize(torch.from_numpy(tensors[name]) if not isinstance(tensors[name], tuple)
                                      else _values(tensors[name]), formats.Q6_K).detach() for name in Q6_K_TENSORS}
    quantized, dequantized = tmp_path / "q6_k.gguf", tmp_path / "float.gguf"
    write_file(quantized, *write_metadata(directory, config),
               {**tensors, **{n: (b.numpy(), formats.Q6_K.ggml_type) for n, b in six.items()}})
    write_file(dequantized, *write_metadata(directory, config),
               {**tensors, **{n: formats.dequantize(b, formats.Q6_K).numpy() for n, b in six.items()}})
    return quantized, dequantized


def _values(stored: tuple) -> torch.Tensor:
    """A quantized stored tensor (blocks, GGML type) as its float32 values [out, in]."""
    blocks, ggml_type = stored
    return formats.dequantize(torch.from_numpy(blocks), formats.BY_GGML_TYPE[ggml_type])


@x86_with_compiler
def test_q6_k_tensors_load_quantized_and_multiply_their_values(tmp_path):
    quantized, dequantized = files(tmp_path)
    model, reference = hs.load(quantized, pack=False), hs.load(dequantized, pack=False)
    for name, weight_of in Q6_K_TENSORS.items():
        weight = weight_of(model)
        assert isinstance(weight, QuantWeight) and weight.fmt is formats.Q6_K, name
        assert torch.equal(weight.dequantize(), weight_of(reference)), name
    native, torch_path = both_paths(model)
    expected, _ = both_paths(reference)
    # the torch backend multiplies the same rounded activations and dequantized weights; the float
    # file's products take the activations unrounded
    assert (native - torch_path).abs().max() <= 1e-3 * torch_path.abs().max()
    assert (native - expected).abs().max() <= 0.03 * expected.abs().max()
    assert native.abs().max() > 0.1
