"""`hs.LLM`: text in, text out on the embedded pair (stop strings cut exactly,
speculative equal to plain, EOS stops by default), a tokenizer directory
with its chat template, and the front door without torch or triton."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import hybridspec as hs
from hybridspec.text.codec import ByteCodec
from hybridspec.errors import ConfigError, InvalidRequestError

SIZES = dict(max_batch_size=4, max_model_len=256)


@pytest.fixture(scope="module")
def llms():
    return hs.LLM(**SIZES), hs.LLM(draft=None, **SIZES)


def test_text_in_text_out(llms):
    spec, plain = llms
    [done] = spec.generate(["def add(a, b):"], hs.SamplingParams(max_new_tokens=24))
    assert isinstance(done.text, str) and done.text == bytes(done.token_ids).decode("utf-8", errors="replace")
    assert done.finish_reason == "length" and len(done.token_ids) == 24 and spec.stats.drafted_tokens > 0
    assert plain.generate("def add(a, b):", hs.SamplingParams(max_new_tokens=24))[0].text == done.text


def test_stop_string_cuts_exactly_across_tokens(llms):
    spec, plain = llms
    prompt = "class Stack:\n    def push(self, item):\n"
    full = plain.generate([prompt], hs.SamplingParams(max_new_tokens=40))[0].text
    stop = full[9:12]  # three bytes: three tokens of the byte-level model
    assert stop not in full[:11]
    for llm in llms:
        out = llm.generate([prompt], hs.SamplingParams(max_new_tokens=40, stop=[stop, "never here"]))[0]
        assert out.text == full[:full.index(stop)]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert bytes(out.token_ids).decode() == full[:full.index(stop) + len(stop)]  # the completing token is kept
    both = spec.generate([prompt], hs.SamplingParams(max_new_tokens=40, stop=[full[11:14], full[10:12]]))[0]
    assert both.text == full[:10] and both.stop_reason == full[10:12]  # the earliest stop string wins


def test_eos_stops_by_default(llms):
    spec, plain = llms
    prompt = "import os\n"
    full = plain.generate([prompt], hs.SamplingParams(max_new_tokens=30))[0]
    eos = full.token_ids[6]
    for draft in (spec.engine.speculator.drafter, None):
        llm = hs.LLM(draft=draft, eos_token_ids=[eos], **SIZES)
        out = llm.generate([prompt], hs.SamplingParams(max_new_tokens=30))[0]
        assert out.token_ids == full.token_ids[:full.token_ids.index(eos) + 1]
        assert out.finish_reason == "stop" and out.stop_reason is None
        assert llm.generate([prompt], hs.SamplingParams(max_new_tokens=30, ignore_eos=True))[0].text == full.text


def test_n_samples_and_logprobs_through_the_text_api(llms):
    spec, _ = llms
    outs = spec.generate(["x = ", "y = "], hs.SamplingParams(max_new_tokens=6, temperature=1.0, seed=1, n=2,
                                                             logprobs=1))
    assert [(o.prompt_index, o.sample_index) for o in outs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(len(o.logprobs) == len(o.token_ids) and len(o.logprobs[0].top) == 1 for o in outs)


def test_bad_text_requests(llms):
    spec, _ = llms
    with pytest.raises(InvalidRequestError, match="list of strings"):
        spec.generate([[1, 2, 3]])
    with pytest.raises(ConfigError, match="no chat template"):
        hs.LLM(spec.target, draft=None, tokenizer=ByteCodec()).chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ConfigError, match="dtype='fp8'"):
        hs.LLM(dtype="fp8")
    with pytest.raises(ConfigError, match="threads=0"):
        hs.LLM(threads=0)


def test_tokenizer_directory_and_chat_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from oracles import bamba
    words = ["[UNK]", "</s>", "<user>", "<assistant>", "hi", "there", "x", "y"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>")
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}<assistant> {% endif %}")
    bamba(seed=0, vocab=len(words)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = hs.LLM(str(tmp_path), max_batch_size=2, max_model_len=64)  # the tokenizer beside the weights
    assert llm.engine.eos_token_ids == {1} and llm.codec.name == str(tmp_path)
    [reply] = llm.chat([{"role": "user", "content": "hi there"}], hs.SamplingParams(max_new_tokens=5))
    assert reply.finish_reason == "stop" or len(reply.token_ids) == 5
    assert reply.text == tokenizer.decode(reply.token_ids, skip_special_tokens=True)
    [again] = llm.generate(["<user> hi there <assistant>"], hs.SamplingParams(max_new_tokens=5))
    assert again.token_ids == reply.token_ids


def run_python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          check=True).stdout


def test_cpu_runs_never_import_triton():
    out = run_python("import sys, hybridspec as hs\n"
                     "llm = hs.LLM(max_batch_size=1, max_model_len=64)\n"
                     "print(llm.generate('ab', hs.SamplingParams(max_new_tokens=6))[0].finish_reason)\n"
                     "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))")
    assert out.split() == ["length", "[]"]


def test_help_imports_neither_torch_nor_a_subcommand():
    out = run_python("import sys\nfrom hybridspec.cli.main import main\n"
                     "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
                     "print('torch' in sys.modules, 'hybridspec.cli.generate' in sys.modules)")
    assert out.strip().splitlines()[-1] == "False False"


def test_bf16_weights_on_cpu_compute_in_float32_from_bf16_storage(tmp_path):
    """By default on a CPU the model computes in float32 (the native kernels),
    its linear weights and embedding kept in bfloat16, exactly; dtype= still
    chooses."""
    from oracles import bamba
    bamba(seed=1, vocab=256).to(torch.bfloat16).save_pretrained(tmp_path)
    llm = hs.LLM(str(tmp_path), draft=None, max_batch_size=1, max_model_len=64)
    assert llm.target.dtype is torch.float32
    assert llm.target.embed.dtype is torch.bfloat16 and llm.target.lm_head.dtype is torch.bfloat16
    assert hs.LLM(str(tmp_path), draft=None, dtype="bfloat16", max_batch_size=1, max_model_len=64).target.dtype \
        is torch.bfloat16
    [out] = llm.generate(["ab"], hs.SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4
