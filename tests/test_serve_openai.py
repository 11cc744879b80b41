"""`hybridspec serve` answers as OpenAI's and vLLM's servers do where clients
look: 400 (BadRequestError) naming the field the client sent, greedy n > 1,
a bound on n, `stop_reason`, log-probs of the returned text only (streamed
offsets going on across chunks, logprobs=0 as vLLM), OpenAI's error body on
unknown routes and models, HEAD, aborted requests in /metrics, vLLM's
/tokenize, /detokenize and /version, and chat on the embedded pair through
the chat template its tokenizer files ship."""
import json
import re

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import hybridspec as hs  # noqa: E402
from test_serve import NAME, PROMPTS, LiveServer, wait_until  # noqa: E402

MAX_N = 4


@pytest.fixture(scope="module")
def llm():
    return hs.LLM(max_batch_size=8, max_model_len=512)


@pytest.fixture(scope="module")
def offline():
    return hs.LLM(max_batch_size=8, max_model_len=512)


@pytest.fixture(scope="module")
def live(llm):
    with LiveServer(llm, chat_template=None, max_n=MAX_N) as server:  # the embedded pair's own chat template
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)


def bad_request(call, **kwargs) -> dict:
    with pytest.raises(openai.BadRequestError) as bad:
        call(model=NAME, **kwargs)
    return bad.value.body


def test_errors_name_the_fields_the_client_sent(client):
    too_long = bad_request(client.completions.create, prompt="x" * 600, max_tokens=4)
    assert too_long["param"] == "prompt" and too_long["type"] == "invalid_request_error"
    chat_long = bad_request(client.chat.completions.create, messages=[{"role": "user", "content": "x" * 600}])
    assert chat_long["param"] == "messages"
    negative = bad_request(client.completions.create, prompt="x", max_tokens=-1)
    assert negative["param"] == "max_tokens" and "max_tokens=-1" in negative["message"]
    assert "max_new" not in negative["message"]
    chat = bad_request(client.chat.completions.create, messages=[{"role": "user", "content": "x"}],
                       max_completion_tokens=0)
    assert chat["param"] == "max_completion_tokens" and "max_completion_tokens=0" in chat["message"]
    many = bad_request(client.completions.create, prompt="x", max_tokens=2, n=MAX_N + 1, temperature=1)
    assert many["param"] == "n" and str(MAX_N) in many["message"]
    options = bad_request(client.completions.create, prompt="x", max_tokens=2, stream_options={"include_usage": True})
    assert options["param"] == "stream_options"
    top_p = bad_request(client.completions.create, prompt="x", max_tokens=2, top_p=2.0)
    assert top_p["param"] == "top_p" and "top_p=2.0" in top_p["message"]


def test_greedy_n_gives_n_identical_completions(offline, client):
    [want] = offline.generate(PROMPTS[:1], hs.SamplingParams(max_new_tokens=10))
    got = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=10, temperature=0, n=MAX_N)
    assert sorted(c.index for c in got.choices) == list(range(MAX_N))
    assert [c.text for c in got.choices] == [want.text] * MAX_N and got.usage.completion_tokens == 10 * MAX_N
    chunks = list(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, n=2, stream=True))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in (0, 1)]
    assert texts[0] == texts[1] and len(texts[0]) > 0


def stop_inside(offline, prompt: str, tokens: int) -> str:
    """A stop string that cuts the greedy output of `prompt` inside its first `tokens` tokens."""
    [full] = offline.generate([prompt], hs.SamplingParams(max_new_tokens=tokens))
    middle = full.text[len(full.text) // 2:]
    return next(middle[i:i + 2] for i in range(len(middle) - 1) if middle[i:i + 2].isprintable()
                and middle[i:i + 2].strip())


def test_stop_reason_and_logprobs_of_the_returned_text_only(offline, client):
    stop = stop_inside(offline, PROMPTS[1], 40)
    [want] = offline.generate(PROMPTS[1:], hs.SamplingParams(max_new_tokens=40, stop=[stop]))
    assert want.stop_reason == stop
    got = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=stop,
                                    logprobs=1)
    choice = got.choices[0]
    assert choice.text == want.text and choice.finish_reason == "stop" and choice.stop_reason == stop
    # byte tokens: the returned text's tokens are its bytes; the stop string's are not there
    assert len(choice.logprobs.tokens) == len(want.text.encode()) < len(want.token_ids)
    streamed = [c.choices[0] for c in client.completions.create(
        model=NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=stop, logprobs=1, stream=True)]
    assert "".join(c.text for c in streamed) == want.text
    assert [c.stop_reason for c in streamed] == [None] * (len(streamed) - 1) + [stop]
    tokens = [t for c in streamed for t in c.logprobs.tokens]
    offsets = [o for c in streamed for o in c.logprobs.text_offset]
    assert tokens == choice.logprobs.tokens and offsets == choice.logprobs.text_offset
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))] and len(streamed) > 2
    length = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert length.choices[0].finish_reason == "length" and length.choices[0].stop_reason is None


