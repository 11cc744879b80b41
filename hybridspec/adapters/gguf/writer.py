"""`write_gguf`: a model directory as a GGUF file in llama.cpp's layout for its architecture (the
inverse of `reader`), its product weights quantized into a block format or kept float32.

Quantized, it holds what `hs.load(directory, quantize=fmt)` multiplies, bit for bit (except for Falcon-H1,
whose multipliers llama.cpp's layout folds into the weights before they are quantized): the decoder
layers' linear weights and the token embedding in `fmt` (Q8_0 where the input size is not whole
blocks of it, float where not whole blocks of 32 either), the LM head in Q8_0 (written as
output.weight where the embedding is tied too, the embedding then that same Q8_0 table), everything
else float32. The tokenizer
goes in too where the directory holds a byte-level BPE tokenizer.json (`vocab`)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hybridspec.errors import ModelFilesError
from hybridspec.kernels.quant import formats
from hybridspec.kernels.quant.weight import QuantWeight
from hybridspec.models import quantizing
from hybridspec.adapters.gguf import names
from hybridspec.adapters.gguf.archs import arch_of


def canonical_weights(directory: Path):
    """(HybridConfig, canonical float weights) of a model directory, checked as `hs.load` checks it."""
    from hybridspec.adapters import MODEL_TYPES, _adapter, _adapter_module, _checked, _config, _to_canonical
    from hybridspec.adapters.model_files import describe_files, read_config, read_weights
    from hybridspec.adapters.common import MTP_UNUSED, set_aside
    cfg = read_config(directory)
    if "d_model" in cfg and "n_layer" in cfg:  # mamba_ssm's layout
        adapter = _adapter_module("mamba_ssm")
        to_canonical = lambda state: adapter.weights_from_state(state, cfg)  # noqa: E731
    else:
        model_type = str(cfg.get("model_type", "<missing>"))
        architectures = cfg.get("architectures") or [MODEL_TYPES.get(model_type, model_type)]
        adapter = _adapter(str(architectures[0] if isinstance(architectures, list) else architectures))
        to_canonical = _to_canonical(adapter, cfg)
    config = _config(adapter.config_from_dict, cfg, str(directory / "config.json"))
    state, file_of = read_weights(directory, "cpu")
    source = describe_files(directory, sorted(set(file_of.values())))
    state, _ = set_aside(state, getattr(adapter, "UNUSED", []) + MTP_UNUSED, source)
    return config, _checked(config, to_canonical, state, adapter.RULES, source, file_of)


def stored_tensors(config, weights: dict[str, torch.Tensor], fmt: str | None) -> dict[str, np.ndarray | tuple]:
    """GGUF name -> float32 array, or (uint8 blocks, GGML type) for a quantized one."""
    arch = arch_of(config)
    block_format = formats.format_named(fmt) if fmt is not None else None
    if block_format is not None and config.tie_word_embeddings:
        weights = {**weights, "lm_head.weight": weights["embed_tokens.weight"]}
    out = {}
    for name, tensor in weights.items():
        targets = names.gguf_names(name, arch, config)
        if not targets:
            raise ModelFilesError(f"{name} has no name in llama.cpp's {arch.name} layout; this model cannot be "
                                  "written as GGUF")
        chosen = None
        embedding = name == "embed_tokens.weight"
        if block_format is not None and (names.quantizable(name) or embedding) and tensor.dim() == 2:
            head = name == "lm_head.weight" or (embedding and config.tie_word_embeddings)
            chosen = quantizing.weight_format(tensor, quantizing.HEAD_FORMAT if head else block_format)
        for target, part in zip(targets, names.to_stored(name, tensor.detach(), config, arch)):
            if chosen is not None:  # quantized by rows: a tensor split by rows keeps the whole one's blocks
                blocks = QuantWeight.quantize(part.float().contiguous(), chosen).detach()
                out[target] = (blocks.numpy(), chosen.ggml_type)
            else:
                out[target] = part.float().contiguous().numpy()
    return out


def write_gguf(directory: str | Path, out: str | Path, fmt: str | None = None) -> Path:
    """Write the model directory `directory` as the GGUF file `out` (see the module); fmt None:
    every tensor float32."""
    from hybridspec.adapters.gguf.vocab import vocab_metadata
    directory, out = Path(directory), Path(out)
    if fmt is not None:
        formats.format_named(fmt)
    config, weights = canonical_weights(directory)
    arch = arch_of(config)
    metadata = {f"{arch.name}.{key}": value for key, value in arch.metadata(config).items()}
    metadata |= vocab_metadata(directory, config) | {"general.name": directory.name,
                                                     "general.file_type": _file_type(fmt)}
    write_file(out, arch.name, metadata, stored_tensors(config, weights, fmt))
    return out


def write_file(out: Path, architecture: str, metadata: dict, tensors: dict[str, np.ndarray | tuple]) -> None:
    """A GGUF file of `metadata` (full key -> value) and `tensors` (as `stored_tensors` gives them)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    writer = GGUFWriter(str(out), architecture)
    for key, value in metadata.items():
        _add(writer, key, value)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            writer.add_tensor(name, value[0], raw_dtype=GGMLQuantizationType(value[1]))
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _file_type(fmt: str | None) -> int:
    from gguf import LlamaFileType
    return int({None: LlamaFileType.ALL_F32, "q8_0": LlamaFileType.MOSTLY_Q8_0,
                "q4_0": LlamaFileType.MOSTLY_Q4_0, "q4_k": LlamaFileType.MOSTLY_Q4_K_M}[fmt])


def _add(writer, key: str, value) -> None:
    """One metadata key in the GGUF type llama.cpp reads it as (ints uint32, floats float32, per-layer
    arrays int32)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))
