"""No head-of-line blocking in `hybridspec serve`: a body over the size limit
answers 413 from its Content-Length or as its chunks arrive, the default
limit follows the context, a prompt over the context answers 400 before it is
tokenized, bodies are tokenized on neither the event loop's nor the engine's
thread, and while 10 MB bodies are in flight another stream never goes silent
for more than 0.5 s."""
import json
import random
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("uvicorn")

import hybridspec as hs  # noqa: E402
from hybridspec.serve import default_max_body_bytes  # noqa: E402
from test_serve import NAME, LiveServer, wait_until  # noqa: E402

CONTEXT = 512
BIG = 10_000_000
MOST_SILENCE_S = 0.5


@pytest.fixture(scope="module")
def llm():
    return hs.LLM(max_batch_size=4, max_model_len=CONTEXT)


def padded(size: int) -> bytes:
    """A good completions body of exactly `size` bytes (JSON whitespace after the object)."""
    body = json.dumps({"model": NAME, "prompt": "x", "max_tokens": 1}).encode()
    return body + b" " * (size - len(body))


def post(url: str, content, **headers) -> httpx.Response:
    return httpx.post(url + "/v1/completions", content=content, timeout=60,
                      headers={"content-type": "application/json", **headers})


def test_a_body_over_the_limit_answers_413_from_its_length_or_its_chunks(llm):
    with LiveServer(llm, max_body_bytes=1000) as server:
        assert post(server.url, padded(1000)).status_code == 200
        declared = post(server.url, padded(1001))
        assert declared.status_code == 413
        error = declared.json()["error"]
        assert "1000" in error["message"] and "--max-body-bytes" in error["message"] and error["code"] == 413
        chunked = post(server.url, (padded(1200)[i:i + 100] for i in range(0, 1200, 100)))  # no Content-Length
        assert chunked.request.headers.get("transfer-encoding") == "chunked"
        assert chunked.status_code == 413 and "max_body_bytes" in chunked.json()["error"]["message"]
        assert post(server.url, (padded(900)[i:i + 100] for i in range(0, 900, 100))).status_code == 200
        assert expecting_continue(server.url, 5000).startswith(b"HTTP/1.1 413")  # the body is never sent
        assert httpx.get(server.url + "/health").status_code == 200


def expecting_continue(url: str, length: int) -> bytes:
    """The first bytes answered to headers that declare `length` bytes and wait for `100 Continue`."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {length}\r\nExpect: 100-continue\r\n\r\n".encode())
        return sock.recv(4096)


def test_the_default_limit_follows_the_context(llm):
    limit = default_max_body_bytes(llm.engine.max_model_len)
    assert default_max_body_bytes(2 * CONTEXT) > limit > 4 * CONTEXT  # a few bytes a token or more
    with LiveServer(llm) as server:
        assert post(server.url, padded(limit)).status_code == 200
        assert post(server.url, padded(limit + 1)).status_code == 413


def test_a_prompt_over_the_context_is_refused_before_it_is_tokenized(llm, monkeypatch):
    threads = []
    encode = llm.codec.encode

    def spy(text, *args, **kwargs):
        threads.append(threading.current_thread())
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(llm.codec, "encode", spy)
    with LiveServer(llm) as server:
        r = post(server.url, json.dumps({"model": NAME, "prompt": "é" * CONTEXT, "max_tokens": 1}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert f"at least {2 * CONTEXT} tokens" in r.json()["error"]["message"]
        assert "max_tokens=1" in r.json()["error"]["message"] and not threads
        ids = post(server.url, json.dumps({"model": NAME, "prompt": [120] * (CONTEXT + 1), "max_tokens": 1}))
        assert ids.status_code == 400 and ids.json()["error"]["param"] == "prompt"
        fits = post(server.url, json.dumps({"model": NAME, "prompt": "x" * (CONTEXT - 2), "max_tokens": 2}))
        assert fits.status_code == 200 and fits.json()["usage"]["prompt_tokens"] == CONTEXT - 2
        chat = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"model": NAME, "messages": [{"role": "user", "content": "x" * CONTEXT}]})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
        assert "a reply of at least 1 token" in chat.json()["error"]["message"]
        event_loop = server.thread
    assert threads and all(t is not event_loop and t.name != "hybridspec-engine-loop" for t in threads)


def test_min_tokens_is_a_lower_bound_where_one_is_sound():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from hybridspec.text.codec import ByteCodec, TokenizerCodec
    rng = random.Random(0)
    source = Path(hs.__file__).read_text()
    samples = [source[rng.randrange(len(source)):][:rng.randint(1, 2000)] + "é漢🙂" * rng.randint(0, 4)
               for _ in range(20)]
    assert all(ByteCodec().min_tokens(t) == len(ByteCodec().encode(t)) for t in samples)  # a token per byte
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([source] * 3, vocab_size=400, min_frequency=1, show_progress=False)
    bpe.add_special_tokens(["<|a-long-special-token|>"])
    codec = TokenizerCodec(transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer), "bpe")
    info = codec.info()  # /tokenizer_info's body
    assert info["tokenizer_class"] == type(codec.tokenizer).__name__ and info["eos_token"] is None
    samples.append("<|a-long-special-token|>" * 50)
    bounds = [(codec.min_tokens(t), len(codec.encode(t))) for t in samples]
    assert all(0 < low <= count for low, count in bounds), bounds
    bpe._tokenizer.normalizer = tokenizers.normalizers.NFC()  # may compose characters: no sound bound
    assert TokenizerCodec(transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer), "nfc") \
        .min_tokens(samples[0]) == 0


def test_other_streams_go_on_while_10_mb_bodies_are_in_flight(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benches"))
    from serve_hol import Stream  # the stream the bench measures with: its chunks' arrival times
    text, ids = {"model": NAME, "prompt": "x" * (BIG - 64)}, {"model": NAME, "prompt": [120] * (BIG // 5 - 64)}
    bodies = {"a text prompt over the context": (json.dumps(text).encode(), 400),
              "token ids over the context": (json.dumps(ids).encode(), 400),
              "a body over the limit": (padded(BIG + 1), 413)}
    with LiveServer(hs.LLM(max_batch_size=2), max_body_bytes=BIG) as server:
        stream = Stream(server.url, model=NAME)
        stream.thread.start()
        wait_until(lambda: len(stream.times) >= 5, "the stream's first chunks")
        windows = {}
        for name, (body, status) in bodies.items():
            began = time.perf_counter()
            assert post(server.url, body).status_code == status, name
            windows[name] = (began, time.perf_counter())
        last = time.perf_counter()
        wait_until(lambda: stream.times[-1] > last, "a chunk after the big requests")  # the stream still runs
        stream.stop.set()
        stream.thread.join(timeout=60)
    gaps = {name: stream.longest_gap(*window) for name, window in windows.items()}
    print("longest silence of the stream while each body was in flight (s):", gaps)
    assert all(gap < MOST_SILENCE_S for gap in gaps.values()), gaps  # a window with no gap (nan) fails too
