"""Qwen3-Next (`Qwen3NextForCausalLM`): gated DeltaNet ("linear_attention")
layers and gated full-attention layers (q/k RMSNorms, a sigmoid output gate
from a doubled q_proj, partial rotary), each followed by a SwiGLU MLP or a
mixture of experts (softmax router, top-k weights renormalised when
`norm_topk_prob`, a shared expert scaled by sigmoid(shared_expert_gate · x)).

`layer_types` (or every `full_attention_interval`-th layer) says which mixer a
layer runs; layer i's feed-forward is a MoE when num_experts > 0, i is not in
`mlp_only_layers` and (i + 1) % decoder_sparse_step == 0.

The RMSNorms (layer, final, q/k) are zero-centred, y = (1 + w)·x̂
(`zero_centred_norms`: the model forms 1 + w from w in its own dtype, so a
bf16 weights loaded as float32 gets HF's float32 1 + w); the GDN's gated
norm is a plain w·x̂.

Conversions to hybridspec's canonical weights (copies, not views: from_hf
shares every other tensor with the HF model):
- the GDN input projections in_proj_qkvz / in_proj_ba hold, per key head, its
  q, k, and its group's v and z (resp. b and a): they are regrouped into one
  `in_proj` [q | k | v | z | b | a] (`gated_deltanet.py`);
- per-expert Hub weights are stacked as for Jamba.
The released models carry multi-token-prediction weights (`mtp.*`): not part of the
target (named in the model's `load_report`), read by `draft="mtp"` (`adapters/mtp.py`).
"""
from __future__ import annotations

import torch

from hybridspec.config import AttentionConfig, GdnConfig, HybridConfig, MLPConfig, MoEConfig
from hybridspec.errors import UnsupportedModelError
from hybridspec.adapters.common import eos_id, rename, rope_settings
from hybridspec.adapters.jamba import stack_experts

ARCHITECTURE = "Qwen3NextForCausalLM"

RULES = [
    (r"^model\.embed_tokens\.", "embed_tokens."),
    (r"^model\.norm\.", "final_norm."),
    (r"^lm_head\.", "lm_head."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.input_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.ffn_norm."),
    (r"^model\.layers\.(\d+)\.(linear_attn|self_attn)\.", r"layers.\1.mixer."),
    (r"^model\.layers\.(\d+)\.mlp\.gate\.", r"layers.\1.ffn.router."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_expert_gate\.", r"layers.\1.ffn.shared_gate."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_expert\.", r"layers.\1.ffn.shared."),
    (r"^model\.layers\.(\d+)\.mlp\.", r"layers.\1.ffn."),
    (r"^model\.rotary_emb\.", None),  # HF's rotary buffers, recomputed from the config
]

# stored tensors present and deliberately unused: name pattern -> why (the model's `load_report`)
UNUSED = []  # the MTP layer (`mtp.*`) is every family's to set aside: `common.MTP_UNUSED`


def qwen_config(cfg: dict, ffn_types: tuple[str, ...], moe: MoEConfig | None, family: str) -> HybridConfig:
    """The HybridConfig of a Qwen3-Next-style config dict, given its feed-forward pattern."""
    activation = cfg.get("hidden_act", "silu")
    if activation != "silu":
        raise UnsupportedModelError(f"{family} hidden_act={activation!r} is not supported; the conv, the gated "
                                    "norm and the MLPs run with 'silu' only")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    theta, factor = rope_settings(cfg)
    if "partial_rotary_factor" not in (cfg.get("rope_parameters") or {}) and "partial_rotary_factor" not in cfg:
        factor = 0.25  # the default Qwen3-Next's config assigns
    intermediate = cfg.get("intermediate_size")
    return HybridConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        layer_types=mixer_types(cfg),
        ffn_types=ffn_types,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        attention=AttentionConfig(
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads, rope_theta=theta, partial_rotary_factor=factor,
            bias=bool(cfg.get("attention_bias", False)), qk_norm=True, output_gate=True),
        gdn=GdnConfig(
            num_key_heads=cfg["linear_num_key_heads"], num_value_heads=cfg["linear_num_value_heads"],
            key_head_dim=cfg["linear_key_head_dim"], value_head_dim=cfg["linear_value_head_dim"],
            d_conv=cfg.get("linear_conv_kernel_dim", 4)),
        mlp=MLPConfig(intermediate, activation) if "mlp" in ffn_types else None,
        moe=moe if "moe" in ffn_types else None,
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        zero_centred_norms=True,
        eos_token_id=eos_id(cfg),
        family=family,
    )


