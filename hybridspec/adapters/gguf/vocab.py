"""A model directory's byte-level BPE tokenizer (tokenizer.json) as GGUF's `tokenizer.ggml.*`
metadata, as llama.cpp's converter writes a "gpt2" vocabulary (`text.gguf_vocab` reads it back)."""
from __future__ import annotations

import json
from pathlib import Path

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # tokenizer.ggml.token_type values
NO_VOCAB = "no_vocab"  # tokenizer.ggml.model of a file that carries no tokenizer


def vocab_metadata(directory: Path, config) -> dict:
    """The tokenizer.ggml.* keys of the byte-level BPE tokenizer.json in `directory`, padded with unused
    tokens to the model's vocabulary; where there is none or another kind, "no_vocab" (llama.cpp's word
    for a file without a tokenizer: it refuses a file that names none) and the config's eos id."""
    file = directory / "tokenizer.json"
    eos = {"tokenizer.ggml.model": NO_VOCAB}
    if config.eos_token_id is not None:
        eos["tokenizer.ggml.eos_token_id"] = int(config.eos_token_id)
    if not file.is_file():
        return eos
    spec = json.loads(file.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        return eos
    tokens = {i: t for t, i in model["vocab"].items()}
    types = dict.fromkeys(tokens, NORMAL)
    for added in spec.get("added_tokens") or []:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    size = max(config.vocab_size, max(tokens) + 1)
    out = eos | {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
           "tokenizer.ggml.tokens": [tokens.get(i, f"[PAD{i}]") for i in range(size)],
           "tokenizer.ggml.token_type": [types.get(i, UNUSED) for i in range(size)],
           "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]}
    config_file = directory / "tokenizer_config.json"
    settings = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    by_content = {t: i for i, t in tokens.items()}
    for role in ("bos", "eos"):
        token = settings.get(f"{role}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token in by_content:
            out[f"tokenizer.ggml.{role}_token_id"] = by_content[token]
    if settings.get("chat_template"):
        out["tokenizer.chat_template"] = settings["chat_template"]
    return out
