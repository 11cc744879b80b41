"""The one place that chooses between a Triton kernel and its torch reference.

Triton runs on CUDA tensors; everywhere else (CPU) the `_ref` functions run.
`HYBRIDSPEC_KERNELS=reference` forces the references on a GPU too, to tell a
kernel bug from a runtime bug; `HYBRIDSPEC_KERNELS=triton` forces the kernels
on every device, which on CPU tensors needs `TRITON_INTERPRET=1` (the tests
run a whole model's GPU path that way, slowly; turn the native CPU kernels
off too, `HYBRIDSPEC_CPU_KERNELS=torch`, or they take float32 CPU work first).
"""
from __future__ import annotations

import os
from typing import Callable, TypeVar

import torch

KERNELS_ENV = "HYBRIDSPEC_KERNELS"
KERNEL_CHOICES = ("auto", "reference", "triton")

F = TypeVar("F", bound=Callable)


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernel should run for tensors on `tensor`'s device."""
    return triton_runs_on(tensor.device)


def triton_runs_on(device: torch.device | str) -> bool:
    """Whether the Triton kernels (not the torch references) run on `device`."""
    choice = os.environ.get(KERNELS_ENV, "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNELS_ENV}={choice!r} must be one of {KERNEL_CHOICES}; unset it for 'auto'")
    return choice == "triton" or (choice == "auto" and torch.device(device).type == "cuda")


def pick(kernel: F, reference: F, tensor: torch.Tensor) -> F:
    """`kernel` (Triton launcher) or `reference` (torch), same signature, for `tensor`'s device."""
    return kernel if use_triton(tensor) else reference
