"""A GGUF file's tokenizer (its `tokenizer.ggml.*` metadata) as a codec, and a model directory's
byte-level BPE tokenizer as that metadata (`hybridspec quantize` writes it).

Read: "gpt2" (byte-level BPE: tokens, merges, token types; the pre-tokenizer `tokenizer.ggml.pre`
names) becomes an HF `tokenizers` BPE tokenizer with ByteLevel pre-tokenizer and decoder; control
tokens (type 3) are special, user-defined ones (type 4) added tokens; bos/eos ids, add_bos and the
chat template are kept. "llama" (SentencePiece) and others raise UnsupportedModelError: pass the
model's HF tokenizer directory as tokenizer= instead.
"""
from __future__ import annotations

import json
from pathlib import Path

from hybridspec.errors import UnsupportedModelError
from hybridspec.text.codec import TokenizerCodec

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
GPT2_SPLIT = None  # the ByteLevel pre-tokenizer's own (GPT-2) regex
# tokenizer.ggml.pre -> the split regex llama.cpp applies before byte-level BPE (llama-vocab.cpp)
PRE_SPLITS = {
    "default": GPT2_SPLIT, "gpt-2": GPT2_SPLIT,
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def gguf_codec(path: str | Path) -> TokenizerCodec:
    """The codec of the tokenizer in the GGUF file `path`."""
    from hybridspec.adapters.gguf.reader import metadata, open_file
    meta = metadata(open_file(Path(path)))
    return TokenizerCodec(tokenizer_of(meta, str(path)), str(path))


def tokenizer_of(meta: dict, source: str):
    """A transformers fast tokenizer from GGUF tokenizer metadata (see the module)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(f"{source}: tokenizer.ggml.model={kind!r} is not supported (hybridspec reads "
                                    "'gpt2', byte-level BPE); pass the model's HF tokenizer directory as tokenizer=")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_SPLITS:
        raise UnsupportedModelError(f"{source}: tokenizer.ggml.pre={pre!r} is not a pre-tokenizer hybridspec knows "
                                    f"({', '.join(PRE_SPLITS)}); pass the model's HF tokenizer directory as "
                                    "tokenizer=")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
    split = PRE_SPLITS[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    tokenizer.pre_tokenizer = byte_level if split is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(_regex(split), behavior="isolated"), byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    special = [t for t, kind in zip(tokens, types) if kind == CONTROL]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens([t for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    named = {role: tokens[meta[f"tokenizer.ggml.{role}_token_id"]] for role in ("bos", "eos", "padding")
             if f"tokenizer.ggml.{role}_token_id" in meta}
    if meta.get("tokenizer.ggml.add_bos_token") and "bos" in named:
        bos = named["bos"]
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                                 special_tokens=[(bos, tokens.index(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=named.get("bos"),
                                   eos_token=named.get("eos"), pad_token=named.get("padding"))
    fast.chat_template = meta.get("tokenizer.chat_template")
    return fast


def _regex(pattern: str):
    from tokenizers import Regex
    return Regex(pattern)


def vocab_metadata(directory: Path, config) -> dict:
    """The tokenizer.ggml.* keys of the byte-level BPE tokenizer.json in `directory`, padded with unused
    tokens to the model's vocabulary (only the config's eos id where there is none or another kind)."""
    file = directory / "tokenizer.json"
    eos = {} if config.eos_token_id is None else {"tokenizer.ggml.eos_token_id": int(config.eos_token_id)}
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
