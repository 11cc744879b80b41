"""`QuantWeight`: a linear layer's weight [out, in] held as GGUF blocks, the Parameter type the
products dispatch on (`ops.Linear`, `cpu/quant.py`), and its torch product (the reference and the
path where the native kernels do not run).

Its data is uint8 [out, in / block · nbytes], each row the row's blocks back to back (the bytes of
a GGUF tensor of that type and shape): `from_blocks` wraps such bytes as they are (a GGUF file's
tensor, no requantizing), `quantize` makes them from float values. It is frozen (no gradient);
`dequantize` gives the float32 values [out, in].
"""
from __future__ import annotations

import torch
from torch import nn

from hybridspec.errors import ConfigError
from hybridspec.kernels.quant import formats
from hybridspec.kernels.quant.formats import BlockFormat


class QuantWeight(nn.Parameter):
    """A frozen product weight [out_features, in_features] in the block format `fmt` (see the module)."""

    def __new__(cls, data: torch.Tensor, fmt: BlockFormat, out_features: int, in_features: int) -> "QuantWeight":
        expected = (out_features, formats.row_bytes(fmt, in_features))
        if data.dtype is not torch.uint8 or tuple(data.shape) != expected or in_features % fmt.block:
            raise ConfigError(f"QuantWeight: {fmt.name} data {tuple(data.shape)} {data.dtype} is not the blocks of "
                              f"[{out_features}, {in_features}]: uint8 {expected}, in_features a multiple of "
                              f"{fmt.block}")
        weight = super().__new__(cls, data.contiguous(), requires_grad=False)
        weight.fmt, weight.out_features, weight.in_features = fmt, out_features, in_features
        return weight

    @classmethod
    def from_blocks(cls, data: torch.Tensor, fmt: BlockFormat | str, out_features: int,
                    in_features: int) -> "QuantWeight":
        """Raw blocks (any shape holding out · row_bytes bytes, e.g. a GGUF tensor's data) as a weight."""
        fmt = formats.format_named(fmt, tuple(formats.FORMATS)) if isinstance(fmt, str) else fmt
        return cls(data.reshape(out_features, -1), fmt, out_features, in_features)

    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt: BlockFormat | str) -> "QuantWeight":
        """A float weight [out, in] quantized into `fmt`."""
        fmt = formats.format_named(fmt, tuple(formats.FORMATS)) if isinstance(fmt, str) else fmt
        return cls(formats.quantize(weight, fmt), fmt, *weight.shape)

    def dequantize(self) -> torch.Tensor:
        """The values [out, in], float32 (gguf's dequantize, bit for bit)."""
        return formats.dequantize(self.detach(), self.fmt)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [n] of the values, float32 [n, in]: only those rows' blocks dequantized (an
        embedding table's lookup), each exactly its row of `dequantize`."""
        return formats.dequantize(self.detach().index_select(0, ids), self.fmt)

    def __deepcopy__(self, memo) -> "QuantWeight":
        if id(self) not in memo:
            memo[id(self)] = QuantWeight(self.data.clone(), self.fmt, self.out_features, self.in_features)
        return memo[id(self)]

    def __reduce_ex__(self, protocol):
        return QuantWeight, (self.data, self.fmt, self.out_features, self.in_features)

    def __repr__(self) -> str:
        return f"QuantWeight([{self.out_features}, {self.in_features}], {self.fmt.name})"


def activation_block(fmt: BlockFormat) -> int:
    """The block the products round activations in for weights of `fmt`: 256 for Q4_K and Q6_K
    (ggml's Q8_K), else 32 (ggml's Q8_0)."""
    return 256 if fmt.block == 256 else 32


def rounded_activations(x: torch.Tensor, fmt: BlockFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] as the products multiply it for weights of `fmt`: rounded to int8 blocks
    (`formats.quantize_rows_q8`) and back, [M, K] in `dtype` (exact in float64)."""
    q, d = formats.quantize_rows_q8(x, activation_block(fmt))
    return formats.dequantize_rows_q8(q, d, dtype)


def matmul(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """x [M, K] @ the values' transpose by torch, on the same rounded activations and dequantized
    weights as the native products (their rounding of the sums differs): [M, N] in x's dtype."""
    return rounded_activations(x, weight.fmt, x.dtype) @ weight.dequantize().to(x.dtype).t()
