"""The one kernel/reference dispatch point."""
import pytest
import torch

from hybridspec.kernels.dispatch import KERNELS_ENV, pick, use_triton


def kernel(x):
    return "kernel"


def reference(x):
    return "reference"


def test_cpu_tensors_take_the_reference(monkeypatch):
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert not use_triton(torch.zeros(1)) and pick(kernel, reference, torch.zeros(1)) is reference


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_tensors_take_the_kernel_unless_references_are_forced(monkeypatch):
    x = torch.zeros(1, device="cuda")
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert pick(kernel, reference, x) is kernel
    monkeypatch.setenv(KERNELS_ENV, "reference")
    assert pick(kernel, reference, x) is reference


def test_triton_forces_the_kernel_on_every_device(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "triton")
    assert pick(kernel, reference, torch.zeros(1)) is kernel


def test_an_unknown_choice_names_the_variable(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="HYBRIDSPEC_KERNELS='fast'"):
        use_triton(torch.zeros(1))
