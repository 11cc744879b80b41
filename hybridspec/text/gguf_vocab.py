"""A GGUF file's tokenizer (its `tokenizer.ggml.*` metadata, which `adapters.gguf.vocab` writes) as
a codec.

Read: "gpt2" (byte-level BPE: tokens, merges, token types; the pre-tokenizer `tokenizer.ggml.pre`
names) becomes an HF `tokenizers` BPE tokenizer with ByteLevel pre-tokenizer and decoder. "llama"
(SentencePiece BPE: tokens, scores, token types, no merges) becomes a BPE tokenizer whose merges
rank each pair of pieces by the score of the piece they make (as HF's converters derive them), with
byte fallback to the `<0xNN>` tokens; spaces are `▁`, and `tokenizer.ggml.add_space_prefix` (default
true) puts one before the text and before the text after each special token, as llama.cpp and HF's
normalizer-style SentencePiece tokenizers do (text starting with a space keeps it: " hi" is "▁▁hi").
Either way control tokens (type 3, and type 2, unknown, in "llama") are special, user-defined ones
(type 4) added tokens; bos/eos ids, add_bos (default true for "llama", as llama.cpp), add_eos and the
chat template are kept. Other kinds raise UnsupportedModelError: pass the model's HF tokenizer
directory as tokenizer= instead.
"""
from __future__ import annotations

from pathlib import Path

from hybridspec.errors import UnsupportedModelError
from hybridspec.text.codec import TokenizerCodec
from hybridspec.adapters.gguf.vocab import CONTROL, NO_VOCAB, NORMAL, UNKNOWN, USER_DEFINED

SPACE = "\u2581"  # SentencePiece's space
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
    from transformers import PreTrainedTokenizerFast
    kind = meta.get("tokenizer.ggml.model")
    builders = {"gpt2": _byte_level, "llama": _sentencepiece}
    if kind in (None, NO_VOCAB, "none"):
        raise UnsupportedModelError(f"{source} carries no tokenizer (tokenizer.ggml.model={kind!r}); pass the "
                                    "model's HF tokenizer directory as tokenizer=")
    if kind not in builders:
        raise UnsupportedModelError(f"{source}: tokenizer.ggml.model={kind!r} is not supported (hybridspec reads "
                                    "'gpt2', byte-level BPE, and 'llama', SentencePiece BPE); pass the model's HF "
                                    "tokenizer directory as tokenizer=")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    tokenizer = builders[kind](meta, tokens, source)
    special = (CONTROL, UNKNOWN) if kind == "llama" else (CONTROL,)
    tokenizer.add_special_tokens([t for t, type_ in zip(tokens, types) if type_ in special])
    tokenizer.add_tokens([t for t, type_ in zip(tokens, types) if type_ == USER_DEFINED])
    named = {role: tokens[meta[f"tokenizer.ggml.{role}_token_id"]] for role in ("bos", "eos", "padding", "unknown")
             if f"tokenizer.ggml.{role}_token_id" in meta}
    _add_bos_eos(tokenizer, meta, named, tokens, default_bos=kind == "llama")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=named.get("bos"),
                                   eos_token=named.get("eos"), pad_token=named.get("padding"),
                                   unk_token=named.get("unknown"))
    fast.chat_template = meta.get("tokenizer.chat_template")
    return fast


def _byte_level(meta: dict, tokens: list[str], source: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_SPLITS:
        raise UnsupportedModelError(f"{source}: tokenizer.ggml.pre={pre!r} is not a pre-tokenizer hybridspec knows "
                                    f"({', '.join(PRE_SPLITS)}); pass the model's HF tokenizer directory as "
                                    "tokenizer=")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
    split = PRE_SPLITS[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    tokenizer.pre_tokenizer = byte_level if split is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(_regex(split), behavior="isolated"), byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(meta: dict, tokens: list[str], source: str):
    from tokenizers import Tokenizer, decoders, models, normalizers
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise UnsupportedModelError(f"{source}: a 'llama' (SentencePiece) vocabulary needs tokenizer.ggml.scores, one "
                                    f"per token ({len(tokens)}); the file has "
                                    f"{'none' if scores is None else len(scores)}: convert it again")
    unknown = meta.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges_by_score(tokens, scores),
                                     unk_token=None if unknown is None else tokens[unknown], fuse_unk=True,
                                     byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    escape = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if prefix else escape
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tokenizer


def merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges that emulate SentencePiece's merging by scores: every split of a token into two
    tokens, best-scoring token first; ties go to the longer left part, then the longer right, then
    vocabulary order (the order HF's SentencePiece converters give)."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for position, (token, score) in enumerate(dict(zip(tokens, scores)).items()):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-score, -len(left), -len(right), position, ids[left], ids[right], left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


def _add_bos_eos(tokenizer, meta: dict, named: dict, tokens: list[str], default_bos: bool) -> None:
    """The post-processor adding BOS / EOS around each sequence as the file's add_bos / add_eos say."""
    from tokenizers import processors
    wanted = {"bos": meta.get("tokenizer.ggml.add_bos_token", default_bos),
              "eos": meta.get("tokenizer.ggml.add_eos_token", False)}
    bos, eos = (named[role] if wanted[role] and role in named else None for role in ("bos", "eos"))
    if bos is None and eos is None:
        return
    single = " ".join(t for t in (bos, "$A", eos) if t)
    pair = " ".join(t for t in (bos, "$A", eos, bos, "$B", eos) if t)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, tokens.index(t)) for t in dict.fromkeys((bos, eos)) if t])


def _regex(pattern: str):
    from tokenizers import Regex
    return Regex(pattern)
