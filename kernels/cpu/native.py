"""The CPU's native kernels: plain C (AVX2 + FMA; the products also on
AVX-512 vectors where the CPU has them, chosen at run time with the same
bits, `cpu_rows.vector_path`) built on first use and called through ctypes.

Nine kernels, each used by its own module where it applies, and whole blocks
and a whole forward chaining them:
- `cpu/rows.c` (`cpu/rows.py`): few-row float32 matrix products, for `linear`
  (weights float32 or their exact bfloat16 / float16 copies, `cpu/rows_weights.h`);
  `cpu/rows_bf16.c`: the same products in bfloat16 compute (AVX512-BF16), the
  opt-in fast path (`compute="bfloat16"`, not the float32 bits);
- `cpu/quant.c` (`cpu/quant.py`): products of GGUF-block weights (Q8_0, Q4_0, Q4_K, Q6_K in
  `cpu/quant_q6k.h`; `quant.QuantWeight`) with activations rounded to int8 blocks, integer dot products (AVX2, or
  AVX512-VNNI where present, `cpu_quant.vector_path`: the same bits), for any row count;
- `cpu/mamba2.c` (`cpu/mamba2.py`): the Mamba-2 recurrence over a forward's
  inputs, straight into the ring slots, for the Mamba-2 mixer;
- `cpu/mamba1.c` (`cpu/mamba1.py`): the same for the Mamba-1 mixer;
- `cpu/gdn.c` (`cpu/gdn.py`): the gated delta rule over a forward's inputs,
  straight into the ring slots, for the GDN layer, and its log replay;
- `cpu/conv.c` (`cpu/conv.py`): the causal conv window over a forward's
  inputs, straight into the ring slots, for the Mamba mixers;
- `cpu/norm.c` (`cpu/norm.py`): RMSNorm, plain and gated;
- `cpu/pointwise.c` (`ops.NativePointwise`): softplus and sigmoid, each output
  the same bits wherever its element lies (torch's are not in a tensor's tail);
- `cpu/rope.c` (`cpu/rope.py`): the rotary embedding of queries and keys;
- `cpu/blocks.c` (`cpu/blocks.py`): a decoder layer's MLP block, Mamba-2
  mixer block and attention block (norm to residual) in one call each;
- `cpu/forward.c` (`cpu/forward.py`): a whole forward (embeddings, the
  blocks of every layer, final norm, LM head) in one call;
- `cpu/pool.c`: the helper threads the products and the Mamba-2 recurrence
  split their work over (`sync_threads`).

They are compiled together with the system's C compiler (`CC`, else `cc`,
`gcc` or `clang`) into a per-user cache (`HYBRIDSPEC_CACHE_DIR`, default
`~/.cache/hybridspec`, else a folder of the temporary directory; about a
second, once per source version, said on stderr) and loaded with ctypes: no torch headers,
no build step at install. Where they cannot be built (no compiler) the torch
paths run after one warning; on a CPU without AVX2 and FMA (ARM, old x86)
they run without one. A model runs them where its backend is native
(`kernels.backend`: HYBRIDSPEC_BACKEND=torch turns them off); float64 (the
parity suites) never takes them. They run at any torch thread count: the matrix products
(`cpu/rows.c`, which every block and the whole forward call) split their
columns, and the Mamba-2 and GDN recurrences their heads, over torch's intra-op thread
count (`sync_threads`), with the same bits at every count; the other kernels
run on the calling thread. `pin_threads` (HYBRIDSPEC_PIN_THREADS=1) binds each
helper thread to a CPU of its own.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from hybridspec.errors import ConfigError
from hybridspec.kernels.cpu.panels import PanelWeight
from hybridspec.kernels.quant.weight import QuantWeight

CACHE_ENV = "HYBRIDSPEC_CACHE_DIR"
PIN_ENV = "HYBRIDSPEC_PIN_THREADS"  # "1": each helper thread bound to a CPU of its own (`pin_threads`)
SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("pool.c", "rows.c", "rows_bf16.c", "panels.c", "quant.c", "quant_rows.c", "mamba2.c", "mamba1.c", "gdn.c",
                             "conv.c", "norm.c", "pointwise.c", "rope.c", "blocks.c", "forward.c", "calls.c"))
HEADERS = tuple(Path(__file__).with_name(name)  # what the sources include: SIMD helpers, declarations
                for name in ("simd.h", "kernels.h", "rows_weights.h", "quant_tiles.h", "quant_q4_0.h", "quant_q4k.h",
                             "quant_q6k.h"))
# no contraction into FMA where the source does not ask for it: the kernels that promise torch's
# rounding (cpu/rope.c) keep it under any compiler's default
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11", "-pthread")
BUILD_TIMEOUT_S = 300  # a compiler that has not finished by then is taken as failed

ARGUMENTS = {  # C entry point hs_<name>_call(const hs_<name>_args *): the struct's fields in order (p pointer,
    # i int64, f float), the positional arguments of hs_<name> (cpu/kernels.h)
    "rms_norm": "p:x i:ldx p:gate i:ldg p:w p:out i:rows i:n i:group f:eps",
    "conv_window_steps": ("p:states p:src p:dst p:xs i:sxb i:sxt p:weight p:bias i:silu p:out i:batch i:T "
                         "i:conv_dim i:d_conv p:parents"),
    "mamba2_steps": ("p:states p:src p:dst p:scratch p:x i:sxb i:sxt i:sxh p:dt i:sdb i:sdt p:A p:D p:B i:sBb "
                    "i:sBt i:sBg p:C i:sCb i:sCt i:sCg p:y i:batch i:T i:nheads i:headdim i:d_state i:ngroups "
                    "p:parents"),
    "mamba1_steps": ("p:states p:src p:dst p:x i:sxb i:sxt p:dt i:sdb i:sdt p:A p:B i:sBb i:sBt p:C i:sCb "
                    "i:sCt p:D p:y i:batch i:T i:d_inner i:d_state p:parents"),
    "gdn_steps": ("p:states p:src p:dst p:q i:sqb i:sqt i:sqh p:k i:skb i:skt i:skh p:v i:svb i:svt i:svh p:g "
                  "i:sgb i:sgt p:beta i:sbb i:sbt p:o i:batch i:T i:heads i:key_heads i:d_k i:d_v p:parents"),
    "rope": "p:x p:cos p:sin i:ldc p:out i:rows i:heads i:head_dim i:half",
    "mlp_block": "p:h p:norm_w f:eps p:gate_t p:up_t p:down_t p:work p:out i:rows i:hidden i:inter f:residual",
    "mamba2_block": ("p:h p:norm_w f:eps p:in_t p:conv_states p:ssm_states p:src p:dst p:conv_w p:conv_b "
                    "p:dt_bias p:A p:D p:gate_norm_w i:group p:out_t p:work p:logged p:out i:batch i:T "
                    "i:hidden i:d_inner i:nheads i:headdim i:ngroups i:d_state i:d_conv f:residual"),
    "attention_block": ("p:h p:norm_w f:eps p:q_t p:k_t p:v_t p:o_t p:inv_freq i:half p:k_cache p:v_cache "
                       "p:slot_mapping p:block_tables i:max_blocks i:block_size p:context_lens p:query_lens "
                       "f:scale p:work p:out i:batch i:T i:hidden i:nheads i:kv_heads i:head_dim f:residual"),
}
_FIELD_TYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "f": ctypes.c_float}


def _struct(name: str, spec: str) -> type[ctypes.Structure]:
    fields = [field.split(":") for field in spec.split()]
    return type(f"hs_{name}_args", (ctypes.Structure,), {"_fields_": [(n, _FIELD_TYPES[t]) for t, n in fields]})


ARGUMENT_STRUCTS = {name: _struct(name, spec) for name, spec in ARGUMENTS.items()}


def call(name: str, *values) -> int:
    """hs_<name>_call with one struct of `values` (hs_<name>'s arguments, in order); its status."""
    return getattr(library(), f"hs_{name}_call")(ctypes.byref(ARGUMENT_STRUCTS[name](*values)))


_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
SIGNATURES = {  # function: argument types (all return int: 0, or -1 for arguments it does not take)
    "hs_rows_matmul": [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr],
    "hs_rows_isa": [ctypes.c_int],
    "hs_quant_matmul": [_ptr, _i64, _ptr, ctypes.c_int, _i64, _i64, _i64, _ptr],
    "hs_quant_isa": [ctypes.c_int],
    "hs_quant_top": [_ptr, _i64, _ptr, ctypes.c_int, _i64, _i64, _i64, _i64, _ptr, _ptr],
    "hs_bf16_supported": [],
    "hs_set_threads": [ctypes.c_int],
    "hs_set_pinning": [ctypes.c_int],
    "hs_pointwise": [ctypes.c_int, _ptr, _ptr, _i64],
    "hs_forward": [_ptr],  # one hs_forward_args struct (cpu/forward.py)
    **{f"hs_{name}_call": [_ptr] for name in ARGUMENTS},  # one hs_<name>_args struct (`arguments`)
    "hs_greedy_steps": [_ptr, _i64, _ptr, _ptr, _ptr],
    "hs_extend_greedy": [_ptr, _ptr, _i64, _ptr, _ptr, _ptr],
}

_library = None  # the loaded ctypes library, False when it cannot run here


class CpuKernelsUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded on this machine (the reason in the message)."""


def cpu_supported() -> bool:
    """Whether this CPU runs the kernels' code (x86-64 with AVX2 and FMA)."""
    return (platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512")))


def cache_root() -> Path:
    """The per-user folder hybridspec keeps what it builds or measures in (`HYBRIDSPEC_CACHE_DIR`)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hybridspec")


def cache_dir() -> Path:
    return cache_root() / "kernels"


def build(directory: Path | None = None) -> Path:
    """Compile the C sources into one shared library in `directory` (default
    `cache_dir()`) unless a build of the same sources and flags is there;
    returns its path. Raises CpuKernelsUnavailable with the reason when it cannot."""
    if not cpu_supported():
        raise CpuKernelsUnavailable(f"the kernels are x86 AVX2 + FMA code; this CPU is {platform.machine()} "
                                    f"(torch reports {torch.backends.cpu.get_cpu_capability()})")
    compiler = find_compiler()
    code = b"".join(s.read_bytes() for s in (*SOURCES, *HEADERS)) + " ".join(FLAGS).encode()
    digest = hashlib.sha256(code).hexdigest()[:16]
    directory = Path(directory) if directory is not None else cache_dir()
    target = directory / f"hybridspec_cpu-{digest}.so"
    if target.is_file():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: a per-user folder of the temporary directory
        directory = Path(tempfile.gettempdir()) / f"hybridspec-kernels-{getattr(os, 'getuid', lambda: 'user')()}"
        target = directory / target.name
        if target.is_file():
            return target
        directory.mkdir(parents=True, exist_ok=True)
    # a user would otherwise wonder why the first run stalls; a cache hit says nothing
    print(f"hybridspec: building the native CPU kernels (once, cached in {directory})...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:  # built aside, then renamed: no half-written library
        built = Path(tmp) / target.name
        compile_library(compiler, SOURCES, built)
        os.replace(built, target)
    return target


def find_compiler() -> str:
    """`CC`, else the first of cc, gcc, clang on the PATH; CpuKernelsUnavailable when there is none."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise CpuKernelsUnavailable("no C compiler found (set CC, or install gcc)")
    return compiler


def compile_library(compiler: str, sources, target: Path) -> None:
    """Compile `sources` (paths; their headers beside them) with FLAGS into the shared library
    `target`: each source to an object file in its own compiler process, all at once (a first
    use waits for the slowest source, not for their sum), then one link; raises
    CpuKernelsUnavailable with the compiler's reason when it cannot."""
    compile_flags = [f for f in FLAGS if f != "-shared"]
    objects = [target.with_name(f"{target.stem}-{Path(s).stem}.o") for s in sources]
    steps = [[compiler, *compile_flags, "-c", "-o", str(o), str(s)] for s, o in zip(sources, objects)]
    try:
        running = [subprocess.Popen(step, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for step in steps]
        failures = [err for p in running for _, err in [p.communicate(timeout=BUILD_TIMEOUT_S)] if p.returncode]
        if not failures:
            link = subprocess.run([compiler, *FLAGS, "-o", str(target), *map(str, objects), "-lm"],
                                  capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            failures = [link.stderr] if link.returncode else []
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CpuKernelsUnavailable(f"the C compiler {compiler!r} cannot run: {exc}") from exc
    finally:
        for o in objects:
            o.unlink(missing_ok=True)
    if failures:
        raise CpuKernelsUnavailable(f"{compiler} failed on the CPU kernels: {failures[0].strip()[:2000]}")


def load(path: Path):
    """The shared library at `path`, its functions typed by SIGNATURES."""
    lib = ctypes.CDLL(str(path))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


def library():
    """The loaded library (its functions typed by SIGNATURES), or False where it cannot run."""
    global _library
    if _library is None and not cpu_supported():  # expected on ARM and old x86: the torch paths, quietly
        _library = False
    if _library is None:
        try:
            lib = load(build())
        except (CpuKernelsUnavailable, OSError, AttributeError) as exc:
            warnings.warn(f"hybridspec: the native CPU kernels are off, the torch paths run instead: {exc}",
                          RuntimeWarning, stacklevel=3)
            _library = False
        else:
            _library = lib
            pin_threads(None)
    return _library


def available() -> bool:
    """Whether the kernels run here (built and loaded); when they do, their
    products use torch's thread count (`sync_threads`). Whether a model runs them
    is its backend's choice (`kernels.backend`)."""
    if not (_library if _library is not None else library()):
        return False
    sync_threads()
    return True


_threads = 1  # the thread count the products were last given
_held = 0  # inside `torch_on_one_thread`: the kernels' count, torch's own being 1; else 0


def sync_threads() -> int:
    """Give the products torch's intra-op thread count (`torch.set_num_threads`,
    or `hybridspec.engine.threads.use_threads`) if it changed; returns it. Inside
    `torch_on_one_thread` the kernels keep the count it found."""
    global _threads
    if _held:
        return _held
    threads = torch.get_num_threads()
    if threads != _threads and _library:
        _threads = _library.hs_set_threads(threads)
    return _threads


@contextmanager
def torch_on_one_thread():
    """Run what torch computes inside the block on one thread while the kernels
    split their work over torch's thread count as before (a layer-by-layer
    forward of the native backend, `Backend.layer_by_layer`). Why: after each
    parallel region GNU OpenMP's workers spin on their cores for a while
    (OMP_WAIT_POLICY's default), the cores the kernels' helpers need for the
    next product; a prefill runs a few hundred such regions (elementwise
    operations) between its products, and the helpers then share a core with a
    spinning worker. What splits well gets torch's count back (`torch_threads`:
    attention over a prompt, a product the kernels do not take). Nested blocks
    and blocks in other Python threads while one holds change nothing."""
    global _held
    threads = sync_threads() if available() else 1
    if threads < 2 or _held:
        yield
        return
    _held = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _held = 0


@contextmanager
def torch_threads():
    """Inside `torch_on_one_thread`: torch's count back for the block (one operation
    that splits well); elsewhere nothing."""
    held = _held
    if not held:
        yield
        return
    torch.set_num_threads(held)
    try:
        yield
    finally:
        torch.set_num_threads(1)


def pin_threads(on: bool | None) -> bool:
    """Bind each helper thread of the kernels to a CPU of its own (True), or let
    them run on any of the process's CPUs (False); None: HYBRIDSPEC_PIN_THREADS's
    choice ("0", the default, or "1"). Returns whether they are bound; False where
    the kernels do not run. The calling thread is never bound (cpu/pool.c says
    why, and why binding is not the default)."""
    if on is None:
        value = os.environ.get(PIN_ENV, "0")
        if value not in ("0", "1"):
            raise ConfigError(f"{PIN_ENV}={value!r} must be '1' (bind each helper thread to a CPU of its own) or "
                              "'0' (leave them the process's CPUs, the default)")
        on = value == "1"
    elif not isinstance(on, bool):
        raise ConfigError(f"pin_threads({on!r}) takes True, False or None (HYBRIDSPEC_PIN_THREADS's choice)")
    return bool(_library) and bool(_library.hs_set_pinning(int(on)))


def choose_isa(isa_fn: str, paths: tuple[str, str], choice: str | None, missing: str) -> str:
    """The vector path of one family of kernels (`paths`: the baseline, then the wider one), through
    its library function `isa_fn` (-1 asks which runs; the first use picks the widest the CPU has):
    `choice` sets it for the process. ValueError for a name not in `paths`, or for the wider path on
    a CPU without `missing` (an instruction set)."""
    if choice is not None and choice not in paths:
        raise ValueError(f"vector_path({choice!r}): pick one of {paths}")
    lib = library()
    if not lib:
        raise CpuKernelsUnavailable("the native CPU kernels cannot run here")
    got = getattr(lib, isa_fn)(-1 if choice is None else paths.index(choice))
    if got < 0:
        raise ValueError(f"vector_path({choice!r}): this CPU has no {missing}; {paths[0]!r} runs")
    return paths[got]


def takes(*tensors: torch.Tensor) -> bool:
    """The conditions every kernel shares: each tensor float32 on the CPU, the kernels built."""
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_cpu:
            return False
    return available()


# HS_BF16_WEIGHT, HS_F16_WEIGHT (cpu/kernels.h): the bits of a product weight's address that say its type
WEIGHT_TYPE_BITS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def weight_dtype_ok(weight: torch.Tensor) -> bool:
    """Whether the products take this weight's storage: float32, or bfloat16 or
    float16 (an exact copy of a float32 weight, `HybridModel.pack_for_cpu`),
    on the CPU, 8-byte aligned so that its address can carry the tags; or a
    `QuantWeight` on the CPU (its header's address carries HS_QUANT)."""
    if isinstance(weight, QuantWeight):
        return weight.is_cpu
    return weight.dtype in WEIGHT_TYPE_BITS and weight.is_cpu and weight.data_ptr() % 8 == 0


BF16_COMPUTE_BITS = 3  # HS_BF16_COMPUTE: bfloat16 data multiplied in bfloat16 compute (cpu/rows_bf16.c)
PANELS_BIT = 4  # HS_PANELS: the data lies in panels (`panels.PanelWeight`, cpu/panels.c)
QUANT_BIT = 8  # HS_QUANT: the address of a quantized weight's header (`quant_header`, cpu/kernels.h)
POINTWISE_FUNCTIONS = {"softplus": 0, "sigmoid": 1}  # HS_SOFTPLUS, HS_SIGMOID: hs_pointwise's (cpu/pointwise.c)


def weight_address(weight: torch.Tensor, compute: torch.dtype = torch.float32) -> int:
    """A product weight's address as the kernels take it: 16-bit data carries
    its type's bit (cpu/rows.c, "weight storage"); a bfloat16 weight under
    `compute` bfloat16 both bits (the opt-in fast products, cpu/rows_bf16.c);
    a `PanelWeight` the panels' bit too. `weight`: a PanelWeight, or the
    input-major [in, out] view of any other; a `QuantWeight` its header's
    address with HS_QUANT (`quant_header`), whatever `compute`."""
    if isinstance(weight, QuantWeight):
        return quant_header(weight).data_ptr() | QUANT_BIT
    tags = BF16_COMPUTE_BITS if compute is torch.bfloat16 and weight.dtype is torch.bfloat16 else \
        WEIGHT_TYPE_BITS[weight.dtype]
    return weight.data_ptr() | tags | (PANELS_BIT if isinstance(weight, PanelWeight) else 0)


def product_address(weight: torch.Tensor, compute: torch.dtype = torch.float32) -> int:
    """`weight_address` of a product weight [out, in] as a layer holds it (panels, blocks, or input-major)."""
    return weight_address(weight if isinstance(weight, (PanelWeight, QuantWeight)) else weight.t(), compute)


def quant_header(weight: QuantWeight) -> torch.Tensor:
    """The header the C products read a quantized weight through: int64 [format code, the
    blocks' address], made once per weight and remade if its storage moves (kept on the weight,
    so it lives as long as the address a block or the whole forward holds)."""
    header = getattr(weight, "_hs_header", None)
    if header is None or int(header[1]) != weight.data_ptr():
        header = torch.tensor([weight.code, weight.data_ptr()], dtype=torch.int64)
        if header.data_ptr() % 16:  # torch's CPU allocations are 64-byte aligned; the tag needs 16
            raise CpuKernelsUnavailable(f"a quantized weight's header at {header.data_ptr():#x} is not 16-byte "
                                        "aligned")
        weight._hs_header = header
    return header


def bf16_compute_supported() -> bool:
    """Whether the products in bfloat16 compute run here: the kernels built and
    a CPU with AVX512-BF16 (`hs_bf16_supported`)."""
    lib = library()
    return bool(lib) and lib.hs_bf16_supported() == 1


def takes_forward(plan, *tensors: torch.Tensor) -> bool:
    """`takes`, for a state kernel over a forward with a host-side `SlotPlan`.
    A padded row runs its padding inputs too (they come after its live ones,
    so no live state depends on them) with no snapshot there
    (`SlotPlan.live_snap`), and the wrapper zeroes their outputs as the
    references do."""
    return plan is not None and plan.batch > 0 and takes(*tensors)


def unit_inner_stride(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor as it is when its last dimension has unit stride (the kernels
    take the other strides), else a contiguous copy."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)
