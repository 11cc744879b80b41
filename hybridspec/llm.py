"""`LLM`: text in, text out, over an `Engine` (the id-level API).

    import hybridspec as hs
    llm = hs.LLM()                                   # the embedded byte-level pair
    [done] = llm.generate(["def add(a, b):"], hs.SamplingParams(max_new_tokens=40, stop=["\\n\\n"]))
    print(done.text, done.finish_reason)

`hs.LLM(model_dir)` loads any model directory `hs.load` reads, with the HF
tokenizer saved beside it (or `tokenizer=DIR`); local files only, nothing is
downloaded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from hybridspec.adapters import load
from hybridspec.text.codec import (ByteCodec, TokenizerCodec, byte_codec, byte_tokenizer_codec, has_tokenizer,
                                   load_tokenizer)
from hybridspec.adapters.embedded import embedded_paths
from hybridspec.adapters.gguf import is_gguf
from hybridspec.text.gguf_vocab import gguf_codec
from hybridspec.engine.config import EngineConfig, engine_config
from hybridspec.engine.engine import Engine, Output
from hybridspec.errors import ConfigError, InvalidRequestError
from hybridspec.kernels import backend as backends
from hybridspec.sampling.logprobs import TokenLogprob
from hybridspec.models.hybrid import HybridModel
from hybridspec.sampling.sampler import SamplingParams
from hybridspec.spec.drafters import as_draft
from hybridspec.engine.stats import EngineStats
from hybridspec.sampling.stopping import cut_text
from hybridspec.engine.threads import use_threads

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
DEFAULT_DRAFT = "default"  # the embedded draft with the embedded target, the n-gram drafter otherwise


@dataclass
class Completion:
    """One generated text.

    text: the generated text (prompt not included), cut just before a stop string.
    token_ids: the generated token ids (the one that completed a stop string included).
    logprobs: with `SamplingParams(logprobs=k)`, a `TokenLogprob` per token; else None.
    finish_reason: "stop" (EOS, stop token or stop string) or "length".
    stop_reason: the stop string or stop token id; None for EOS or length.
    prompt_index, sample_index: which prompt, and which of its n samples.
    prompt_logprobs: with `SamplingParams(prompt_logprobs=k)`, one entry per
        prompt token (None for the first: `Output.prompt_logprobs`); else None.
    """

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: Literal["stop", "length"]
    stop_reason: int | str | None
    prompt_index: int = 0
    sample_index: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    """A model, its drafter and its tokenizer behind a text API.

    model: a model directory (`hs.load`), a loaded `HybridModel`, or None
        (default: the embedded byte-level target).
    draft: a draft model directory, "ngram" (prompt lookup,
        `hs.NgramDrafter`), "suffix" (suffix decoding, `hs.SuffixDrafter`),
        "mtp", "eagle3:DIR", "layers:N" (the model's own first N layers),
        None (plain decoding), a HybridModel or a `Drafter`
        (what `Engine(draft=...)` takes: `hybridspec.spec.drafters.as_draft`);
        default: the embedded draft with the embedded target, "ngram" otherwise.
    tokenizer: a local HF tokenizer directory or a loaded tokenizer; default
        None: the model directory's own tokenizer, or bytes for a byte-level
        model (vocabulary 256).
    config: an `hs.EngineConfig`, or its settings as keyword arguments
        (both: they must agree), as in `Engine`: num_draft_tokens ("auto":
        adaptive γ), max_draft_tokens, checkpoint, verify, max_batch_size,
        max_model_len, prefix_cache, cuda_graphs, ... (defaults: γ = 4, a
        snapshot after every verify input, "rejection", 16 sequences, the
        model's limit up to 4096 tokens, no prefix cache, CUDA graphs as
        `HYBRIDSPEC_CUDA_GRAPHS` says: none unless it is "1"). Here:
      tensor_parallel_size: > 1, this process loads its shard of the target
        (`hybridspec.tp`) in a torch.distributed group of that many ranks that
        torchrun or the caller started; the draft runs whole on every rank.
        None (default): one process, or a HybridModel `model` as it is.
      eos_token_ids: the ids that end a request unless `ignore_eos`; default
        None: the tokenizer's EOS, the config's `eos_token_id` and those of the
        model directory's generation_config.json.
      decode: default None: the tokenizer's.
    device: torch device to load onto (default "cpu"); dtype: "float32",
        "bfloat16", "float16", "float64" or a torch.dtype (default: float32
        on a CPU, where stored bf16 linear weights and embedding stay
        bfloat16 in memory, exactly (fp16: float16); the weights' stored
        dtype elsewhere).
    compute: what the target's products multiply in (`HybridModel.set_compute`):
        None or "float32" (default: exact, the float32 bits), or "bfloat16", the
        opt-in fast path on CPUs with AVX512-BF16: the linear layers and LM head
        round their activations to bfloat16 and use the CPU's BF16 dot product
        (float32 sums; norms, recurrences and attention stay float32). Close to
        float32, not its bits; speculative output still equals plain output
        within it. A separate option from `dtype`, which names the model's own
        dtype (every op's, as in HF and vLLM): a bfloat16 `dtype` on a CPU runs
        everything through torch in bfloat16, several times slower. A
        HybridModel `model` is switched in place. A ConfigError before anything
        is loaded where it cannot run (a GPU, a CPU without AVX512-BF16).
    threads: torch intra-op threads for CPU runs (a process-wide torch
        setting); default None: `hybridspec.engine.threads.default_threads` (1 for
        the embedded pair).

    `llm.engine` is the id-level `Engine` underneath; `llm.stats` its last
    call's statistics.
    """

    def __init__(self, model: str | Path | HybridModel | None = None, draft=DEFAULT_DRAFT, tokenizer=None, *,
                 config: EngineConfig | None = None, device: str = "cpu", dtype: str | torch.dtype | None = None,
                 threads: int | None = None, compute: str | torch.dtype | None = None, **settings):
        config = engine_config(config, settings)  # checked, as dtype and compute, before anything is loaded
        dtype = load_dtype(model_dtype(dtype), device)
        if compute is not None:
            compute = HybridModel.compute_for(compute, device, model.dtype if isinstance(model, HybridModel) else dtype)
        embedded_target, embedded_draft = embedded_paths() if model is None else (None, None)
        self.target = as_model(embedded_target if model is None else model, dtype, device,
                               config.tensor_parallel_size or 1, compute)
        if draft == DEFAULT_DRAFT:
            draft = embedded_draft if model is None else "ngram"
        self.codec = as_codec(tokenizer, embedded_target if model is None else model, self.target.vocab_size)
        self.threads = use_threads(threads, self.target)
        if config.eos_token_ids is None:
            config = config.replace(eos_token_ids=sorted(set(self.codec.eos_token_ids)
                                                         | set(model_eos_ids(model, self.target))))
        if config.decode is None:
            config = config.replace(decode=self.codec.decode)
        if config.tokenizer is None and getattr(self.codec, "tokenizer", None) is not None:
            config = config.replace(tokenizer=self.codec.tokenizer)  # structured output's token bytes
        self.engine = Engine(self.target, draft=as_draft(draft, dtype, device), config=config)

    @property
    def stats(self) -> EngineStats:
        """The last call's `EngineStats` (`llm.engine.total_stats`: every call's)."""
        return self.engine.stats

    def generate(self, prompts: str | list[str], params: SamplingParams | list[SamplingParams] | None = None, *,
                 progress: bool = False) -> list[Completion]:
        """One Completion per prompt, in order (n consecutive ones with n > 1).
        params: one SamplingParams, one per prompt, or None (64 greedy tokens)."""
        prompts = [prompts] if isinstance(prompts, str) else prompts
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
            raise InvalidRequestError(f"prompts must be a string or a list of strings, got {_short(prompts)}; "
                                      "for token ids use llm.engine.generate")
        return self._run([self.codec.encode(p) for p in prompts], params, progress)

    def chat(self, conversations: list[dict] | list[list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None, *,
             progress: bool = False) -> list[Completion]:
        """The assistant's reply to each conversation (a list of {"role", "content"}
        messages, or a list of them), through the tokenizer's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.codec.encode(self.codec.chat_prompt(list(c)), add_special_tokens=False)
                   for c in conversations]
        return self._run(prompts, params, progress)

    def _run(self, prompts: list[list[int]], params, progress: bool) -> list[Completion]:
        outputs = self.engine.generate(prompts, params, progress=progress)
        return [self.completion(o, i) for o, i in zip(outputs, _prompt_indices(outputs))]

    def completion(self, output: Output, prompt_index: int) -> Completion:
        """The Completion of one Engine Output."""
        return Completion(cut_text(self.codec.decode(output.token_ids), output.stop_reason), output.token_ids,
                          output.logprobs, output.finish_reason, output.stop_reason, prompt_index,
                          output.sample_index, output.prompt_logprobs)


