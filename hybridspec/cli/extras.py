"""The package's optional dependencies: which extra (pyproject.toml's
[project.optional-dependencies]) brings each module a command may import, and
the one line a command ends with when one is missing, naming the install
command that fixes it (`pip install -e ".[hf]"` in a source checkout)."""
from __future__ import annotations

from pathlib import Path

EXTRAS = {  # top-level module -> the extra that installs it ([dev] holds every one of them)
    "transformers": "hf", "tokenizers": "hf",
    "matplotlib": "plot",
    "fastapi": "serve", "uvicorn": "serve", "pydantic": "serve", "prometheus_client": "serve", "starlette": "serve",
    "gguf": "gguf", "xgrammar": "structured",
    "scipy": "dev", "hypothesis": "dev", "openai": "dev", "httpx": "dev", "jsonschema": "dev",
}

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout an editable install runs from


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """The extra that brings the module `error` could not import, or None when
    it is no optional dependency (or only a part of one is missing: a bug or a
    version mismatch, which keeps its traceback)."""
    return EXTRAS.get(error.name or "")


def install_command(extra: str) -> str:
    """How to install `extra`: from the source checkout where this package runs from one, else by name."""
    if (SOURCE_ROOT / "pyproject.toml").is_file():
        return f'pip install -e ".[{extra}]" (in {SOURCE_ROOT})'
    return f'pip install "hybridspec[{extra}]"'


def missing_message(module: str, extra: str) -> str:
    also = "" if extra == "dev" else ", or the [dev] extra, which includes it"
    return f"{module} is not installed; it comes with the [{extra}] extra: {install_command(extra)}{also}"
