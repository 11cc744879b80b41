"""The quantized products (`kernels/cpu/quant.c`) against a float64 product of the same rounded
activations and dequantized weights, within `cpu_quant.error_bound`; and their promise: a row's
bits do not depend on the batch, the few-row or many-row path, the thread count, the ISA, or x's
row stride."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from hybridspec.kernels.cpu import quant as cpu_quant
from hybridspec.kernels.quant import weight as quant_weight
from hybridspec.kernels.quant.weight import QuantWeight
from native_cpu import one_thread, quant_paths as available_paths, with_threads, x86_with_compiler  # noqa: F401 (one_thread: autouse)

pytestmark = x86_with_compiler
FORMATS = ("q8_0", "q4_0", "q4_k", "q6_k")
# few rows (1-4: one column at a time; Q6_K two distant columns, up to 4 rows on AVX2 and 6 on AVX512-VNNI),
# tiles (5 and up; Q6_K's 16-column ones from 7 on AVX512-VNNI), more than a chunk of 64 rows
ROWS = (1, 2, 4, 5, 7, 8, 9, 13, 70)


def operands(fmt: str, N: int = 37, K: int | None = None, M: int = max(ROWS), seed: int = 0):
    # 19 blocks of 32 (the kernel takes the scales 8 blocks at a time: a tail, and an odd count)
    K = K or (256 * 2 if fmt in ("q4_k", "q6_k") else 32 * 19)
    g = torch.Generator().manual_seed(seed)
    w = QuantWeight.quantize(torch.randn(N, K, generator=g) * 0.05, fmt)
    x = torch.randn(M, K, generator=g)
    x[0, :32] = 0  # a block of zeros: scale 0
    return x, w


@pytest.mark.parametrize("fmt", FORMATS)
def test_products_are_the_float64_product_of_the_same_values_within_the_bound(fmt):
    x, w = operands(fmt)
    for M in ROWS:
        got = cpu_quant.quant_matmul(x[:M], w).double()
        rounded = quant_weight.rounded_activations(x[:M], w.fmt, torch.float64)
        want = rounded @ w.dequantize().double().t()
        assert ((got - want).abs() <= cpu_quant.error_bound(rounded, w.dequantize())).all(), M
    # and the torch form (`weight.matmul`) multiplies the same values
    assert torch.allclose(quant_weight.matmul(x, w), cpu_quant.quant_matmul(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", available_paths())
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_bits_do_not_depend_on_the_batch_or_the_path(fmt, path):
    x, w = operands(fmt, N=41, seed=1)
    first = cpu_quant.vector_path()
    try:
        cpu_quant.vector_path(path)
        alone = torch.cat([cpu_quant.quant_matmul(x[m:m + 1], w) for m in range(x.shape[0])])
        # every row count of the few-row path and the tiles' shapes, and more than a chunk
        for M in (*range(1, 21), max(ROWS)):
            assert torch.equal(cpu_quant.quant_matmul(x[:M], w), alone[:M]), M
        assert torch.equal(cpu_quant.quant_matmul(x[3:9], w), alone[3:9])
    finally:
        cpu_quant.vector_path(first)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_columns_bits_do_not_depend_on_the_columns_beside_it(fmt):
    """The Q4_0 tiles hold 8 weight rows in a vector's lanes (16 on AVX512-VNNI), Q4_K's two: any
    slice of the weight's rows, at any offset in a tile, gives the full product's columns bit for bit."""
    x, w = operands(fmt, N=29, seed=7)
    full = cpu_quant.quant_matmul(x, w)
    rows = w.detach()
    for start, stop in ((0, 1), (3, 4), (5, 14), (8, 16), (21, 29), (1, 29)):
        part = QuantWeight.from_blocks(rows[start:stop].clone(), w.fmt, stop - start, w.in_features)
        for M in (1, 6, 13):
            assert torch.equal(cpu_quant.quant_matmul(x[:M], part), full[:M, start:stop]), (start, stop, M)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_bits_do_not_depend_on_the_thread_count(fmt):
    x, w = operands(fmt, N=300, K=1024, seed=2)
    one = {M: cpu_quant.quant_matmul(x[:M], w) for M in ROWS}
    for count in (2, 3):
        for M in ROWS:
            assert torch.equal(with_threads(count, lambda: cpu_quant.quant_matmul(x[:M], w)), one[M]), (count, M)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_prefills_rows_bits_do_not_depend_on_the_thread_count(fmt):
    """Past 2^18 floats of activations (300 rows of 1024) their quantization splits over the threads too."""
    x, w = operands(fmt, N=48, K=1024, M=300, seed=4)
    one = cpu_quant.quant_matmul(x, w)
    for count in (2, 3):
        assert torch.equal(with_threads(count, lambda: cpu_quant.quant_matmul(x, w)), one), count


@pytest.mark.parametrize("fmt", FORMATS)
def test_both_dot_products_give_the_same_bits(fmt):
    first = cpu_quant.vector_path()
    try:
        cpu_quant.vector_path("avx512vnni")
    except ValueError:
        pytest.skip("this CPU has no AVX512-VNNI: one path only")
    x, w = operands(fmt, seed=3)
    try:
        got = {path: cpu_quant.quant_matmul(x, w) for path in cpu_quant.VECTOR_PATHS if cpu_quant.vector_path(path)}
    finally:
        cpu_quant.vector_path(first)
    assert torch.equal(got["avx2"], got["avx512vnni"])


def test_rows_of_a_wider_tensor_are_taken_where_they_lie():
    x, w = operands("q8_0", seed=4)
    wide = torch.zeros(x.shape[0], x.shape[1] + 64)
    wide[:, 16:16 + x.shape[1]] = x
    view = wide[:, 16:16 + x.shape[1]]
    assert cpu_quant.applies(view, w)
    assert torch.equal(cpu_quant.quant_matmul(view, w), cpu_quant.quant_matmul(x, w))


def test_q6_k_products_of_arbitrary_blocks_are_within_the_bound():
    """Q6_K's blocks as llama.cpp writes them, not only as our plain quantizer makes them: any q,
    any int8 scale (−128 included), rows 1 … 20 alone or together."""
    g = torch.Generator().manual_seed(6)
    N, K = 23, 768
    raw = torch.randint(0, 256, (N, K // 256, 210), dtype=torch.uint8, generator=g)
    raw[:, :, 192] = 128  # one scale −128 per block
    raw[:, :, 208:] = (torch.rand(N, K // 256, generator=g) * 1e-3).to(torch.float16).view(torch.uint8).reshape(
        N, K // 256, 2)
    w = QuantWeight.from_blocks(raw, "q6_k", N, K)
    x = torch.randn(20, K, generator=g)
    alone = torch.cat([cpu_quant.quant_matmul(x[m:m + 1], w) for m in range(20)])
    rounded = quant_weight.rounded_activations(x, w.fmt, torch.float64)
    want = rounded @ w.dequantize().double().t()
    assert ((alone.double() - want).abs() <= cpu_quant.error_bound(rounded, w.dequantize())).all()
    for M in range(1, 21):
        assert torch.equal(cpu_quant.quant_matmul(x[:M], w), alone[:M]), M


def test_raw_blocks_wrap_as_a_weight_without_requantizing():
    _, w = operands("q4_k", seed=5)
    again = QuantWeight.from_blocks(w.detach().reshape(-1), "q4_k", w.out_features, w.in_features)
    assert torch.equal(again.detach(), w.detach()) and torch.equal(again.dequantize(), w.dequantize())


def one_hot_q8_0(K: int) -> QuantWeight:
    """A Q8_0 weight [K, K] whose row n is 1 at column n (scale 1.0): the product reads back x's
    rounded values, y[m, n] = d · q of x[m, n]."""
    blocks = torch.zeros(K, K // 32, 34, dtype=torch.uint8)
    blocks[:, :, :2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # float16 1.0, little-endian
    n = torch.arange(K)
    blocks[n, n // 32, 2 + n % 32] = 1
    return QuantWeight.from_blocks(blocks.reshape(-1), "q8_0", K, K)


def test_activations_round_as_roundf_halves_away_from_zero():
    K = 128
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(6)) * 3
    # block 0 of row 0: max 127, so d = 1 and every x · (1 / d) is x itself: exact halves of both signs
    x[0, :32] = torch.tensor([127.0, -0.5, 0.5, -1.5, 1.5, 2.5, -2.5, 126.5, -126.5, 0.49999997, -0.49999997]
                             + [k + 0.5 for k in range(-10, 11)], dtype=torch.float32)
    x[1, 32:64] = 0  # a block of zeros: scale 0
    got = cpu_quant.quant_matmul(x, one_hot_q8_0(K))
    assert torch.equal(got, quant_weight.rounded_activations(x, one_hot_q8_0(K).fmt, torch.float32))


# -- interleaved Q4_K and Q6_K (`QuantWeight.interleave_`, cpu/quant.c's HS_X16) -------------------------

INTERLEAVED = ("q4_k", "q6_k")
ROWS_OF = {"q4_k": 48, "q6_k": 272}  # Q6_K: a whole group of 256 rows and a short one


@pytest.mark.parametrize("step", (1 << 22, 1))
@pytest.mark.parametrize("fmt", INTERLEAVED)
def test_interleaving_keeps_the_values_and_undoes_exactly(fmt, step, monkeypatch):
    monkeypatch.setattr(quant_weight, "INTERLEAVE_STEP_BYTES", step)  # all groups at once, or one at a time
    N = ROWS_OF[fmt]
    _, w = operands(fmt, N=N, K=768, seed=4)
    wi = copy.deepcopy(w)
    address = wi.data_ptr()
    assert wi.interleave_() is wi and wi.interleaved and not w.interleaved and wi.interleave_() is wi
    assert wi.data_ptr() == address  # in place: no second copy of the weight
    assert not torch.equal(wi.detach(), w.detach())  # the same bytes, in another order
    assert torch.equal(wi.blocks(), w.detach()) and torch.equal(wi.dequantize(), w.dequantize())
    ids = torch.tensor([0, N - 1, 16, 15, 33, 33, N - 17])
    assert torch.equal(wi.rows(ids), w.rows(ids))
    for again in (copy.deepcopy(wi), pickle.loads(pickle.dumps(wi))):
        assert again.interleaved and torch.equal(again.detach(), wi.detach()) and again.code == wi.code != w.code


def test_only_k_formats_in_whole_tiles_interleave():
    from hybridspec.errors import ConfigError
    for fmt, N in (("q8_0", 32), ("q4_0", 32), ("q6_k", 40), ("q4_k", 40)):
        _, w = operands(fmt, N=N, seed=5)
        assert not w.can_interleave()
        with pytest.raises(ConfigError, match="cannot be interleaved"):
            w.interleave_()
        assert cpu_quant.laid_out(w) is w  # the products take it as it lies


@pytest.mark.parametrize("path", available_paths())
@pytest.mark.parametrize("fmt", INTERLEAVED)
def test_interleaved_products_are_the_plain_ones_bit_for_bit(fmt, path):
    """Every path (Q4_K: AVX2's 8-column tiles read half of each word vector, AVX512-VNNI's 16-column
    ones load it whole; Q6_K: AVX512-VNNI's 16-column tiles, AVX2 a word at a time), every row count
    (one row, the tiles of up to 4 or 6 rows, the VNNI tiles' decoded cache, more than a chunk), any
    thread count."""
    x, w = operands(fmt, N=ROWS_OF[fmt] if fmt == "q6_k" else 64, K=1024, seed=6)
    wi = copy.deepcopy(w).interleave_()
    first = cpu_quant.vector_path()
    try:
        cpu_quant.vector_path(path)
        for M in (*range(1, 10), 13, max(ROWS)):
            plain = cpu_quant.quant_matmul(x[:M], w)
            assert torch.equal(cpu_quant.quant_matmul(x[:M], wi), plain), M
            assert torch.equal(with_threads(2, lambda: cpu_quant.quant_matmul(x[:M], wi)), plain), M
    finally:
        cpu_quant.vector_path(first)
    assert torch.equal(quant_weight.matmul(x, wi), quant_weight.matmul(x, w))  # the torch form too
