"""Small building blocks shared by every family: parameter wrapping, RMSNorm,
activations, the backend a module computes through (`Kernelled`)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridspec.errors import NumericalError
from hybridspec.kernels.backend import Backend, reference
from hybridspec.kernels.descriptors import NormDesc
from hybridspec.kernels.ops import as_dtype, compute_dtype, constant, transposed  # noqa: F401 (the models' helpers)


def param(tensor: torch.Tensor | None) -> nn.Parameter | None:
    """Wrap `tensor` as a frozen parameter that shares its storage (no copy), but for a tensor whose
    address is not 16-byte aligned (a small tensor memory-mapped from a safetensors file): the C kernels
    tag a weight's address in its low 4 bits (`cpu.native.weight_address`), so that one is copied."""
    if tensor is None:
        return None
    if tensor.data_ptr() % 16:
        tensor = tensor.clone()
    return nn.Parameter(tensor.detach(), requires_grad=False)


def take(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The sub-dict of `weights` under `prefix.` with the prefix stripped."""
    start = prefix + "."
    return {name[len(start):]: t for name, t in weights.items() if name.startswith(start)}


class Kernelled:
    """A module that computes through its model's backend: `ops` (the op objects
    of `hybridspec.kernels.backend`), set by `HybridModel.bind_backend`; the torch
    references until a model binds it."""
    ops: Backend = reference()


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "relu2":  # squared ReLU (Nemotron-H)
        return torch.square(F.relu(x))
    raise ValueError(f"unknown activation {name!r}; expected silu, gelu or relu2")


def norm_weight(weight: torch.Tensor, zero_centred: bool) -> torch.Tensor:
    """The weight an RMSNorm multiplies by: the stored w, or 1 + w for a
    zero-centred one (Qwen3-Next, Qwen3.5), formed as HF forms it (in float32
    at least) from w in the model's dtype, then held in that dtype: a copy."""
    if not zero_centred:
        return weight
    return (weight.to(torch.promote_types(weight.dtype, torch.float32)) + 1.0).to(weight.dtype)


class RMSNorm(Kernelled, nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, zero_centred: bool = False):
        super().__init__()
        self.weight = param(norm_weight(weight, zero_centred))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.norm.rms(x, self.weight, self.eps)

    def describe(self) -> NormDesc:
        return NormDesc(self.weight, self.eps)


def check_finite(logits: torch.Tensor, num_tokens: torch.Tensor, last_only: bool) -> None:
    """Raise NumericalError if any valid row of `logits` holds NaN or inf."""
    if math.isfinite(float(logits.sum())):  # the common case, one operation: NaN and inf carry into a sum
        return
    # a non-finite sum: a NaN or inf somewhere, or finite logits whose sum overflows
    if last_only:
        bad = ~torch.isfinite(logits).all(dim=(1, 2))
    else:
        valid = torch.arange(logits.shape[1], device=logits.device)[None] < num_tokens[:, None]
        bad = (~torch.isfinite(logits).all(dim=-1) & valid).any(dim=1)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise NumericalError(f"the model produced NaN or inf logits for batch rows {rows}; "
                             "check the weights and the dtype (float16 overflows are common), "
                             "no state was changed")
