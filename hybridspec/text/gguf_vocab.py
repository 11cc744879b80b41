"""A GGUF file's tokenizer (its `tokenizer.ggml.*` metadata, which `adapters.gguf.vocab` writes) as
a codec.

Read: "gpt2" (byte-level BPE: tokens, merges, token types; the pre-tokenizer `tokenizer.ggml.pre`
names) becomes an HF `tokenizers` BPE tokenizer with ByteLevel pre-tokenizer and decoder; control
tokens (type 3) are special, user-defined ones (type 4) added tokens; bos/eos ids, add_bos and the
chat template are kept. "llama" (SentencePiece) and others raise UnsupportedModelError: pass the
model's HF tokenizer directory as tokenizer= instead.
"""
from __future__ import annotations

from pathlib import Path

from hybridspec.errors import UnsupportedModelError
from hybridspec.text.codec import TokenizerCodec
from hybridspec.adapters.gguf.vocab import CONTROL, NORMAL, USER_DEFINED
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
