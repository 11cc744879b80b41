"""Drafter shapes for the simulator: a target's MTP layer and an EAGLE-3 head,
each a `HybridShape` priced per draft step by the roofline that prices the
target, and the acceptance prior a preset pairs with its drafter.

MTP (`hybridspec.models.mtp`): fc [hidden, 2·hidden] over [embedding ; the
target's hidden state], one decoder layer of the target's attention and its
feed-forward kind (the MoE of a MoE target, its dense MLP otherwise), then the
target's own LM head over the full vocabulary. The embedding and LM head are
shared, so they are not held twice, but every draft step reads the LM head
whole: at Qwen3-Next's hidden 2048 and vocabulary 151936 it is most of the step.

EAGLE-3 (Li et al. 2025): fc [hidden, 3·hidden] fusing three of the target's
hidden states, one Llama decoder layer whose q, k, v read [embedding ; fused]
(2·hidden wide) and a dense SwiGLU MLP, and an LM head of its own over a draft
vocabulary (32000 in the published heads for Qwen3 targets, mapped to the
target's by d2t). The embedding is the target's (a row gather).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hybridspec.costs.closed_form import alpha_from_acceptance_rate
from hybridspec.costs.validation import check_alpha
from hybridspec.errors import ConfigError
from hybridspec.sim.shapes import HybridShape

DRAFTER_KINDS = ("model", "mtp", "eagle3")
EAGLE3_DRAFT_VOCAB = 32000

# what a one-layer drafter drops of the target's stack layout
_ONE_LAYER = dict(num_mamba_layers=0, num_attention_layers=1, separate_mlp_layers=False, parallel_mixers=False,
                  attention_weight_copies=None, mlp_weight_copies=None, attention_input_dim=None, stack_layers=None)


@dataclass(frozen=True)
class AcceptancePrior:
    """The per-draft α of the i.i.d. model a drafter is expected to reach, and
    the figure it was derived from (published, or said to be assumed)."""

    alpha: float
    source: str

    def __post_init__(self) -> None:
        check_alpha(self.alpha)


def prior_from_rate(rate: float, gamma: int, source: str) -> AcceptancePrior:
    """α from a published acceptance rate (accepted / drafted) at γ drafts per round."""
    return AcceptancePrior(alpha_from_acceptance_rate(rate, gamma), source)


def prior_from_length(length: float, gamma: int, source: str) -> AcceptancePrior:
    """α from a published mean acceptance length (tokens per round, bonus included) at γ drafts."""
    if not 1.0 <= length <= gamma + 1:
        raise ConfigError(f"acceptance length {length} at gamma={gamma} must lie in [1, {gamma + 1}]")
    return prior_from_rate((length - 1.0) / gamma, gamma, source)


def check_drafter_kind(kind: str) -> str:
    if kind not in DRAFTER_KINDS:
        raise ConfigError(f"drafter {kind!r} is not one of {', '.join(DRAFTER_KINDS)}; "
                          "pick one of them, e.g. --drafter model,mtp,eagle3")
    return kind


def _feed_forward(target: HybridShape) -> dict:
    """One layer of the target's feed-forward: a MoE layer if it has them, else one dense MLP."""
    if target.num_moe_blocks:
        return dict(num_mlp_blocks=0, num_moe_blocks=1)
    if not target.num_mlp_blocks:
        raise ConfigError(f"{target.name} has neither MLP nor MoE layers, so its MTP layer's feed-forward "
                          "cannot be inferred")
    return dict(num_mlp_blocks=1, num_moe_blocks=0)


def mtp_draft(target: HybridShape) -> HybridShape:
    """The target's MTP layer: fc, one attention layer and feed-forward of the
    target's kinds, the target's LM head (shared) read every step."""
    d = target.d_model
    return dataclasses.replace(
        target, **_ONE_LAYER, **_feed_forward(target),
        name=f"MTP layer of {target.name}",
        extra_params=d * 2 * d,  # fc: [embedding ; hidden state] (2·hidden) -> hidden
        lm_head_shared=True,
        source=f"assumed: one MTP layer over {target.name} (fc [hidden, 2·hidden], the target's attention and "
               "feed-forward, the target's LM head), as Qwen3-Next and Qwen3.5 ship it (mtp.*)",
    )


def eagle3_draft(target: HybridShape, draft_vocab: int = EAGLE3_DRAFT_VOCAB) -> HybridShape:
    """An EAGLE-3 head over `target`: fc over three hidden states, one Llama
    layer reading 2·hidden, its own LM head over `draft_vocab` tokens. A MoE
    target's head gets a dense MLP as wide as the target's active feed-forward
    (top-k experts plus the shared one)."""
    d = target.d_model
    width = target.mlp_intermediate if target.num_mlp_blocks else \
        target.moe_top_k * target.moe_intermediate + target.moe_shared_intermediate
    return dataclasses.replace(
        target, **{**_ONE_LAYER, "attention_input_dim": 2 * d},  # q, k, v read [embedding ; fused hidden]
        name=f"EAGLE-3 head of {target.name} ({draft_vocab} draft vocab)",
        vocab_size=draft_vocab,
        num_mlp_blocks=1, mlp_intermediate=width, mlp_matrices=3, num_moe_blocks=0,
        attention_output_gate=False,  # a Llama layer
        extra_params=d * 3 * d,  # fc: three of the target's hidden states (3·hidden) -> hidden
        tie_embeddings=True,  # its own LM head, counted once; the embedding is the target's
        lm_head_shared=False,
        source=f"assumed: an EAGLE-3 head over {target.name} shaped as the published Qwen3 heads (one Llama layer "
               f"with the target's heads, fc [hidden, 3·hidden], draft vocabulary {draft_vocab}); MLP width "
               f"{width}",
    )
