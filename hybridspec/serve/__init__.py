"""`hybridspec serve`: an OpenAI-compatible HTTP server over an `hs.LLM`
(`create_app` for embedding the ASGI app, `serve` to run it with uvicorn).
Needs the `[serve]` extra: FastAPI, uvicorn, pydantic, prometheus-client."""
from __future__ import annotations

DEFAULT_MAX_N = 16  # most choices per prompt a request may ask for (`create_app(max_n=)`, --max-n)

# The default body limit (--max-body-bytes): BYTES_PER_TOKEN bytes for each token of the context, plus
# ENVELOPE_BYTES. A token of the usual tokenizers covers about 4 bytes of English and rarely more than 16
# (runs of spaces, long words); JSON may spell a byte as 6 ("\u00e9"), and a token id as up to 8
# (" 151935,"). 64 bytes per token covers a prompt of the whole context in any of these spellings; the
# envelope (1 MiB) holds the other fields, chat messages' framing and a batch of a few dozen prompts of the
# usual length.
BYTES_PER_TOKEN = 64
ENVELOPE_BYTES = 1 << 20


def default_max_body_bytes(max_model_len: int) -> int:
    """The default body limit of a server whose sequences hold at most `max_model_len` tokens."""
    return BYTES_PER_TOKEN * max_model_len + ENVELOPE_BYTES


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
