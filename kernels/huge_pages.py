"""CPU memory in transparent huge pages, for the weights a decode step streams.

Why: a decode step reads every weight once (a 212M-parameter model: 0.4 GB in
bfloat16, 0.8 GB in float32). With 4 KiB pages every 4 KiB of that stream costs
a TLB miss and a page walk beside the load, and one thread's products read
markedly less than the memory delivers (docs/results/llamacpp.md, "Huge pages").
Linux backs memory with 2 MiB pages where transparent huge pages are "always",
or "madvise" and the memory is advised MADV_HUGEPAGE before it is first
written. torch's allocator gives no advice, and the memory it hands out may
already be backed by small pages, so `zeros` maps fresh memory,
advises it, and places the tensors side by side in it (one mapping: the few
small pages at its two ends are all that a tensor's odd size leaves behind).

Where the advice is not available (another OS) or refused, the tensors are
the same tensors in small pages, and where the OS has no private anonymous
mappings (Windows) torch's own: only the speed differs, never a value.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import mmap

import torch

ALIGN = 64  # bytes between the starts of two tensors: a cache line, what the kernels' vector loads like


def zeros(specs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> list[torch.Tensor]:
    """Zero-filled contiguous tensors of these (shape, dtype)s on `device`: on a CPU side
    by side in one fresh mapping advised for huge pages (fresh anonymous memory
    is zero), where they keep the mapping alive between them (it is released
    when the last one goes); elsewhere torch's own."""
    if torch.device(device).type != "cpu" or not hasattr(mmap, "MAP_ANONYMOUS"):  # no private anonymous maps: Windows
        return [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in specs]
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        total += -(-_nbytes(shape, dtype) // ALIGN) * ALIGN
    buffer = _advised_buffer(max(total, 1))
    return [buffer[start:start + _nbytes(shape, dtype)].view(dtype).view(shape)
            for (shape, dtype), start in zip(specs, offsets)]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def _advised_buffer(nbytes: int) -> torch.Tensor:
    """nbytes of fresh private anonymous memory as a uint8 tensor, advised MADV_HUGEPAGE where the
    OS has it (before anything is written: advice does not turn pages already backed)."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mapping.madvise(advice)
        except OSError:  # transparent huge pages compiled out or refused: small pages, same values
            pass
    return torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while a view of it lives


def return_freed_memory() -> bool:
    """Hand the C allocator's free memory back to the OS (glibc's malloc_trim),
    after collecting Python's cyclic garbage (which still holds some of it): a
    load's temporaries (a file's float copies, quantized blocks before they
    move into a huge-page mapping) are freed into the allocator's heaps, which
    keep them resident until something asks. Returns whether it asked: False
    where the C library has no malloc_trim (musl, macOS, Windows)."""
    gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim():
    """The C library's malloc_trim, looked up once; None where it has none."""
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
