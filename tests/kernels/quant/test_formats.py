"""The block formats against the `gguf` package's reference: quantize byte-equal for Q8_0 and
Q4_0, dequantize bit-equal for all four (arbitrary bytes too, as llama.cpp's files hold them), a row
lookup (`QuantWeight.rows`) those rows of it, and our Q4_K and Q6_K quantizers within their bounds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridspec.errors import ConfigError
from hybridspec.kernels.quant import formats
from hybridspec.kernels.quant.weight import QuantWeight

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0, "q4_k": GGMLQuantizationType.Q4_K,
        "q6_k": GGMLQuantizationType.Q6_K}


def values(seed: int, rows: int = 24, cols: int = 512) -> torch.Tensor:
    """Random rows with the edge cases: an all-zero block, a lone spike, exact halves, a tie of
    magnitudes of opposite sign (Q4_0 keeps the first's sign)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 0.05
    x[0, :256] = 0
    x[1, 7] = 4.0
    x[2, :32] = torch.tensor([0.5, -0.5] * 16)
    x[3, 32:64] = torch.linspace(-1, 1, 32)
    x[4, :32] = torch.tensor([-0.25] + [0.25] + [0.1] * 30)
    return x


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantize_is_byte_equal_to_gguf(name, seed):
    x = values(seed)
    ours = formats.quantize(x, formats.FORMATS[name])
    theirs = gguf_quants.quantize(x.numpy(), GGML[name])
    assert ours.dtype is torch.uint8 and ours.shape == theirs.shape
    assert np.array_equal(ours.numpy(), theirs)


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_k", "q6_k"])
def test_dequantize_is_bit_equal_to_gguf(name):
    fmt = formats.FORMATS[name]
    data = formats.quantize(values(3), fmt)
    ours = formats.dequantize(data, fmt)
    assert np.array_equal(ours.numpy(), gguf_quants.dequantize(data.numpy(), GGML[name]))


def test_dequantize_of_arbitrary_q4_k_bytes_is_gguf_s():
    """Every bit pattern of the scales and nibbles (not only our quantizer's), float16 d finite."""
    g = torch.Generator().manual_seed(4)
    data = torch.randint(0, 256, (16, 144 * 2), dtype=torch.uint8, generator=g)
    d = (torch.rand(16, 2, 2, generator=g) * 0.01).to(torch.float16).view(torch.uint8).reshape(16, 2, 4)
    data.view(16, 2, 144)[:, :, :4] = d
    assert np.array_equal(formats.dequantize(data, formats.Q4_K).numpy(),
                          gguf_quants.dequantize(data.numpy(), GGMLQuantizationType.Q4_K))


def arbitrary_blocks(fmt: formats.BlockFormat, count: int, seed: int) -> torch.Tensor:
    """uint8 [count, nbytes]: random bytes, each float16 scale a finite value of either sign."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (count, fmt.nbytes), dtype=torch.uint8, generator=g)
    for at in {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}[fmt.name]:
        d = (torch.rand(count, generator=g) - 0.25) * 1e-2
        blocks[:, at:at + 2] = d.to(torch.float16).view(torch.uint8).reshape(count, 2)
    return blocks


@pytest.mark.parametrize("name", sorted(GGML))
def test_dequantize_of_arbitrary_bytes_is_gguf_s(name):
    fmt = formats.FORMATS[name]
    blocks = arbitrary_blocks(fmt, 300, seed=fmt.code)
    assert np.array_equal(formats.dequantize(blocks.reshape(-1), fmt).numpy(),
                          gguf_quants.dequantize(blocks.numpy().reshape(-1), GGML[name]))


@pytest.mark.parametrize("name", sorted(GGML))
def test_a_row_lookup_is_those_rows_of_the_whole_dequantized_table(name):
    fmt = formats.FORMATS[name]
    table = QuantWeight.from_blocks(arbitrary_blocks(fmt, 40, seed=10 + fmt.code), fmt, 20, 2 * fmt.block)
    ids = torch.tensor([3, 0, 19, 3, 7])
    assert torch.equal(table.rows(ids), table.dequantize()[ids])


def test_q4_k_scales_pack_and_unpack():
    g = torch.Generator().manual_seed(5)
    sc, m = (torch.randint(0, 64, (10, 8), dtype=torch.uint8, generator=g) for _ in range(2))
    back = formats.unpack_scales(formats.pack_scales(sc, m))
    assert torch.equal(back[0], sc) and torch.equal(back[1], m)


@pytest.mark.parametrize("seed", [0, 6])
def test_q4_k_round_trip_within_its_bound(seed):
    x = values(seed)
    err = (formats.dequantize(formats.quantize(x, formats.Q4_K), formats.Q4_K) - x).abs()
    assert (err <= formats.q4_k_error_bound(x)).all()
    assert err.pow(2).mean().sqrt() < 0.12 * x.pow(2).mean().sqrt()  # a 4-bit format's error, not garbage


@pytest.mark.parametrize("seed", [0, 6])
def test_q6_k_round_trip_within_its_bound(seed):
    """Our plain Q6_K quantizer (llama.cpp's files are read, `quantize=` does not make Q6_K)."""
    for scale in (1.0, 1e-3, 1e-6):  # the last: d in float16's subnormals
        x = values(seed) * scale
        err = (formats.dequantize(formats.quantize(x, formats.Q6_K), formats.Q6_K) - x).abs()
        assert (err <= formats.q6_k_error_bound(x)).all()
    assert err.max() > 0


@pytest.mark.parametrize("name,steps", [("q8_0", 0.5), ("q4_0", 1.0)])
def test_round_trip_within_a_step(name, steps):
    """Q8_0: half a step. Q4_0: codes -8..7 with -8 at the peak, so a value of the other sign near
    the peak's magnitude clamps at 7: up to one step."""
    fmt = formats.FORMATS[name]
    x = values(7)
    data = formats.quantize(x, fmt)
    d = data.reshape(-1, fmt.nbytes)[:, :2].contiguous().view(torch.float16).to(torch.float32).abs()
    err = (formats.dequantize(data, fmt) - x).abs().reshape(-1, 32)
    # plus float16's rounding of d over the largest code
    assert (err <= d * (steps + 128 * 2.0 ** -11) + 1e-12).all()


def test_activation_rounding_round_trips_within_half_a_step():
    x = values(8, rows=5, cols=128)
    q, d = formats.quantize_rows_q8(x)
    back = formats.dequantize_rows_q8(q, d)
    assert ((back - x).abs().reshape(5, -1, 32) <= d.unsqueeze(2) * 0.5 * (1 + 1e-6)).all()


def test_the_formats_carry_ggmls_type_ids_and_sizes():
    for name, ggml_type in GGML.items():
        fmt = formats.FORMATS[name]
        assert formats.BY_GGML_TYPE[int(ggml_type)] is fmt
        assert gguf_quants.GGML_QUANT_SIZES[ggml_type] == (fmt.block, fmt.nbytes)


def test_a_format_is_named_or_refused():
    assert formats.format_named("Q4_K") is formats.Q4_K
    with pytest.raises(ConfigError, match="q5_k"):
        formats.format_named("q5_k")
    with pytest.raises(ConfigError, match="q6_k"):  # read and multiplied, not made by quantize=
        formats.format_named("q6_k")
    assert formats.format_named("q6_k", tuple(formats.FORMATS)) is formats.Q6_K
    with pytest.raises(ConfigError, match="whole blocks"):
        formats.quantize(torch.zeros(2, 48), formats.Q8_0)
