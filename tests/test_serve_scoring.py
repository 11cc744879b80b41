"""Scoring through `hybridspec serve`, as lm-evaluation-harness and legacy
OpenAI clients do it: `/v1/completions` with `echo` (the prompt before the
text, its tokens' log-probs before the generated ones', the first `null`,
`text_offset` going on), `max_tokens=0`, and vLLM's `prompt_logprobs`; the
numbers are the engine's prompt log-probs of the same prompt."""
import json
from itertools import accumulate

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import hybridspec as hs  # noqa: E402
from test_serve import NAME, LiveServer  # noqa: E402

PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def offline():
    return hs.LLM(draft=None, max_batch_size=4, max_model_len=512)


@pytest.fixture(scope="module")
def live():
    with LiveServer(hs.LLM(max_batch_size=8, max_model_len=512)) as server:  # the speculative default
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)


def scored(offline, prompts: list[list[int]], k: int = 1) -> list:
    """The engine's prompt log-probs of each prompt (token ids)."""
    outputs = offline.engine.generate(prompts, hs.SamplingParams(max_new_tokens=0, prompt_logprobs=k))
    return [o.prompt_logprobs for o in outputs]


def test_echo_max_tokens_zero_gives_the_prompts_logprobs(offline, client):
    ids = offline.codec.encode(PROMPT)
    [want] = scored(offline, [ids])
    got = client.completions.create(model=NAME, prompt=PROMPT, echo=True, max_tokens=0, logprobs=1)
    choice = got.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length" and got.usage.completion_tokens == 0
    lp = choice.logprobs
    tokens = [offline.codec.decode([t]) for t in ids]
    assert lp.tokens == tokens and "".join(lp.tokens) == PROMPT
    assert lp.text_offset == [0] + list(accumulate(map(len, tokens)))[:-1]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [e.logprob for e in want[1:]]
    for token, top, entry in zip(tokens[1:], lp.top_logprobs[1:], want[1:]):
        best_id, best = entry.top[0]
        assert top[token] == entry.logprob and top[offline.codec.decode([best_id])] == best and len(top) <= 2


def test_echo_with_generated_tokens_streamed_and_not(offline, client):
    [gen] = offline.generate([PROMPT], hs.SamplingParams(max_new_tokens=6))
    got = client.completions.create(model=NAME, prompt=PROMPT, echo=True, max_tokens=6, temperature=0, logprobs=2)
    choice = got.choices[0]
    assert choice.text == PROMPT + gen.text
    num_prompt = len(offline.codec.encode(PROMPT))
    lp = choice.logprobs
    assert len(lp.tokens) == num_prompt + 6 and lp.token_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    assert lp.text_offset == [0] + list(accumulate(map(len, lp.tokens)))[:-1]
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, echo=True, max_tokens=6, temperature=0,
                                            logprobs=2, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert sum((c.choices[0].logprobs.text_offset for c in chunks), []) == lp.text_offset
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == lp.token_logprobs
    plain = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=0)
    assert plain.choices[0].text == "" and plain.choices[0].finish_reason == "length"


def test_vllm_prompt_logprobs(offline, live):
    ids = offline.codec.encode(PROMPT)
    [want] = scored(offline, [ids], k=2)
    r = httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 1,
                                                       "prompt_logprobs": 2}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None and len(choice["text"]) > 0
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token_id, entry, ref in zip(ids[1:], entries[1:], want[1:]):
        assert entry[str(token_id)] == {"logprob": ref.logprob, "rank": ref.rank,
                                        "decoded_token": offline.codec.decode([token_id])}
        for rank, (top_id, value) in enumerate(ref.top, start=1):
            assert entry[str(top_id)]["logprob"] == value
            assert entry[str(top_id)]["rank"] == (rank if top_id != token_id else ref.rank)
        assert len(entry) <= 3


@pytest.mark.parametrize("max_tokens", [0, 1])  # lm-eval's local-completions has sent each
def test_lm_eval_loglikelihood_request(offline, live, max_tokens):
    """lm-eval's loglikelihood request: context + continuation token ids in one batch,
    echo, logprobs=1; it sums token_logprobs[ctxlen:] and calls a continuation greedy
    when each of its tokens' log-prob is the top one's."""
    context = offline.codec.encode(PROMPT)
    [gen] = offline.generate([PROMPT], hs.SamplingParams(max_new_tokens=4))
    continuations = [gen.token_ids, offline.codec.encode(" a + c")]
    prompts = [context + c for c in continuations]
    payload = {"model": NAME, "prompt": prompts, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
               "seed": 1234, "echo": True}
    r = httpx.post(live.url + "/v1/completions", json=payload, timeout=60)
    assert r.status_code == 200, r.text
    body = json.loads(r.text)
    wants = scored(offline, prompts)
    greedy = []
    for choice, want in zip(sorted(body["choices"], key=lambda c: c["index"]), wants):
        end = len(context) + len(continuations[choice["index"]])
        logprobs = choice["logprobs"]["token_logprobs"][len(context):end]
        tops = choice["logprobs"]["top_logprobs"][len(context):end]
        assert sum(logprobs) == pytest.approx(sum(e.logprob for e in want[len(context):]), abs=1e-12)
        greedy.append(all(lp == max(top.values()) for lp, top in zip(logprobs, tops)))
        assert greedy[-1] == all(e.rank == 1 for e in want[len(context):])
    assert greedy == [True, False]
