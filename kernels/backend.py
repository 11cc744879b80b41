"""Backends: which kernels a model runs, chosen once per (model, device, dtype).

A `Backend` is a set of op objects, one per operation the models need, each
with one interface and up to three implementations (`kernels.ops`): the
Triton kernels (CUDA, or CPU tensors under TRITON_INTERPRET=1), the native C
kernels (float32 on x86 CPUs, `cpu_native`) and the torch references. Models,
caches and the speculator call the ops; they never test a device, an
environment variable or a kernel's availability. An op may still decline a
call's shapes inside itself (a native kernel that takes only some strides
runs its torch form then): the caller never asks.

The choice, by name (`CHOICES`):
- "auto" (default): the native kernels, whole forward and blocks included,
  for float32 on a CPU where they are built; Triton on CUDA; the torch
  references anywhere else (float64 parity runs, MPS);
- "native", "native-blocks", "native-ops": on a float32 CPU model, the native
  kernels with the whole forward, with the blocks layer by layer but no whole
  forward, or the single ops only (products, norms, recurrences) under the
  modules; elsewhere as "auto" (tests and benches compare these paths);
- "triton": the Triton kernels on every device (on CPU tensors only under
  TRITON_INTERPRET=1, to run the GPU path in tests);
- "torch": the torch references everywhere (to tell a kernel bug from a
  runtime bug).
The products' compute (`COMPUTES`, `check_compute`) is a second, per-model choice:
"float32" (default) multiplies float32 (or exact 16-bit copies widened as they
load: the float32 bits); "bfloat16", the opt-in fast path on CPUs with
AVX512-BF16, rounds each product's activations to bfloat16 and multiplies the
bfloat16 weights with the CPU's BF16 dot product, float32 sums
(`cpu/rows_bf16.c`): close to float32, not its bits. It changes the products
only (the linear layers and the LM head: layer by layer, in the blocks and in
the whole forward); norms, recurrences, conv windows and attention stay
float32. It applies where the native kernels run; under "torch" or "triton"
the products are those backends' own.

The name comes from `use_backend(name)` (the one override, for this process), else
the environment variable HYBRIDSPEC_BACKEND, else "auto"; a bad value is a
ConfigError. `select` reads it when a model binds (construction,
`pack_for_cpu`, `to`) or a cache is made, never per call: after changing it,
a model takes it at its next `bind_backend()`.
"""
from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from hybridspec.errors import ConfigError
from hybridspec.kernels import ops
from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.kernels.cpu.blocks import BLOCK_ROWS, CALL_ROWS, NO_BLOCKS, LayerBlocks
from hybridspec.kernels.cpu.forward import NO_WHOLE_FORWARD, WholeForward
from hybridspec.kernels.descriptors import LayerDesc, ModelDesc

BACKEND_ENV = "HYBRIDSPEC_BACKEND"
CHOICES = ("auto", "native", "native-blocks", "native-ops", "triton", "torch")
COMPUTES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # what the products multiply in

_override: str | None = None  # `use_backend`


def check_choice(name: str, source: str) -> str:
    if name not in CHOICES:
        raise ConfigError(f"{source}={name!r} must be one of {CHOICES}; unset it (or pass None) for 'auto'")
    return name


def check_compute(compute: str | torch.dtype | None, device="cpu", dtype: torch.dtype | None = None) -> torch.dtype:
    """The products' compute named by `compute` ("float32", the default and exact, or
    "bfloat16", `COMPUTES`; None: float32) for a model on `device` in `dtype`. "bfloat16"
    needs a float32 model on a CPU whose native kernels run with AVX512-BF16. Raises
    ConfigError naming the value and the fix otherwise; changes nothing."""
    if compute is None:
        return torch.float32
    named = compute if compute in COMPUTES.values() else COMPUTES.get(compute) if isinstance(compute, str) else None
    if named is None:
        raise ConfigError(f"compute={compute!r} must be one of {tuple(COMPUTES)} (or None for 'float32', exact)")
    if named is torch.float32:
        return named
    if torch.device(device).type != "cpu" or dtype not in (None, torch.float32):
        raise ConfigError(f"compute={compute!r} runs on CPU for a float32 model (device 'cpu', dtype float32, "
                          f"the CPU default), not device {str(device)!r} dtype {dtype}; for 16-bit on a GPU "
                          "pass dtype='bfloat16', or leave compute unset")
    if not cpu_native.bf16_compute_supported():
        raise ConfigError(f"compute={compute!r} needs a CPU with AVX512-BF16 and the native CPU kernels, which "
                          "this machine lacks (or they are off); leave compute unset (or 'float32'): the exact "
                          "path, which reads stored bf16 weights in 16 bits too")
    return named


