"""What the tests of the native CPU kernels (`kernels/cpu/`) share, here and in
tests/kernels/cpu/: the mark that skips where the kernels cannot be built, one
torch thread per test, each vector path of the products in turn, and a block
run at a given torch thread count, the quantized products' vector paths."""
from __future__ import annotations

import platform
import shutil

import pytest
import torch

from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.kernels.cpu import rows as cpu_rows

x86_with_compiler = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64") or not (shutil.which("cc") or shutil.which("gcc"))
    or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="the kernel is AVX2 C code built with the system's compiler")


def set_threads(count: int) -> None:
    """torch's intra-op thread count and, where the kernels run here, theirs (a kernel called
    directly, not through `cpu_native.available`, would otherwise keep the count it last had)."""
    torch.set_num_threads(count)
    cpu_native.available()


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    set_threads(1)
    yield
    set_threads(threads)


@pytest.fixture
def both_vector_paths():
    """The product kernel's vector paths, each run in turn (skips without AVX-512)."""
    first = cpu_rows.vector_path()
    try:
        cpu_rows.vector_path("avx512")
    except ValueError:
        pytest.skip("this CPU has no AVX-512F: one vector path only")

    def each(fn):
        return [fn() for path in cpu_rows.VECTOR_PATHS if cpu_rows.vector_path(path)]
    yield each
    cpu_rows.vector_path(first)


def with_threads(count: int, fn):
    """fn() with torch and the kernels at `count` threads."""
    before = torch.get_num_threads()
    set_threads(count)
    try:
        return fn()
    finally:
        set_threads(before)


def quant_paths() -> list[str]:
    """The quantized products' dot products this CPU takes (`cpu_quant.VECTOR_PATHS`)."""
    from hybridspec.kernels.cpu import quant as cpu_quant
    first, paths = cpu_quant.vector_path(), []
    try:
        for path in cpu_quant.VECTOR_PATHS:
            try:
                paths.append(cpu_quant.vector_path(path))
            except ValueError:
                pass
    finally:
        cpu_quant.vector_path(first)
    return paths
