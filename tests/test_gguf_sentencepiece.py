"""SentencePiece ("llama") tokenizers in GGUF files, as Jamba, Zamba2 and Mamba-Codestral ship them:
a tiny SentencePiece-style BPE vocabulary (trained here, with the 256 byte-fallback tokens) written
as tokens, scores and token types encodes as transformers' tokenizer of the same file does, with
SentencePiece's space prefix as llama.cpp and the models' HF tokenizers put it (a normalizer, so text
starting with a space keeps it), and decodes back to the text."""
from __future__ import annotations

import numpy as np
import pytest

from hybridspec.adapters.gguf.vocab import BYTE, CONTROL, NORMAL, UNKNOWN
from hybridspec.adapters.gguf.writer import write_file
from hybridspec.text.gguf_vocab import gguf_codec

pytest.importorskip("gguf")
SPACE = "\u2581"
CORPUS = ["the cat sat on the mat", "hello world, hello there", "déjà vu über alles", "def main(): return 0",
          "where there is heat there is a theatre of other hearts", "the heron and the hen hear the rain in spain",
          "interesting internal entries enter into a rather tender ending", "a stone on a station tone",
          "seven eleven never ever leveled the rivers"]
TEXTS = ["the cat sat on the mat", "hello world", " leading space", "trailing space  ", "  two\tspaces\n",
         "déjà vu über", "日本語 ✓ bytes", "line one\nline two\n", "x", "hello</s>the mat",
         "mother's catalogue: the theme, whether others hear", "matter of the heart returned"]


def trained_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types) laid out as llama.cpp's converter writes a SentencePiece BPE model:
    <unk>, <s>, </s>, the byte tokens, then the pieces. The pieces' scores are drawn from a few
    values, not from the training order: which pair merges first then decides the pieces, and ties
    are common, so encoding equals the reference only where the merge order is the same."""
    from tokenizers import SentencePieceBPETokenizer
    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(CORPUS * 10, vocab_size=260, min_frequency=1, show_progress=False)
    model = trainer.get_vocab()
    merged = ["".join(pair) for pair in _merges(trainer)]
    pieces = merged + sorted(p for p in model if p not in merged)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + (-np.random.default_rng(0).integers(0, 6, len(pieces))).astype(float).tolist()
    return tokens, scores, [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)


def _merges(trainer) -> list[tuple[str, str]]:
    import json
    return [tuple(m) for m in json.loads(trainer.to_str())["model"]["merges"]]


def _pieces_of(texts: list[str]) -> list[str]:
    """Every text cut at each of its characters, glued back in another order: words split and joined
    across the pieces, where merges of equal score compete."""
    return [text[cut:] + text[:cut] for text in texts for cut in range(1, len(text), 3)]


def written(tmp_path, vocabulary=None, **flags) -> str:
    """A GGUF file holding only the tokenizer of `vocabulary` (the trained one by default) and an
    embedding, its add_* flags set as given."""
    tokens, scores, types = vocabulary or trained_vocabulary()
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    meta |= {f"tokenizer.ggml.{key}": value for key, value in flags.items()}
    write_file(tmp_path / "m.gguf", "llama", meta, {"token_embd.weight": np.zeros((len(tokens), 4), np.float32)})
    return str(tmp_path / "m.gguf")


def reference(path: str, prefix: bool):
    """transformers' tokenizer of the file, its space prefix made a normalizer that add_space_prefix
    turns on or off (transformers' own choice for such files is Metaspace's, which differs on text
    starting with a space, and it reads no add_space_prefix)."""
    from tokenizers import decoders, normalizers
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(path).rsplit("/", 1)[0], gguf_file=path.rsplit("/", 1)[1])
    escape = normalizers.Replace(" ", SPACE)
    backend = tokenizer.backend_tokenizer
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if prefix else escape
    backend.pre_tokenizer = None
    if not prefix:
        backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


@pytest.mark.parametrize("flags", [{}, {"add_bos_token": False, "add_space_prefix": False},
                                   {"add_bos_token": True, "add_eos_token": True}])
def test_encode_and_decode_equal_transformers_tokenizer_of_the_file(flags, tmp_path):
    path = written(tmp_path, **flags)
    codec, expected = gguf_codec(path), reference(path, flags.get("add_space_prefix", True))
    for text in TEXTS + CORPUS + _pieces_of(CORPUS):
        ids = codec.encode(text)
        assert ids == expected.encode(text), text
        assert codec.decode(ids) == expected.decode(ids, skip_special_tokens=True), text
    assert (codec.encode("x")[0] == 1) == flags.get("add_bos_token", True)
    assert (codec.encode("x")[-1] == 2) == flags.get("add_eos_token", False)


def test_merges_of_equal_score_are_ordered_as_hfs_converter_orders_them(tmp_path):
    """xyy and yyz, pq and qrr score alike and are listed first: the longer left part (yy|z), then
    the longer right part (q|rr) merges first."""
    pieces = {"yy": -1.0, "rr": -1.0, "xyy": -2.0, "pq": -2.0, "yyz": -2.0, "qrr": -2.0}
    pieces |= dict.fromkeys([SPACE, "x", "y", "z", "p", "q", "r"], -3.0)
    vocabulary = (["<unk>", "<s>", "</s>", *pieces], [0.0] * 3 + list(pieces.values()),
                  [UNKNOWN, CONTROL, CONTROL] + [NORMAL] * len(pieces))
    path = written(tmp_path, vocabulary)
    codec, expected = gguf_codec(path), reference(path, prefix=True)
    tokens = codec.tokenizer.convert_ids_to_tokens(codec.encode("xyyz pqrr", add_special_tokens=False))
    assert tokens == [SPACE, "x", "yyz", SPACE, "p", "qrr"]
    assert codec.encode("xyyz pqrr") == expected.encode("xyyz pqrr")


def test_text_round_trips_through_pieces_and_byte_fallback(tmp_path):
    codec = gguf_codec(written(tmp_path))
    tokens = codec.tokenizer.convert_ids_to_tokens(codec.encode("the mat 日本\n", add_special_tokens=False))
    assert tokens[:2] == [f"{SPACE}the", f"{SPACE}mat"] and "<0xE6>" in tokens and tokens[-1] == "<0x0A>"
    for text in (t for t in TEXTS if "</s>" not in t):
        assert codec.decode(codec.encode(text)) == text
    # </s> is special: decoding leaves it out, and the text after it took a space prefix
    assert codec.decode(codec.encode("hello</s>the mat")) == "hello the mat"
    assert codec.eos_token_ids == (2,)


def test_a_vocabulary_without_scores_is_a_typed_error(tmp_path):
    from hybridspec.errors import UnsupportedModelError
    from hybridspec.text.gguf_vocab import tokenizer_of
    with pytest.raises(UnsupportedModelError, match="tokenizer.ggml.scores"):
        tokenizer_of({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"]}, "m.gguf")