def choice() -> str:
    """The backend name in force: `use_backend`'s, else HYBRIDSPEC_BACKEND's, else "auto"."""
    if _override is not None:
        return _override
    return check_choice(os.environ.get(BACKEND_ENV, "auto"), BACKEND_ENV)


def use_backend(name: str | None) -> None:
    """Choose the backend for this process by name (`CHOICES`); None: back to
    HYBRIDSPEC_BACKEND. Models and caches made (or re-bound) after it take it."""
    global _override
    _override = None if name is None else check_choice(name, "use_backend")


@contextmanager
def using(name: str | None):
    """`use_backend(name)` for the duration of a `with` block (tests and benches)."""
    global _override
    before = _override
    use_backend(name)
    try:
        yield
    finally:
        _override = before


@dataclass(frozen=True, eq=False)
class Backend:
    """The op objects of one (device, dtype) under one choice, and what the
    native path can run whole. `writes_any_slot`: the recurrent kernels write
    snapshots into any ring slot from registers (Triton); the references write
    in place only on aligned slots. `graphable`: a forward can be captured
    (the kernels read device-side plans only); `captures`: on a CUDA device."""
    name: str
    device: torch.device
    dtype: torch.dtype
    linear: ops.Linear
    norm: ops.Norm
    pointwise: ops.Pointwise
    rotary: ops.Rotary
    conv_window: ops.ConvWindow
    mamba2_steps: ops.Mamba2Steps
    mamba1_steps: ops.Mamba1Steps
    mamba2_replay: ops.LogReplay
    mamba1_replay: ops.LogReplay
    gdn_steps: ops.GdnSteps
    gdn_replay: ops.GdnLogReplay
    paged_attention: ops.PagedAttention
    kv_write: ops.KVWrite
    rejection: ops.Rejection
    tree_forms: ops.TreeForms  # a tree forward layer by layer (the whole C forward has its own)
    native_blocks: bool  # whole residual blocks in C (`cpu_blocks`)
    whole_forward: bool  # a whole forward in one C call (`cpu_forward`), and the greedy chain
    writes_any_slot: bool
    graphable: bool
    captures: bool
    compute: torch.dtype = torch.float32  # what the products multiply in (`COMPUTES`)
    native: bool = False  # the native CPU kernels run the ops they take, over torch's thread count

    def __deepcopy__(self, memo) -> "Backend":  # stateless: a deep-copied model shares it
        return self

    @property
    def reads_16bit_weights(self) -> bool:
        """Whether the products read bfloat16 / float16 copies of float32 weights (`pack_for_cpu`)."""
        return self.linear.reads_16bit

    @property
    def reads_panels(self) -> bool:
        """Whether the products read float32 models' weights fastest in panels (`pack_for_cpu`, `panels`)."""
        return self.linear.reads_panels

    @property
    def block_inputs(self) -> int | None:
        """The most inputs per sequence the native blocks and the whole forward take
        (at any batch; `cpu_blocks.BLOCK_ROWS`), None where no block runs. Longer
        sequences take the modules, whose bits differ in the last places, so a
        forward mixing both kinds runs as two (`HybridModel.extend`)."""
        return BLOCK_ROWS if self.native_blocks else None

    @property
    def block_call_rows(self) -> int:
        """The most rows (batch · inputs) a plain forward gives one native call
        (`cpu_blocks.CALL_ROWS`; `HybridModel.extend` splits larger batches by sequences)."""
        return CALL_ROWS

    def torch_beside_kernels(self):
        """The context host work runs in between native calls (a layer-by-layer
        forward; an engine step's sampling, acceptance and bookkeeping): on the
        native backend torch's own operations on one thread beside the kernels'
        threads (`cpu_native.torch_on_one_thread` says why); elsewhere nothing."""
        return cpu_native.torch_on_one_thread() if self.native else nullcontext()

    def blocks_of(self, layer: LayerDesc) -> LayerBlocks:
        """The native blocks of one layer, their products in `compute`: none unless this backend runs blocks."""
        return LayerBlocks.of(layer, self.native_blocks, self.compute)

    def whole_forward_of(self, desc: ModelDesc, blocks: list[LayerBlocks]) -> WholeForward:
        """The whole forward in one C call over `blocks` (`blocks_of` each layer), where this backend runs it;
        else the forward that declines every call."""
        return WholeForward(desc, blocks, self.compute) if self.whole_forward else NO_WHOLE_FORWARD


