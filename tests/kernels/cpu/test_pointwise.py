"""softplus and sigmoid of the native backend (`ops.NativePointwise`, `kernels/cpu/pointwise.c`):
each output the same bits wherever its element lies, close to torch's, torch's where the kernels
do not take the tensor."""
from __future__ import annotations

import pytest
import torch

from hybridspec.kernels import ops
from native_cpu import one_thread, x86_with_compiler  # noqa: F401 (one_thread: an autouse fixture)

pytestmark = x86_with_compiler
FUNCTIONS = {"softplus": torch.nn.functional.softplus, "sigmoid": torch.sigmoid}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_each_output_is_the_same_bits_wherever_its_element_lies(name):
    x = torch.randn(2, 1000, 3, generator=torch.Generator().manual_seed(1)) * 8
    x[0, 0, :] = torch.tensor([25.0, -30.0, 0.0])  # past softplus's threshold; saturated; zero
    native = getattr(ops.NativePointwise(), name)
    whole = native(x)
    assert torch.equal(whole[:1], native(x[:1].clone()))  # body vs tail of torch's loop
    assert torch.equal(whole[1, 7:], native(x[1, 7:]))  # a strided view: computed contiguous
    assert torch.equal(whole.flatten()[::97], torch.cat([native(v.view(1)) for v in x.flatten()[::97]]))
    assert torch.allclose(whole, FUNCTIONS[name](x), rtol=2e-7, atol=0)
    if name == "softplus":
        assert whole[0, 0, 0] == 25.0


def test_tensors_the_kernels_do_not_take_get_torchs():
    native = ops.NativePointwise()
    x64 = torch.randn(50, dtype=torch.float64)
    assert torch.equal(native.softplus(x64), torch.nn.functional.softplus(x64))
    x = torch.randn(50, requires_grad=True)
    native.sigmoid(x).sum().backward()  # autograd: torch's, with its gradient
    assert torch.allclose(x.grad, torch.sigmoid(x) * (1 - torch.sigmoid(x)))
