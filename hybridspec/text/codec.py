"""Text <-> token ids for one model: bytes for the byte-level embedded pair,
a local HF tokenizer for every other model."""
from __future__ import annotations

import functools
import json
from pathlib import Path

from hybridspec.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ByteCodec:
    """UTF-8 bytes as token ids 0..255 (no special tokens, no EOS).
    chat_template: a Jinja chat template (HF's variables), or None: no chat."""

    name = "bytes"
    eos_token_ids: tuple[int, ...] = ()

    def __init__(self, chat_template: str | None = None):
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def min_tokens(self, text: str) -> int:
        """The fewest tokens `text` can encode to, without encoding it: one token per UTF-8 byte, exactly."""
        return utf8_length(text)

    def decode(self, ids: list[int]) -> str:
        """Text of the bytes; an incomplete trailing character reads U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")

    def info(self) -> dict:
        """The tokenizer's description as vLLM's /tokenizer_info gives it: no special tokens."""
        return {"tokenizer_class": "ByteCodec", "bos_token": None, "eos_token": None, "pad_token": None,
                "unk_token": None, "chat_template": self.chat_template}

    def chat_prompt(self, messages: list[dict]) -> str:
        if self.chat_template is None:
            raise ConfigError("this byte-level model has no chat template; use generate() with plain text, or a "
                              "model whose tokenizer directory defines a chat template")
        return render_chat_template(self.chat_template, messages)


def render_chat_template(template: str, messages: list[dict]) -> str:
    """`template` applied to `messages` as transformers' `apply_chat_template` does
    (its Jinja settings, a generation prompt, no special tokens), without transformers."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return environment.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                    bos_token="", eos_token="")


class TokenizerCodec:
    """A Hugging Face tokenizer (`transformers.AutoTokenizer`, local files only)."""

    def __init__(self, tokenizer, name: str):
        self.tokenizer, self.name = tokenizer, name
        eos = tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = () if eos is None else (int(eos),)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of `text`, without encoding it; 0 where
        no bound is sound. A general tokenizer gives none: a normalizer may
        shrink the text (NFC composes, NFKC folds), WordPiece maps a whole
        unknown word to one token, a BPE model with fuse_unk merges a run of
        unknown characters into one. Byte-level BPE without a normalizer has
        one: every token covers at most `_max_token_bytes` bytes of the text."""
        longest = self._max_token_bytes
        return 0 if longest is None else -(-utf8_length(text) // longest)

    @functools.cached_property
    def _max_token_bytes(self) -> int | None:
        """The most text bytes one token covers, where the tokenizer is byte-level BPE without a normalizer
        (each character of a vocabulary entry stands for one byte; an added token matches its content), else None."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        spec = json.loads(backend.to_str())
        if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE" \
                or not _is_byte_level(spec.get("pre_tokenizer")):
            return None
        added = [len(t["content"].encode("utf-8")) for t in spec.get("added_tokens") or []]
        return max([len(entry) for entry in spec["model"]["vocab"]] + added)

    def decode(self, ids: list[int]) -> str:
        """Text of the ids, special tokens (EOS, padding) left out."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def info(self) -> dict:
        """The tokenizer's description as vLLM's /tokenizer_info gives it (what a remote-tokenizer client such
        as lm-eval reads: its class, special tokens as text, chat template)."""
        t = self.tokenizer
        return {"tokenizer_class": type(t).__name__,
                **{role: getattr(t, role, None) for role in ("bos_token", "eos_token", "pad_token", "unk_token")},
                "chat_template": getattr(t, "chat_template", None)}

    def chat_prompt(self, messages: list[dict]) -> str:
        """The tokenizer's chat template applied to `messages`, ready for the
        assistant's reply (its special tokens included: encode it without adding more)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"the tokenizer in {self.name} has no chat template; use generate() with the prompt "
                              "text, or a tokenizer directory whose tokenizer_config.json has a chat_template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _is_byte_level(pre_tokenizer: dict | None) -> bool:
    """Whether a pre-tokenizer ends in ByteLevel (every byte of the text one alphabet character)."""
    if pre_tokenizer is None:
        return False
    steps = pre_tokenizer.get("pretokenizers", [pre_tokenizer]) if pre_tokenizer.get("type") == "Sequence" \
        else [pre_tokenizer]
    return any(step.get("type") == "ByteLevel" for step in steps)


def utf8_length(text: str) -> int:
    """Bytes of `text` in UTF-8, counted without building them."""
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8", errors="surrogatepass"))


def byte_codec(vocab_size: int) -> ByteCodec:
    """The codec of a byte-level model (vocabulary 256), else ConfigError."""
    if vocab_size != 256:
        raise ConfigError(f"the model's vocabulary has {vocab_size} tokens, not the 256 bytes of a byte-level "
                          "model; pass the directory of its HF tokenizer (--tokenizer DIR, or tokenizer= in hs.LLM)")
    return ByteCodec()


def byte_tokenizer_codec(directory: str | Path) -> ByteCodec | None:
    """A ByteCodec (with the directory's chat template) where `directory` holds
    the HF form of the byte codec (`tools/embedded_tokenizer.py`: 256 tokens,
    token id = byte value, no merges, no special tokens), else None. Read as
    JSON: the embedded pair needs no transformers, and its tokens are the same."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    spec = json.loads(path.read_text())
    model = spec.get("model") or {}
    if (model.get("type"), model.get("vocab"), model.get("merges")) != ("BPE", byte_vocab(), []) \
            or spec.get("added_tokens") or spec.get("normalizer") or spec.get("post_processor") \
            or spec.get("pre_tokenizer") != BYTE_PRE_TOKENIZER \
            or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        return None
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    return ByteCodec(config.get("chat_template"))


BYTE_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}


def byte_vocab() -> dict[str, int]:
    """The ByteLevel alphabet's character of each byte value -> that value (GPT-2's byte-to-unicode map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


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
