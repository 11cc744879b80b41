"""Reading a GGUF file strictly: its metadata, each tensor's type and shape checked against the config
the metadata implies before any tensor is read, then the canonical weights, Q8_0 / Q4_0 / Q4_K / Q6_K
product weights and token embedding kept as their blocks (`QuantWeight.from_blocks`) and the rest as
float32."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import torch

from hybridspec.config import HybridConfig
from hybridspec.errors import ModelFilesError
from hybridspec.kernels.quant import formats
from hybridspec.kernels.quant.weight import QuantWeight
from hybridspec.adapters.gguf import gdn, names
from hybridspec.adapters.gguf.archs import Arch, Tensors, arch_named
from hybridspec.adapters.validate import expected_tensors

SHOWN = 4


def open_file(path: Path):
    """The gguf package's reader of `path` (its tensors memory-mapped, nothing read yet)."""
    from gguf import GGUFReader
    if not path.is_file():
        raise ModelFilesError(f"{path} not found; hs.load takes a GGUF file or a model directory")
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as error:
        raise ModelFilesError(f"{path} is not a readable GGUF file ({type(error).__name__}: {error}); it is "
                              "truncated or corrupt: download or convert it again") from None


def metadata(reader) -> dict:
    """The file's key -> value (strings, numbers, lists)."""
    out = {}
    for name, field in reader.fields.items():
        if not name.startswith("GGUF."):
            value = field.contents()
            out[name] = value.tolist() if isinstance(value, np.ndarray) else value
    return out


def shapes(reader) -> dict[str, tuple[tuple[int, ...], object]]:
    """GGUF tensor name -> (torch-order shape, GGMLQuantizationType)."""
    return {t.name: (tuple(int(n) for n in reversed(t.shape.tolist())), t.tensor_type) for t in reader.tensors}


def config_of(reader, meta: dict, source: str) -> tuple[Arch, HybridConfig]:
    """The architecture and the HybridConfig the metadata says (ModelFilesError naming a missing key)."""
    from hybridspec.adapters import _adapter_module, _config
    arch = arch_named(str(meta.get("general.architecture", "<missing>")))
    stored = shapes(reader)
    cfg = arch.config_dict(meta, arch.name, Tensors(set(stored)))
    if cfg["vocab_size"] is None:  # llama.cpp's converters write no vocab_size key: the embedding's rows
        embedding = stored.get("token_embd.weight")
        cfg["vocab_size"] = embedding[0][0] if embedding else len(meta.get("tokenizer.ggml.tokens", []))
    config = _config(_adapter_module(arch.adapter).config_from_dict, cfg, f"{source} metadata")
    if config.zero_centred_norms:  # llama.cpp's converters store such a norm as 1 + w (`names`)
        config = dataclasses.replace(config, zero_centred_norms=False)
    if "partial_rotary_factor" in cfg and config.attention is not None:  # Granite's adapter reads no such field
        config = dataclasses.replace(config, attention=dataclasses.replace(
            config.attention, partial_rotary_factor=cfg["partial_rotary_factor"]))
    return arch, config


def check_tensors(reader, arch: Arch, config: HybridConfig, source: str) -> dict[str, tuple[str, ...]]:
    """Canonical name -> its GGUF tensor(s), after checking every tensor's presence, type and shape and
    that every tensor is used: a ModelFilesError naming each problem."""
    stored = shapes(reader)
    plan, missing, wrong, bad_type = {}, [], [], []
    for name, expected in expected_tensors(config).items():
        parts = names.gguf_names(name, arch, config)
        if not parts:
            missing.append(f"{name} (no llama.cpp name for it in {arch.name})")
            continue
        for part, shape in zip(parts, names.stored_shapes(name, expected.shape, config, arch)):
            if part not in stored:
                missing.append(part)
            elif _without_leading_ones(stored[part][0]) != _without_leading_ones(shape):
                wrong.append(f"{part} is {list(stored[part][0])}, expected {list(shape)} ({name} {expected.formula})")
            elif not readable(stored[part][1]):
                bad_type.append(f"{part} ({stored[part][1].name})")
        plan[name] = parts
    used = {part for parts in plan.values() for part in parts}
    unused = sorted(name for name in set(stored) - used if not _spare_block(name, config))
    problems = [f"{kind} {len(items)}: " + ", ".join(items[:SHOWN]) + (" ..." if len(items) > SHOWN else "")
                for kind, items in (("missing", missing), ("wrong shape", wrong),
                                    ("unsupported type", bad_type), ("not used by the model", unused)) if items]
    if problems:
        raise ModelFilesError(f"{source}: the tensors do not match the metadata ({arch.name}, {config.num_layers} "
                              f"layers): " + "; ".join(problems) + ". Convert the model again with llama.cpp's "
                              "convert_hf_to_gguf.py or `hybridspec quantize`; types read: F32, F16, BF16, "
                              "Q8_0/Q4_0/Q4_K/Q6_K kept quantized, other types the gguf package dequantizes")
    return plan


