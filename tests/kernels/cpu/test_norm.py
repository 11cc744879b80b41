"""RMSNorm in C (`kernels/cpu/norm.c`): plain and gated, against the torch
form; the same bits at every thread count; and when it runs."""
from __future__ import annotations

import pytest
import torch

from hybridspec.kernels import ops
from hybridspec.kernels.cpu import norm as cpu_norm
from native_cpu import one_thread, with_threads, x86_with_compiler  # noqa: F401 (one_thread: an autouse fixture)

pytestmark = x86_with_compiler


NATIVE, TORCH = ops.NORM["native"], ops.NORM["torch"]  # the norm op of a native and of a torch backend


@pytest.mark.parametrize("shape,group", [((1, 1, 256), 256), ((2, 5, 512), 64), ((3, 7), 7), ((4, 100), 20)])
def test_plain_and_gated_match_the_torch_form(shape, group):
    g = torch.Generator().manual_seed(shape[-1])
    x, gate = torch.randn(*shape, generator=g), 3 * torch.randn(*shape, generator=g)
    weight = torch.randn(shape[-1], generator=g)
    for w in (weight, None):
        got = cpu_norm.rms_norm(x, w, 1e-6)
        assert got is not None and got.shape == x.shape
        torch.testing.assert_close(got, TORCH.rms(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    got = cpu_norm.rms_norm(x, weight, 1e-6, gate=gate, group=group)
    torch.testing.assert_close(got, TORCH.gated(x, gate, weight, group, 1e-6), rtol=1e-5, atol=1e-5)


def test_many_rows_bits_do_not_depend_on_the_thread_count():
    """Past 2^18 floats (300 rows of 1024, a prefill's) the rows split over the threads."""
    g = torch.Generator().manual_seed(5)
    x, gate, weight = torch.randn(300, 1024, generator=g), torch.randn(300, 1024, generator=g), torch.randn(1024)

    def both():
        return cpu_norm.rms_norm(x, weight, 1e-6), cpu_norm.rms_norm(x, weight, 1e-6, gate=gate, group=256)
    one = both()
    for count in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(with_threads(count, both), one)), count


def test_a_gate_sliced_from_a_projection_and_the_fallbacks():
    g = torch.Generator().manual_seed(3)
    projected = torch.randn(2, 5, 1100, generator=g)
    gate, y, weight = projected[..., :512], torch.randn(2, 5, 512, generator=g), torch.randn(512, generator=g)
    assert cpu_norm.as_rows(gate).stride() == (1100, 1)  # a view, no copy
    torch.testing.assert_close(NATIVE.gated(y, gate, weight, 64, 1e-6),
                               TORCH.gated(y, gate, weight, 64, 1e-6), rtol=1e-5, atol=1e-5)
    assert cpu_norm.rms_norm(torch.randn(4, 6).t(), None, 1e-6) is None  # columns are not rows: torch form
    assert not cpu_norm.applies(torch.randn(3, 8, dtype=torch.float64), None)
    assert not cpu_norm.applies(torch.randn(3, 8), torch.randn(7))  # weight of the wrong size
    x = torch.randn(3, 8, generator=g)
    column_major = x.t().contiguous().t()  # channel stride 3: the torch form runs, to the same values
    assert not cpu_norm.applies(column_major, None)
    torch.testing.assert_close(NATIVE.rms(column_major, None, 1e-6), NATIVE.rms(x, None, 1e-6),
                               rtol=1e-5, atol=1e-6)
