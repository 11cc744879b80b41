"""Feed-forward blocks: dense MLP (gated SwiGLU or plain, e.g. squared ReLU)
and mixture-of-experts with top-k routing (Shazeer et al. 2017)."""
from __future__ import annotations

import torch
from torch import nn

from hybridspec.kernels.descriptors import MLPDesc, MoEDesc

from hybridspec.config import MLPConfig, MoEConfig
from hybridspec.models.common import Kernelled, activation, as_dtype, compute_dtype, param, take


class MLP(Kernelled, nn.Module):
    """gated: down(act(gate(x)) ⊙ up(x)); plain: down(act(up(x))); with
    Falcon-H1's µP multipliers on the gate and the output when set."""

    def __init__(self, cfg: MLPConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.gate_proj = param(weights["gate_proj.weight"]) if cfg.gated else None
        self.up_proj, self.down_proj = param(weights["up_proj.weight"]), param(weights["down_proj.weight"])
        self.gate_bias = param(weights["gate_proj.bias"]) if cfg.gated and cfg.bias else None
        self.up_bias, self.down_bias = ((param(weights["up_proj.bias"]), param(weights["down_proj.bias"]))
                                        if cfg.bias else (None, None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        up = self.ops.linear(x, self.up_proj, self.up_bias)
        if cfg.gated:
            gate = self.ops.linear(x, self.gate_proj, self.gate_bias)
            gate = gate if cfg.gate_multiplier == 1.0 else gate * cfg.gate_multiplier
            up = activation(cfg.activation, gate) * up
        else:
            up = activation(cfg.activation, up)
        out = self.ops.linear(up, self.down_proj, self.down_bias)
        return out if cfg.down_multiplier == 1.0 else out * cfg.down_multiplier

    def describe(self) -> MLPDesc:
        cfg = self.cfg
        return MLPDesc(up=self.up_proj, down=self.down_proj, gate=self.gate_proj, up_bias=self.up_bias,
                       gate_bias=self.gate_bias, down_bias=self.down_bias, activation=cfg.activation,
                       gate_multiplier=cfg.gate_multiplier, down_multiplier=cfg.down_multiplier)


class MoE(Kernelled, nn.Module):
    """Routed experts (+ an optional dense shared MLP).

    weights: router.weight [E, hidden] (+ router.e_score_correction_bias [E]
    for the sigmoid group router), experts.gate_up_proj [E, 2·I, hidden]
    (gate rows first; gated experts) or experts.up_proj [E, I, hidden]
    (ungated), experts.down_proj [E, hidden, I], shared.* as MLP,
    shared_gate.weight [1, hidden] (the shared expert's sigmoid gate).
    """

    def __init__(self, cfg: MoEConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.router = param(weights["router.weight"])
        self.score_bias = (param(weights["router.e_score_correction_bias"])
                           if cfg.router == "sigmoid_group_topk" else None)
        self.up = param(weights["experts.gate_up_proj" if cfg.gated else "experts.up_proj"])
        self.down = param(weights["experts.down_proj"])
        shared = take(weights, "shared")
        self.shared = (MLP(MLPConfig(cfg.shared_intermediate_size, cfg.activation, gated=cfg.gated), shared)
                       if cfg.shared_intermediate_size else None)
        self.shared_gate = param(weights["shared_gate.weight"]) if cfg.shared_gate else None

    def describe(self) -> MoEDesc:
        return MoEDesc(num_experts=self.cfg.num_experts, top_k=self.cfg.top_k,
                       shared=None if self.shared is None else self.shared.describe())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k], expert ids [tokens, k]). The router's product is the
        backend's `linear` like every other (packed like them, `pack_for_cpu`), so that
        a token's routing does not depend on how many tokens the call holds."""
        cd = compute_dtype(x.dtype)
        if self.cfg.router == "sigmoid_group_topk":
            weights, ids = sigmoid_group_topk(self.ops.linear(as_dtype(x, cd), self.router), self.score_bias.to(cd),
                                              self.cfg, self.ops.pointwise.sigmoid)
        elif self.cfg.router == "softmax_topk":
            probs = torch.softmax(self.ops.linear(x, self.router).to(cd), dim=-1)
            weights, ids = torch.topk(probs, self.cfg.top_k, dim=-1)
            if self.cfg.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            top_logits, ids = torch.topk(self.ops.linear(x, self.router), self.cfg.top_k, dim=-1)
            weights = torch.softmax(top_logits.to(cd), dim=-1)
        return weights.to(x.dtype), ids

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `index` on x [tokens, hidden]: down(act(gate)·up) or down(act(up))."""
        up = self.ops.linear(x, self.up[index])
        if self.cfg.gated:
            gate, up = up.chunk(2, dim=-1)
            up = activation(self.cfg.activation, gate) * up
        else:
            up = activation(self.cfg.activation, up)
        return self.ops.linear(up, self.down[index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [tokens, hidden]
        weights, ids = self.route(flat)
        out = torch.zeros_like(flat)
        for expert in torch.unique(ids).tolist():  # ascending, so sums run in the same order for any batch
            token_idx, slot = torch.where(ids == expert)
            out.index_add_(0, token_idx, self.expert(expert, flat[token_idx]) * weights[token_idx, slot, None])
        out = out.view(shape)
        if self.shared is None:
            return out
        shared = self.shared(x)
        if self.shared_gate is not None:  # sigmoid(w · x) per token
            shared = self.ops.pointwise.sigmoid(self.ops.linear(x, self.shared_gate)) * shared
        return out + shared


def sigmoid_group_topk(logits: torch.Tensor, score_bias: torch.Tensor, cfg: MoEConfig,
                       sigmoid=torch.sigmoid) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited sigmoid routing (DeepSeek-V3 §2.1.2; Nemotron 3 Nano).

    s = sigmoid(logits); the choice score s + b (b: the load-balancing
    correction bias) picks experts, but the weights are s itself:
        groups   = the topk_group groups with the largest sum of their 2 best s + b
        chosen   = top_k experts by s + b inside those groups
        w        = s[chosen] / (Σ s[chosen] + 1e-20) if norm_topk_prob else s[chosen]
        w       *= routed_scaling_factor
    logits: [tokens, E] -> (w [tokens, k], expert ids [tokens, k]); `sigmoid`: the backend's
    (`ops.Pointwise`)."""
    scores = sigmoid(logits)
    choice = scores + score_bias  # [tokens, E]
    grouped = choice.view(-1, cfg.n_group, cfg.num_experts // cfg.n_group)  # [tokens, groups, E / groups]
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [tokens, groups]
    groups = torch.topk(group_scores, k=cfg.topk_group, dim=-1).indices
    in_group = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)  # [tokens, groups]
    in_group = in_group[..., None].expand_as(grouped).reshape_as(choice)  # [tokens, E]
    ids = torch.topk(choice.masked_fill(~in_group, float("-inf")), k=cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids
