"""The coarse-to-exact argmax of a Q6_K product (`cpu/quant.c`'s `hs_quant_top`, a greedy draft's LM
head): each row's best columns by a coarse pass over the weights' high bits get the product's own
outputs, bit for bit, the others −∞; the coarse pass ranks by Σ d · sc · (2h − 3) · x (h a value's
two high bits) on every path and layout alike. (The interleaved layout's round trip and products:
test_products.py.)"""
from __future__ import annotations

import copy

import pytest
import torch

from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.kernels.cpu import quant as cpu_quant
from hybridspec.kernels.quant import formats
from hybridspec.kernels.quant import weight as quant_weight
from hybridspec.kernels.quant.weight import QuantWeight
from native_cpu import one_thread, quant_paths as available_paths, with_threads, x86_with_compiler  # noqa: F401 (one_thread: autouse)

pytestmark = x86_with_compiler


def operands(N: int = 272, K: int = 512, M: int = 9, seed: int = 0) -> tuple[torch.Tensor, QuantWeight]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g), QuantWeight.quantize(torch.randn(N, K, generator=g) * 0.05, "q6_k")


def top_columns(x: torch.Tensor, w: QuantWeight, top: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """hs_quant_top's (status, outputs [M, N], argmax [M])."""
    M, K = x.shape
    y, best = torch.empty(M, w.out_features), torch.empty(M, dtype=torch.int64)
    status = cpu_native.library().hs_quant_top(x.data_ptr(), K, w.data_ptr(), w.code, M, K, w.out_features, top,
                                               y.data_ptr(), best.data_ptr())
    return status, y, best


def coarse_scores(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """Σ d · sc · (2h − 3) · x over the rounded activations, float64 [M, N]."""
    blocks = w.blocks().view(w.out_features, -1, formats.Q6_K.nbytes)
    v = torch.arange(256)
    qh = blocks[:, :, 128 + 32 * (v // 128) + v % 32].long()  # [N, blocks, 256]: each value's qh byte
    high = (qh >> (2 * (v % 128 // 32))) & 3
    scales = blocks[:, :, 192:208].view(torch.int8)[:, :, v // 16].double()
    d = blocks[:, :, 208:210].contiguous().view(torch.float16).double()  # [N, blocks, 1]
    values = (d * scales * (2 * high - 3).double()).reshape(w.out_features, -1)
    return quant_weight.rounded_activations(x, w.fmt, torch.float64) @ values.t()


@pytest.mark.parametrize("path", available_paths())
@pytest.mark.parametrize("interleaved", (False, True))
def test_best_columns_get_the_products_outputs(path, interleaved):
    x, w = operands()
    w = copy.deepcopy(w).interleave_() if interleaved else w
    first = cpu_quant.vector_path()
    try:
        cpu_quant.vector_path(path)
        for M in (1, 3, 7):
            product = cpu_quant.quant_matmul(x[:M], w)
            for top in (1, 5, 40, w.out_features, w.out_features + 3):
                status, y, best = top_columns(x[:M], w, top)
                kept = torch.isfinite(y)
                assert status == 0 and (kept.sum(1) == min(top, w.out_features)).all()
                assert torch.equal(y[kept], product[kept]), (M, top)  # the product's bits
                assert (y[~kept] == float("-inf")).all() and torch.equal(best, y.argmax(1))
                if top >= w.out_features:
                    assert torch.equal(best, product.argmax(1))
    finally:
        cpu_quant.vector_path(first)


def test_the_coarse_pass_ranks_by_the_high_bits_on_every_path_and_layout():
    x, w = operands(seed=1)
    reference = coarse_scores(x, w)
    first, masks = cpu_quant.vector_path(), []
    try:
        for path in available_paths():
            cpu_quant.vector_path(path)
            for weight in (w, copy.deepcopy(w).interleave_()):
                for threads in (1, 2):
                    status, y, _ = with_threads(threads, lambda: top_columns(x, weight, 40))
                    masks.append(torch.isfinite(y))
    finally:
        cpu_quant.vector_path(first)
    assert all(torch.equal(mask, masks[0]) for mask in masks)  # the same columns everywhere
    kept = masks[0]
    tolerance = 1e-5 * reference.abs().max()
    for m in range(x.shape[0]):  # the best 40 by the coarse scores, but for float32's rounding
        assert reference[m][kept[m]].min() >= reference[m][~kept[m]].max() - tolerance
    assert not torch.equal(kept, torch.isfinite(cpu_quant.quant_matmul(x, w)))  # (the test can see a difference)


def test_not_taken_arguments():
    x, w = operands(N=32)
    for fmt in ("q8_0", "q4_0", "q4_k"):
        other = QuantWeight.quantize(torch.randn(32, 512), fmt)
        assert top_columns(x, other, 4)[0] == -1
    assert top_columns(x, w, 0)[0] == -1


def test_q6_k_stays_as_it_lies_on_avx2():
    _, w = operands(N=32)
    first = cpu_quant.vector_path()
    try:
        cpu_quant.vector_path("avx2")
        assert cpu_quant.laid_out(w) is w and not w.interleaved
    finally:
        cpu_quant.vector_path(first)
