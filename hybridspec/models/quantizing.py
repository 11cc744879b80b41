"""Quantizing a model's linear weights into GGUF's block formats (`HybridModel.quantize`): which
weights, in which format, and the checks before anything changes.

Every linear weight of the decoder layers (attention's q, k, v, o; the MLP's gate, up, down; the
mixers' in_proj and out_proj, shared blocks' included) becomes a `QuantWeight` in the format asked;
one whose input size is not whole blocks of it takes Q8_0 (blocks of 32) where it can, as
llama.cpp falls back for such tensors, else stays float. The LM head takes Q8_0 whatever the format
(llama.cpp's Q8_0 files keep it Q8_0 and its Q4_K_M files in Q6_K, which hybridspec reads and
multiplies but does not make: Q8_0 is the nearest it makes); an embedding tied to it is that same
Q8_0 table, an untied one takes the format asked (as llama.cpp's files hold it), and a lookup
dequantizes the rows it reads. Norms, conv weights, biases, a MoE's router and experts and the
state mixers' small parameters (Mamba-1's x_proj and dt_proj, A, D, dt_bias) stay float.
"""
from __future__ import annotations

import torch

from hybridspec.errors import ConfigError
from hybridspec.kernels import backend as backends
from hybridspec.kernels.cpu import panels
from hybridspec.kernels.cpu.panels import PanelWeight
from hybridspec.kernels.quant import formats
from hybridspec.kernels.quant.formats import BlockFormat
from hybridspec.kernels.quant.weight import QuantWeight
from hybridspec.models import packing

QUANTIZED = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj", "down_proj", "in_proj",
                       "out_proj"})
HEAD_FORMAT = formats.Q8_0


def check(fmt: str, device, dtype: torch.dtype | None, sharded: bool = False,
          compute: torch.dtype = torch.float32) -> BlockFormat:
    """The format `fmt` names, after the checks `quantize` needs, each a ConfigError naming the
    fix: a known format, a CPU model, float32 (the quantized products' activations), one process,
    float32 compute."""
    block_format = formats.format_named(fmt)
    if not backends.multiplies_quantized(device):
        raise ConfigError(f"quantize={fmt!r} runs on CPU only; load onto device='cpu' or drop quantize=")
    if dtype is not None and dtype is not torch.float32:
        raise ConfigError(f"quantize={fmt!r} needs a float32 model (its products take float32 activations); "
                          f"got dtype={dtype}: pass dtype=torch.float32 or leave it out")
    if sharded:
        raise ConfigError(f"quantize={fmt!r} does not shard over tensor parallel ranks; use tensor_parallel_size=1")
    if compute is not torch.float32:
        raise ConfigError(f"quantize={fmt!r} multiplies quantized weights, not bfloat16 ones; drop compute=")
    return block_format


def weight_format(weight: torch.Tensor, fmt: BlockFormat) -> BlockFormat | None:
    """The format a weight [out, in] takes under `fmt`: fmt where `in` is whole blocks of it, else
    Q8_0 where it is whole blocks of 32, else None (stays float)."""
    in_features = weight.in_features if isinstance(weight, PanelWeight) else weight.shape[-1]
    for candidate in (fmt, formats.Q8_0):
        if in_features % candidate.block == 0:
            return candidate
    return None


def quantized(weight: torch.Tensor, fmt: BlockFormat) -> QuantWeight:
    values = panels.unpack(weight, torch.float32) if isinstance(weight, PanelWeight) else weight.detach().float()
    return QuantWeight.quantize(values, fmt)


def quantize(model, fmt: BlockFormat) -> None:
    """`HybridModel.quantize`'s work on `model` (see the module); checks first, then replaces."""
    check(fmt.name, model.device, model.dtype, model.tensor_parallel is not None, model.compute)
    done: dict[int, QuantWeight] = {}  # a Parameter several modules hold (a shared block) stays one
    layers = [*model.layers, *(model.shared_blocks or [])]
    for module in (m for layer in layers for m in layer.modules()):
        for name, weight in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if name not in QUANTIZED or isinstance(weight, QuantWeight) or not (
                    weight.dim() == 2 or isinstance(weight, PanelWeight)):
                continue
            if id(weight) not in done and (chosen := weight_format(weight, fmt)) is not None:
                done[id(weight)] = quantized(weight, chosen)
            if id(weight) in done:
                setattr(module, name, done[id(weight)])
    if not isinstance(model.lm_head, QuantWeight) and weight_format(model.lm_head, HEAD_FORMAT) is not None:
        tied = model.embed is model.lm_head
        model.lm_head = quantized(model.lm_head, HEAD_FORMAT)
        if tied:  # one table for both: the lookup dequantizes the rows it reads
            model.embed = model.lm_head
    if not isinstance(model.embed, QuantWeight) and (chosen := weight_format(model.embed, fmt)) is not None:
        model.embed = quantized(model.embed, chosen)
    packing.lay_out_quantized(model)
    model.bind_backend(model.backend_name)
