"""`QuantWeight`: a linear layer's weight [out, in] held as GGUF blocks, the Parameter type the
products dispatch on (`ops.Linear`, `cpu/quant.py`), and its torch product (the reference and the
path where the native kernels do not run).

Its data is uint8 [out, in / block · nbytes], each row the row's blocks back to back (the bytes of
a GGUF tensor of that type and shape): `from_blocks` wraps such bytes as they are (a GGUF file's
tensor, no requantizing), `quantize` makes them from float values. It is frozen (no gradient);
`dequantize` gives the float32 values [out, in].

`interleave_` puts the same bytes in another order, where the native products read them so fastest
(`cpu/quant.py`'s `laid_out`, at packing): Q4_K's rows in groups of INTERLEAVE_ROWS, each group's
super-block b as its 16 blocks' 4-byte words transposed (word i of the 16 rows side by side, then
word i + 1), the group's super-blocks in order. Q6_K's rows in groups of PLANE_ROWS (the last one what
is left), each group two planes: every super-block's ql (the values' low nibbles), then their qh,
scales and d, each plane by tiles of 16 rows and super-blocks in order, a tile's super-block its
words transposed as Q4_K's (the low plane ql's 32 words; the high plane qh's 16, the scales' 4, then
the 16 rows' d): a greedy draft's coarse LM head (cpu/quant.c's `hs_quant_top`) streams the high
plane alone, 82 of each 210 bytes. The values, `dequantize` and `rows` are the same.
"""
from __future__ import annotations

import torch
from torch import nn

from hybridspec.errors import ConfigError
from hybridspec.kernels.quant import formats
from hybridspec.kernels.quant.formats import BlockFormat


INTERLEAVE_ROWS = 16  # rows per interleaved group (cpu/quant.c's X16_ROWS)
INTERLEAVED_FLAG = 16  # added to the format's code for interleaved bytes (cpu/kernels.h's HS_X16)
INTERLEAVE_STEP_BYTES = 1 << 22  # `interleave_` rearranges about this much at a time
INTERLEAVES = ("q4_k", "q6_k")  # the formats `interleave_` takes
PLANE_ROWS = 256  # Q6_K: rows per group of its two planes (cpu/quant_q6k.h's Q6_PLANE_ROWS)
Q6_LOW = 128  # Q6_K: a super-block's bytes in the low plane (ql); the other 82 in the high plane


