"""The request-body size limit of `hybridspec serve`: an ASGI middleware that
refuses a body over `--max-body-bytes` with 413 before the app reads it.

A body that declares its length (Content-Length) is refused from the header;
one sent in chunks is counted as it arrives and refused once it passes the
limit. Either way the app never sees it: nothing of it is parsed or
tokenized, so a huge request costs the server no more than reading it.
"""
from __future__ import annotations

import json

from hybridspec.serve.protocol import ApiError

# A client that sent no `Expect: 100-continue` is already sending the body: the refusal reads (and drops)
# up to this much of it first, so that the client, still writing, gets the 413 instead of a reset
# connection; past it, the connection is closed with the answer.
DRAIN_BYTES = 64 << 20


class BodyLimit:
    """ASGI middleware: requests with a body over `max_bytes` answer 413 (OpenAI's error body)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            if headers.get(b"expect", b"").lower() != b"100-continue":
                await drain(receive, DRAIN_BYTES)
            return await self.refuse(send, f"{int(declared)} bytes")
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                if more:
                    await drain(receive, DRAIN_BYTES)
                return await self.refuse(send, f"more than {self.max_bytes} bytes")
        await self.app(scope, replay(b"".join(chunks), receive), send)

    async def refuse(self, send, size: str) -> None:
        error = ApiError(413, f"the request body ({size}) is larger than this server's limit of {self.max_bytes} "
                              "bytes; send a shorter prompt, or start the server with a higher --max-body-bytes "
                              "(max_body_bytes= in create_app)", type="invalid_request_error")
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


async def drain(receive, most: int) -> None:
    """Read and drop what is left of a body, at most `most` bytes of it."""
    read = 0
    while read <= most:
        message = await receive()
        if message["type"] != "http.request":
            return
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def replay(body: bytes, receive):
    """A `receive` that hands the app the body already read, then what the client sends next (its leaving)."""
    sent = False

    async def again():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return again
