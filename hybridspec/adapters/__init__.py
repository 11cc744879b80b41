"""Adapters: build a `HybridModel` from an HF transformers model object
(`from_hf`, sharing its parameters) or from a local checkpoint directory
(`load`: config.json + safetensors in HF layout or in mamba_ssm's
`MambaLMHeadModel` layout)."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

from ..errors import UnsupportedModelError
from ..models.hybrid import HybridModel

# HF architecture name -> adapter module (config_from_dict, weights_from_state)
HF_ADAPTERS = {
    "BambaForCausalLM": "bamba",
    "JambaForCausalLM": "jamba",
    "NemotronHForCausalLM": "nemotron_h",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
}
MODEL_TYPES = {"bamba": "BambaForCausalLM", "jamba": "JambaForCausalLM", "nemotron_h": "NemotronHForCausalLM",
               "granitemoehybrid": "GraniteMoeHybridForCausalLM"}
SUPPORTED = sorted(HF_ADAPTERS) + ["mamba_ssm MambaLMHeadModel (hybrid Mamba2 + MHA)"]


def _adapter(architecture: str):
    if architecture not in HF_ADAPTERS:
        raise UnsupportedModelError(f"architecture {architecture!r} is not supported; supported: "
                                    + ", ".join(SUPPORTED))
    return importlib.import_module(f"{__name__}.{HF_ADAPTERS[architecture]}")


def from_hf(model) -> HybridModel:
    """A HybridModel that shares `model`'s parameters (no copy)."""
    architecture = type(model).__name__
    adapter = _adapter(architecture)
    config = adapter.config_from_dict(model.config.to_dict())
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    return HybridModel(config, adapter.weights_from_state(state))


def load(path: str | Path, dtype: torch.dtype | None = None, device="cpu") -> HybridModel:
    """Load a checkpoint directory: config.json + *.safetensors (or
    pytorch_model.bin), in HF layout or mamba_ssm's layout."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: hs.load expects a checkpoint directory with "
                                "config.json and safetensors weights")
    cfg = json.loads(config_file.read_text(), object_hook=_special_floats)
    state = _read_weights(path, device)
    if "d_model" in cfg and "n_layer" in cfg:
        from . import mamba_ssm
        config, weights = mamba_ssm.config_from_dict(cfg), mamba_ssm.weights_from_state(state, cfg)
    else:
        model_type = cfg.get("model_type", "<missing>")
        architectures = cfg.get("architectures") or [MODEL_TYPES.get(model_type, model_type)]
        adapter = _adapter(architectures[0])
        config, weights = adapter.config_from_dict(cfg), adapter.weights_from_state(state)
    if dtype is not None:
        weights = {k: (v.to(dtype) if v.is_floating_point() and not k.endswith("inv_freq") else v)
                   for k, v in weights.items()}
    return HybridModel(config, weights)


def _special_floats(obj: dict):
    """transformers writes inf/nan in config.json as {"__float__": "Infinity"}."""
    return float(obj["__float__"]) if set(obj) == {"__float__"} else obj


def _read_weights(path: Path, device) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        state = {}
        for f in files:
            state.update(load_file(str(f), device=str(device)))
        return state
    bin_file = path / "pytorch_model.bin"
    if bin_file.is_file():
        return torch.load(bin_file, map_location=device, weights_only=True)
    raise FileNotFoundError(f"no *.safetensors or pytorch_model.bin in {path}")