def _without_leading_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A torch-order shape without its leading 1s: llama.cpp writes a tensor with ggml_n_dims dimensions,
    so its quantizer stores a [1, n] tensor (a one-group Mamba-2 norm, ggml's ne = [n, 1]) as [n]."""
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return tuple(shape)


def _spare_block(name: str, config: HybridConfig) -> bool:
    """A tensor of a block past the model's layers: the multi-token-prediction blocks a converter
    appends (block_count counts them, the config does not), set aside as `mtp.*` weights are."""
    match = re.match(r"^blk\.(\d+)\.", name)
    return match is not None and int(match.group(1)) >= config.num_layers


def readable(qtype) -> bool:
    from gguf import GGMLQuantizationType as T
    from gguf.quants import _type_traits
    return qtype in (T.F32, T.F16, T.BF16) or qtype in _type_traits


def read_tensors(reader, plan: dict[str, tuple[str, ...]], config: HybridConfig,
                 arch: Arch) -> tuple[dict[str, torch.Tensor], dict[str, QuantWeight]]:
    """(canonical weights, the quantized ones): a product weight or the token embedding stored in a
    block format hybridspec multiplies is a QuantWeight (a float placeholder of its shape stands in `weights` until the
    model holds it); every other tensor float32."""
    by_name = {t.name: t for t in reader.tensors}
    expected = expected_tensors(config)
    weights, quantized = {}, {}
    for name, parts in plan.items():
        blocks = _blocks(name, [by_name[part] for part in parts], config, arch)
        if blocks is not None:
            out_features, in_features = expected[name].shape
            quantized[name] = QuantWeight.from_blocks(blocks[1], blocks[0], out_features, in_features)
            weights[name] = torch.zeros(1).expand(out_features, in_features)
        else:
            stored = [as_float(by_name[part]) for part in parts]
            weights[name] = names.from_stored(name, stored, expected[name].shape, config, arch)
    return weights, quantized


def _blocks(name: str, tensors: list, config: HybridConfig, arch: Arch):
    """(format, canonical uint8 blocks [rows, bytes]) of a product weight or the token embedding stored
    in one block format hybridspec multiplies, as one tensor or as row parts (`names.block_rows`); else
    None (read as float)."""
    fmts = {formats.BY_GGML_TYPE.get(int(t.tensor_type)) for t in tensors}
    fmt = fmts.pop() if len(fmts) == 1 else None
    if fmt is None or not names.kept_quantized(name):
        return None
    rows = names.block_rows(name, config, arch)
    if rows is None and (len(tensors) != 1 or names.columns_moved(name, config, arch)):
        return None
    blocks = [torch.from_numpy(np.array(t.data, copy=True)).view(torch.uint8) for t in tensors]
    if rows is None:
        return fmt, blocks[0]
    return fmt, torch.cat([b.reshape(b.shape[0], -1) for b in blocks])[gdn.inverse(rows)].contiguous()


def as_float(tensor) -> torch.Tensor:
    """A GGUF tensor's values, float32, in torch order."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    if tensor.tensor_type == T.F32:
        values = np.array(tensor.data, dtype=np.float32)
    elif tensor.tensor_type == T.F16:
        values = np.array(tensor.data, dtype=np.float16).astype(np.float32)
    elif tensor.tensor_type == T.BF16:
        raw = np.array(tensor.data).view(np.uint16).astype(np.uint32) << 16
        values = raw.view(np.float32)
    else:
        values = dequantize(np.array(tensor.data), tensor.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(values).reshape(shape))
