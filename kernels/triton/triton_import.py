"""`triton` and `triton.language` for the kernel modules, imported only where
a kernel can run.

The Triton kernels run on CUDA tensors (the backend, `kernels.backend`), or on CPU tensors
under `TRITON_INTERPRET=1` (the kernel tests). Anywhere else only the torch
references run, so the kernel modules take stand-ins from here instead of
importing triton (which is slow and loads a few hundred modules): `jit`
keeps the function, `tl.constexpr` reads as an annotation, and launching a
kernel or asking for anything else raises `TritonUnavailable` naming the fix.
No math is re-implemented: the references stay the one CPU path.
"""
import os

import torch


class TritonUnavailable(RuntimeError):
    """A Triton kernel was launched where triton was not imported."""


FIX = ("Triton kernels run on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1 set before hybridspec is "
       "imported; on CPU call the torch reference (the function's `_ref` twin)")


def triton_can_run() -> bool:
    """Whether a kernel can run in this process: a CUDA device, or the interpreter asked for."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or torch.cuda.is_available()


class UnavailableKernel:
    """What `jit` makes of a kernel when triton is not imported."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = fn.__name__

    def __getitem__(self, grid):
        raise TritonUnavailable(f"{self.__name__} cannot launch: {FIX}")

    def __call__(self, *args, **kwargs):
        raise TritonUnavailable(f"{self.__name__} cannot run: {FIX}")


class UnavailableModule:
    """Stands in for `triton` or `triton.language` when triton is not imported."""

    constexpr = "constexpr"  # what `BLOCK: tl.constexpr` annotations read

    def __init__(self, name: str):
        self.name = name

    @staticmethod
    def jit(fn):
        return UnavailableKernel(fn)

    def __getattr__(self, attribute: str):
        raise TritonUnavailable(f"{self.name}.{attribute} is not available: {FIX}")


if triton_can_run():
    import triton
    import triton.language as tl
else:
    triton, tl = UnavailableModule("triton"), UnavailableModule("triton.language")
