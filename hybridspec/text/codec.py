"""Text <-> token ids for one model: bytes for the byte-level embedded pair,
a local HF tokenizer for every other model."""
from __future__ import annotations

from pathlib import Path

from hybridspec.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ByteCodec:
    """UTF-8 bytes as token ids 0..255 (no special tokens, no EOS)."""

    name = "bytes"
    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of the bytes; an incomplete trailing character reads U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")

    def chat_prompt(self, messages: list[dict]) -> str:
        raise ConfigError("this byte-level model has no chat template; use generate() with plain text, or a model "
                          "whose tokenizer directory defines a chat template")


class TokenizerCodec:
    """A Hugging Face tokenizer (`transformers.AutoTokenizer`, local files only)."""

    def __init__(self, tokenizer, name: str):
        self.tokenizer, self.name = tokenizer, name
        eos = tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = () if eos is None else (int(eos),)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        """Text of the ids, special tokens (EOS, padding) left out."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict]) -> str:
        """The tokenizer's chat template applied to `messages`, ready for the
        assistant's reply (its special tokens included: encode it without adding more)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"the tokenizer in {self.name} has no chat template; use generate() with the prompt "
                              "text, or a tokenizer directory whose tokenizer_config.json has a chat_template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def byte_codec(vocab_size: int) -> ByteCodec:
    """The codec of a byte-level model (vocabulary 256), else ConfigError."""
    if vocab_size != 256:
        raise ConfigError(f"the model's vocabulary has {vocab_size} tokens, not the 256 bytes of a byte-level "
                          "model; pass the directory of its HF tokenizer (--tokenizer DIR, or tokenizer= in hs.LLM)")
    return ByteCodec()


def has_tokenizer(directory: str | Path) -> bool:
    """Whether `directory` holds the files of a saved HF tokenizer."""
    return Path(directory).is_dir() and any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(path: str | Path, label: str = "tokenizer"):
    """The HF tokenizer saved in the local directory `path` (never the hub); a
    ConfigError that starts with `label` (the argument or flag) and names the fix."""
    directory = Path(path)
    fix = "pass the directory the model's tokenizer was saved to (tokenizer.save_pretrained)"
    if not directory.is_dir():
        raise ConfigError(f"{label} {path}: no such directory; {fix}")
    if not has_tokenizer(directory):
        raise ConfigError(f"{label} {path}: the directory holds none of {', '.join(TOKENIZER_FILES)}; {fix}")
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"{label} {path}: transformers cannot load a tokenizer from it ({reason}); {fix}") \
            from None
