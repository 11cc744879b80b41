"""The embedded pair's HF tokenizer files: `tools/embedded_tokenizer.py`
writes exactly the shipped files, `AutoTokenizer` loads them from the model
directories and gives ByteCodec's ids and text (invalid UTF-8 included), the
pair's codec stays a ByteCodec (no transformers needed) and its chat template
is transformers' rendering of the same messages."""
import random
import subprocess
import sys
from pathlib import Path

import pytest

import hybridspec as hs
from hybridspec.adapters.embedded import embedded_paths
from hybridspec.llm import as_codec
from hybridspec.text.codec import ByteCodec, byte_tokenizer_codec

REPO = Path(__file__).resolve().parent.parent
PIECES = ["a", "é", "日本", " ", "  ", "\n", "\t", "\r\n", "🙂", "def f(x):", " ,", " .", "?", "'", "\x00", "\x7f",
          "ÿ", "Ā", "\u200b", "<s>", "</s>", "[UNK]", "Ġ", "Ċ"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    return {name: transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            for name, path in zip(("target", "draft"), embedded_paths())}


def texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 20))) for _ in range(count)]


def test_the_shipped_files_are_the_generators_output():
    done = subprocess.run([sys.executable, str(REPO / "tools" / "embedded_tokenizer.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_hf_tokenizer_gives_the_byte_codecs_ids_and_text(hf):
    codec, rng = ByteCodec(), random.Random(1)
    for tokenizer in hf.values():
        assert len(tokenizer) == 256 and tokenizer.all_special_ids == [] and tokenizer.eos_token_id is None
        for text in texts(300, seed=0):
            ids = codec.encode(text)
            assert tokenizer.encode(text) == ids == tokenizer.encode(text, add_special_tokens=False)
            assert tokenizer.decode(ids, skip_special_tokens=True) == codec.decode(ids) == text
        for _ in range(2000):  # any bytes, invalid UTF-8 and characters cut short included
            ids = [rng.randrange(256) for _ in range(rng.randint(0, 12))]
            assert tokenizer.decode(ids, skip_special_tokens=True) == codec.decode(ids)
        assert tokenizer.decode(list("日".encode())[:2]) == codec.decode(list("日".encode())[:2]) == "\ufffd"


def test_the_pairs_codec_is_bytes_with_the_chat_template_of_the_files(hf, monkeypatch):
    target, draft = embedded_paths()
    want = hf["target"].apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    monkeypatch.setitem(sys.modules, "transformers", None)  # the lean install: no transformers
    for codec in (as_codec(None, target, 256), as_codec(str(draft), None, 256), byte_tokenizer_codec(target)):
        assert type(codec) is ByteCodec and codec.chat_prompt(MESSAGES) == want
    assert want.endswith("### assistant\n") and "def add(a, b):" in want


def test_a_tokenizer_that_is_not_the_byte_codec_is_not_taken_for_it(tmp_path):
    text = (embedded_paths()[0] / "tokenizer.json").read_text()
    (tmp_path / "tokenizer.json").write_text(text)
    assert type(byte_tokenizer_codec(tmp_path)) is ByteCodec and byte_tokenizer_codec(tmp_path).chat_template is None
    (tmp_path / "tokenizer.json").write_text(text.replace('"use_regex": false', '"use_regex": true', 1))
    assert byte_tokenizer_codec(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text(text.replace('"merges": []', '"merges": [["a", "b"]]', 1))
    assert byte_tokenizer_codec(tmp_path) is None
    assert byte_tokenizer_codec(tmp_path / "missing") is None


def test_chat_on_the_embedded_pair_is_generate_on_the_templated_prompt():
    llm = hs.LLM(max_batch_size=2, max_model_len=256)
    params = hs.SamplingParams(max_new_tokens=12)
    [chat] = llm.chat(MESSAGES, params)
    [plain] = llm.generate([llm.codec.chat_prompt(MESSAGES)], params)
    assert chat.token_ids == plain.token_ids and len(chat.token_ids) == 12
