"""GGUF's block formats Q8_0, Q4_0, Q4_K and Q6_K: their bytes, quantize and dequantize in torch.

A weight [out, in] in one of these formats is `out` rows of `in / block` blocks each, every row
its blocks back to back: the bytes of a GGUF tensor of that type and shape (ggml's ne0 = in), so a
GGUF file's tensor data wraps as it is (`weight.QuantWeight.from_blocks`).

- Q8_0: blocks of 32 values, 34 bytes: d (float16), then 32 int8 q; value = d · q.
- Q4_0: blocks of 32 values, 18 bytes: d (float16), then 16 bytes of nibbles, byte j holding value j
  (low nibble) and value j + 16 (high nibble); value = d · (q − 8).
- Q4_K: super-blocks of 256 values, 144 bytes: d and dmin (float16), 12 bytes of eight 6-bit scales
  sc and mins m (ggml's get_scale_min_k4 packing), 128 bytes of nibbles, chunk c (32 bytes) holding
  values 64c + l (low nibble) and 64c + 32 + l (high); value = (d · sc_j) · q − dmin · m_j for
  sub-block j (32 values).
- Q6_K: super-blocks of 256 values, 210 bytes: 128 bytes ql (low nibbles), 64 bytes qh (2 high bits
  each), 16 int8 scales sc, d (float16); half h (128 values) takes ql[64h …] and qh[32h …], its value
  128h + 32k + l (k = 0 … 3) the nibble of ql[64h + 32(k % 2) + l] (low for k < 2, high for k ≥ 2) with
  bits 2k, 2k + 1 of qh[32h + l] above it: q in 0 … 63; value = (d · sc_j) · (q − 32) for sub-block
  j (16 values). llama.cpp's Q4_K_M files keep the LM head and some layers' tensors in it.

`quantize` gives the bytes of the `gguf` package's reference quantizers (ggml-quants.c's) for
Q8_0 and Q4_0; for Q4_K, which that package cannot quantize, a plain min/max quantizer (not
llama.cpp's iterative scale search, so different bytes from llama.cpp's for the same values; the
error bound is in `q4_k_error_bound`); for Q6_K, which it cannot quantize either, a plain absmax
quantizer (tests and files that need Q6_K bytes; `quantize=` does not offer it, `QUANTIZE_FORMATS`).
`dequantize` gives gguf's float32 values, bit for bit.
`quantize_rows_q8` is the activations' rounding the products use (`kernels/cpu/quant.c`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridspec.errors import ConfigError


@dataclass(frozen=True)
class BlockFormat:
    """One block format: `block` values in `nbytes` bytes."""
    name: str
    block: int
    nbytes: int
    code: int  # the format's number in the C products (HS_Q8_0, HS_Q4_0, HS_Q4_K) and ggml's type id
    ggml_type: int


Q8_0 = BlockFormat("q8_0", 32, 34, 0, 8)
Q4_0 = BlockFormat("q4_0", 32, 18, 1, 2)
Q4_K = BlockFormat("q4_k", 256, 144, 2, 12)
Q6_K = BlockFormat("q6_k", 256, 210, 3, 14)
FORMATS = {f.name: f for f in (Q8_0, Q4_0, Q4_K, Q6_K)}  # every format the products multiply
QUANTIZE_FORMATS = ("q8_0", "q4_0", "q4_k")  # those `quantize=` makes (Q6_K: read from files only)
BY_GGML_TYPE = {f.ggml_type: f for f in FORMATS.values()}  # a GGUF tensor's type id -> its format


def format_named(name: str, offered: tuple[str, ...] = QUANTIZE_FORMATS) -> BlockFormat:
    """The format called `name` among `offered` (default: those `quantize=` makes); ConfigError for another."""
    fmt = FORMATS.get(str(name).lower()) if isinstance(name, str) else None
    if fmt is None or fmt.name not in offered:
        raise ConfigError(f"quantize={name!r} is not a block format hybridspec multiplies; "
                          f"pick one of {sorted(offered)}")
    return fmt


def row_bytes(fmt: BlockFormat, in_features: int) -> int:
    """The bytes of one row of `in_features` values (a multiple of the format's block)."""
    return in_features // fmt.block * fmt.nbytes


def roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero) exactly: floor(|v|) + floor(2·frac) with its sign
    (ggml's and gguf's `np_roundf`; |v| + 0.5 would round up values just below a half)."""
    a = v.abs()
    floored = a.floor()
    return torch.sign(v) * (floored + (2 * (a - floored)).floor())


def _f16_bytes(d: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1] -> float16's bytes [n, 2] (to nearest, as numpy's astype)."""
    return d.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def _f16_values(b: torch.Tensor) -> torch.Tensor:
    """bytes [n, 2] -> float32 [n, 1]."""
    return b.contiguous().view(torch.float16).to(torch.float32).reshape(-1, 1)


