"""Request bodies turned into the engine's prompts and params, on a worker
thread: parsed, checked and tokenized before the engine loop sees them.

The handlers run these functions in Starlette's thread pool, so the event
loop only moves bytes (other streams' chunks go on while a big body is
parsed) and the engine loop only adds prompts already known to fit the
context. A prompt over the context is refused before it is tokenized where
its text alone proves it (`codec.min_tokens`: exact for the byte codec), and
every prompt's length is checked here, where the engine would check it only
after taking it in.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from hybridspec.errors import HybridSpecError
from hybridspec.sampling.sampler import SamplingParams
from hybridspec.serve.structured import structured_output
from hybridspec.serve.protocol import (ApiError, ChatMessage, ChatRequest, CompletionRequest, TokenizeRequest,
                                       request_field, sampling_params)


@dataclass
class Prepared:
    """A generation request ready for the engine: its body, prompts (token ids), params and prompt field."""

    body: CompletionRequest | ChatRequest
    prompts: list[list[int]]
    params: SamplingParams
    field: str


def parse(raw: bytes, model: type[BaseModel], context: int | None = None) -> BaseModel:
    """The body as `model`; a bad one raises what FastAPI's own parsing would (a 400 naming the field).
    context: refuse a token-id prompt longer than this before validating its ids (`refuse_long_ids`)."""
    try:
        data = json.loads(raw or b"null", parse_int=_int, parse_float=_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON ({error}); send a JSON object") from None
    if context is not None:
        refuse_long_ids(data, context)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise RequestValidationError(error.errors(include_url=False, include_input=False)) from None


# Numbers are parsed through Python functions, not the parser's C conversions: the interpreter lock can pass
# to the event loop between two of them, where a body of millions of token ids otherwise holds it for the
# whole parse (other streams go silent meanwhile), at the price of a slower parse of such a body.
def _int(text: str) -> int:
    return int(text)


def _float(text: str) -> float:
    return float(text)


def refuse_long_ids(data, context: int) -> None:
    """ApiError(400) where a body's prompt is a list of token ids (or of such lists) longer than `context`:
    validating millions of ids holds the interpreter lock for a second or more, the length alone refuses it."""
    prompt = data.get("prompt") if isinstance(data, dict) else None
    if not isinstance(prompt, list) or not prompt:
        return
    prompts = [prompt] if isinstance(prompt[0], int) else prompt
    for i, ids in enumerate(prompts):
        if isinstance(ids, list) and len(ids) > context:
            raise ApiError(400, f"prompt {i} holds {len(ids)} token ids, more than this model's context, "
                                f"max_model_len={context} tokens; shorten the prompt", param="prompt")


def completion(server, raw: bytes) -> Prepared:
    """A /v1/completions body: each prompt's tokens, every one within the context."""
    body = parse(raw, CompletionRequest, context=server.max_model_len)
    server.check_model(body.model)
    params = constrained(server, body, sampling_params(body, max_n=server.max_n))
    prompts = [within_context(server, p, f"prompt {i}", body, params) if isinstance(p, str)
               else checked(server, list(p), f"prompt {i}", body, params, "prompt")
               for i, p in enumerate(body.prompts())]
    return Prepared(body, prompts, params, "prompt")


def chat(server, raw: bytes) -> Prepared:
    """A /v1/chat/completions body: its messages through the chat template, within the context.
    Without max_tokens the reply may take what the prompt leaves of the context (at least 1 token)."""
    body = parse(raw, ChatRequest)
    server.check_model(body.model)
    text = chat_text(server, body.messages)
    floor = server.codec.min_tokens(text)
    params = sampling_params(body, default_max_tokens=max(1, server.max_model_len - floor), max_n=server.max_n)
    params = constrained(server, body, params)
    check_length(server, floor, "the messages", body, params, "messages", at_least=True)
    prompt = server.codec.encode(text, add_special_tokens=False)
    if not sets_max_tokens(body):
        params = dataclasses.replace(params, max_new_tokens=max(1, server.max_model_len - len(prompt)))
    return Prepared(body, [checked(server, prompt, "the messages", body, params, "messages")], params, "messages")


def constrained(server, body, params: SamplingParams) -> SamplingParams:
    """`params` with the body's structured output, checked to compile (`hybridspec.serve.structured`)."""
    structured = structured_output(body, lambda s: server.llm.engine.grammars.compile(s))
    return params if structured is None else dataclasses.replace(params, structured=structured)


def tokenize(server, raw: bytes) -> list[int]:
    """vLLM's /tokenize body: the tokens of its prompt, or of its messages through the chat template."""
    body = parse(raw, TokenizeRequest)
    server.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "send either 'prompt' (text) or 'messages' (a chat, through its template)",
                       param="prompt")
    if body.messages is not None:
        return server.codec.encode(chat_text(server, body.messages), add_special_tokens=False)
    return server.codec.encode(body.prompt, add_special_tokens=body.add_special_tokens)


def within_context(server, text: str, what: str, body, params: SamplingParams) -> list[int]:
    """The tokens of `text`, refused (400) before it is tokenized where its length alone proves it too long."""
    check_length(server, server.codec.min_tokens(text), what, body, params, "prompt", at_least=True)
    return checked(server, server.codec.encode(text), what, body, params, "prompt")


def checked(server, ids: list[int], what: str, body, params: SamplingParams, field: str) -> list[int]:
    check_length(server, len(ids), what, body, params, field)
    return ids


def check_length(server, tokens: int, what: str, body, params: SamplingParams, field: str,
                 at_least: bool = False) -> None:
    """ApiError(400) naming `field` where `tokens` prompt tokens and the reply's exceed the context."""
    limit = server.max_model_len
    if tokens + params.max_new_tokens <= limit:
        return
    name = request_field("max_new_tokens", body)
    reply = f"{name}={params.max_new_tokens}" if sets_max_tokens(body) or isinstance(body, CompletionRequest) \
        else "a reply of at least 1 token"
    count = f"at least {tokens}" if at_least else f"{tokens}"
    raise ApiError(400, f"{what} holds {count} tokens; with {reply} that exceeds this model's context, "
                        f"max_model_len={limit} tokens; shorten the {field} or lower {name}", param=field)


def sets_max_tokens(body: CompletionRequest | ChatRequest) -> bool:
    return body.max_tokens is not None or getattr(body, "max_completion_tokens", None) is not None


def chat_text(server, messages: list[ChatMessage]) -> str:
    """The prompt text of a chat: the server's chat template, else the tokenizer's."""
    messages = [{"role": m.role, "content": m.text()} for m in messages]
    if server.chat_template is not None:
        return render_template(server.chat_template, messages, server.codec)
    try:
        return server.codec.chat_prompt(messages)
    except HybridSpecError:  # (its message names offline fixes; a client needs the server's)
        raise ApiError(400, f"the model '{server.name}' has no chat template (neither its tokenizer nor the "
                            "server defines one): start the server with --chat-template FILE|TEXT (a Jinja "
                            "template; chat_template= in create_app), or send the prompt text to "
                            "/v1/completions", param="messages") from None


def render_template(template: str, messages: list[dict], codec) -> str:
    """A Jinja chat template (HF's variables: messages, add_generation_prompt, bos/eos tokens)."""
    tokenizer = getattr(codec, "tokenizer", None)
    if tokenizer is not None:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    import jinja2
    return jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=True,
                                                             bos_token="", eos_token="")