class QuantWeight(nn.Parameter):
    """A frozen product weight [out_features, in_features] in the block format `fmt` (see the module);
    `interleaved`: its bytes in `interleave_`'s order."""

    def __new__(cls, data: torch.Tensor, fmt: BlockFormat, out_features: int, in_features: int,
                interleaved: bool = False) -> "QuantWeight":
        expected = (out_features, formats.row_bytes(fmt, in_features))
        if data.dtype is not torch.uint8 or tuple(data.shape) != expected or in_features % fmt.block:
            raise ConfigError(f"QuantWeight: {fmt.name} data {tuple(data.shape)} {data.dtype} is not the blocks of "
                              f"[{out_features}, {in_features}]: uint8 {expected}, in_features a multiple of "
                              f"{fmt.block}")
        if interleaved and not _interleavable(fmt, out_features):
            raise _not_interleavable(fmt, out_features, in_features)
        weight = super().__new__(cls, data.contiguous(), requires_grad=False)
        weight.fmt, weight.out_features, weight.in_features = fmt, out_features, in_features
        weight.interleaved = interleaved
        return weight

    @property
    def code(self) -> int:
        """The format's number as the C products take it: with INTERLEAVED_FLAG for interleaved bytes."""
        return self.fmt.code + (INTERLEAVED_FLAG if self.interleaved else 0)

    def can_interleave(self) -> bool:
        """Whether `interleave_` takes this weight (its format, its rows in whole groups)."""
        return _interleavable(self.fmt, self.out_features)

    def interleave_(self) -> "QuantWeight":
        """Its bytes put in the interleaved order (see the module) in place, a few groups at a time (no
        second copy of the weight: the memory a load holds stays the file's tensor bytes); returns self."""
        if self.interleaved:
            return self
        if not self.can_interleave():
            raise _not_interleavable(self.fmt, self.out_features, self.in_features)
        data, rows = self.detach(), _group_rows(self.fmt)
        step = rows * max(1, INTERLEAVE_STEP_BYTES // (rows * self.shape[1]))
        with torch.no_grad():
            for r0 in range(0, self.out_features, step):
                part = data[r0:r0 + step]
                part.copy_(_rearranged(part, self.fmt, back=False))
        self.interleaved = True
        self.__dict__.pop("_hs_header", None)  # the C products' header carries the format's code
        return self

    def blocks(self) -> torch.Tensor:
        """The bytes in GGUF's order [out, row bytes] (a copy where they are interleaved)."""
        data = self.detach()
        return _rearranged(data, self.fmt, back=True) if self.interleaved else data

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
        return formats.dequantize(self.blocks(), self.fmt)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [n] of the values, float32 [n, in]: only those rows' blocks dequantized (an
        embedding table's lookup; interleaved: their groups' bytes put back in order), each exactly
        its row of `dequantize`."""
        if not self.interleaved:
            return formats.dequantize(self.detach().index_select(0, ids), self.fmt)
        if self.fmt.name == "q6_k":  # each row from its group put back in order
            data = self.detach()
            picked = [_q6_planes(data[n - n % PLANE_ROWS:n - n % PLANE_ROWS + PLANE_ROWS], back=True)[n % PLANE_ROWS]
                      for n in ids.tolist()]
            return formats.dequantize(torch.stack(picked), self.fmt)
        groups = self.detach().view(-1, INTERLEAVE_ROWS * self.shape[1]).index_select(0, ids // INTERLEAVE_ROWS)
        in_order = _words_by_group(groups.view(-1, self.shape[1]), self.fmt, len(ids) * INTERLEAVE_ROWS, back=True)
        picked = in_order.view(len(ids), INTERLEAVE_ROWS, -1)[torch.arange(len(ids)), ids % INTERLEAVE_ROWS]
        return formats.dequantize(picked, self.fmt)

    def __deepcopy__(self, memo) -> "QuantWeight":
        if id(self) not in memo:
            memo[id(self)] = QuantWeight(self.data.clone(), self.fmt, self.out_features, self.in_features,
                                         self.interleaved)
        return memo[id(self)]

    def __reduce_ex__(self, protocol):
        return QuantWeight, (self.data, self.fmt, self.out_features, self.in_features, self.interleaved)

    def __repr__(self) -> str:
        return (f"QuantWeight([{self.out_features}, {self.in_features}], {self.fmt.name}"
                f"{', interleaved' if self.interleaved else ''})")


def _interleavable(fmt: BlockFormat, out_features: int) -> bool:
    return fmt.name in INTERLEAVES and out_features % INTERLEAVE_ROWS == 0


def _not_interleavable(fmt: BlockFormat, out_features: int, in_features: int) -> ConfigError:
    return ConfigError(f"QuantWeight: {fmt.name} [{out_features}, {in_features}] cannot be interleaved: formats "
                       f"{INTERLEAVES}, out_features a multiple of {INTERLEAVE_ROWS}")


def _group_rows(fmt: BlockFormat) -> int:
    """The rows of one group of the interleaved layout (see the module)."""
    return PLANE_ROWS if fmt.name == "q6_k" else INTERLEAVE_ROWS


def _rearranged(data: torch.Tensor, fmt: BlockFormat, back: bool) -> torch.Tensor:
    """data [rows, row bytes], whole groups from a group's first row (Q6_K's last may be short), in GGUF's
    order -> interleaved (`back`: the way back), a new tensor."""
    if fmt.name == "q4_k":
        return _words_by_group(data, fmt, data.shape[0], back)
    return torch.cat([_q6_planes(data[r0:r0 + PLANE_ROWS], back) for r0 in range(0, data.shape[0], PLANE_ROWS)])


_Q6_PARTS = ((Q6_LOW, 4), (64, 4), (16, 4), (2, 2))  # ql, qh, scales, d: (bytes a super-block, bytes a word)


def _q6_planes(group: torch.Tensor, back: bool) -> torch.Tensor:
    """One group of Q6_K rows [rows, row bytes] in GGUF's order -> its two planes (`back`: the way
    back): per 16-row tile and super-block, each part's words transposed ([16, words] -> [words, 16])."""
    rows, blocks = group.shape[0], group.shape[1] // formats.Q6_K.nbytes
    tiles, sizes = rows // INTERLEAVE_ROWS, [size for size, _ in _Q6_PARTS]
    if not back:
        parts = group.reshape(tiles, INTERLEAVE_ROWS, blocks, -1).split(sizes, dim=3)
        words = [part.reshape(tiles, INTERLEAVE_ROWS, blocks, size // unit, unit).permute(0, 2, 3, 1, 4)
                 .reshape(tiles, blocks, -1) for part, (size, unit) in zip(parts, _Q6_PARTS)]  # tile, block, word, row
        return torch.cat([words[0].reshape(-1), torch.cat(words[1:], dim=2).reshape(-1)]).view(group.shape)
    flat, low_bytes = group.reshape(-1), rows * blocks * Q6_LOW
    words = [flat[:low_bytes].view(tiles, blocks, -1),
             *flat[low_bytes:].view(tiles, blocks, -1).split([INTERLEAVE_ROWS * size for size in sizes[1:]], dim=2)]
    parts = [word.reshape(tiles, blocks, size // unit, INTERLEAVE_ROWS, unit).permute(0, 3, 1, 2, 4)
             .reshape(tiles, INTERLEAVE_ROWS, blocks, size) for word, (size, unit) in zip(words, _Q6_PARTS)]
    return torch.cat(parts, dim=3).reshape(group.shape)


def _words_by_group(data: torch.Tensor, fmt: BlockFormat, out_features: int, back: bool) -> torch.Tensor:
    """data [out, row bytes] in GGUF's order -> interleaved (`back`: the way back), a new tensor: per group
    of INTERLEAVE_ROWS rows and super-block, the blocks' 4-byte words [16, words] <-> [words, 16]."""
    groups, blocks, words = out_features // INTERLEAVE_ROWS, data.shape[1] // fmt.nbytes, fmt.nbytes // 4
    in_order = (groups, INTERLEAVE_ROWS, blocks, words, 4)  # group, row, block, word, byte
    interleaved = (groups, blocks, words, INTERLEAVE_ROWS, 4)  # group, block, word, row, byte
    if back:
        return data.reshape(interleaved).permute(0, 3, 1, 2, 4).reshape(data.shape).contiguous()
    return data.reshape(in_order).permute(0, 2, 3, 1, 4).reshape(data.shape).contiguous()


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
