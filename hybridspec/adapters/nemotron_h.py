"""Nemotron-H (`NemotronHForCausalLM`): every layer is one pre-norm residual
block holding a single sublayer, named by its pattern character:

    "M"  Mamba2 mixer          -> mixer "mamba2", ffn "none"
    "*"  attention (no RoPE)   -> mixer "attention", ffn "none"
    "-"  squared-ReLU MLP      -> mixer "none", ffn "mlp" (not gated)
    "E"  mixture of experts    -> mixer "none", ffn "moe": squared-ReLU experts
                                  with sigmoid group routing and a shared expert
                                  (Nemotron 3 Nano)

The pattern comes from `hybrid_override_pattern` (config.json on the Hub) or
`layers_block_type` (HF transformers 5). Models on the Hub prefix the
stack with `backbone.`, HF transformers 5 with `model.`; both load. An "E"
block's experts are stored stacked (`mixer.experts.up_proj [E, I, H]`,
`down_proj [E, H, I]`) by HF transformers 5 and one by one
(`mixer.experts.{e}.up_proj.weight`) on the Hub; both load. The shared
expert is `mixer.shared_experts.*`, the router `mixer.gate.*`.
"""
from __future__ import annotations

import re

import torch

from hybridspec.config import AttentionConfig, HybridConfig, Mamba2Config, MLPConfig, MoEConfig
from hybridspec.errors import ConfigError, ModelFilesError, UnsupportedModelError
from hybridspec.adapters.common import eos_id, rename

ARCHITECTURE = "NemotronHForCausalLM"
ACTIVATIONS = ("relu2", "silu", "gelu")

# pattern character -> (mixer type, feed-forward type)
BLOCKS = {"M": ("mamba2", "none"), "*": ("attention", "none"), "-": ("none", "mlp"), "E": ("none", "moe")}
# HF transformers 5 block names (and their older spellings) -> pattern character
BLOCK_NAMES = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-",
               "moe": "E"}

RULES = [
    (r"^(?:model|backbone)\.embeddings\.", "embed_tokens."),
    (r"^(?:model|backbone)\.norm_f\.", "final_norm."),
    (r"^lm_head\.", "lm_head."),
    (r"^(?:model|backbone)\.layers\.(\d+)\.norm\.", r"layers.\1.norm."),
    (r"^(?:model|backbone)\.layers\.(\d+)\.mixer\.(up_proj|down_proj)\.", r"layers.\1.ffn.\2."),
    (r"^(?:model|backbone)\.layers\.(\d+)\.mixer\.gate\.", r"layers.\1.ffn.router."),
    (r"^(?:model|backbone)\.layers\.(\d+)\.mixer\.shared_experts\.", r"layers.\1.ffn.shared."),
    (r"^(?:model|backbone)\.layers\.(\d+)\.mixer\.experts\.", r"layers.\1.ffn.experts."),
    (r"^(?:model|backbone)\.layers\.(\d+)\.mixer\.", r"layers.\1.mixer."),
]
_BLOCK_NORM = re.compile(r"^layers\.(\d+)\.norm\.weight$")
_PER_EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")


def layer_pattern(cfg: dict) -> str:
    """The layer pattern as a string over "M*-E"."""
    blocks = cfg.get("layers_block_type") or cfg.get("layer_types")
    if blocks:
        unknown = sorted({b for b in blocks if b not in BLOCK_NAMES})
        if unknown:
            raise UnsupportedModelError(f"Nemotron-H block types {unknown} are unknown; expected "
                                        f"{sorted(BLOCK_NAMES)}")
        return "".join(BLOCK_NAMES[b] for b in blocks)
    pattern = cfg.get("hybrid_override_pattern")
    if not pattern:
        raise UnsupportedModelError("a Nemotron-H config needs `hybrid_override_pattern` or `layers_block_type`")
    return pattern


