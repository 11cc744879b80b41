"""GGUF files (llama.cpp's format) as hybridspec models: `load_gguf` reads one (`hs.load("m.gguf")`),
`write_gguf` writes a model directory as one (`hybridspec quantize`), both in llama.cpp's layout for
the architecture (`archs`: metadata <-> config, `names`: tensor names and layouts)."""
from __future__ import annotations

from pathlib import Path

MAGIC = b"GGUF"


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file: a name ending in .gguf, or a file starting with the GGUF magic."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return True
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == MAGIC
