"""Reading an EAGLE-3 head directory for an `Eagle3Head` (`models/eagle3.py`),
strictly, as every model is read.

The format published heads use (EAGLE, SpecForge; vLLM's Eagle3 Llama reads
it): `config.json` of a one-layer Llama (`LlamaForCausalLMEagle3`):
hidden_size, num_attention_heads, num_key_value_heads, head_dim,
intermediate_size, rms_norm_eps, rope_theta, vocab_size (the target's),
draft_vocab_size, num_hidden_layers = 1, optionally target_hidden_size,
norm_before_residual and the capture layers
(`eagle_config.eagle_aux_hidden_state_layer_ids`, or at the top level); and
`model.safetensors` holding fc.weight [hidden, 3·target_hidden],
midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight,
midlayer.self_attn.{q,k,v,o}_proj.weight (q, k, v read 2·hidden),
midlayer.mlp.{gate,up,down}_proj.weight, norm.weight, lm_head.weight
[draft_vocab, hidden], d2t [draft_vocab] (target id = draft id + d2t[draft
id]), t2d [vocab] (bool: in the draft vocabulary), and embed_tokens.weight
where the head does not share the target's. `layers.0.` stands for
`midlayer.`, and a leading `model.` is dropped.
"""
from __future__ import annotations

from pathlib import Path

import torch

from hybridspec.adapters.embedded import EMBEDDED_DIR
from hybridspec.adapters.model_files import describe_files, read_config, read_weights
from hybridspec.config import AttentionConfig, HybridConfig, MLPConfig
from hybridspec.errors import ConfigError, ModelFilesError
from hybridspec.models.eagle3 import Eagle3Head, default_points
from hybridspec.models.hybrid import HybridModel

LAYER = {"input_layernorm.weight": "input_norm.weight", "hidden_norm.weight": "hidden_norm.weight",
         "post_attention_layernorm.weight": "post_norm.weight",
         **{f"self_attn.{p}_proj.weight": f"attention.{p}_proj.weight" for p in "qkvo"},
         **{f"mlp.{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}}


def load_eagle3(target: HybridModel, directory: str | Path | None = None) -> Eagle3Head:
    """The EAGLE-3 head in `directory`, over `target`; None: the head shipped
    beside the embedded target (for that target only). A ConfigError names what
    does not fit the target (hidden size, vocabulary, capture layers); a
    ModelFilesError a tensor missing, unexpected or of the wrong shape."""
    if target.tensor_parallel is not None:
        raise ConfigError("draft='eagle3:DIR' does not run under tensor parallelism yet; use "
                          "tensor_parallel_size=1, or another drafter (a draft model, 'ngram', 'suffix')")
    source = Path(directory) if directory is not None else _shipped_head(target)
    cfg = read_config(source)
    config, points, norm_before_residual = head_config(cfg, target, source)
    state, file_of = read_weights(source, "cpu")
    where = describe_files(source, sorted(set(file_of.values())))
    weights = _canonical(state, where)
    _check_shapes(weights, config, where)
    weights["d2t"] = _checked_d2t(weights, config.vocab_size, where)
    weights.pop("t2d", None)
    head = Eagle3Head(target, config, {k: v if k == "d2t" else v.to(target.dtype) for k, v in weights.items()},
                      points, norm_before_residual)
    return head.to(target.device)


def _shipped_head(target: HybridModel) -> Path:
    """The head trained for the embedded target (`tools/train_eagle3.py`)."""
    embedded = EMBEDDED_DIR / "target"
    if target.source_dir is None or Path(target.source_dir).resolve() != embedded.resolve():
        raise ConfigError("draft='eagle3' names the head shipped for the embedded target, and this target is "
                          "another model; pass draft='eagle3:DIR', DIR an EAGLE-3 head trained for it")
    return EMBEDDED_DIR / "eagle3"


def head_config(cfg: dict, target: HybridModel, source: Path) -> tuple[HybridConfig, tuple[int, ...], bool]:
    """(the head's layer as a one-attention-layer HybridConfig, its three capture
    points, norm_before_residual) from `config.json`, refused where it does not fit `target`."""
    where = source / "config.json"
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in cfg]
    if missing:
        raise ConfigError(f"{where} lacks {', '.join(missing)}, which an EAGLE-3 head's config carries; restore "
                          "the head's original config.json")
    hidden, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise ConfigError(f"{where}: num_hidden_layers={cfg['num_hidden_layers']}; hybridspec runs EAGLE-3 heads "
                          "of one decoder layer")
    if vocab != target.vocab_size:
        raise ConfigError(f"{where}: vocab_size={vocab} but the target's vocabulary has {target.vocab_size} "
                          "tokens; an EAGLE-3 head must be trained for this target's tokenizer")
    draft_vocab = int(cfg.get("draft_vocab_size") or vocab)
    if not 0 < draft_vocab <= vocab:
        raise ConfigError(f"{where}: draft_vocab_size={draft_vocab} must lie in 1..vocab_size={vocab}")
    target_hidden = int(cfg.get("target_hidden_size") or hidden)
    if target_hidden != target.config.hidden_size:
        raise ConfigError(f"{where}: the head reads hidden states of size {target_hidden} (target_hidden_size, "
                          f"else hidden_size) but the target's hidden size is {target.config.hidden_size}; use a "
                          "head trained for this target")
    if cfg.get("rope_scaling") not in (None, {}) and (cfg["rope_scaling"] or {}).get("rope_type", "default") != \
            "default":
        raise ConfigError(f"{where}: rope_scaling={cfg['rope_scaling']} is not supported for EAGLE-3 heads; "
                          "hybridspec applies plain rotary embeddings (rope_theta)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ConfigError(f"{where}: attention_bias / mlp_bias are not supported for EAGLE-3 heads")
    heads = int(cfg["num_attention_heads"])
    rope = cfg.get("rope_parameters") or {}
    attention = AttentionConfig(num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                                head_dim=int(cfg.get("head_dim") or hidden // heads),
                                rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)))
    config = HybridConfig(vocab_size=vocab, hidden_size=hidden, layer_types=("attention",), ffn_types=("mlp",),
                          rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), attention=attention,
                          mlp=MLPConfig(int(cfg["intermediate_size"]), cfg.get("hidden_act", "silu")),
                          max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)), family="eagle3",
                          extra={"draft_vocab_size": draft_vocab,
                                 "target_hidden_size": target_hidden})
    return config, _points(cfg, target.config.num_layers, where), bool(cfg.get("norm_before_residual", False))


