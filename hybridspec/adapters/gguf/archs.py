"""GGUF metadata <-> model config, per llama.cpp architecture: `Arch.config_dict` turns a file's
metadata into the HF config dict its hybridspec adapter reads (`config_from_dict`), `Arch.metadata`
turns a `HybridConfig` into the keys llama.cpp's converter writes for that architecture.

Keys are named without the "<arch>." prefix. Layer kinds come from per-layer arrays, as llama.cpp
reads them: `attention.head_count_kv[i]` > 0 marks an attention layer, and in Nemotron-H
`feed_forward_length[i]` > 0 an MLP layer (in `nemotron_h_moe`, a mixture-of-experts layer); the rest
are Mamba-2 layers. Biases and tied embeddings
are not metadata: the tensors present say (`Tensors`). Two keys are hybridspec's own, which
llama.cpp ignores: `ssm.chunk_size` (the SSD chunk of prefill, which sets its float rounding) and
`ssm.dt_limit` (the Δ clamp), written where they differ from the adapter's default. Families whose
rules differ more have their own module: `qwen_meta` (the gated-DeltaNet Qwens), `falcon_h1_meta`
(parallel layers, µP multipliers folded into the weights: `Arch.fold`), `jamba_meta` (Mamba-1 and MoE
layers from per-layer keys).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from hybridspec.config import HybridConfig
from hybridspec.errors import UnsupportedModelError
from hybridspec.adapters.gguf import falcon_h1_meta, jamba_meta, qwen_meta
from hybridspec.adapters.gguf.keys import Tensors, get, per_layer


def _common(meta: dict, arch: str, tensors: Tensors) -> dict:
    hidden, inner = int(get(meta, arch, "embedding_length")), int(get(meta, arch, "ssm.inner_size"))
    heads = int(get(meta, arch, "attention.head_count"))
    ssm_heads = int(get(meta, arch, "ssm.time_step_rank"))
    cfg = {"vocab_size": int(get(meta, arch, "vocab_size", 0)) or None, "hidden_size": hidden,
           "num_hidden_layers": int(get(meta, arch, "block_count")), "num_attention_heads": heads,
           "head_dim": int(get(meta, arch, "attention.key_length", hidden // max(heads, 1))),
           "max_position_embeddings": int(get(meta, arch, "context_length", 4096)),
           "tie_word_embeddings": "output.weight" not in tensors.names,
           "attention_bias": tensors.any(".attn_q.bias"), "eos_token_id": meta.get("tokenizer.ggml.eos_token_id")}
    ssm = {"heads": ssm_heads, "head_dim": inner // ssm_heads, "state": int(get(meta, arch, "ssm.state_size")),
           "groups": int(get(meta, arch, "ssm.group_count")), "conv": int(get(meta, arch, "ssm.conv_kernel")),
           "expand": inner // hidden, "conv_bias": tensors.any(".ssm_conv1d.bias"),
           "proj_bias": tensors.any(".ssm_in.bias"), "chunk": get(meta, arch, "ssm.chunk_size", None),
           "dt_limit": get(meta, arch, "ssm.dt_limit", None)}
    return cfg, ssm, float(get(meta, arch, "attention.layer_norm_rms_epsilon"))


def _granite_config(meta: dict, arch: str, tensors: Tensors) -> dict:
    cfg, ssm, eps = _common(meta, arch, tensors)
    layers = cfg["num_hidden_layers"]
    kv = per_layer(meta, arch, "attention.head_count_kv", layers)
    experts = int(get(meta, arch, "expert_count", 0))
    ff = int(get(meta, arch, "feed_forward_length"))
    cfg |= {"layer_types": ["attention" if n else "mamba" for n in kv], "num_key_value_heads": max(kv) or None,
            "position_embedding_type": "rope" if get(meta, arch, "rope.scaling.finetuned", False) else None,
            "rope_theta": float(get(meta, arch, "rope.freq_base", 10000.0)), "rms_norm_eps": eps,
            "mamba_n_heads": ssm["heads"], "mamba_d_head": ssm["head_dim"], "mamba_d_state": ssm["state"],
            "mamba_n_groups": ssm["groups"], "mamba_d_conv": ssm["conv"], "mamba_expand": ssm["expand"],
            "mamba_conv_bias": ssm["conv_bias"], "mamba_proj_bias": ssm["proj_bias"],
            "num_local_experts": experts, "num_experts_per_tok": int(get(meta, arch, "expert_used_count", 0)),
            "intermediate_size": ff,
            "shared_intermediate_size": int(get(meta, arch, "expert_shared_feed_forward_length", ff)),
            "attention_multiplier": float(get(meta, arch, "attention.scale", cfg["head_dim"] ** -0.5)),
            "embedding_multiplier": float(get(meta, arch, "embedding_scale", 1.0)),
            "residual_multiplier": float(get(meta, arch, "residual_scale", 1.0)),
            "logits_scaling": float(get(meta, arch, "logit_scale", 1.0))}
    rotary = get(meta, arch, "rope.dimension_count", None)
    if rotary is not None:
        cfg["partial_rotary_factor"] = int(rotary) / cfg["head_dim"]
    return _ssm_extras(cfg, ssm, "mamba_chunk_size", "time_step_limit")


def _nemotron_config(meta: dict, arch: str, tensors: Tensors) -> dict:
    cfg, ssm, eps = _common(meta, arch, tensors)
    layers = cfg["num_hidden_layers"]
    trunk = layers - int(get(meta, arch, "nextn_predict_layers", 0))  # less the MTP block a converter appends
    kv = per_layer(meta, arch, "attention.head_count_kv", layers)[:trunk]
    ff = per_layer(meta, arch, "feed_forward_length", layers)[:trunk]
    cfg |= {"num_hidden_layers": trunk,
            "hybrid_override_pattern": "".join("*" if k else "-" if f else "M" for k, f in zip(kv, ff)),
            "num_key_value_heads": max(kv) or None, "layer_norm_epsilon": eps, "intermediate_size": max(ff) or 1,
            "mamba_num_heads": ssm["heads"], "mamba_head_dim": ssm["head_dim"], "ssm_state_size": ssm["state"],
            "n_groups": ssm["groups"], "conv_kernel": ssm["conv"], "expand": ssm["expand"],
            "use_conv_bias": ssm["conv_bias"], "use_bias": ssm["proj_bias"], "mlp_bias": tensors.any(".ffn_up.bias")}
    return _ssm_extras(cfg, ssm, "chunk_size", "time_step_limit")


def _nemotron_moe_config(meta: dict, arch: str, tensors: Tensors) -> dict:
    """Nemotron-H with "E" layers where feed_forward_length[i] > 0. llama.cpp's converter writes no
    expert_group_used_count: absent, every group is eligible (topk_group = n_group), as llama.cpp runs it."""
    cfg = _nemotron_config(meta, arch, tensors)
    cfg["hybrid_override_pattern"] = cfg["hybrid_override_pattern"].replace("-", "E")
    groups = int(get(meta, arch, "expert_group_count", 1))
    return cfg | {"n_routed_experts": int(get(meta, arch, "expert_count")),
                  "num_experts_per_tok": int(get(meta, arch, "expert_used_count")),
                  "moe_intermediate_size": int(get(meta, arch, "expert_feed_forward_length", cfg["intermediate_size"])),
                  "moe_shared_expert_intermediate_size": int(get(meta, arch, "expert_shared_feed_forward_length")),
                  "n_shared_experts": int(get(meta, arch, "expert_shared_count", 1)),
                  "n_group": groups, "topk_group": int(get(meta, arch, "expert_group_used_count", groups)),
                  "norm_topk_prob": bool(get(meta, arch, "expert_weights_norm", False)),
                  "routed_scaling_factor": float(get(meta, arch, "expert_weights_scale", 1.0))}


def _mamba2_config(meta: dict, arch: str, tensors: Tensors) -> dict:
    from hybridspec.adapters.mamba_ssm import NORM_EPS
    cfg, ssm, eps = _common(meta, arch, tensors)
    if float(np.float32(eps)) != float(np.float32(NORM_EPS)):
        raise UnsupportedModelError(f"{arch}.attention.layer_norm_rms_epsilon={eps}: hybridspec's Mamba-2 models "
                                    f"(mamba_ssm's) normalise with eps={NORM_EPS} only")
    ssm_cfg = {"layer": "Mamba2", "d_state": ssm["state"], "d_conv": ssm["conv"], "expand": ssm["expand"],
               "headdim": ssm["head_dim"], "ngroups": ssm["groups"], "conv_bias": ssm["conv_bias"],
               "bias": ssm["proj_bias"]}
    ssm_cfg |= _ssm_extras({}, ssm, "chunk_size", "dt_limit")
    return {"d_model": cfg["hidden_size"], "n_layer": cfg["num_hidden_layers"], "vocab_size": cfg["vocab_size"],
            "pad_vocab_size_multiple": 1, "ssm_cfg": ssm_cfg, "tie_embeddings": cfg["tie_word_embeddings"],
            "max_position_embeddings": cfg["max_position_embeddings"]}


def _ssm_extras(cfg: dict, ssm: dict, chunk_key: str, limit_key: str) -> dict:
    if ssm["chunk"] is not None:
        cfg[chunk_key] = int(ssm["chunk"])
    if ssm["dt_limit"] is not None:
        cfg[limit_key] = [float(x) for x in ssm["dt_limit"]]
    return cfg


def _common_metadata(config: HybridConfig) -> dict:
    a, m = config.attention, config.mamba2
    kv = [a.num_kv_heads if a and t == "attention" else 0 for t in config.layer_types]
    out = {"block_count": config.num_layers, "embedding_length": config.hidden_size,
           "context_length": config.max_position_embeddings, "vocab_size": config.vocab_size,
           "attention.head_count": a.num_heads if a else 0, "attention.head_count_kv": kv,
           "attention.key_length": a.head_dim if a else 0, "attention.value_length": a.head_dim if a else 0,
           "attention.layer_norm_rms_epsilon": config.rms_norm_eps,
           "ssm.conv_kernel": m.d_conv, "ssm.state_size": m.d_state, "ssm.group_count": m.n_groups,
           "ssm.inner_size": m.d_inner, "ssm.time_step_rank": m.num_heads, "ssm.chunk_size": m.chunk_size}
    if tuple(m.time_step_limit) != (0.0, float("inf")):
        out["ssm.dt_limit"] = [float(x) for x in m.time_step_limit]
    return out


def _granite_metadata(config: HybridConfig) -> dict:
    a, moe = config.attention, config.moe
    out = _common_metadata(config) | {
        "rope.scaling.finetuned": bool(a and a.use_rope),
        "embedding_scale": config.embedding_multiplier, "residual_scale": config.residual_multiplier,
        "logit_scale": config.logits_scaling}
    if a and a.scale is not None:  # absent: head_dim ** -0.5
        out["attention.scale"] = a.scale
    if a and a.use_rope:
        out |= {"rope.freq_base": a.rope_theta, "rope.dimension_count": int(a.head_dim * a.partial_rotary_factor)}
    if moe is not None:
        return out | {"feed_forward_length": moe.intermediate_size, "expert_count": moe.num_experts,
                      "expert_used_count": moe.top_k,
                      "expert_shared_feed_forward_length": moe.shared_intermediate_size}
    return out | {"feed_forward_length": config.mlp.intermediate_size,
                  "expert_shared_feed_forward_length": config.mlp.intermediate_size}


def _nemotron_metadata(config: HybridConfig) -> dict:
    ff = [config.mlp.intermediate_size if f == "mlp" else 0 for f in config.ffn_types]
    return _common_metadata(config) | {"feed_forward_length": ff, "attention.layer_norm_type": "rms"}


def _nemotron_moe_metadata(config: HybridConfig) -> dict:
    """llama.cpp's nemotron_h_moe: every feed-forward layer is experts (squared ReLU, sigmoid routing)."""
    moe = config.moe
    if "mlp" in config.ffn_types:
        raise UnsupportedModelError("llama.cpp's nemotron_h_moe makes every feed-forward layer experts; this "
                                    "Nemotron-H has both MLP ('-') and expert ('E') layers, which GGUF cannot hold")
    if moe.activation != "relu2":
        raise UnsupportedModelError(f"Nemotron-H experts with mlp_hidden_act={moe.activation!r} cannot be "
                                    "written as GGUF: llama.cpp's nemotron_h_moe runs squared ReLU ('relu2') only")
    ff = [moe.intermediate_size if f == "moe" else 0 for f in config.ffn_types]
    return _common_metadata(config) | {
        "feed_forward_length": ff, "attention.layer_norm_type": "rms", "expert_count": moe.num_experts,
        "expert_used_count": moe.top_k, "expert_feed_forward_length": moe.intermediate_size,
        "expert_shared_feed_forward_length": moe.shared_intermediate_size, "expert_shared_count": 1,
        "expert_weights_norm": moe.norm_topk_prob, "expert_weights_scale": moe.routed_scaling_factor,
        "expert_group_count": moe.n_group, "expert_group_used_count": moe.topk_group}