def config_from_dict(cfg: dict) -> HybridConfig:
    pattern = layer_pattern(cfg)
    unsupported = sorted(set(pattern) - set(BLOCKS))
    if unsupported:
        raise UnsupportedModelError(
            f"Nemotron-H layer pattern {pattern!r} holds {unsupported}; hybridspec runs 'M' (Mamba2), '*' "
            "(attention), '-' (MLP) and 'E' (mixture of experts) layers only")
    if "E" in pattern and cfg.get("moe_latent_size") is not None:
        raise UnsupportedModelError(f"Nemotron-H moe_latent_size={cfg['moe_latent_size']} (experts in a latent "
                                    "space) is not supported; only experts on the hidden size (moe_latent_size "
                                    "null, as in Nemotron 3 Nano) are")
    if cfg.get("mamba_hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"mamba_hidden_act={cfg['mamba_hidden_act']!r} is not supported; the "
                                    "Mamba2 conv runs with 'silu' only")
    activation = cfg.get("mlp_hidden_act", "relu2")
    if activation not in ACTIVATIONS:
        raise UnsupportedModelError(f"mlp_hidden_act={activation!r} is not supported; expected one of {ACTIVATIONS}")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    mixers, ffns = zip(*(BLOCKS[c] for c in pattern))
    return HybridConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        layer_types=mixers,
        ffn_types=ffns,
        rms_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        # Nemotron-H attention has no positional embedding: order comes from the Mamba layers.
        attention=AttentionConfig(
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg.get("attention_head_dim") or hidden // heads, use_rope=False,
            bias=cfg.get("attention_bias", False)),
        mamba2=Mamba2Config(
            num_heads=cfg["mamba_num_heads"], head_dim=cfg["mamba_head_dim"], d_state=cfg["ssm_state_size"],
            n_groups=cfg.get("n_groups", 8), d_conv=cfg.get("conv_kernel", 4), expand=cfg.get("expand", 2),
            conv_bias=cfg.get("use_conv_bias", True), proj_bias=cfg.get("use_bias", False),
            time_step_limit=dt_limit(cfg),
            chunk_size=cfg.get("chunk_size", 128)),
        mlp=MLPConfig(cfg["intermediate_size"], activation, gated=False,
                      bias=cfg.get("mlp_bias", False)) if "-" in pattern else None,
        moe=moe_config(cfg, activation) if "E" in pattern else None,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        eos_token_id=eos_id(cfg),
        family="nemotron_h",
    )


def dt_limit(cfg: dict) -> tuple[float, float]:
    """The Δ clamp of HF's NemotronHMamba2Mixer: `time_step_limit`, which HF's
    config also takes as `mamba_dt_limit` (that name wins when both are given).
    `time_step_min` and `time_step_max` only initialise dt_bias."""
    name = "mamba_dt_limit" if "mamba_dt_limit" in cfg else "time_step_limit"
    limit = cfg.get(name) or (0.0, float("inf"))
    is_pair = isinstance(limit, (list, tuple)) and len(limit) == 2
    if not is_pair or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in limit) \
            or not 0.0 <= limit[0] <= limit[1]:
        raise ConfigError(f"Nemotron-H {name}={limit!r} must be a pair [low, high] with 0 <= low <= high "
                          "(HF's default is [0.0, Infinity])")
    return float(limit[0]), float(limit[1])


def moe_config(cfg: dict, activation: str) -> MoEConfig:
    """The "E" blocks: squared-ReLU experts, sigmoid group routing, one shared expert."""
    if cfg.get("mlp_bias", False):
        raise UnsupportedModelError("Nemotron-H mlp_bias=true with 'E' layers is not supported: hybridspec's "
                                    "experts have no biases")
    if cfg.get("n_shared_experts", 1) != 1:
        raise UnsupportedModelError(f"Nemotron-H n_shared_experts={cfg['n_shared_experts']} is not supported; "
                                    "HF's NemotronHMoE runs exactly one shared expert")
    return MoEConfig(
        num_experts=cfg["n_routed_experts"], top_k=cfg.get("num_experts_per_tok", 2),
        intermediate_size=cfg["moe_intermediate_size"], router="sigmoid_group_topk", activation=activation,
        shared_intermediate_size=cfg["moe_shared_expert_intermediate_size"], gated=False,
        n_group=cfg.get("n_group", 1), topk_group=cfg.get("topk_group", 1),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))


def stack_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stack Hub-layout per-expert weights (`experts.{e}.up_proj.weight`) into
    `experts.up_proj [E, I, H]` and `experts.down_proj [E, H, I]`; names
    already stacked pass through."""
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    out = {}
    for name, tensor in weights.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
        else:
            per_expert.setdefault((match.group(1), match.group(3)), {})[int(match.group(2))] = tensor
    for (prefix, proj), experts in per_expert.items():
        order = sorted(experts)
        shapes = {tuple(t.shape) for t in experts.values()}
        if order != list(range(len(order))) or len(shapes) > 1:
            raise ModelFilesError(f"{prefix}.*.{proj}: expected experts 0..{len(order) - 1} of one shape, got "
                                  f"experts {order} of shapes {sorted(shapes)}; the weights are incomplete")
        out[f"{prefix}.{proj}"] = torch.stack([experts[e] for e in order])
    return out


def weights_from_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stored names -> canonical names. A block's single norm is the mixer's
    input norm, or the feed-forward norm in an MLP block."""
    weights = stack_experts(rename(state, RULES))
    for name in [n for n in weights if _BLOCK_NORM.match(n)]:
        layer = _BLOCK_NORM.match(name).group(1)
        is_ffn = any(f"layers.{layer}.ffn.{n}" in weights for n in ("up_proj.weight", "router.weight"))
        role = "ffn_norm" if is_ffn else "input_norm"
        weights[f"layers.{layer}.{role}.weight"] = weights.pop(name)
    return weights