def _reciprocal(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _blocks(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """x [..., in] float -> float32 blocks [n, block]; ConfigError where `in` is not whole blocks."""
    if x.shape[-1] % fmt.block:
        raise ConfigError(f"{fmt.name}: rows of {x.shape[-1]} values are not whole blocks of {fmt.block}; "
                          "keep this weight float")
    return x.detach().to(torch.float32).reshape(-1, fmt.block)


def quantize(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """x [..., in] -> uint8 [..., in / block · nbytes], the format's bytes."""
    blocks = _blocks(x, fmt)
    out = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_k": _q4_k, "q6_k": _q6_k}[fmt.name](blocks)
    return out.reshape(*x.shape[:-1], row_bytes(fmt, x.shape[-1]))


def dequantize(data: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """uint8 [..., in / block · nbytes] -> float32 [..., in]."""
    blocks = data.reshape(-1, fmt.nbytes)
    out = {"q8_0": _dq8_0, "q4_0": _dq4_0, "q4_k": _dq4_k, "q6_k": _dq6_k}[fmt.name](blocks)
    return out.reshape(*data.shape[:-1], data.shape[-1] // fmt.nbytes * fmt.block)


# -- Q8_0 -----------------------------------------------------------------------------------------

def _q8_0(blocks: torch.Tensor) -> torch.Tensor:  # [n, 32] -> [n, 34]
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    q = roundf(blocks * _reciprocal(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), q], dim=1)


def _dq8_0(blocks: torch.Tensor) -> torch.Tensor:  # [n, 34] -> [n, 32]
    return blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32) * _f16_values(blocks[:, :2])


# -- Q4_0 -----------------------------------------------------------------------------------------

def _q4_0(blocks: torch.Tensor) -> torch.Tensor:  # [n, 32] -> [n, 18]
    # the value of largest magnitude, its sign kept (the first one on a tie, as numpy's argmax)
    peak = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))
    d = peak / -8
    q = torch.trunc(blocks * _reciprocal(d) + 8.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d), q[:, :16] | (q[:, 16:] << 4)], dim=1)


def _dq4_0(blocks: torch.Tensor) -> torch.Tensor:  # [n, 18] -> [n, 32]
    qs = blocks[:, 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).to(torch.int8) - 8
    return _f16_values(blocks[:, :2]) * q.to(torch.float32)


# -- Q4_K -----------------------------------------------------------------------------------------

def pack_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """6-bit scales and mins [n, 8] -> ggml's 12 bytes [n, 12] (`unpack_scales`' inverse)."""
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    low = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    high = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return torch.cat([low, mid, high], dim=1)


def unpack_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's 12 bytes [n, 12] -> the scales and mins [n, 8] (uint8, 0..63)."""
    d, m, md = scales[:, :4], scales[:, 4:8], scales[:, 8:]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:  # [n, 256] -> [n, 144]
    sub = blocks.view(-1, 8, 32)
    low = sub.amin(dim=2).clamp(max=0)  # [n, 8]: the offset is a min at or below zero
    scale = (sub.amax(dim=2) - low) / 15
    d = (scale.amax(dim=1, keepdim=True) / 63).to(torch.float16).to(torch.float32)  # [n, 1]
    dmin = ((-low).amax(dim=1, keepdim=True) / 63).to(torch.float16).to(torch.float32)
    # rounded up, so that d · sc covers the sub-block's range and dmin · m its offset
    sc = torch.ceil(scale * _reciprocal(d)).clamp(0, 63)
    m = torch.ceil(-low * _reciprocal(dmin)).clamp(0, 63)
    step, offset = (d * sc).unsqueeze(2), (dmin * m).unsqueeze(2)  # [n, 8, 1]
    q = roundf((sub + offset) * _reciprocal(step)).clamp(0, 15).to(torch.uint8).view(-1, 4, 2, 32)
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), pack_scales(sc, m), nibbles], dim=1)


def _dq4_k(blocks: torch.Tensor) -> torch.Tensor:  # [n, 144] -> [n, 256]
    d, dmin = _f16_values(blocks[:, :2]), _f16_values(blocks[:, 2:4])
    sc, m = unpack_scales(blocks[:, 4:16])
    step = (d * sc.to(torch.float32)).unsqueeze(2)  # [n, 8, 1]
    offset = (dmin * m.to(torch.float32)).unsqueeze(2)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32).to(torch.float32)
    return (step * q - offset).reshape(-1, 256)


