"""`create_app(llm)`: the OpenAI-compatible FastAPI app over an `hs.LLM`.

POST /v1/completions and /v1/chat/completions (JSON, or server-sent events
with `"stream": true`), GET /v1/models, /health and /metrics. One
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

from hybridspec.errors import HybridSpecError, InvalidRequestError
from hybridspec.sampling.logprobs import TokenLogprob
from hybridspec.sampling.sampler import SamplingParams
from hybridspec.serve.loop import EngineFailure, EngineLoop
from hybridspec.serve.metrics import Metrics
from hybridspec.serve.protocol import ApiError, ChatRequest, CompletionRequest, finish_reason, sampling_params
from hybridspec.text.stream import TextStream

log = logging.getLogger("hybridspec.serve")

DISCONNECT_POLL_S = 0.25  # how often a non-streaming handler looks for a client that left


@dataclass
class Event:
    """What one sequence (choice) gained: text, tokens, logprobs, and its end."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None


class Server:
    """What the routes share: the LLM, its engine loop, metrics and names."""

    def __init__(self, llm, served_model_name: str, api_key: str | None, max_queue: int, chat_template: str | None):
        self.llm, self.codec, self.name, self.api_key = llm, llm.codec, served_model_name, api_key
        self.chat_template = chat_template
        self.metrics = Metrics()
        self.loop = EngineLoop(llm.engine, max_queue, self.metrics)
        self.created = int(time.time())

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves '{self.name}'",
                           param="model", type="not_found_error")

    def chat_prompt(self, body: ChatRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if self.chat_template is not None:
            text = render_template(self.chat_template, messages, self.codec)
        else:
            try:
                text = self.codec.chat_prompt(messages)
            except HybridSpecError:  # (its message names offline fixes; a client needs the server's)
                raise ApiError(400, f"the model '{self.name}' has no chat template (neither its tokenizer nor the "
                                    "server defines one): start the server with --chat-template FILE|TEXT (a Jinja "
                                    "template; chat_template= in create_app), or send the prompt text to "
                                    "/v1/completions", param="messages") from None
        return self.codec.encode(text, add_special_tokens=False)

    def encode(self, prompt: str | list[int]) -> list[int]:
        return self.codec.encode(prompt) if isinstance(prompt, str) else list(prompt)

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> AsyncIterator[Event]:
        """Events of every sequence of `prompts` (choice index: prompt * n + sample) until all end;
        leaving early (a client that left) aborts what still runs."""
        out: asyncio.Queue = asyncio.Queue()
        ids: list[int] = []
        try:
            for prompt in prompts:
                ids.append(await self._submit(prompt, params, out))
            texts = {(rid, s): TextStream(self.codec.decode, params.stop) for rid in ids for s in range(params.n)}
            left = len(texts)
            while left:
                request_id, item = await out.get()
                if isinstance(item, EngineFailure):
                    raise ApiError(500, item.message)
                index = ids.index(request_id) * params.n + item.sample_index
                text = texts[request_id, item.sample_index].push(item.token_ids, item.finished, item.stop_reason)
                left -= item.finished
                yield Event(index, text, item.token_ids, item.logprobs,
                            finish_reason(item.finish_reason) if item.finished else None)
        finally:
            for request_id in ids:
                self.loop.abort(request_id)

    async def _submit(self, prompt: list[int], params: SamplingParams, out: asyncio.Queue) -> int:
        try:
            return await self.loop.submit(prompt, params, out)
        except InvalidRequestError as error:
            status = 413 if "max_model_len" in str(error) or "KV pages" in str(error) else 400
            raise ApiError(status, str(error), param="prompt") from None


def render_template(template: str, messages: list[dict], codec) -> str:
    """A Jinja chat template (HF's variables: messages, add_generation_prompt, bos/eos tokens)."""
    tokenizer = getattr(codec, "tokenizer", None)
    if tokenizer is not None:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    import jinja2
    return jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=True,
                                                             bos_token="", eos_token="")


