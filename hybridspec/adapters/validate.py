"""The tensors a `HybridConfig` implies, by canonical name, with their shapes,
and the strict check of a model directory's weights against them: every expected
tensor present with the expected shape, every tensor used, optional tensors
(biases, `lm_head`) present exactly when the config says so.

Symbols in the shape formulas: V vocab_size, H hidden_size; attention heads
h, KV heads h_kv, head dim d; Mamba2 heads n, head dim p, groups g, state N,
conv kernel k; Mamba1 d_inner, dt_rank r; gated DeltaNet key heads K of
d_k, value heads V of d_v; MLP width I; experts E.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hybridspec.config import AttentionConfig, GdnConfig, HybridConfig, Mamba1Config, Mamba2Config, MLPConfig, MoEConfig
from hybridspec.errors import ModelFilesError

SHOWN = 4  # tensors listed per kind of mismatch


@dataclass(frozen=True)
class Expected:
    shape: tuple[int, ...]
    formula: str  # where the shape comes from, e.g. "[V, H]"


def _attention(a: AttentionConfig, H: int) -> dict[str, Expected]:
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    out = {"q_proj.weight": Expected((2 * q, H), "[2·h·d, H] (query and output gate)") if a.output_gate
           else Expected((q, H), "[h·d, H]"),
           "k_proj.weight": Expected((kv, H), "[h_kv·d, H]"),
           "v_proj.weight": Expected((kv, H), "[h_kv·d, H]"), "o_proj.weight": Expected((H, q), "[H, h·d]")}
    if a.qk_norm:
        out |= {"q_norm.weight": Expected((a.head_dim,), "[d] (q norm)"),
                "k_norm.weight": Expected((a.head_dim,), "[d] (k norm)")}
    if a.bias:
        out |= {"q_proj.bias": Expected((q,), "[h·d] (bias)"), "k_proj.bias": Expected((kv,), "[h_kv·d] (bias)"),
                "v_proj.bias": Expected((kv,), "[h_kv·d] (bias)")}
    if a.out_bias:
        out["o_proj.bias"] = Expected((H,), "[H] (bias)")
    return out


def _mamba2(m: Mamba2Config, H: int) -> dict[str, Expected]:
    n = m.num_heads
    out = {"in_proj.weight": Expected((m.d_inner + m.conv_dim + n, H), "[2·n·p + 2·g·N + n, H] (z, x, B, C, dt)"),
           "conv1d.weight": Expected((m.conv_dim, 1, m.d_conv), "[n·p + 2·g·N, 1, k]"),
           "dt_bias": Expected((n,), "[n]"), "A_log": Expected((n,), "[n]"), "D": Expected((n,), "[n]"),
           "out_proj.weight": Expected((H, m.d_inner), "[H, n·p]")}
    if m.norm != "gate_only":
        out["norm.weight"] = Expected((m.d_inner,), "[n·p]")
    if m.conv_bias:
        out["conv1d.bias"] = Expected((m.conv_dim,), "[n·p + 2·g·N] (conv bias)")
    if m.proj_bias:
        out |= {"in_proj.bias": Expected((m.d_inner + m.conv_dim + n,), "[2·n·p + 2·g·N + n] (proj bias)"),
                "out_proj.bias": Expected((H,), "[H] (proj bias)")}
    return out


def _mamba1(m: Mamba1Config, H: int) -> dict[str, Expected]:
    d, N, r = m.d_inner, m.d_state, m.dt_rank
    out = {"in_proj.weight": Expected((2 * d, H), "[2·d_inner, H]"),
           "conv1d.weight": Expected((d, 1, m.d_conv), "[d_inner, 1, k]"),
           "x_proj.weight": Expected((r + 2 * N, d), "[r + 2·N, d_inner]"),
           "dt_proj.weight": Expected((d, r), "[d_inner, r]"), "dt_proj.bias": Expected((d,), "[d_inner]"),
           "A_log": Expected((d, N), "[d_inner, N]"), "D": Expected((d,), "[d_inner]"),
           "out_proj.weight": Expected((H, d), "[H, d_inner]")}
    if m.conv_bias:
        out["conv1d.bias"] = Expected((d,), "[d_inner] (conv bias)")
    if m.proj_bias:
        out |= {"in_proj.bias": Expected((2 * d,), "[2·d_inner] (proj bias)"),
                "out_proj.bias": Expected((H,), "[H] (proj bias)")}
    if m.inner_layernorms:
        out |= {"dt_norm.weight": Expected((r,), "[r]"), "b_norm.weight": Expected((N,), "[N]"),
                "c_norm.weight": Expected((N,), "[N]")}
    return out


def _gdn(m: GdnConfig, H: int) -> dict[str, Expected]:
    V = m.num_value_heads
    return {"in_proj.weight": Expected((m.conv_dim + m.value_dim + 2 * V, H),
                                       "[2·K·d_k + 2·V·d_v + 2·V, H] (q, k, v, z, b, a)"),
            "conv1d.weight": Expected((m.conv_dim, 1, m.d_conv), "[2·K·d_k + V·d_v, 1, k]"),
            "dt_bias": Expected((V,), "[V]"), "A_log": Expected((V,), "[V]"),
            "norm.weight": Expected((m.value_head_dim,), "[d_v]"),
            "out_proj.weight": Expected((H, m.value_dim), "[H, V·d_v]")}


def _mlp(m: MLPConfig, H: int) -> dict[str, Expected]:
    I = m.intermediate_size
    out = {"up_proj.weight": Expected((I, H), "[I, H]"), "down_proj.weight": Expected((H, I), "[H, I]")}
    if m.gated:
        out["gate_proj.weight"] = Expected((I, H), "[I, H]")
    if m.bias:
        out |= {"up_proj.bias": Expected((I,), "[I] (bias)"), "down_proj.bias": Expected((H,), "[H] (bias)")}
        if m.gated:
            out["gate_proj.bias"] = Expected((I,), "[I] (bias)")
    return out


def _moe(m: MoEConfig, H: int) -> dict[str, Expected]:
    E, I = m.num_experts, m.intermediate_size
    out = {"router.weight": Expected((E, H), "[E, H]"), "experts.down_proj": Expected((E, H, I), "[E, H, I]")}
    if m.gated:
        out["experts.gate_up_proj"] = Expected((E, 2 * I, H), "[E, 2·I, H]")
    else:
        out["experts.up_proj"] = Expected((E, I, H), "[E, I, H] (ungated experts)")
    if m.router == "sigmoid_group_topk":
        out["router.e_score_correction_bias"] = Expected((E,), "[E] (routing correction bias)")
    if m.shared_intermediate_size:
        shared = _mlp(MLPConfig(m.shared_intermediate_size, m.activation, gated=m.gated), H)
        out |= {f"shared.{name}": e for name, e in shared.items()}
    if m.shared_gate:
        out["shared_gate.weight"] = Expected((1, H), "[1, H] (shared expert gate)")
    return out


def _shared_blocks(config: HybridConfig) -> dict[str, Expected]:
    """Zamba2: each shared block's weights once, each occurrence's linear and adapters (rank r, input 2·H)."""
    shared, H = config.shared_blocks, config.hidden_size
    a, r, I = config.attention, shared.adapter_rank, shared.mlp.intermediate_size
    out = {}
    for b in range(shared.num_blocks):
        prefix = f"shared_blocks.{b}."
        out[prefix + "input_norm.weight"] = Expected((2 * H,), "[2·H] (norm of [h, embeddings])")
        out[prefix + "ffn_norm.weight"] = Expected((H,), "[H]")
        out |= {f"{prefix}attention.{n}": e for n, e in _attention(a, H).items()
                if n not in ("q_proj.weight", "k_proj.weight", "v_proj.weight")}
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        out |= {prefix + "attention.q_proj.weight": Expected((q, 2 * H), "[h·d, 2·H]"),
                prefix + "attention.k_proj.weight": Expected((kv, 2 * H), "[h_kv·d, 2·H]"),
                prefix + "attention.v_proj.weight": Expected((kv, 2 * H), "[h_kv·d, 2·H]")}
        out |= {f"{prefix}ffn.{n}": e for n, e in _mlp(shared.mlp, H).items()}
    for layer in shared.occurrences:
        prefix = f"layers.{layer}.shared."
        out[prefix + "linear.weight"] = Expected((H, H), "[H, H] (per occurrence)")
        out[prefix + "adapters.gate_up.down.weight"] = Expected((r, H), "[r, H] (MLP adapter)")
        out[prefix + "adapters.gate_up.up.weight"] = Expected((2 * I, r), "[2·I, r] (MLP adapter)")
        if shared.attention_adapters:
            widths = {"q": a.num_heads * a.head_dim, "k": a.num_kv_heads * a.head_dim,
                      "v": a.num_kv_heads * a.head_dim}
            for p, width in widths.items():
                out[f"{prefix}adapters.{p}.down.weight"] = Expected((r, 2 * H), f"[r, 2·H] ({p} adapter)")
                out[f"{prefix}adapters.{p}.up.weight"] = Expected((width, r), f"[{p} width, r] ({p} adapter)")
    return out


def expected_tensors(config: HybridConfig) -> dict[str, Expected]:
    """Canonical name -> expected shape of every tensor `config` requires."""
    H, V = config.hidden_size, config.vocab_size
    out = {"embed_tokens.weight": Expected((V, H), "[V, H]"), "final_norm.weight": Expected((H,), "[H]")}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = Expected((V, H), "[V, H] (untied lm_head)")
    mixers = {"attention": lambda: _attention(config.attention, H), "mamba2": lambda: _mamba2(config.mamba2, H),
              "mamba1": lambda: _mamba1(config.mamba1, H), "gdn": lambda: _gdn(config.gdn, H), "none": dict,
              "parallel": lambda: {**{f"attention.{k}": e for k, e in _attention(config.attention, H).items()},
                                   **{f"mamba.{k}": e for k, e in _mamba2(config.mamba2, H).items()}}}
    ffns = {"mlp": lambda: _mlp(config.mlp, H), "moe": lambda: _moe(config.moe, H), "none": dict}
    for i, (mixer, ffn) in enumerate(zip(config.layer_types, config.ffn_types)):
        prefix = f"layers.{i}."
        if mixer != "none":
            out[prefix + "input_norm.weight"] = Expected((H,), "[H]")
        if ffn != "none":
            out[prefix + "ffn_norm.weight"] = Expected((H,), "[H]")
        out |= {f"{prefix}mixer.{name}": e for name, e in mixers[mixer]().items()}
        out |= {f"{prefix}ffn.{name}": e for name, e in ffns[ffn]().items()}
    if config.shared_blocks is not None:
        out |= _shared_blocks(config)
    return out


def optional_tensors(config: HybridConfig) -> dict[str, Expected]:
    """Tensors a model directory may carry or leave out: the rotary frequencies
    (recomputed from the config when absent)."""
    a = config.attention
    if a is None or not a.use_rope:
        return {}
    return {"rotary.inv_freq": Expected((a.rotary_dim // 2,), "[rotary_dim / 2]")}


def check_weights(config: HybridConfig, weights: dict[str, torch.Tensor], unmatched: list[str], source: str,
                  describe: Callable[[str], str]) -> dict[str, torch.Tensor]:
    """`weights` (canonical names) if they are exactly what `config` implies, else
    ModelFilesError naming `source` and the first tensors missing, unused
    (`unmatched`: stored names no naming rule knows) or of the wrong shape.
    A model with tied embeddings may store the embedding again as lm_head.weight; the copy is dropped."""
    weights = dict(weights)
    if config.tie_word_embeddings and _same_tensor(weights.get("lm_head.weight"), weights.get("embed_tokens.weight")):
        del weights["lm_head.weight"]
    required = expected_tensors(config)
    expected = required | optional_tensors(config)
    missing = [name for name in required if name not in weights]
    unused = [describe(name) for name in weights if name not in expected] + list(unmatched)
    wrong = [f"{describe(name)} is {list(t.shape)}, expected {list(expected[name].shape)} = {expected[name].formula}"
             for name, t in weights.items() if name in expected and tuple(t.shape) != expected[name].shape]
    if missing or unused or wrong:
        raise ModelFilesError(_mismatch_message(config, source, missing, unused, wrong, weights))
    return weights


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.shape == b.shape and bool(torch.equal(a, b))


def _listed(kind: str, items: list[str]) -> str:
    more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return f"{len(items)} {kind}: " + ", ".join(items[:SHOWN]) + more


def _mismatch_message(config: HybridConfig, source: str, missing: list[str], unused: list[str], wrong: list[str],
                      weights: dict[str, torch.Tensor]) -> str:
    parts = [_listed(kind, items) for kind, items in (("missing", missing), ("unused", unused),
                                                     ("of the wrong shape", wrong)) if items]
    hints = []
    if missing:
        hints.append("that no shard or tensor is missing")
    if wrong:
        hints.append(f"that the config fields that set shapes (vocab_size={config.vocab_size}, "
                     f"hidden_size={config.hidden_size}, head counts, state sizes, expand) match the weights")
    if "lm_head.weight" in missing:
        hints.append("tie_word_embeddings: the config unties the embeddings but there is no lm_head.weight")
    if config.tie_word_embeddings and "lm_head.weight" in weights:
        hints.append("tie_word_embeddings: the config ties the embeddings but lm_head.weight differs from them")
    if unused and not hints:
        hints.append("that the layer pattern, the layer count and the *_bias flags in the config match the weights")
    return (f"{source}: the weights do not match the config ({config.family}, {config.num_layers} layers): "
            + "; ".join(parts) + ". Check " + "; ".join(hints) + ".")