def _points(cfg: dict, num_layers: int, where: Path) -> tuple[int, ...]:
    """The capture layers from the config, else EAGLE-3's default (`default_points`)."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return default_points(num_layers)
    if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i <= num_layers for i in ids):
        raise ConfigError(f"{where}: eagle_aux_hidden_state_layer_ids={ids}; expected three layer indices in "
                          f"[0, {num_layers}] of the target's {num_layers} layers")
    return tuple(ids)


def _canonical(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Stored names -> canonical ones (`Eagle3Head`); an unknown name is refused."""
    out = {}
    for name, t in state.items():
        short = name[len("model."):] if name.startswith("model.") else name
        for prefix in ("midlayer.", "layers.0."):
            if short.startswith(prefix) and short[len(prefix):] in LAYER:
                short = LAYER[short[len(prefix):]]
                break
        else:
            if short not in ("fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t", "t2d"):
                raise ModelFilesError(f"{where} holds {name}, which an EAGLE-3 head of one layer does not have; "
                                      "hybridspec reads the published EAGLE-3 format (fc, midlayer.*, norm, "
                                      "lm_head, d2t, t2d)")
        out[short] = t
    return out


def _expected(config: HybridConfig) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Canonical name -> (shape, required)."""
    H, V, att = config.hidden_size, config.vocab_size, config.attention
    Vd, I = config.extra["draft_vocab_size"], config.mlp.intermediate_size
    q, kv = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
    shapes = {"fc.weight": (H, 3 * config.extra["target_hidden_size"]), "norm.weight": (H,),
              "lm_head.weight": (Vd, H), "input_norm.weight": (H,), "hidden_norm.weight": (H,),
              "post_norm.weight": (H,), "attention.q_proj.weight": (q, 2 * H), "attention.k_proj.weight": (kv, 2 * H),
              "attention.v_proj.weight": (kv, 2 * H), "attention.o_proj.weight": (H, q),
              "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
    optional = {"d2t": (Vd,), "t2d": (V,), "embed_tokens.weight": (V, H)}
    return {**{k: (v, True) for k, v in shapes.items()},
            **{k: (v, k == "d2t" and Vd < V) for k, v in optional.items()}}  # a full vocabulary needs no map


def _check_shapes(weights: dict[str, torch.Tensor], config: HybridConfig, where: str) -> None:
    for name, (shape, required) in _expected(config).items():
        if name not in weights:
            if required:
                raise ModelFilesError(f"{where} lacks {name}, which an EAGLE-3 head needs; restore it from the "
                                      "head's original files")
        elif tuple(weights[name].shape) != shape:
            raise ModelFilesError(f"{where}: {name} is {list(weights[name].shape)}, expected {list(shape)} from "
                                  "the head's config.json and the target")
    target_hidden = config.extra["target_hidden_size"]
    if "embed_tokens.weight" not in weights and config.hidden_size != target_hidden:
        raise ConfigError(f"{where}: the head's hidden size {config.hidden_size} differs from the target's "
                          f"{target_hidden} and it ships no embed_tokens.weight, so the target's embedding cannot "
                          "feed it")


def _checked_d2t(weights: dict[str, torch.Tensor], vocab: int, where: str) -> torch.Tensor:
    """d2t as offsets [Vd], checked: each target id in the vocabulary once, t2d agreeing."""
    Vd = weights["lm_head.weight"].shape[0]
    d2t = weights.get("d2t", torch.zeros(Vd, dtype=torch.long))
    if d2t.is_floating_point():
        raise ModelFilesError(f"{where}: d2t is {d2t.dtype}; it holds integer offsets (target id = draft id + d2t)")
    ids = torch.arange(Vd) + d2t.to(torch.long)
    if bool((ids < 0).any() or (ids >= vocab).any()) or len(set(ids.tolist())) != Vd:
        raise ModelFilesError(f"{where}: d2t maps the draft vocabulary outside the target's {vocab} tokens or "
                              "onto one token twice; it must hold target id - draft id for each draft id")
    if "t2d" in weights:
        t2d = weights["t2d"]
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[ids] = True
        if tuple(t2d.shape) != (vocab,) or not torch.equal(t2d.to(torch.bool), mask):
            raise ModelFilesError(f"{where}: t2d {list(t2d.shape)} does not mark exactly the target ids d2t maps "
                                  f"to (a bool [{vocab}] mask)")
    return d2t.to(torch.long)
