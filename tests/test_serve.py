"""`hybridspec serve` against the official `openai` client: a live uvicorn
server on 127.0.0.1 (an ephemeral port) over the embedded pair. Greedy
outputs equal `hs.LLM().generate` token for token, streamed deltas add up to
the non-streamed text, chat goes through a real tokenizer's chat template, a
client that leaves mid-stream frees its pages, a failing engine step fails
the requests of its batch (500) while the waiting ones complete and the
server goes on, and a small load of concurrent clients (some leaving early,
some sending bad bodies) completes with /health answering throughout."""
import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import hybridspec as hs  # noqa: E402
from hybridspec.serve import create_app  # noqa: E402

NAME = "embedded"
LOAD_CLIENTS = 32
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


class LiveServer:
    """A uvicorn server of `create_app(llm)` in a thread; one per LLM at a time
    (its engine loop is the only thread that may drive the LLM's engine)."""

    def __init__(self, llm, chat_template=TEMPLATE, **kwargs):
        self.app = create_app(llm, served_model_name=NAME, chat_template=chat_template, **kwargs)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        wait_until(lambda: self.server.started, "the server to start")
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def wait_until(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def llm():
    """The served LLM: only the server's engine loop may drive it."""
    return hs.LLM(max_batch_size=8)


@pytest.fixture(scope="module")
def offline():
    """The same pair, for the outputs a client should get."""
    return hs.LLM(max_batch_size=8)


@pytest.fixture(scope="module")
def live(llm):
    with LiveServer(llm, max_queue=64) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)


PROMPTS = ["def add(a, b):", "class Stack:\n    def push(self, item):"]
FAULT_PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "x = [1, 2", "for i in range(10):"]


def test_completions_greedy_equal_llm_generate_and_stream_adds_up(offline, client):
    want = offline.generate(PROMPTS, hs.SamplingParams(max_new_tokens=24))
    got = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=24, temperature=0)
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert [c.finish_reason for c in got.choices] == ["length", "length"]
    assert got.usage.completion_tokens == 48 and got.usage.prompt_tokens == sum(len(p.encode()) for p in PROMPTS)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want[0].text
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-2].choices[0].finish_reason == "length"


def test_stop_strings_n_and_logprobs(offline, client):
    params = hs.SamplingParams(max_new_tokens=40, stop=["self"])
    [want] = offline.generate(PROMPTS[1:], params)
    got = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0, stop="self")
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    streamed = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0, stop="self",
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want.text
    sampled = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0.8, seed=5, n=3,
                                        logprobs=2)
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]
    for c in sampled.choices:
        assert len(c.logprobs.token_logprobs) == 8 and all(len(t) <= 3 for t in c.logprobs.top_logprobs)
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)


def test_chat_stream_and_not(offline, client):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    prompt = TEMPLATE.replace("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}",
                              "<user>def add(a, b):\n")
    [want] = offline.generate([prompt], hs.SamplingParams(max_new_tokens=20))
    got = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=20, temperature=0,
                                         logprobs=True, top_logprobs=1)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert len(got.choices[0].logprobs.content) == 20
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


WORDS = ["[UNK]", "</s>", "<system>", "<user>", "<assistant>", "hi", "there", "x", "y", "z", "def", "add", "(", ")"]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant> {% endif %}")


