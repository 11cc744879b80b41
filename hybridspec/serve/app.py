"""`create_app(llm)`: the OpenAI-compatible FastAPI app over an `hs.LLM`.

POST /v1/completions and /v1/chat/completions (JSON, or server-sent events
with `"stream": true`; completions score prompts with `echo`, `max_tokens=0`
and vLLM's `prompt_logprobs`), GET /v1/models and /v1/models/{id}; vLLM's POST
/tokenize and /detokenize, GET /tokenizer_info, /version, /health and /metrics. Every error,
unknown routes' and methods' included, is OpenAI's error body; GET routes
answer HEAD too. A body over the size limit is refused (413) before it is read
(`limits`); a generation body is parsed, checked and tokenized on a worker
thread (`prepare`), never on the event loop or the engine's thread. One
`EngineLoop` thread drives the LLM's engine; every handler submits its
prompts there and reads its sequences' outputs back from an asyncio queue.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

import hybridspec
from hybridspec.errors import ConfigError, InvalidRequestError
from hybridspec.sampling.logprobs import TokenLogprob
from hybridspec.sampling.sampler import SamplingParams
from hybridspec.serve.logprobs import CompletionLogprobs, LogprobStream, chat_logprobs, joined, prompt_logprobs_body
from hybridspec.serve.loop import EngineFailure, EngineLoop
from hybridspec.serve.metrics import Metrics
from hybridspec.serve import DEFAULT_MAX_N, default_max_body_bytes, prepare
from hybridspec.serve.limits import BodyLimit
from hybridspec.serve.protocol import (ApiError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                       finish_reason)
from hybridspec.text.stream import TextStream

log = logging.getLogger("hybridspec.serve")

DISCONNECT_POLL_S = 0.25  # how often a non-streaming handler looks for a client that left


@dataclass
class Event:
    """What one sequence (choice) gained: text, tokens, the logprobs of its
    text, and its end (with the stop string or stop token id that ended it);
    its first event holds its prompt log-probs when they were asked for."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Scoring:
    """What a completions request asks of its prompts: `echo` (each prompt's
    text before its choices' texts, its tokens' log-probs before theirs) and
    vLLM's `prompt_logprobs` (top tokens per entry; None: not asked)."""

    token_ids: list[list[int]]  # [prompts] each prompt's tokens
    texts: list[str] | None  # [prompts] with echo, the text each prompt's choices start with; None: no echo
    prompt_logprobs: int | None
    choices_per_prompt: int


class Server:
    """What the routes share: the LLM, its engine loop, metrics and names."""

    def __init__(self, llm, served_model_name: str, api_key: str | None, max_queue: int, chat_template: str | None,
                 max_n: int):
        self.llm, self.codec, self.name, self.api_key = llm, llm.codec, served_model_name, api_key
        self.chat_template, self.max_n = chat_template, max_n
        self.max_model_len = llm.engine.max_model_len
        self.metrics = Metrics()
        self.loop = EngineLoop(llm.engine, max_queue, self.metrics)
        self.created = int(time.time())

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves '{self.name}'",
                           param="model", type="not_found_error")

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "hybridspec",
                "max_model_len": self.llm.engine.max_model_len}

    async def generate(self, prompts: list[list[int]], params: SamplingParams, copies: int = 1,
                       field: str = "prompt") -> AsyncIterator[Event]:
        """Events of every sequence of `prompts` until all end, each sequence's
        `copies` times (greedy n > 1: n identical choices of one sequence; choice
        index: (prompt * params.n + sample) * copies + copy); leaving early (a
        client that left) aborts what still runs. field: the request's field of
        the prompts, named by a 400 (too long, say)."""
        out: asyncio.Queue = asyncio.Queue()
        ids: list[int] = []
        try:
            for prompt in prompts:
                ids.append(await self._submit(prompt, params, out, field))
            keys = [(rid, s) for rid in ids for s in range(params.n)]
            texts = {key: TextStream(self.codec.decode, params.stop) for key in keys}
            sent = dict.fromkeys(keys, "")
            logprobs = {key: LogprobStream(self.codec.decode) for key in keys} if params.logprobs is not None else {}
            left = len(texts)
            while left:
                request_id, item = await out.get()
                if isinstance(item, EngineFailure):
                    raise ApiError(500, item.message)
                key = (request_id, item.sample_index)
                text = texts[key].push(item.token_ids, item.finished, item.stop_reason)
                sent[key] += text
                entries = logprobs[key].push(item.token_ids, item.logprobs, sent[key], item.finished,
                                             item.stop_reason) if logprobs else None
                left -= item.finished
                index = (ids.index(request_id) * params.n + item.sample_index) * copies
                for copy in range(copies):
                    yield Event(index + copy, text, item.token_ids, entries,
                                finish_reason(item.finish_reason) if item.finished else None,
                                item.stop_reason if item.finished else None, item.prompt_logprobs)
        finally:
            for request_id in ids:
                self.loop.abort(request_id)

    async def _submit(self, prompt: list[int], params: SamplingParams, out: asyncio.Queue, field: str) -> int:
        try:
            return await self.loop.submit(prompt, params, out)
        except InvalidRequestError as error:  # too long for the model or the KV pool: 400, as OpenAI and vLLM
            raise ApiError(400, str(error), param=field) from None


