"""Qwen3.5 text models, dense (`Qwen3_5ForCausalLM`) and MoE
(`Qwen3_5MoeForCausalLM`): Qwen3-Next's layers (`qwen3_next.py`) with the
GDN input projections stored split (in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a; fused here into one `in_proj`), a SwiGLU MLP after every mixer
(dense) or a MoE after every mixer (top-k weights always renormalised, shared
expert with its sigmoid gate). The multimodal rotary (`mrope_section`) gives
text positions the plain rotary angles, so text runs with the plain rotation.
`mtp.*` weights are present and unused, as for Qwen3-Next.

The released models are the multimodal `Qwen3_5ForConditionalGeneration`
/ `Qwen3_5MoeForConditionalGeneration`: the text model's config under
`text_config`, its weights under `model.language_model.`, the vision encoder
under `model.visual.` (present and unused: hybridspec runs the text model).
"""
from __future__ import annotations

import torch

from hybridspec.config import HybridConfig
from hybridspec.adapters.common import rename
from hybridspec.adapters.jamba import stack_experts
from hybridspec.adapters import qwen3_next
from hybridspec.adapters.qwen3_next import fuse_gdn_projections, moe_config, qwen_config

ARCHITECTURE = "Qwen3_5ForCausalLM"
SPLIT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
# Qwen3-Next's names, the text model also under the multimodal model's `model.language_model.`
RULES = [(pattern.replace(r"^model\.", r"^model\.(?:language_model\.)?"), target)
         for pattern, target in qwen3_next.RULES]
UNUSED = qwen3_next.UNUSED + [(r"^model\.visual\.", "vision encoder: hybridspec runs the text model")]


def text_config(cfg: dict) -> dict:
    """The text model's config: `text_config` of a multimodal model (the top level's tie and EOS where
    it sets them), else the config itself."""
    if "text_config" not in cfg:
        return cfg
    shared = {key: cfg[key] for key in ("tie_word_embeddings", "eos_token_id") if cfg.get(key) is not None}
    return {**cfg["text_config"], **shared}


def config_from_dict(cfg: dict) -> HybridConfig:
    cfg = text_config(cfg)
    n = cfg["num_hidden_layers"]
    if cfg.get("num_experts"):  # Qwen3.5 MoE: every layer's feed-forward
        return qwen_config(cfg, ("moe",) * n, moe_config(cfg, norm_topk_prob=True), "qwen3_5_moe")
    return qwen_config(cfg, ("mlp",) * n, None, "qwen3_5")


def split_parts(weights: dict[str, torch.Tensor], prefix: str):
    """Qwen3.5's split projections -> [q | k | v], z, b, a (None, all left in place, if one is missing)."""
    if any(prefix + f"{name}.weight" not in weights for name in SPLIT):
        return None
    return [weights.pop(prefix + f"{name}.weight") for name in SPLIT]


def weights_from_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    weights = stack_experts(rename(state, RULES))
    return fuse_gdn_projections(weights, split_parts)