def save_tiny_model_and_tokenizer(directory):
    """A tiny random Bamba and a word-level HF tokenizer of its vocabulary,
    with a chat template, saved together (built offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from oracles import bamba
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    bamba(seed=0, vocab=len(WORDS)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return tokenizer


def test_chat_through_the_tokenizers_template_and_a_400_without_one(tmp_path):
    from hybridspec.serve import prepare
    tokenizer = save_tiny_model_and_tokenizer(tmp_path)
    llm = hs.LLM(str(tmp_path), max_batch_size=2, max_model_len=64)
    messages = [{"role": "system", "content": "x y"}, {"role": "user", "content": "def add ( x y )"}]
    [want] = llm.chat(messages, hs.SamplingParams(max_new_tokens=8))  # before the server drives the engine
    with LiveServer(llm, chat_template=None) as server:
        [prompt] = prepare.chat(server.app.state.server, json.dumps({"messages": messages}).encode()).prompts
        assert prompt == tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert prompt[0] == WORDS.index("<system>") and prompt[-1] == WORDS.index("<assistant>")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        got = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=8, temperature=0)
        assert got.choices[0].message.content == want.text
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(prompt), len(want.token_ids))
        assert got.choices[0].finish_reason == want.finish_reason
        chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "no_template")
    with LiveServer(hs.LLM(str(tmp_path), tokenizer=str(tmp_path / "no_template"), max_batch_size=1,
                           max_model_len=64), chat_template=None) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=NAME, messages=messages, max_tokens=4)
        assert bad.value.body["param"] == "messages" and "--chat-template" in bad.value.body["message"]
        assert client.completions.create(model=NAME, prompt="hi there", max_tokens=2).usage.prompt_tokens == 2


def test_errors_follow_openai(live, client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=NAME, prompt="x", max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens" and "max_tokens=-1" in bad.value.body["message"]
    assert "max_new_tokens" not in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.completions.create(model=NAME, prompt="x", logit_bias={"1": 2})
    assert unsupported.value.body["param"] == "logit_bias"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")
    r = httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": "x", "temperature": "hot"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": "x" * 5000, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["param"] == "prompt"
    r = httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2,
                                                        "vendor_extension": 1, "echo": False, "logit_bias": {}})
    assert r.status_code == 200  # unknown fields: ignored with a warning; unsupported ones asking for nothing too
    assert client.models.list().data[0].id == NAME


def test_api_key_required():
    with LiveServer(hs.LLM(max_batch_size=2), api_key="secret") as server:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200
        ok = openai.OpenAI(base_url=server.url + "/v1", api_key="secret", max_retries=0)
        assert ok.completions.create(model=NAME, prompt="a", max_tokens=2).choices[0].finish_reason == "length"


def test_a_client_leaving_mid_stream_frees_its_pages(llm, live):
    engine = llm.engine
    wait_until(lambda: engine.memory().is_idle(), "an idle engine")
    with httpx.stream("POST", live.url + "/v1/completions", json={
            "model": NAME, "prompt": PROMPTS[0], "max_tokens": 3000, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert engine.memory().target.kv_pages_used > 0
    wait_until(lambda: engine.memory().is_idle(), "the pages of the request that left")
    assert b"hybridspec_kv_pages_used" in httpx.get(live.url + "/metrics").content


def test_a_client_leaving_a_non_streaming_request_frees_its_pages(llm, live):
    engine = llm.engine
    wait_until(lambda: engine.memory().is_idle(), "an idle engine")
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(live.url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.5))
    wait_until(lambda: engine.memory().is_idle(), "the pages of the request that left")


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(llm, live, client, monkeypatch):
    step = llm.engine.step
    calls = {"n": 0}

    def fail_once(first_tokens=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return step(first_tokens)

    monkeypatch.setattr(llm.engine, "step", fail_once)
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=NAME, prompt="a", max_tokens=4)
    wait_until(lambda: llm.engine.memory().is_idle(), "the failed request's pages")
    assert client.completions.create(model=NAME, prompt="a", max_tokens=4).choices[0].finish_reason == "length"


def fault_in_a_round(engine, when):
    """Make the first round of `engine` for which `when()` holds raise; returns
    what `step_request_ids` named then (the failing step's batch)."""
    round_, seen = engine._round, {}

    def faulty(*args, **kwargs):
        if not seen and when():
            seen["batch"] = engine.step_request_ids()
            raise RuntimeError("injected fault")
        return round_(*args, **kwargs)

    engine._round = faulty
    return seen


def test_a_step_that_raises_names_its_batch_and_the_waiting_requests_run_on(offline):
    llm = hs.LLM(max_batch_size=2)
    engine, params = llm.engine, hs.SamplingParams(max_new_tokens=10)
    ids = [engine.add_request(llm.codec.encode(p), params) for p in FAULT_PROMPTS[:4]]
    seen = fault_in_a_round(engine, lambda: True)
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()
    assert seen["batch"] == engine.step_request_ids() == ids[:2]  # admitted in the step, then its round raised
    for request_id in ids[:2]:
        engine.abort(request_id)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
            assert out.request_id in ids[2:] or out.finish_reason == "abort"
    want = offline.generate(FAULT_PROMPTS[2:4], params)
    assert [got[i] for i in ids[2:]] == [w.token_ids for w in want]
    assert engine.step_request_ids() == [] and engine.memory().is_idle()


def test_a_failing_step_fails_only_its_batch_while_waiting_requests_complete(offline):
    """max_batch_size 2 and 5 clients: the step that raises holds two of them
    (500); the three still waiting in the engine's queue get their offline text."""
    llm = hs.LLM(max_batch_size=2)
    engine, count = llm.engine, len(FAULT_PROMPTS)
    want = [w.text for w in offline.generate(FAULT_PROMPTS, hs.SamplingParams(max_new_tokens=12))]
    with LiveServer(llm) as server:
        loop = server.app.state.server.loop
        # the first round waits for every client; the first with a full batch and others queued raises
        seen = fault_in_a_round(engine, lambda: len(engine.scheduler.waiting) >= 2)
        round_ = engine._round

        def first_waits(*args, **kwargs):
            # the running ones have their first tokens (handed out before the round)
            wait_until(lambda: loop.num_waiting == count - len(engine.scheduler.running), "every client to be queued")
            engine._round = round_
            return round_(*args, **kwargs)

        engine._round = first_waits

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json={
                    "model": NAME, "prompt": p, "max_tokens": 12, "temperature": 0}) for p in FAULT_PROMPTS))

        replies = asyncio.run(main())
        assert len(seen["batch"]) == 2
        assert sorted(r.status_code for r in replies) == [200] * (count - 2) + [500] * 2
        assert all("injected fault" in r.json()["error"]["message"] for r in replies if r.status_code == 500)
        assert all(r.json()["choices"][0]["text"] == text for r, text in zip(replies, want) if r.status_code == 200)
        wait_until(lambda: engine.memory().is_idle() and not engine.has_unfinished_requests(), "every page back")
        assert b"hybridspec_engine_failures_total 1.0" in httpx.get(server.url + "/metrics").content