def _mamba2_metadata(config: HybridConfig) -> dict:
    if set(config.layer_types) != {"mamba2"} or set(config.ffn_types) != {"none"}:
        raise UnsupportedModelError("llama.cpp's mamba2 architecture holds Mamba-2 layers only; this mamba_ssm "
                                    f"model has {sorted(set(config.layer_types) | set(config.ffn_types))}")
    return _common_metadata(config) | {"feed_forward_length": 0}


@dataclass(frozen=True)
class Arch:
    """One llama.cpp architecture hybridspec reads and writes."""

    name: str  # general.architecture
    adapter: str  # the hybridspec adapter module whose config_from_dict reads `config_dict`'s output
    config_dict: Callable[[dict, str, Tensors], dict]
    metadata: Callable[[HybridConfig], dict]
    families: tuple[str, ...]  # HybridConfig.family values written as this architecture
    norm_of_ffn: str  # the GGUF norm a feed-forward sublayer reads (its name under blk.N.)
    # (canonical name under layers.N., tensor, config) -> the tensor as the converter stores it, where it
    # folds multipliers into weights (`falcon_h1_meta.fold`)
    fold: Callable[[str, torch.Tensor, HybridConfig], torch.Tensor] | None = None
    moe: bool | None = None  # written for models with (True) or without (False) experts only; None: either