def _prompt_indices(outputs: list[Output]) -> list[int]:
    """The prompt each output belongs to: a new prompt starts at every sample 0."""
    indices, prompt = [], -1
    for o in outputs:
        prompt += o.sample_index == 0
        indices.append(prompt)
    return indices


def model_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} must be one of {', '.join(DTYPES)}, a torch.dtype, or None for the "
                          "default (float32 on CPU, else the weights' stored dtype)")
    return DTYPES[dtype]


def load_dtype(dtype: torch.dtype | None, device) -> torch.dtype | None:
    """The dtype a model directory is loaded in: `dtype`, or by default float32
    on a CPU and the weights' stored dtype elsewhere. On a CPU the native kernels run
    float32, and stored bf16 (fp16) linear weights and embedding stay
    16-bit in memory, exactly (`HybridModel.pack_for_cpu`); bf16 compute
    through torch makes a decode step several times slower."""
    return backends.default_dtype(device) if dtype is None else dtype


def as_model(model, dtype, device, tensor_parallel_size: int = 1, compute: torch.dtype | None = None) -> HybridModel:
    """A HybridModel from a model directory, this rank's shard of it with
    tensor_parallel_size > 1 (or the model itself), its products in `compute`
    where that is given (`HybridModel.set_compute`)."""
    if isinstance(model, HybridModel):
        return model if compute is None or compute is model.compute else model.set_compute(compute)
    if isinstance(model, (str, Path)):
        return load(model, dtype=dtype, device=device, tensor_parallel_size=tensor_parallel_size, compute=compute)
    raise ConfigError(f"expected a model directory or a HybridModel, got a {type(model).__name__}")


