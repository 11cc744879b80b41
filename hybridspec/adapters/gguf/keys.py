"""Reading GGUF metadata keys (named without the "<arch>." prefix) and which optional tensors a file
holds, for `archs` and the per-family metadata modules."""
from __future__ import annotations

from hybridspec.errors import ModelFilesError


class Tensors:
    """Which optional tensors a file holds (by GGUF name), for the config fields they imply."""

    def __init__(self, names: set[str]):
        self.names = names

    def any(self, suffix: str) -> bool:
        return any(name.endswith(suffix) for name in self.names)


def get(meta: dict, arch: str, key: str, default=KeyError):
    full = f"{arch}.{key}"
    if full in meta:
        return meta[full]
    if default is KeyError:
        raise ModelFilesError(f"metadata key {full!r} is missing; llama.cpp's converter writes it for {arch}")
    return default


def per_layer(meta: dict, arch: str, key: str, layers: int) -> list[int]:
    """A per-layer array key (a scalar stands for every layer)."""
    value = get(meta, arch, key)
    values = list(value) if isinstance(value, (list, tuple)) else [value] * layers
    if len(values) != layers:
        raise ModelFilesError(f"metadata {arch}.{key} has {len(values)} entries for {layers} layers "
                              f"({arch}.block_count); the file is inconsistent")
    return [int(v) for v in values]
