"""Small building blocks shared by every family: parameter wrapping, RMSNorm,
activations, the compute dtype rule."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from hybridspec.kernels import cpu_norm
from hybridspec.kernels.descriptors import NormDesc
from hybridspec.kernels.cpu_rows import applies, rows_matmul


@functools.cache
def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms, softmax and recurrences run in at least float32 (float64 stays float64).
    Cached: `torch.promote_types` is an operation."""
    return torch.promote_types(dtype, torch.float32)


def param(tensor: torch.Tensor | None) -> nn.Parameter | None:
    """Wrap `tensor` as a frozen parameter that shares its storage (no copy)."""
    if tensor is None:
        return None
    return nn.Parameter(tensor.detach(), requires_grad=False)


def take(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The sub-dict of `weights` under `prefix.` with the prefix stripped."""
    start = prefix + "."
    return {name[len(start):]: t for name, t in weights.items() if name.startswith(start)}


# Host operations. Every torch call is a dispatch on the host (and a kernel
# launch on a GPU), so the per-token paths count them: a Python float in
# arithmetic costs four more operations (it is wrapped into a tensor and cast
# each time), `.to` to the dtype a tensor already has is still an operation,
# `F.linear` on a 3-d input dispatches eleven and `mean` nine. The helpers
# below give the same numbers with fewer: cached 0-d constants, `mm` on a
# cached transposed view, `sum` then `div_` (which is what `mean` runs).


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`; no operation when it already is."""
    return x if x.dtype == dtype else x.to(dtype)


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def constant(value: float, dtype: torch.dtype, device) -> torch.Tensor:
    """`value` as a cached 0-d tensor: arithmetic with it is one operation."""
    key = (value, dtype, str(device))
    c = _CONSTANTS.get(key)
    if c is None:
        c = _CONSTANTS[key] = torch.tensor(value, dtype=dtype, device=device)
    return c


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """weight.t(), a view made once per parameter and remade if its storage
    changes (`model.to(device)` swaps it)."""
    view = getattr(weight, "_hs_transposed", None)
    if view is None or view.data_ptr() != weight.data_ptr() or view.device != weight.device:
        view = weight.t()
        weight._hs_transposed = view
    return view


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) as one product over the flattened rows: the
    few-row CPU kernel where it applies (`kernels.cpu_rows`), else `torch.mm`.  # [..., out]"""
    rows = x if x.dim() == 2 else (x.view(-1, x.shape[-1]) if x.is_contiguous() else x.reshape(-1, x.shape[-1]))
    weight_t = transposed(weight)
    if applies(rows, weight_t):
        out = rows_matmul(rows, weight_t)
    else:  # a weight stored in 16 bits (`pack_for_cpu`) is widened, exactly, for torch
        out = torch.mm(rows, weight_t if weight_t.dtype == rows.dtype else weight_t.to(rows.dtype))
    if bias is not None:
        out += bias
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = w · x / sqrt(mean(x²) + eps), statistics in the compute dtype.  # [..., hidden]
    float32 on CPU: one C call (`kernels.cpu_norm`). Otherwise bit for bit what
    `h * rsqrt(h.pow(2).mean(-1) + eps)` gives (pow(·, 2) is h·h and mean is
    sum then divide), in a third of the operations."""
    if cpu_norm.applies(x, weight):  # float32 on CPU: one C call
        out = cpu_norm.rms_norm(x, weight, eps)
        if out is not None:
            return out
    cd = compute_dtype(x.dtype)
    h = as_dtype(x, cd)
    var = torch.sum(h * h, -1, keepdim=True).div_(constant(float(h.shape[-1]), cd, h.device))
    h = h * var.add_(constant(eps, cd, h.device)).rsqrt_()
    return as_dtype(h, x.dtype) if weight is None else weight * as_dtype(h, x.dtype)


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "relu2":  # squared ReLU (Nemotron-H)
        return torch.square(F.relu(x))
    raise ValueError(f"unknown activation {name!r}; expected silu, gelu or relu2")


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = param(weight)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def describe(self) -> NormDesc:
        return NormDesc(self.weight, self.eps)