def default_dtype(device: torch.device | str) -> torch.dtype | None:
    """The dtype a checkpoint is loaded in when none is asked: float32 on a CPU, the native
    kernels' dtype; None (the checkpoint's own) elsewhere."""
    return torch.float32 if torch.device(device).type == "cpu" else None


def device_name(device: torch.device | str) -> str:
    """What a measurement on `device` depends on: its type, and a GPU's model."""
    device = torch.device(device)
    return f"cuda:{torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type


def cache_root():
    """The per-user folder for what hybridspec builds or measures (`HYBRIDSPEC_CACHE_DIR`)."""
    return cpu_native.cache_root()


def packs_for_cpu(device: torch.device | str) -> bool:
    """Whether a model loaded onto `device` has its weights packed for the CPU kernels by default."""
    return torch.device(device).type == "cpu"


def multiplies_quantized(device: torch.device | str) -> bool:
    """Whether a model on `device` can hold quantized weights (`HybridModel.quantize`): their products
    run on a CPU (the native kernels, else torch on the same values)."""
    return torch.device(device).type == "cpu"


def select(device: torch.device | str, dtype: torch.dtype, name: str | None = None, sharded: bool = False,
           compute: torch.dtype = torch.float32) -> Backend:
    """The backend for a model or cache on `device` computing in `dtype` under
    `name` (default: `choice()`); `sharded`: the model is one tensor-parallel
    shard, whose layers sum their outputs across ranks between the ops, so no
    native block or whole forward runs it. `compute` (`check_compute`'s):
    bfloat16 makes the native products the bfloat16 ones where they run."""
    name = choice() if name is None else check_choice(name, "backend")
    device = torch.device(device)
    native = (name.startswith("native") or name == "auto") and device.type == "cpu" and dtype is torch.float32 \
        and bool(cpu_native.library())
    triton = name == "triton" or (name in ("auto", "native", "native-blocks", "native-ops") and device.type == "cuda")
    kind = "native" if native else "triton" if triton else "torch"
    compute = compute if native and compute is torch.bfloat16 and cpu_native.bf16_compute_supported() \
        else torch.float32
    linear = ops.NATIVE_BF16_LINEAR if compute is torch.bfloat16 else ops.LINEAR[kind]
    return Backend(
        name=name, device=device, dtype=dtype, linear=linear, norm=ops.NORM[kind], pointwise=ops.POINTWISE[kind],
        rotary=ops.ROTARY[kind], conv_window=ops.CONV_WINDOW[kind], mamba2_steps=ops.MAMBA2_STEPS[kind],
        mamba1_steps=ops.MAMBA1_STEPS[kind], mamba2_replay=ops.MAMBA2_REPLAY[kind],
        mamba1_replay=ops.MAMBA1_REPLAY[kind], gdn_steps=ops.GDN_STEPS[kind], gdn_replay=ops.GDN_REPLAY[kind],
        paged_attention=ops.PAGED_ATTENTION[kind],
        kv_write=ops.KV_WRITE[kind], rejection=ops.REJECTION[kind], tree_forms=ops.TREE_FORMS[kind],
        native_blocks=native and not sharded and name in ("auto", "native", "native-blocks"),
        whole_forward=native and not sharded and name in ("auto", "native"),
        writes_any_slot=triton, graphable=triton, captures=triton and device.type == "cuda", compute=compute,
        native=native)


def reference() -> Backend:
    """The torch references (what a module not bound to a model runs)."""
    return select("cpu", torch.float64, "torch")


def torch_threads():
    """A block of torch work that splits well (sorting a vocabulary, a prompt's
    log-softmax): inside `Backend.torch_beside_kernels` on the native backend it
    gets torch's thread count back; elsewhere nothing."""
    return cpu_native.torch_threads()