def q4_k_error_bound(x: torch.Tensor) -> torch.Tensor:
    """A bound on |x − dequantize(quantize(x, Q4_K))| per value: half a step d · sc of its
    sub-block plus the super-block's dmin (where the rounded-up offset overshoots) plus 15·d (where
    a float16 d rounds below the largest scale, which then clamps at 63), from the bytes' own d,
    dmin and sc."""
    data = quantize(x, Q4_K).reshape(-1, 144)
    d, dmin = _f16_values(data[:, :2]), _f16_values(data[:, 2:4])
    sc, _ = unpack_scales(data[:, 4:16])
    bound = 0.5 * d * sc.to(torch.float32) + dmin + 15 * d  # [n, 8]
    return bound.unsqueeze(2).expand(-1, 8, 32).reshape(x.shape)


# -- Q6_K -----------------------------------------------------------------------------------------

def _q6_k(blocks: torch.Tensor) -> torch.Tensor:  # [n, 256] -> [n, 210]
    sub = blocks.view(-1, 16, 16)
    peak = sub.gather(2, sub.abs().argmax(dim=2, keepdim=True)).squeeze(2)  # [n, 16], its sign kept
    scale = peak / -32  # the peak at q − 32 = −32, the end of the range with the most room
    d = _f16_up(scale.abs().amax(dim=1, keepdim=True) / 127)  # [n, 1]: 127 · d covers every scale
    sc = roundf(scale * _reciprocal(d)).clamp(-127, 127)
    step = (d * sc).unsqueeze(2)  # [n, 16, 1]
    q = (roundf(sub * _reciprocal(step)) + 32).clamp(0, 63).to(torch.uint8).view(-1, 2, 4, 32)  # [n, half, k, l]
    low, high = q & 0x0F, q >> 4
    ql = torch.cat([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], dim=2)  # [n, 2, 64]
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)  # [n, 2, 32]
    scales = sc.to(torch.int8).view(torch.uint8)
    return torch.cat([ql.reshape(-1, 128), qh.reshape(-1, 64), scales, _f16_bytes(d)], dim=1)


def _f16_up(v: torch.Tensor) -> torch.Tensor:
    """float32 v >= 0 rounded up to a float16 value, as float32."""
    down = v.to(torch.float16)
    up = torch.where(down.to(torch.float32) < v, torch.nextafter(down, torch.full_like(down, torch.inf)), down)
    return up.to(torch.float32)


def _dq6_k(blocks: torch.Tensor) -> torch.Tensor:  # [n, 210] -> [n, 256]
    ql, qh = blocks[:, :128].reshape(-1, 2, 1, 64), blocks[:, 128:192].reshape(-1, 2, 1, 32)
    sc = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)  # [n, 16]
    step = (_f16_values(blocks[:, 208:]) * sc).unsqueeze(2)  # [n, 16, 1]
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 2, 4, 32)  # [n, half, k, l]
    high = torch.cat([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2)  # [n, half, k, l]
    q = (low | (high << 4)).to(torch.float32) - 32
    return (step * q.reshape(-1, 16, 16)).reshape(-1, 256)


def q6_k_error_bound(x: torch.Tensor) -> torch.Tensor:
    """A bound on |x − dequantize(quantize(x, Q6_K))| per value: a step |d · sc| of its sub-block
    (half from rounding; a whole one where a value of the peak's opposite sign clamps at q − 32 = 31)
    plus 16·d (sc rounded by up to half of d, over up to 32 steps)."""
    data = quantize(x, Q6_K).reshape(-1, 210)
    d = _f16_values(data[:, 208:])
    sc = data[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    bound = (d * sc).abs() + 16 * d  # [n, 16]
    return bound.unsqueeze(2).expand(-1, 16, 16).reshape(x.shape)


# -- activations ----------------------------------------------------------------------------------

ACT_BLOCK = 32


def quantize_rows_q8(x: torch.Tensor, block: int = ACT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [M, K] (K whole blocks) as the products round them: per `block` values (32,
    or 256 for Q4_K weights as ggml's Q8_K), d = max|x| / 127 (float32, not float16 as ggml's Q8_0
    keeps it) and q = roundf(x · (1 / d)). Returns q int8 [M, K] and d float32 [M, K / block]."""
    blocks = x.detach().to(torch.float32).reshape(x.shape[0], -1, block)
    d = blocks.abs().amax(dim=2, keepdim=True) / 127
    q = roundf(blocks * _reciprocal(d)).to(torch.int8)
    return q.reshape(x.shape), d.squeeze(2)


def dequantize_rows_q8(q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`quantize_rows_q8`'s values back: [M, K] in `dtype` (d · q; d [M, K / block]; exact in float64)."""
    return (q.to(dtype).reshape(q.shape[0], d.shape[1], -1) * d.to(dtype).unsqueeze(2)).reshape(q.shape)
