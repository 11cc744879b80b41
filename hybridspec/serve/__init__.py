"""`hybridspec serve`: an OpenAI-compatible HTTP server over an `hs.LLM`
(`create_app` for embedding the ASGI app, `serve` to run it with uvicorn).
Needs the `[serve]` extra: FastAPI, uvicorn, pydantic, prometheus-client."""
from __future__ import annotations

DEFAULT_MAX_N = 16  # most choices per prompt a request may ask for (`create_app(max_n=)`, --max-n)


def create_app(llm, **kwargs):
    """The FastAPI app serving `llm` (`hybridspec.serve.app.create_app`)."""
    from hybridspec.serve.app import create_app as make
    return make(llm, **kwargs)


def serve(llm=None, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", **kwargs) -> None:
    """Serve `llm` (default: `hs.LLM()`, the embedded pair) until interrupted."""
    import uvicorn

    if llm is None:
        from hybridspec.llm import LLM
        llm = LLM(num_draft_tokens="auto")
    uvicorn.run(create_app(llm, **kwargs), host=host, port=port, log_level=log_level)
