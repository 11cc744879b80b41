"""Few-row float32 matrix products on CPU (decode, drafting, verify forwards).

Why: a decode step of a small model reads every weight once from memory, and
MKL's kernels neither stream a cold weight at the memory's speed nor keep
the cost of 2–8 rows near the cost of one (on this project's CPU, with the
weights out of cache: one row of a 256 × 1160 weight 104 µs, five rows 315 µs;
`cpu_rows.c` takes 102 and 117 µs). So a verify forward of γ + 1 tokens cost
about two plain steps. `cpu_rows.c` streams the weight once per 8 rows in
memory order and hides the extra rows' arithmetic behind the memory.

It is plain C (AVX2 + FMA), compiled on first use with the system's C
compiler into a per-user cache (`HYBRIDSPEC_CACHE_DIR`, default
`~/.cache/hybridspec`; about a second) and called through ctypes. Where it
cannot be built or run (no compiler, no AVX2, not x86) `torch.mm` runs, with
one warning. `HYBRIDSPEC_CPU_MATMUL=torch` (read on first use) or
`set_enabled(False)` turns it off.

Used by `models.common.linear` when every condition holds: float32 CPU
tensors, at most `MAX_ROWS` rows, an input-major contiguous weight (what
`HybridModel.pack_for_cpu` stores; `hs.load` packs on CPU), one torch thread
(the kernel is single-threaded; with more threads MKL's parallel products
run), and no autograd. Each output is the fused multiply-add chain over the
input dimension in order, so a row's result does not depend on the other
rows of the call (batch invariance at the bit level for up to `MAX_ROWS`
rows). float64 (the parity suites) always takes `torch.mm`.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

MATMUL_ENV = "HYBRIDSPEC_CPU_MATMUL"
MATMUL_CHOICES = ("auto", "torch")
CACHE_ENV = "HYBRIDSPEC_CACHE_DIR"
SOURCE = Path(__file__).with_name("cpu_rows.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-std=c99")
# rows up to which the kernel beats MKL with the weights out of cache (measured
# on 256…1536 × 256…3072 weights: 1–8 rows 1.0–3.1× faster; from 10 rows MKL is
# faster on some shapes, the larger the input dimension the sooner)
MAX_ROWS = 8

_library = None  # the loaded ctypes function, False when it cannot run here
_enabled = None  # None: not decided yet (see `enabled`)


class CpuRowsUnavailable(RuntimeError):
    """The C kernel cannot be built or loaded on this machine (the reason in the message)."""


def enabled() -> bool:
    """Whether the kernel may run: `HYBRIDSPEC_CPU_MATMUL`, read on first use, or what `set_enabled` said."""
    global _enabled
    if _enabled is None:
        choice = os.environ.get(MATMUL_ENV, "auto")
        if choice not in MATMUL_CHOICES:
            raise ValueError(f"{MATMUL_ENV}={choice!r} must be one of {MATMUL_CHOICES}; unset it for 'auto'")
        _enabled = choice == "auto"
    return _enabled


def set_enabled(flag: bool | None) -> None:
    """Turn the kernel on or off for this process (None: back to `HYBRIDSPEC_CPU_MATMUL`)."""
    global _enabled
    _enabled = None if flag is None else bool(flag)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hybridspec") / "kernels"


def build(directory: Path | None = None) -> Path:
    """Compile `cpu_rows.c` into `directory` (default `cache_dir()`) unless a
    build of the same source and flags is there; returns the shared library.
    Raises CpuRowsUnavailable with the reason when it cannot."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise CpuRowsUnavailable(f"the kernel is x86 (AVX2) code; this machine is {platform.machine()}")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise CpuRowsUnavailable(f"the CPU lacks AVX2/FMA (torch reports {torch.backends.cpu.get_cpu_capability()})")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise CpuRowsUnavailable("no C compiler found (set CC, or install gcc)")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    directory = Path(directory) if directory is not None else cache_dir()
    target = directory / f"cpu_rows-{digest}.so"
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:  # built aside, then renamed: no half-written library
        built = Path(tmp) / target.name
        try:
            result = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm"],
                                    capture_output=True, text=True)
        except OSError as exc:
            raise CpuRowsUnavailable(f"the C compiler {compiler!r} cannot run: {exc}") from exc
        if result.returncode != 0:
            raise CpuRowsUnavailable(f"{compiler} failed on {SOURCE.name}: {result.stderr.strip()[:2000]}")
        os.replace(built, target)
    return target


def _load():
    global _library
    if _library is None:
        try:
            fn = ctypes.CDLL(str(build())).hs_rows_matmul
        except (CpuRowsUnavailable, OSError) as exc:
            warnings.warn(f"hybridspec: the few-row CPU matmul kernel is off, torch.mm runs instead: {exc}",
                          RuntimeWarning, stacklevel=3)
            _library = False
        else:
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_int64, ctypes.c_void_p]
            _library = fn
    return _library


def available() -> bool:
    """Whether the kernel runs here (built and loaded, and not turned off)."""
    return (_enabled if _enabled is not None else enabled()) and bool(_library if _library is not None else _load())


def applies(x: torch.Tensor, weight_t: torch.Tensor) -> bool:
    """Whether `rows_matmul(x, weight_t)` runs for these operands (see the module docstring)."""
    return (0 < x.shape[0] <= MAX_ROWS and x.dtype is torch.float32 and weight_t.dtype is torch.float32
            and x.is_cpu and weight_t.is_cpu and x.dim() == 2 and x.stride(1) == 1
            and (x.shape[0] == 1 or x.stride(0) >= x.shape[1]) and weight_t.is_contiguous()
            and torch.get_num_threads() == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or weight_t.requires_grad))
            and available())


def rows_matmul(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight_t [K, N] -> [M, N] with the C kernel; the caller checked `applies`."""
    M, K = x.shape
    N = weight_t.shape[1]
    if weight_t.shape[0] != K:
        raise ValueError(f"rows_matmul: x is {tuple(x.shape)} but the weight is {tuple(weight_t.shape)}")
    out = torch.empty(M, N, dtype=torch.float32)
    row_stride = x.stride(0) if M > 1 else K  # a one-row view may carry any row stride
    if _library(x.data_ptr(), row_stride, weight_t.data_ptr(), M, K, N, out.data_ptr()) != 0:
        raise ValueError(f"rows_matmul: sizes not taken: x {tuple(x.shape)} stride {x.stride()}, weight "
                         f"{tuple(weight_t.shape)}")
    return out
