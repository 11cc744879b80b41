"""Kernel tests run the Triton kernels interpreted on CPU tensors, or compiled on a GPU.

TRITON_INTERPRET is read when ``@triton.jit`` decorates a function, so it is set
here, before any kernel module is imported. If something imported the kernels
earlier without it (and there is no GPU), the ``triton_device`` fixture skips.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def _kernels_are_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    from hybridspec.kernels.triton import keyed_random
    from hybridspec.kernels.triton import rejection

    return all(isinstance(f, InterpretedFunction) for f in (keyed_random.uniform_dev, rejection._rejection_kernel))


@pytest.fixture
def triton_device() -> torch.device:
    """The device to run Triton kernels on: CPU when interpreted, else CUDA; skips otherwise."""
    pytest.importorskip("triton", reason="triton is not installed")
    if _kernels_are_interpreted():
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip(
        "Triton kernels were compiled for a GPU (imported before TRITON_INTERPRET=1 was set) "
        "and there is no GPU; run with TRITON_INTERPRET=1 in the environment"
    )