def mixer_types(cfg: dict) -> tuple[str, ...]:
    """"gdn" for "linear_attention" layers, "attention" for "full_attention" ones."""
    n = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = cfg.get("full_attention_interval", 4)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    kinds = {"linear_attention": "gdn", "full_attention": "attention"}
    unknown = sorted(set(layer_types) - set(kinds))
    if unknown:
        raise UnsupportedModelError(f"layer_types {unknown} are not supported; expected 'linear_attention' or "
                                    "'full_attention'")
    if len(layer_types) != n:
        raise ValueError(f"layer_types has {len(layer_types)} entries for num_hidden_layers={n}")
    return tuple(kinds[t] for t in layer_types)


def moe_config(cfg: dict, norm_topk_prob: bool) -> MoEConfig:
    return MoEConfig(num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
                     intermediate_size=cfg["moe_intermediate_size"], router="softmax_topk",
                     activation=cfg.get("hidden_act", "silu"), norm_topk_prob=norm_topk_prob,
                     shared_intermediate_size=cfg["shared_expert_intermediate_size"], shared_gate=True)


def config_from_dict(cfg: dict) -> HybridConfig:
    n, num_experts = cfg["num_hidden_layers"], cfg.get("num_experts", 0)
    mlp_only, step = set(cfg.get("mlp_only_layers") or ()), cfg.get("decoder_sparse_step", 1)
    ffn_types = tuple("moe" if num_experts > 0 and i not in mlp_only and (i + 1) % step == 0 else "mlp"
                      for i in range(n))
    moe = moe_config(cfg, bool(cfg.get("norm_topk_prob", True))) if "moe" in ffn_types else None
    return qwen_config(cfg, ffn_types, moe, "qwen3_next")


def fuse_gdn_projections(weights: dict[str, torch.Tensor], parts) -> dict[str, torch.Tensor]:
    """Replace each GDN layer's input projections by one `in_proj.weight`: `parts(weights, prefix)`
    returns [q, k, v, z, b, a] row blocks, or None where the layer has none (an attention layer)."""
    out = dict(weights)
    prefixes = {name.rsplit(".mixer.", 1)[0] + ".mixer." for name in weights if ".mixer.in_proj_" in name}
    for prefix in sorted(prefixes):
        blocks = parts(out, prefix)
        if blocks is not None:
            out[prefix + "in_proj.weight"] = torch.cat(blocks, dim=0)
    return out


def qkvz_parts(weights: dict[str, torch.Tensor], prefix: str, key_head_dim: int, value_group: int):
    """Qwen3-Next's interleaved projections -> [q, k, v, z, b, a]: in_proj_qkvz [HK·(2·d_k + 2·r·d_v), H] is,
    per key head, its q, k and its r value heads' v and z; in_proj_ba [HK·2·r, H] its b and a. None (both
    left in place, for the strict check to name) where one is missing or their key-head counts differ."""
    qkvz_name, ba_name = prefix + "in_proj_qkvz.weight", prefix + "in_proj_ba.weight"
    qkvz, ba = weights.get(qkvz_name), weights.get(ba_name)
    if qkvz is None or ba is None or ba.shape[0] % (2 * value_group):
        return None
    num_key_heads, hidden = ba.shape[0] // (2 * value_group), qkvz.shape[-1]
    width = qkvz.shape[0] // num_key_heads - 2 * key_head_dim  # 2·r·d_v
    if qkvz.shape[0] % num_key_heads or width <= 0 or width % 2:
        return None
    del weights[qkvz_name], weights[ba_name]
    q, k, v, z = qkvz.reshape(num_key_heads, -1, hidden).split([key_head_dim, key_head_dim, width // 2, width // 2],
                                                                dim=1)
    b, a = ba.reshape(num_key_heads, 2 * value_group, hidden).split([value_group, value_group], dim=1)
    return [t.reshape(-1, hidden) for t in (q, k, v, z, b, a)]


def weights_from_state(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    value_group = cfg["linear_num_value_heads"] // cfg["linear_num_key_heads"]
    weights = stack_experts(rename(state, RULES))
    return fuse_gdn_projections(weights, lambda w, p: qkvz_parts(w, p, cfg["linear_key_head_dim"], value_group))


WEIGHTS_NEED_CONFIG = True