def test_past_max_queue_new_requests_get_503():
    llm = hs.LLM(max_batch_size=2)  # its own: a second server must not drive the shared engine
    release, step = threading.Event(), llm.engine.step

    def held_step(first_tokens=None):  # the engine loop stalls: the first request keeps waiting
        release.wait(20)
        return step(first_tokens)

    with LiveServer(llm, max_queue=1) as server:
        llm.engine.step = held_step
        try:
            first = threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                                     kwargs={"json": {"model": NAME, "prompt": "a", "max_tokens": 2}, "timeout": 30})
            first.start()
            wait_until(lambda: server.app.state.server.loop.num_waiting == 1, "the first request to wait")
            r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "b", "max_tokens": 2})
            assert r.status_code == 503 and "max-queue" in r.json()["error"]["message"]
            assert r.headers["retry-after"] == "1"
        finally:
            release.set()
            del llm.engine.step
        first.join(30)
    assert llm.engine.memory().is_idle() and not llm.engine.has_unfinished_requests()


def test_bounded_load_with_early_leavers_and_bad_bodies(llm, offline, live):
    """LOAD_CLIENTS concurrent streaming clients (every fourth leaves after its
    first chunk, every fifth sends a bad body) while /health is polled: every
    good one gets its offline text, the bad ones 400, and every page returns."""
    clients = LOAD_CLIENTS
    prompts = [PROMPTS[i % 2] + " " * (i % 5) + "#" * (i % 3) for i in range(clients)]
    lengths = [4 + 5 * (i % 9) for i in range(clients)]
    want = {i: offline.generate([prompts[i]], hs.SamplingParams(max_new_tokens=lengths[i]))[0].text
            for i in range(clients)}
    health = []

    async def one(http, i):
        if i % 5 == 4:  # a bad body
            r = await http.post("/v1/completions", json={"model": NAME, "prompt": prompts[i], "n": 0})
            return "bad", r.status_code
        body = {"model": NAME, "prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0, "stream": True}
        text = ""
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += __import__("json").loads(line[6:])["choices"][0]["text"]
                    if i % 4 == 3:
                        return "left", None
        return "done", text

    async def poll_health(http, stop):
        while not stop.is_set():
            health.append((await http.get("/health")).status_code)
            await asyncio.sleep(0.02)

    async def main():
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
            stop = asyncio.Event()
            poller = asyncio.create_task(poll_health(http, stop))
            began = time.perf_counter()
            results = await asyncio.gather(*(one(http, i) for i in range(clients)))
            seconds = time.perf_counter() - began
            stop.set()
            await poller
            return results, seconds

    results, seconds = asyncio.run(main())
    for i, (kind, value) in enumerate(results):
        if kind == "bad":
            assert value == 400
        elif kind == "done":
            assert value == want[i]
    kinds = [kind for kind, _ in results]
    bad = [i % 5 == 4 for i in range(clients)]
    left = [i % 4 == 3 and not b for i, b in enumerate(bad)]
    assert kinds == ["bad" if b else "left" if l else "done" for b, l in zip(bad, left)]
    assert health and set(health) == {200}
    wait_until(lambda: llm.engine.memory().is_idle(), "every page back")
    print(f"load: {clients} clients, {sum(lengths[i] for i, k in enumerate(kinds) if k == 'done')} tokens to the "
          f"clients that stayed, in {seconds:.2f} s; /health answered {len(health)} times")


def test_openai_fields_map_onto_sampling_params():
    from hybridspec.serve.protocol import ChatRequest, CompletionRequest, sampling_params
    body = CompletionRequest(prompt="x", max_tokens=7, temperature=0.5, top_p=0.9, n=2, stop="\n", seed=3,
                             presence_penalty=0.5, frequency_penalty=0.25, logprobs=2, top_k=5, min_p=0.1,
                             repetition_penalty=1.2, ignore_eos=True)
    assert sampling_params(body) == hs.SamplingParams(
        max_new_tokens=7, temperature=0.5, top_p=0.9, n=2, stop=("\n",), seed=3, presence_penalty=0.5,
        frequency_penalty=0.25, logprobs=2, top_k=5, min_p=0.1, repetition_penalty=1.2, ignore_eos=True)
    chat = ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=9, max_completion_tokens=4,
                       logprobs=True, top_logprobs=3, temperature=0)
    params = sampling_params(chat)
    assert (params.max_new_tokens, params.logprobs, params.temperature) == (4, 3, 0.0)


def test_serve_command_line_refuses_a_bad_flag_before_loading(capsys):
    from hybridspec.cli.main import main
    assert main(["serve", "--max-queue", "0"]) == 2
    assert "--max-queue 0 must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--max-body-bytes", "0"]) == 2
    assert "--max-body-bytes 0 must be >= 1" in capsys.readouterr().err
