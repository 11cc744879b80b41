"""OpenAI request bodies (pydantic) and their mapping onto `SamplingParams`.

Fields the runtime honours map onto SamplingParams; the common vLLM
extensions (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, and
`prompt_logprobs` on completions) are accepted at the top level. Scoring as
legacy completions do it: `echo` with `logprobs` asks for the prompt tokens'
log-probs too, and `max_tokens=0` for no generated token. Unknown fields are ignored with a logged warning
(clients send vendor extensions); a known OpenAI field the runtime cannot
honour (`logit_bias`, tools, ...) is refused with a 400 naming it. Every
error is OpenAI's body, and a 400 names the field the client sent (never
the runtime's name for it).
"""
from __future__ import annotations

import logging
import re

from pydantic import BaseModel, ConfigDict, Field

from hybridspec.errors import InvalidRequestError
from hybridspec.sampling.sampler import SamplingParams
from hybridspec.serve import DEFAULT_MAX_N

log = logging.getLogger("hybridspec.serve")

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
RETRY_AFTER_S = 1  # what a 503 tells a client to wait before it retries

# OpenAI fields the runtime cannot honour: refused (never silently dropped) unless they hold a value
# that asks for nothing (what clients send by default)
UNSUPPORTED = {"logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
               "function_call": (None, "none"), "suffix": (None, ""),
               "best_of": (None, 1), "parallel_tool_calls": (None, True, False),
               "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
               "web_search_options": (None,)}


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, the offending param
    (and the headers of its response: a 503's Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             405: "invalid_request_error", 503: "server_overloaded"}.get(status, "server_error")
        self.headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    # structured output (`hybridspec.serve.structured`): OpenAI's, then vLLM's extensions
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def checked_extras(self) -> None:
        """ApiError for a field the runtime cannot honour; a warning for unknown ones."""
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise ApiError(400, f"'{name}' is not supported by this server; remove it from the request",
                               param=name)
            if name not in UNSUPPORTED:
                log.warning("ignoring unknown request field %r", name)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False  # the prompt before each choice's text (and its tokens' log-probs before the choice's)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's: each choice's prompt_logprobs

    @property
    def prompt_top(self) -> int | None:
        """Top tokens to record per prompt token: what `prompt_logprobs` and an
        echo's `logprobs` ask for, the larger (None: neither asks)."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ApiError(400, "'prompt' is empty; send a string, a list of strings or token ids", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The message's text (content parts of type "text" joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ApiError(400, f"message content of type {part.get('type')!r} is not supported; send text",
                               param="messages")
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt's text, or a chat through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def sampling_params(body: CompletionRequest | ChatRequest, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                    max_n: int = DEFAULT_MAX_N) -> SamplingParams:
    """The SamplingParams of an OpenAI body; ApiError(400) naming the bad field.
    default_max_tokens: where the body sets no max_tokens (OpenAI: 16 for
    completions; chat: what is left of the model's length); max_n: the most
    choices per prompt. Greedy with n > 1 (OpenAI: n identical completions)
    gives n=1: the server copies the one sequence into the body's n choices."""
    body.checked_extras()
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true; remove it or set 'stream'",
                       param="stream_options")
    if body.n > max_n:
        raise ApiError(400, f"n={body.n} is more than this server's most choices per request, {max_n} "
                            "(--max-n); ask for fewer", param="n")
    max_tokens = body.max_tokens
    if isinstance(body, ChatRequest):
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if max_tokens is not None and max_tokens < 1:  # (completions score a prompt with 0)
            raise request_error(f"max_new_tokens={max_tokens} must be an integer >= 1 for a chat reply; send "
                                "the prompt to /v1/completions with 'echo' to score it", body)
        prompt_top = None
    else:
        logprobs, prompt_top = body.logprobs, body.prompt_top
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    n = 1 if body.n > 1 and body.temperature == 0 else body.n
    fields = dict(max_new_tokens=default_max_tokens if max_tokens is None else max_tokens,
                  temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, n=n,
                  seed=body.seed, stop=tuple(stop), ignore_eos=body.ignore_eos, logprobs=logprobs,
                  prompt_logprobs=prompt_top,
                  repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                  frequency_penalty=body.frequency_penalty)
    try:
        return SamplingParams(**fields)
    except InvalidRequestError as error:
        raise request_error(str(error), body) from None


def request_error(message: str, body: CompletionRequest | ChatRequest) -> ApiError:
    """ApiError(400) of an InvalidRequestError message (it starts with the
    SamplingParams field: `name=value ...`): that field named, in the message
    too, as the request spelled it."""
    name = re.match(r"\w*", message).group()
    if name not in SamplingParams.__dataclass_fields__:
        return ApiError(400, message)
    field = request_field(name, body)
    return ApiError(400, re.sub(rf"\b{name}\b", field, message), param=field)


def request_field(name: str, body: CompletionRequest | ChatRequest) -> str:
    """The request's field that sets SamplingParams' `name`."""
    chat = isinstance(body, ChatRequest)
    if name == "max_new_tokens":
        return "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
    if name == "logprobs" and chat:
        return "top_logprobs"
    return name


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's spelling: "stop" or "length" (an aborted request never reaches a client;
    `/metrics` counts it under "abort")."""
    return None if reason is None else "length" if reason == "length" else "stop"
