"""The embedded default model pair: a byte-level (vocabulary 256, token = byte
value) hybrid Mamba2 + attention target and a much smaller draft, trained on
the Python standard library's source by `tools/train_embedded.py` and shipped
as package data in HF layout under `hybridspec/assets/embedded/`."""
from __future__ import annotations

from pathlib import Path

from hybridspec.errors import ModelFilesError

EMBEDDED_DIR = Path(__file__).resolve().parents[1] / "assets" / "embedded"


def embedded_paths() -> tuple[Path, Path]:
    """(target_dir, draft_dir) of the embedded pair; each loads with `hs.load`."""
    target, draft = EMBEDDED_DIR / "target", EMBEDDED_DIR / "draft"
    missing = [str(p) for p in (target, draft) if not (p / "config.json").is_file()]
    if missing:
        raise ModelFilesError(f"the embedded model pair is missing ({', '.join(missing)}); reinstall hybridspec, "
                                "or rebuild it with `python tools/train_embedded.py` from a source checkout")
    return target, draft