def as_codec(tokenizer, model, vocab_size: int) -> ByteCodec | TokenizerCodec:
    """The codec of `tokenizer` (a directory or a loaded tokenizer), else the model
    directory's tokenizer (a GGUF file's from its metadata), else bytes for a byte-level model. A directory holding
    the byte codec's HF form (the embedded pair's) gives a ByteCodec with its
    chat template: the same tokens, without transformers."""
    if isinstance(tokenizer, (ByteCodec, TokenizerCodec)):
        return tokenizer
    if isinstance(tokenizer, (str, Path)):
        return byte_tokenizer_codec(tokenizer) or TokenizerCodec(load_tokenizer(tokenizer, "tokenizer="),
                                                                 str(tokenizer))
    if tokenizer is not None:
        return TokenizerCodec(tokenizer, type(tokenizer).__name__)
    if isinstance(model, (str, Path)) and is_gguf(model):
        return gguf_codec(model)
    if isinstance(model, (str, Path)) and has_tokenizer(model):
        return byte_tokenizer_codec(model) or TokenizerCodec(load_tokenizer(model, "tokenizer in"), str(model))
    return byte_codec(vocab_size)


def model_eos_ids(model, target: HybridModel) -> list[int]:
    """EOS ids of the model: its config's, and its generation_config.json's (int or list)."""
    ids = [] if target.config.eos_token_id is None else [target.config.eos_token_id]
    file = Path(model) / "generation_config.json" if isinstance(model, (str, Path)) else None
    if file is not None and file.is_file():
        eos = json.loads(file.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    return [int(t) for t in ids if isinstance(t, int) and 0 <= t < target.vocab_size]


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
