"""`hs.load("model.gguf")`: a HybridModel from a GGUF file (`reader` checks and reads it), its
quantized product weights installed as they are stored."""
from __future__ import annotations

from pathlib import Path

import torch

from hybridspec.errors import ConfigError
from hybridspec.kernels import backend as backends
from hybridspec.kernels.quant import formats
from hybridspec.kernels.quant.weight import QuantWeight
from hybridspec.models import quantizing
from hybridspec.models.hybrid import HybridModel
from hybridspec.adapters.common import LoadReport
from hybridspec.adapters.gguf import reader as gguf_reader


def load_gguf(path: str | Path, dtype: torch.dtype | None = None, device="cpu", pack: bool | None = None,
              tensor_parallel_size: int = 1, compute: torch.dtype = torch.float32,
              quantize: str | None = None) -> HybridModel:
    """The model in the GGUF file `path` (see `adapters.load`): float tensors as float32 (or `dtype`),
    Q8_0 / Q4_0 / Q4_K / Q6_K product weights and token embedding as QuantWeights (which need a float32
    CPU model, one process); quantize= quantizes the product weights still float."""
    from hybridspec.adapters import _build, _cast, _finish
    path = Path(path)
    source = str(path)
    opened = gguf_reader.open_file(path)
    meta = gguf_reader.metadata(opened)
    arch, config = gguf_reader.config_of(opened, meta, source)
    plan = gguf_reader.check_tensors(opened, arch, config, source)
    stored_quantized = any(int(t.tensor_type) in formats.BY_GGML_TYPE for t in opened.tensors)
    if stored_quantized or quantize is not None:
        quantizing.check(quantize or "q8_0", device, dtype, tensor_parallel_size != 1, compute)
    elif tensor_parallel_size != 1:
        raise ConfigError("a GGUF file loads into one process; use tensor_parallel_size=1")
    dtype = dtype or torch.float32
    weights, quantized = gguf_reader.read_tensors(opened, plan, config, arch)
    if pack is None:
        pack = backends.packs_for_cpu(device)
    weights = {k: (v.to(device) if k not in quantized else v) for k, v in weights.items()}
    model = _build(config, weights, 1, LoadReport(source), lambda w: _cast(w, dtype, pack))
    install(model, weights, quantized)
    del weights, quantized  # the model holds what it uses: packing releases each block copy as it moves it
    return _finish(model, path, quantize, pack, compute)


def install(model: HybridModel, placeholders: dict[str, torch.Tensor], quantized: dict[str, QuantWeight]) -> None:
    """Put each QuantWeight where the model holds its placeholder (found by storage: the model's
    parameters share the storage of the tensors it was built from)."""
    if not quantized:
        return
    by_storage = {placeholders[name].untyped_storage().data_ptr(): weight for name, weight in quantized.items()}
    for module in list(model.modules()):
        for name, weight in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            found = by_storage.get(weight.untyped_storage().data_ptr())
            if found is not None:
                setattr(module, name, found)
    model.bind_backend(model.backend_name)
