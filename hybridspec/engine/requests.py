"""What `Engine` requests carry, checked and normalised before anything else
sees it: the prompts of a `generate` call and their sampling parameters (the
Engine's own settings: `hybridspec.engine.config`).

A prompt is a list or tuple of token ids, a 1-D integer numpy array or a 1-D
integer tensor; a token id is an int, a numpy integer or a 0-d integer tensor
(`validation.token_id`). Prompts leave here as `list[int]`, parameters as one
`SamplingParams` per prompt. Every refusal is a typed error raised before any
state changes.
"""
from __future__ import annotations

import numpy as np
import torch

from hybridspec.errors import InvalidRequestError
from hybridspec.sampling.sampler import SamplingParams
from hybridspec.validation import INTEGER_DTYPES, token_id

PROMPT_FORMS = "a list, tuple, 1-D numpy array or 1-D tensor of token ids"


def normalize_requests(prompts, params, vocab_size: int,
                       max_model_len: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """(prompts as lists of ints, one SamplingParams per prompt), or InvalidRequestError."""
    prompts = normalize_prompts(prompts, vocab_size)
    params = normalize_params(params, len(prompts))
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        if len(prompt) + p.max_new_tokens > max_model_len:
            raise InvalidRequestError(
                f"prompt {i}: {len(prompt)} prompt tokens + max_new_tokens={p.max_new_tokens} exceed the "
                f"model limit max_model_len={max_model_len}; shorten the prompt or lower max_new_tokens")
        late = [c for c in p.save_states_at if c > len(prompt)]
        if late:
            raise InvalidRequestError(f"prompt {i}: save_states_at position {late[0]} lies past its {len(prompt)} "
                                      "tokens; mark positions 1..len(prompt)")
        bad_stops = [t for t in p.stop_token_ids if t >= vocab_size]
        if bad_stops:
            raise InvalidRequestError(f"stop token id {bad_stops[0]} is outside the vocabulary [0, {vocab_size})")
    return prompts, params


def normalize_prompts(prompts, vocab_size: int) -> list[list[int]]:
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequestError(f"prompts must be a list of prompts, got a {type(prompts).__name__}; each prompt "
                                  f"is {PROMPT_FORMS} (pass [[1, 2, 3]] for one prompt)")
    if not prompts:
        raise InvalidRequestError("prompts is empty; pass a list of at least one prompt")
    if any(token_id(p) is not None for p in prompts):
        raise InvalidRequestError(f"prompts {_short(prompts)} holds bare token ids where prompts are expected; "
                                  "pass a list of prompts, "
                                  "e.g. [[1, 2, 3]] for one prompt")
    return [normalize_prompt(prompt, i, vocab_size) for i, prompt in enumerate(prompts)]


def normalize_prompt(prompt, i: int, vocab_size: int) -> list[int]:
    """Prompt i as a list of token ids in [0, vocab_size)."""
    ids = _token_list(prompt, i)
    if not ids:
        raise InvalidRequestError(f"prompt {i} is empty; every prompt needs at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt {i} holds token id {bad[0]!r} outside the vocabulary "
                                  f"[0, {vocab_size}); check the tokenizer matches the model")
    return ids


def normalize_params(params, num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams per prompt from None (the defaults), one SamplingParams, or a list of them."""
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    if not isinstance(params, (list, tuple)):
        fix = "; build one with hs.SamplingParams(**params)" if isinstance(params, dict) else ""
        raise InvalidRequestError(f"params must be a SamplingParams or a list of them (one per prompt), got a "
                                  f"{type(params).__name__}{fix}")
    bad = [p for p in params if not isinstance(p, SamplingParams)]
    if bad:
        raise InvalidRequestError(f"params holds a {type(bad[0]).__name__} ({_short(bad[0])}); every entry must be "
                                  "a SamplingParams")
    if len(params) != num_prompts:
        raise InvalidRequestError(f"{len(params)} SamplingParams for {num_prompts} prompts; "
                                  "pass one SamplingParams or one per prompt")
    return list(params)


def _token_list(prompt, i: int) -> list[int]:
    """The ids of prompt i as ints (range not checked)."""
    if isinstance(prompt, (np.ndarray, torch.Tensor)):
        if prompt.ndim != 1 or (len(prompt) and not _has_integer_dtype(prompt)):
            raise InvalidRequestError(f"prompt {i} is a {prompt.ndim}-D {type(prompt).__name__} of {prompt.dtype}; "
                                      f"a prompt is {PROMPT_FORMS}")
        return prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise InvalidRequestError(f"prompt {i} is a {type(prompt).__name__} ({_short(prompt)}); a prompt is "
                                  f"{PROMPT_FORMS} (encode text with the model's tokenizer first)")
    ids = [token_id(t) for t in prompt]
    if None in ids:
        bad = prompt[ids.index(None)]
        raise InvalidRequestError(f"prompt {i} holds {bad!r} ({type(bad).__name__}), not a token id; token ids are "
                                  "integers (int, numpy integer or 0-d integer tensor)")
    return ids


def _has_integer_dtype(array: np.ndarray | torch.Tensor) -> bool:
    if isinstance(array, torch.Tensor):
        return array.dtype in INTEGER_DTYPES
    return array.dtype.kind in "iu"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
