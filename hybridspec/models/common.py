"""Small building blocks shared by every family: parameter wrapping, RMSNorm,
activations, the compute dtype rule."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms, softmax and recurrences run in at least float32 (float64 stays float64)."""
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w · x / sqrt(mean(x²) + eps), statistics in the compute dtype.  # [..., hidden]"""
    h = x.to(compute_dtype(x.dtype))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


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