def create_app(llm, *, served_model_name: str = "hybridspec", api_key: str | None = None, max_queue: int = 256,
               chat_template: str | None = None) -> FastAPI:
    """The ASGI app serving `llm` (an `hs.LLM`); its engine loop runs while the app does.
    api_key: require `Authorization: Bearer <api_key>` on /v1 routes; max_queue: most
    requests waiting for their first token (more: 503); chat_template: a Jinja chat
    template used instead of the tokenizer's (a byte-level model has none)."""
    server = Server(llm, served_model_name, api_key, max_queue, chat_template)

    @asynccontextmanager
    async def lifespan(app):
        server.loop.start()
        try:
            yield
        finally:
            server.loop.shutdown()

    app = FastAPI(title="hybridspec", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status)

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

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=v1)
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": server.created,
                                            "owned_by": "hybridspec", "max_model_len": llm.engine.max_model_len}]}

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest, request: Request):
        server.check_model(body.model)
        params = sampling_params(body)
        prompts = [server.encode(p) for p in body.prompts()]
        response = CompletionResponse(server.name, prompts, params, server.codec, chat=False,
                                      include_usage=body.include_usage)
        return await respond(server, request, body.stream, response, server.generate(prompts, params))

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: ChatRequest, request: Request):
        server.check_model(body.model)
        prompts = [server.chat_prompt(body)]
        params = sampling_params(body, default_max_tokens=max(1, llm.engine.max_model_len - len(prompts[0])))
        response = CompletionResponse(server.name, prompts, params, server.codec, chat=True,
                                      include_usage=body.include_usage)
        return await respond(server, request, body.stream, response, server.generate(prompts, params))

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

    def __init__(self, model: str, prompts: list[list[int]], params: SamplingParams, codec, chat: bool,
                 include_usage: bool):
        self.model, self.params, self.codec, self.chat, self.include_usage = model, params, codec, chat, include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = sum(map(len, prompts))
        self.completion_tokens = 0
        self.num_choices = len(prompts) * params.n

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    async def collect(self, events: AsyncIterator[Event]) -> dict:
        texts, tokens, logprobs = [""] * self.num_choices, [[] for _ in range(self.num_choices)], \
            [[] for _ in range(self.num_choices)]
        reasons = [None] * self.num_choices
        async for e in events:
            texts[e.index] += e.text
            tokens[e.index] += e.token_ids
            logprobs[e.index] += e.logprobs or []
            reasons[e.index] = e.finish_reason or reasons[e.index]
            self.completion_tokens += len(e.token_ids)
        choices = [self._choice(i, texts[i], logprobs[i], reasons[i], chunk=False) for i in range(self.num_choices)]
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
        body = {**self._head(chunk=True), "choices": [self._choice(e.index, e.text, e.logprobs or [],
                                                                   e.finish_reason, chunk=True)]}
        if self.include_usage:
            body["usage"] = None
        return _sse(body)

    def _choice(self, index: int, text: str, logprobs: list[TokenLogprob], reason: str | None, chunk: bool) -> dict:
        wants = self.params.logprobs is not None
        if self.chat:
            content = {"content": text} if chunk else {"role": "assistant", "content": text}
            return {"index": index, "delta" if chunk else "message": content,
                    "logprobs": self._chat_logprobs(logprobs) if wants else None, "finish_reason": reason}
        return {"index": index, "text": text, "logprobs": self._completion_logprobs(logprobs) if wants else None,
                "finish_reason": reason}

    def _token(self, token_id: int) -> str:
        return self.codec.decode([token_id])

    def _chat_logprobs(self, logprobs: list[TokenLogprob]) -> dict:
        def entry(token_id, logprob):
            text = self._token(token_id)
            return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs]}

    def _completion_logprobs(self, logprobs: list[TokenLogprob]) -> dict:
        tokens = [self._token(lp.token_id) for lp in logprobs]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
                "top_logprobs": [{self._token(t): _finite(v) for t, v in lp.top} for lp in logprobs],
                "text_offset": offsets}


def _finite(value: float) -> float:
    """JSON has no -inf: a token the filters removed reads as the most negative float."""
    return value if value > -float("inf") else -9999.0


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