ARCHS = {
    "granitehybrid": Arch("granitehybrid", "granitemoehybrid", _granite_config, _granite_metadata,
                          ("granitemoehybrid", "bamba"), "ffn_norm.weight"),
    "nemotron_h": Arch("nemotron_h", "nemotron_h", _nemotron_config, _nemotron_metadata, ("nemotron_h",),
                       "attn_norm.weight", moe=False),
    "nemotron_h_moe": Arch("nemotron_h_moe", "nemotron_h", _nemotron_moe_config, _nemotron_moe_metadata,
                           ("nemotron_h",), "attn_norm.weight", moe=True),
    "mamba2": Arch("mamba2", "mamba_ssm", _mamba2_config, _mamba2_metadata, ("mamba_ssm",), "ffn_norm.weight"),
    "qwen3next": Arch("qwen3next", "qwen3_next", qwen_meta.config_dict, qwen_meta.metadata, ("qwen3_next",),
                      "post_attention_norm.weight"),
    "qwen35": Arch("qwen35", "qwen3_5", qwen_meta.config_dict, qwen_meta.metadata, ("qwen3_5",),
                   "post_attention_norm.weight"),
    "qwen35moe": Arch("qwen35moe", "qwen3_5", qwen_meta.config_dict, qwen_meta.metadata, ("qwen3_5_moe",),
                      "post_attention_norm.weight"),
    "falcon-h1": Arch("falcon-h1", "falcon_h1", falcon_h1_meta.config_dict, falcon_h1_meta.metadata,
                      ("falcon_h1",), "ffn_norm", falcon_h1_meta.fold),
    "jamba": Arch("jamba", "jamba", jamba_meta.config_dict, jamba_meta.metadata, ("jamba",), "ffn_norm.weight"),
}
UNSUPPORTED = ("mamba",)


def arch_named(name: str) -> Arch:
    if name in ARCHS:
        return ARCHS[name]
    known = " (an architecture llama.cpp writes that this loader does not map yet)" if name in UNSUPPORTED else ""
    raise UnsupportedModelError(f"GGUF architecture {name!r}{known} is not supported; hybridspec reads "
                                f"{', '.join(sorted(ARCHS))}")


def arch_of(config: HybridConfig) -> Arch:
    for arch in ARCHS.values():
        if config.family in arch.families and arch.moe in (None, config.moe is not None):
            return arch
    raise UnsupportedModelError(f"writing a {config.family!r} model as GGUF is not supported; hybridspec writes "
                                + ", ".join(f for a in ARCHS.values() for f in a.families))
