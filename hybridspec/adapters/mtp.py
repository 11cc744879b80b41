"""Reading a checkpoint's multi-token-prediction weights (`mtp.*`) for an
`MTPLayer` (`models/mtp.py`), strictly, as every model is read.

Stored names (Qwen3-Next, Qwen3.5): `mtp.fc.weight`,
`mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`,
`mtp.norm.weight` and `mtp.layers.0.*`, a decoder layer stored as the target
family stores its layers (`model.layers.N.*`), so the family's own renaming
rules map it. They lie in the target's own weight files, or, for a layer
trained beside a checkpoint that has none (the embedded target's:
`assets/embedded/mtp`), in a directory of their own holding a
`model.safetensors` of those names (`draft="mtp:DIR"`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from hybridspec.adapters import MODEL_TYPES, _adapter, _to_canonical
from hybridspec.adapters.embedded import EMBEDDED_DIR
from hybridspec.adapters.model_files import describe_files, read_config, read_weights
from hybridspec.adapters.validate import check_weights
from hybridspec.errors import ConfigError, ModelFilesError
from hybridspec.kernels.quant.weight import QuantWeight
from hybridspec.models.hybrid import HybridModel
from hybridspec.models.mtp import MTPLayer, mtp_config

OWN = ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")


def load_mtp(target: HybridModel, directory: str | Path | None = None) -> MTPLayer:
    """The MTP layer of `target`: from `directory` (its `mtp.*` tensors), else from
    the directory `target` was loaded from (`hs.load`). A ConfigError names what
    is missing where no MTP weights are found; a ModelFilesError where they do
    not fit the target."""
    source = directory if directory is not None else _beside(target.source_dir)
    if source is None:
        raise ConfigError("draft='mtp' reads the MTP weights (mtp.*) of the target's checkpoint, but this target "
                          "was not loaded from a directory; load it with hs.load(DIR), or pass draft='mtp:DIR' "
                          "with a directory holding mtp.* weights")
    if target.tensor_parallel is not None:
        raise ConfigError("draft='mtp' does not run under tensor parallelism yet; use tensor_parallel_size=1, or "
                          "another drafter (a draft model, 'ngram', 'suffix')")
    source = Path(source)
    state, file_of = read_weights(source, "cpu")
    stored = {name: t for name, t in state.items() if name.startswith("mtp.")}
    if not stored:
        raise ConfigError(f"draft='mtp' needs multi-token-prediction weights (mtp.fc.weight, mtp.layers.0.*, ...) "
                          f"but {describe_files(source, sorted(set(file_of.values())))} holds none; use a "
                          "checkpoint that ships them (Qwen3-Next, Qwen3.5), draft='mtp:DIR' with a trained MTP "
                          "layer, or another drafter")
    weights = _canonical(target, stored, read_config(target.source_dir or source))
    config = mtp_config(target.config)
    # checked as a one-layer model: the shared embedding stands in; the MTP's own tensors beside it
    embed = target.embed  # a quantized table checked by the shape of its values
    if isinstance(embed, QuantWeight):
        embed = torch.empty(embed.out_features, embed.in_features, device="meta")
    model_like = {"embed_tokens.weight": embed, "final_norm.weight": weights["norm.weight"],
                  **{k: v for k, v in weights.items() if k.startswith("layers.")}}
    if not config.tie_word_embeddings:
        model_like["lm_head.weight"] = torch.empty(config.vocab_size, config.hidden_size, device="meta")
    where = describe_files(source, sorted({file_of[n] for n in stored}))
    check_weights(config, model_like, [], where, lambda name: name)
    expected = {"fc.weight": (config.hidden_size, 2 * config.hidden_size)}
    for name in OWN:
        if name not in weights:
            raise ModelFilesError(f"{where} lacks mtp.{name}, which an MTP layer needs; restore it from the "
                                  "checkpoint's original files")
        shape = expected.get(name, (config.hidden_size,))
        if tuple(weights[name].shape) != shape:
            raise ModelFilesError(f"{where}: mtp.{name} is {list(weights[name].shape)}, expected {list(shape)} "
                                  f"for a target of hidden size {config.hidden_size}")
    layer = MTPLayer(target, {k: v.to(target.dtype) for k, v in weights.items()})
    return layer.to(target.device)


def _beside(source_dir: Path | None) -> Path | None:
    """Where a target's MTP weights lie: its own directory; for the embedded target, the layer
    trained beside it (`assets/embedded/mtp`, tools/train_mtp.py)."""
    if source_dir is not None and Path(source_dir).resolve() == (EMBEDDED_DIR / "target").resolve():
        return EMBEDDED_DIR / "mtp"
    return source_dir


def _canonical(target: HybridModel, stored: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """The MTP tensors in canonical names: its own (fc, the norms) as they are,
    `mtp.layers.0.*` through the target family's renaming as `layers.0.*`."""
    own = {name[len("mtp."):]: t for name, t in stored.items() if not name.startswith("mtp.layers.")}
    layer = {"model.layers." + name[len("mtp.layers."):]: t for name, t in stored.items()
             if name.startswith("mtp.layers.")}
    unknown = sorted(n for n in layer if not n.startswith("model.layers.0."))
    if unknown:
        raise ModelFilesError(f"MTP layers past the first ({unknown[0]}) are not supported; hybridspec runs one "
                              "MTP layer, applied recursively")
    model_type = str(cfg.get("model_type", "<missing>"))
    architectures = cfg.get("architectures") or [MODEL_TYPES.get(model_type, model_type)]
    adapter = _adapter(str(architectures[0] if isinstance(architectures, list) else architectures))
    return {**own, **_to_canonical(adapter, cfg)(layer)}
