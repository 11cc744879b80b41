"""Feed-forward blocks: dense MLP (gated SwiGLU or plain, e.g. squared ReLU)
and mixture-of-experts with top-k routing (Shazeer et al. 2017)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MLPConfig, MoEConfig
from .common import activation, compute_dtype, linear, param, take


class MLP(nn.Module):
    """gated: down(act(gate(x)) ⊙ up(x)); plain: down(act(up(x)))."""

    def __init__(self, cfg: MLPConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.gate_proj = param(weights["gate_proj.weight"]) if cfg.gated else None
        self.up_proj, self.down_proj = param(weights["up_proj.weight"]), param(weights["down_proj.weight"])
        self.gate_bias = param(weights["gate_proj.bias"]) if cfg.gated and cfg.bias else None
        self.up_bias, self.down_bias = ((param(weights["up_proj.bias"]), param(weights["down_proj.bias"]))
                                        if cfg.bias else (None, None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = linear(x, self.up_proj, self.up_bias)
        if self.cfg.gated:
            up = activation(self.cfg.activation, linear(x, self.gate_proj, self.gate_bias)) * up
        else:
            up = activation(self.cfg.activation, up)
        return linear(up, self.down_proj, self.down_bias)


class MoE(nn.Module):
    """Routed experts (+ an optional dense shared MLP).

    weights: router.weight [E, hidden], experts.gate_up_proj [E, 2·I, hidden]
    (gate rows first), experts.down_proj [E, hidden, I], shared.* as MLP.
    """

    def __init__(self, cfg: MoEConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.router = param(weights["router.weight"])
        self.gate_up = param(weights["experts.gate_up_proj"])
        self.down = param(weights["experts.down_proj"])
        shared = take(weights, "shared")
        self.shared = (MLP(MLPConfig(cfg.shared_intermediate_size, cfg.activation), shared)
                       if cfg.shared_intermediate_size else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k], expert ids [tokens, k])."""
        logits = F.linear(x, self.router)  # [tokens, E]
        cd = compute_dtype(x.dtype)
        if self.cfg.router == "softmax_topk":
            weights, ids = torch.topk(torch.softmax(logits.to(cd), dim=-1), self.cfg.top_k, dim=-1)
        else:
            top_logits, ids = torch.topk(logits, self.cfg.top_k, dim=-1)
            weights = torch.softmax(top_logits.to(cd), dim=-1)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [tokens, hidden]
        weights, ids = self.route(flat)
        out = torch.zeros_like(flat)
        for expert in torch.unique(ids).tolist():
            token_idx, slot = torch.where(ids == expert)
            gate, up = F.linear(flat[token_idx], self.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(activation(self.cfg.activation, gate) * up, self.down[expert])
            out.index_add_(0, token_idx, y * weights[token_idx, slot, None])
        out = out.view(shape)
        return out + self.shared(x) if self.shared is not None else out
