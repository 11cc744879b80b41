"""The HF tokenizer files of the embedded byte-level pair: `tokenizer.json`
(built with the `tokenizers` library) and `tokenizer_config.json` (with the
chat template), written into `hybridspec/assets/embedded/target` and `draft`.

The tokenizer is `ByteCodec` in Hugging Face form: a byte-level BPE model
with no merges whose vocabulary is the 256 byte values, token id = byte value
(each byte spelled as GPT-2's printable byte-to-unicode character, as the
ByteLevel pre-tokenizer and decoder expect); no normalizer, no regex split, no
prefix space, no special tokens. Encoding gives the text's UTF-8 bytes;
decoding reads bytes back as UTF-8 with each invalid sequence replaced by
U+FFFD (Rust's `from_utf8_lossy`, the same maximal-subpart rule as Python's
`errors="replace"` that `ByteCodec.decode` uses), and the config turns off
the clean-up of spaces before punctuation, which would change the text.

    python tools/embedded_tokenizer.py           # (re)write the files
    python tools/embedded_tokenizer.py --check   # exit 1 if the shipped files differ
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from hybridspec.text.codec import BYTE_PRE_TOKENIZER, byte_vocab  # noqa: E402

EMBEDDED = REPO / "hybridspec" / "assets" / "embedded"
MODEL_DIRS = ("target", "draft")

# One turn per message, a role line then its text, and the assistant's line last: plain text
# the byte-level model reads like any other (it has no special tokens to mark turns).
CHAT_TEMPLATE = ("{% for message in messages %}### {{ message['role'] }}\n{{ message['content'] }}\n\n{% endfor %}"
                 "{% if add_generation_prompt %}### assistant\n{% endif %}")


def build_tokenizer():
    """The `tokenizers.Tokenizer`: token id = byte value."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab=byte_vocab(), merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=BYTE_PRE_TOKENIZER["add_prefix_space"],
                                                       use_regex=BYTE_PRE_TOKENIZER["use_regex"])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def tokenizer_config() -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
            "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False,
            "bos_token": None, "eos_token": None, "pad_token": None, "unk_token": None,
            "chat_template": CHAT_TEMPLATE}


def files() -> dict[str, str]:
    """Each file's name and text."""
    return {"tokenizer.json": build_tokenizer().to_str(pretty=True) + "\n",
            "tokenizer_config.json": json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped files instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for name, text in files().items():
        for model in MODEL_DIRS:
            path = EMBEDDED / model / name
            if args.check:
                if not path.is_file() or path.read_text() != text:
                    stale.append(str(path))
            else:
                path.write_text(text)
    if stale:
        print("out of date (run python tools/embedded_tokenizer.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
