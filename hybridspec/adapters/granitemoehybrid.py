"""GraniteMoeHybrid (`GraniteMoeHybridForCausalLM`, the Granite-4.0-H family):
Mamba2 and attention mixers, each followed by a SwiGLU "shared" MLP plus,
when `num_local_experts > 0`, routed experts (softmax over the top-k router
logits). Granite's muP multipliers map onto HybridConfig:

    h_0 = embedding_multiplier · embed(t)
    h  += residual_multiplier · sublayer(norm(h))       (mixer and feed-forward)
    attention softmax scale = attention_multiplier      (not head_dim^-1/2)
    logits = lm_head(norm(h)) / logits_scaling

RoPE (full head width) only when `position_embedding_type == "rope"`.
The shared MLP's fused `input_linear` holds the gate rows first, then the up
rows; it is split into views (no copy). Models on the Hub store the
experts as `block_sparse_moe.input_linear/output_linear` and the router as
`router.layer`; HF transformers 5 renames them, and both spellings load.
"""
from __future__ import annotations

import re

import torch

from hybridspec.config import AttentionConfig, HybridConfig, Mamba2Config, MLPConfig, MoEConfig
from hybridspec.errors import UnsupportedModelError
from hybridspec.adapters.common import eos_id, rename, rope_settings

ARCHITECTURE = "GraniteMoeHybridForCausalLM"

MIXERS = {"mamba": "mamba2", "linear_attention": "mamba2", "attention": "attention",
          "full_attention": "attention"}

RULES = [
    (r"^model\.embed_tokens\.", "embed_tokens."),
    (r"^model\.norm\.", "final_norm."),
    (r"^lm_head\.", "lm_head."),
    (r"^model\.rotary_emb\.inv_freq$", "rotary.inv_freq"),
    (r"^model\.rotary_emb\.original_inv_freq$", None),  # a copy kept for dynamic RoPE scaling
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.input_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.ffn_norm."),
    (r"^model\.layers\.(\d+)\.(mamba|self_attn)\.", r"layers.\1.mixer."),
    (r"^model\.layers\.(\d+)\.block_sparse_moe\.router\.(?:layer\.)?weight$", r"layers.\1.ffn.router.weight"),
    (r"^model\.layers\.(\d+)\.block_sparse_moe\.(?:experts\.gate_up_proj|input_linear\.weight)$",
     r"layers.\1.ffn.experts.gate_up_proj"),
    (r"^model\.layers\.(\d+)\.block_sparse_moe\.(?:experts\.down_proj|output_linear\.weight)$",
     r"layers.\1.ffn.experts.down_proj"),
    (r"^model\.layers\.(\d+)\.shared_mlp\.(input|output)_linear\.weight$", r"layers.\1.shared_mlp.\2"),
]
_SHARED = re.compile(r"^layers\.(\d+)\.shared_mlp\.(input|output)$")


def config_from_dict(cfg: dict) -> HybridConfig:
    activation = cfg.get("hidden_act", "silu")
    if activation != "silu":
        raise UnsupportedModelError(f"GraniteMoeHybrid hidden_act={activation!r} is not supported; the Mamba2 "
                                    "conv and the MLPs run with 'silu' only")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    n = cfg["num_hidden_layers"]
    blocks = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n
    unknown = sorted({b for b in blocks if b not in MIXERS})
    if unknown:
        raise UnsupportedModelError(f"GraniteMoeHybrid layer types {unknown} are unknown; expected {sorted(MIXERS)}")
    use_rope = cfg.get("position_embedding_type") == "rope"
    theta = rope_settings(cfg)[0] if use_rope else 10000.0
    mamba_heads, expand = cfg["mamba_n_heads"], cfg.get("mamba_expand", 2)
    d_head = cfg.get("mamba_d_head", "auto")
    if d_head in (None, "auto"):
        d_head = expand * hidden // mamba_heads
    num_experts = cfg.get("num_local_experts") or 0
    shared = cfg.get("shared_intermediate_size", 1024)
    return HybridConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        layer_types=tuple(MIXERS[b] for b in blocks),
        ffn_types=("moe" if num_experts > 0 else "mlp",) * len(blocks),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        # Granite's rotary embedding always spans the whole head (no partial_rotary_factor).
        attention=AttentionConfig(
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads, use_rope=use_rope, rope_theta=theta,
            scale=float(cfg.get("attention_multiplier", 1.0)), bias=cfg.get("attention_bias", False)),
        mamba2=Mamba2Config(
            num_heads=mamba_heads, head_dim=d_head, d_state=cfg["mamba_d_state"],
            n_groups=cfg.get("mamba_n_groups", 1), d_conv=cfg.get("mamba_d_conv", 4), expand=expand,
            conv_bias=cfg.get("mamba_conv_bias", True), proj_bias=cfg.get("mamba_proj_bias", False),
            time_step_limit=tuple(cfg.get("time_step_limit") or (0.0, float("inf"))),
            chunk_size=cfg.get("mamba_chunk_size", 256)),
        mlp=MLPConfig(shared, activation, gated=True) if num_experts == 0 else None,
        moe=(MoEConfig(num_experts=num_experts, top_k=cfg.get("num_experts_per_tok", 2),
                       intermediate_size=cfg["intermediate_size"], router="topk_softmax", activation=activation,
                       shared_intermediate_size=shared)
             if num_experts > 0 else None),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        eos_token_id=eos_id(cfg),
        family="granitemoehybrid",
    )


def weights_from_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stored names -> canonical names. The shared MLP is the dense MLP of a
    layer without experts (`ffn.*`) and the shared expert of one with experts
    (`ffn.shared.*`)."""
    weights = rename(state, RULES)
    for name in [n for n in weights if _SHARED.match(n)]:
        layer, part = _SHARED.match(name).groups()
        has_experts = f"layers.{layer}.ffn.router.weight" in weights
        prefix = f"layers.{layer}.ffn.shared" if has_experts else f"layers.{layer}.ffn"
        tensor = weights.pop(name)
        if part == "input":
            gate, up = tensor.chunk(2, dim=0)  # [2·I, hidden] -> two [I, hidden] views
            weights[f"{prefix}.gate_proj.weight"], weights[f"{prefix}.up_proj.weight"] = gate, up
        else:
            weights[f"{prefix}.down_proj.weight"] = tensor
    return weights