def test_logprobs_zero_gives_the_sampled_token_as_vllm(client):
    got = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0.7, seed=3,
                                    logprobs=0).choices[0].logprobs
    assert len(got.top_logprobs) == 6
    assert got.top_logprobs == [{t: lp} for t, lp in zip(got.tokens, got.token_logprobs)]
    two = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0.7, seed=3,
                                    logprobs=2).choices[0].logprobs
    assert two.tokens == got.tokens and all(t in top and 2 <= len(top) <= 3
                                            for t, top in zip(two.tokens, two.top_logprobs))


def test_models_unknown_routes_and_head_answer_openai_bodies(live, client):
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-9")
    assert missing.value.body["param"] == "model"
    for method, path, status in (("GET", "/nope", 404), ("POST", "/v1/nope", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/v1/models", 405)):
        r = httpx.request(method, live.url + path)
        error = r.json()["error"]
        assert r.status_code == status and set(error) == {"message", "type", "param", "code"}
        assert error["code"] == status and path in error["message"]
    for path in ("/health", "/v1/models", f"/v1/models/{NAME}", "/version", "/metrics"):
        r = httpx.head(live.url + path)
        assert r.status_code == 200 and r.content == b""
    assert httpx.head(live.url + "/nope").status_code == 404


def aborted(live) -> float:
    text = httpx.get(live.url + "/metrics").text
    found = re.search(r'hybridspec_requests_finished_total\{finish_reason="abort"\} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def test_a_client_that_leaves_is_counted_as_aborted(llm, live):
    before = aborted(live)
    with httpx.stream("POST", live.url + "/v1/completions", json={
            "model": NAME, "prompt": PROMPTS[0], "max_tokens": 400, "stream": True, "ignore_eos": True}) as r:
        assert next(line for line in r.iter_lines() if line.startswith("data:"))
    wait_until(lambda: llm.engine.memory().is_idle(), "the pages of the request that left")
    wait_until(lambda: aborted(live) == before + 1, "the abort to be counted")


def test_tokenize_detokenize_and_version(llm, live):
    text = "déf add(a, b): 🙂"
    r = httpx.post(live.url + "/tokenize", json={"model": NAME, "prompt": text}).json()
    assert r == {"tokens": list(text.encode()), "count": len(text.encode()), "max_model_len": 512}
    messages = [{"role": "user", "content": text}]
    chat = httpx.post(live.url + "/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == llm.codec.encode(llm.codec.chat_prompt(messages)) and chat["count"] > r["count"]
    back = httpx.post(live.url + "/detokenize", json={"tokens": r["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    bad = httpx.post(live.url + "/detokenize", json={"tokens": [65, 256]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    neither = httpx.post(live.url + "/tokenize", json={"model": NAME})
    assert neither.status_code == 400 and neither.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(live.url + "/version").json() == {"version": hs.__version__}
    info = httpx.get(live.url + "/tokenizer_info").json()  # what lm-eval's remote tokenizer reads first
    assert info["chat_template"] == llm.codec.chat_template and info["eos_token"] is None
    assert info["model_max_length"] == 512 and info["tokenizer_class"] == "ByteCodec"


def test_chat_on_the_embedded_pair_through_its_shipped_template(offline, client):
    messages = [{"role": "system", "content": "python"}, {"role": "user", "content": "def add(a, b):"}]
    [want] = offline.chat(messages, hs.SamplingParams(max_new_tokens=12))
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == want.text and got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(offline.codec.chat_prompt(messages).encode())
    assert json.loads(got.model_dump_json())["choices"][0]["stop_reason"] is None