def create_app(llm, *, served_model_name: str = "hybridspec", api_key: str | None = None, max_queue: int = 256,
               chat_template: str | None = None, max_n: int = DEFAULT_MAX_N,
               max_body_bytes: int | None = None) -> FastAPI:
    """The ASGI app serving `llm` (an `hs.LLM`); its engine loop runs while the app does.
    api_key: require `Authorization: Bearer <api_key>` on /v1 routes; max_queue: most
    requests waiting for their first token (more: 503); chat_template: a Jinja chat
    template used instead of the tokenizer's; max_n: most choices per prompt (`n`);
    max_body_bytes: the largest request body (more: 413), default sized to the
    model's context (`hybridspec.serve.default_max_body_bytes`)."""
    if max_body_bytes is not None and max_body_bytes < 1:
        raise ConfigError(f"max_body_bytes={max_body_bytes} must be >= 1, or None for the default sized to the "
                          "model's context")
    server = Server(llm, served_model_name, api_key, max_queue, chat_template, max_n)
    body_limit = max_body_bytes or default_max_body_bytes(server.max_model_len)

    @asynccontextmanager
    async def lifespan(app):
        server.loop.start()
        try:
            yield
        finally:
            server.loop.shutdown()

    app = FastAPI(title="hybridspec", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodyLimit, max_bytes=body_limit)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):  # an unknown route or method
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(ApiError(error.status_code, message).body(), status_code=error.status_code,
                            headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        message = f"{param or 'body'}: {first.get('msg', 'invalid request body')}"
        return JSONResponse(ApiError(400, message, param=param).body(), status_code=400)

    def authorized(request: Request) -> None:
        if server.api_key is not None and request.headers.get("authorization") != f"Bearer {server.api_key}":
            raise ApiError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'")

    v1 = [Depends(authorized)]

    get = ["GET", "HEAD"]  # (HEAD: the GET's status and headers, no body)

    @app.api_route("/health", methods=get)
    async def health():
        return {"status": "ok"}

    @app.api_route("/version", methods=get)
    async def version():
        return {"version": hybridspec.__version__}

    @app.api_route("/metrics", methods=get)
    async def metrics():
        return Response(server.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.api_route("/v1/models", methods=get, dependencies=v1)
    async def models():
        return {"object": "list", "data": [server.model_card()]}

    @app.api_route("/v1/models/{model:path}", methods=get, dependencies=v1)
    async def model(model: str):
        server.check_model(model)
        return server.model_card()

    # The generation routes read the body's bytes here and parse, check and tokenize them on a worker thread
    # (`prepare`): the event loop goes on streaming other requests meanwhile.
    @app.post("/v1/completions", dependencies=v1, openapi_extra=schema_of(CompletionRequest))
    async def completions(request: Request):
        job = await run_in_threadpool(prepare.completion, server, await request.body())
        return await start(request, job, chat=False)

    @app.post("/v1/chat/completions", dependencies=v1, openapi_extra=schema_of(ChatRequest))
    async def chat_completions(request: Request):
        job = await run_in_threadpool(prepare.chat, server, await request.body())
        return await start(request, job, chat=True)

    async def start(request: Request, job: prepare.Prepared, chat: bool):
        body, params = job.body, job.params
        scoring = None
        if not chat:  # completions score their prompts: echo, prompt log-probs
            texts = ([p if isinstance(p, str) else server.codec.decode(p) for p in body.prompts()] if body.echo
                     else None)
            scoring = Scoring(job.prompts, texts, body.prompt_logprobs, body.n)
        response = CompletionResponse(server.name, len(job.prompts) * body.n, params, server.codec, chat=chat,
                                      include_usage=body.include_usage, prompt_tokens=sum(map(len, job.prompts)),
                                      scoring=scoring)
        events = server.generate(job.prompts, params, copies=body.n // params.n, field=job.field)
        return await respond(server, request, body.stream, response, events)

    @app.post("/tokenize", openapi_extra=schema_of(TokenizeRequest))
    async def tokenize(request: Request):
        tokens = await run_in_threadpool(prepare.tokenize, server, await request.body())
        return {"tokens": tokens, "count": len(tokens), "max_model_len": server.max_model_len}

    @app.api_route("/tokenizer_info", methods=get)
    async def tokenizer_info():
        return {**server.codec.info(), "model_max_length": server.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        server.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < llm.target.vocab_size]
        if bad:
            raise ApiError(400, f"tokens holds {bad[0]}, not a token id of this model (0 to "
                                f"{llm.target.vocab_size - 1})", param="tokens")
        return {"prompt": server.codec.decode(body.tokens)}

    return app


async def respond(server: Server, request: Request, stream: bool, response: "CompletionResponse",
                  events: AsyncIterator[Event]):
    """A streaming response of `events`, or the whole JSON body once they end."""
    if stream:
        first = await anext(events)  # errors before the first token (400, 503) answer as such, not as a stream
        return StreamingResponse(response.sse(first, events), media_type="text/event-stream")
    collect = asyncio.ensure_future(response.collect(events))
    while not collect.done():
        await asyncio.wait([collect], timeout=DISCONNECT_POLL_S)
        if not collect.done() and await request.is_disconnected():
            collect.cancel()  # the generator's cleanup aborts the requests
            return Response(status_code=499)
    return JSONResponse(collect.result())


class CompletionResponse:
    """The OpenAI bodies of one request: the JSON of completions or chat, or its SSE chunks."""

    def __init__(self, model: str, num_choices: int, params: SamplingParams, codec, chat: bool, include_usage: bool,
                 prompt_tokens: int, scoring: Scoring | None = None):
        self.model, self.params, self.codec, self.chat, self.include_usage = model, params, codec, chat, include_usage
        self.scoring = scoring  # completions: echo and prompt log-probs, in each choice's first body
        self.scored = [False] * num_choices  # whether choice i's first body went out
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens, self.completion_tokens = prompt_tokens, 0
        self.num_choices = num_choices
        self.logprobs = [CompletionLogprobs(codec.decode) for _ in range(num_choices)]  # (completions' offsets)

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    async def collect(self, events: AsyncIterator[Event]) -> dict:
        texts, tokens, logprobs = [""] * self.num_choices, [[] for _ in range(self.num_choices)], \
            [[] for _ in range(self.num_choices)]
        reasons, stop_reasons = [None] * self.num_choices, [None] * self.num_choices
        prompt_logprobs = [None] * self.num_choices
        async for e in events:
            texts[e.index] += e.text
            tokens[e.index] += e.token_ids
            logprobs[e.index] += e.logprobs or []
            reasons[e.index] = e.finish_reason or reasons[e.index]
            stop_reasons[e.index] = e.stop_reason if e.finish_reason else stop_reasons[e.index]
            prompt_logprobs[e.index] = e.prompt_logprobs or prompt_logprobs[e.index]
            self.completion_tokens += len(e.token_ids)
        choices = [self._choice(i, texts[i], logprobs[i], reasons[i], stop_reasons[i], chunk=False,
                                prompt_logprobs=prompt_logprobs[i]) for i in range(self.num_choices)]
        return {**self._head(chunk=False), "choices": choices, "usage": self.usage()}

    async def sse(self, first: Event, events: AsyncIterator[Event]) -> AsyncIterator[str]:
        if self.chat:
            for i in range(self.num_choices):  # OpenAI opens each choice with the role
                yield _sse({**self._head(chunk=True), "choices": [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}]})
        try:
            yield self._chunk(first)
            async for e in events:
                yield self._chunk(e)
        finally:  # a client that left: its requests are aborted now, not when the generator is collected
            await events.aclose()
        if self.include_usage:
            yield _sse({**self._head(chunk=True), "choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"

    def _chunk(self, e: Event) -> str:
        self.completion_tokens += len(e.token_ids)
        body = {**self._head(chunk=True), "choices": [self._choice(e.index, e.text, e.logprobs or [], e.finish_reason,
                                                                   e.stop_reason, chunk=True,
                                                                   prompt_logprobs=e.prompt_logprobs)]}
        if self.include_usage:
            body["usage"] = None
        return _sse(body)

    def _choice(self, index: int, text: str, logprobs: list[TokenLogprob], reason: str | None,
                stop_reason: int | str | None, chunk: bool,
                prompt_logprobs: list[TokenLogprob | None] | None = None) -> dict:
        wants = self.params.logprobs is not None
        if self.chat:
            content = {"content": text} if chunk else {"role": "assistant", "content": text}
            return {"index": index, "delta" if chunk else "message": content,
                    "logprobs": chat_logprobs(logprobs, self.codec.decode) if wants else None,
                    "finish_reason": reason, "stop_reason": stop_reason}
        echo, echo_logprobs, scored = self._scoring(index, prompt_logprobs)  # (before the body: text offsets)
        choice = {"index": index, "text": echo + text,
                  "logprobs": joined(echo_logprobs, self.logprobs[index].body(logprobs)) if wants else None,
                  "finish_reason": reason, "stop_reason": stop_reason}
        if self.scoring.prompt_logprobs is not None:
            choice["prompt_logprobs"] = scored
        return choice

    def _scoring(self, index: int, entries: list[TokenLogprob | None] | None) -> tuple[str, dict | None, list | None]:
        """Choice `index`'s echoed prompt text, the echoed tokens' `logprobs` part and its
        vLLM `prompt_logprobs`, in its first body only ("", None, None after it)."""
        scoring = self.scoring
        if self.scored[index]:
            return "", None, None
        self.scored[index] = True
        prompt = index // scoring.choices_per_prompt
        echo, echo_logprobs, scored = "", None, None
        if scoring.texts is not None:
            echo = scoring.texts[prompt]
            if self.params.logprobs is not None:
                echo_logprobs = self.logprobs[index].prompt(scoring.token_ids[prompt], entries, self.params.logprobs)
        if scoring.prompt_logprobs is not None:
            scored = prompt_logprobs_body(entries, scoring.prompt_logprobs, self.codec.decode)
        return echo, echo_logprobs, scored


def schema_of(model) -> dict:
    """The OpenAPI entry of a JSON body the route parses itself (`prepare`)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
