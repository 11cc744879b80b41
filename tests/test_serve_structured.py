"""Structured output through the server, with the official `openai` client:
`response_format` (json_object, json_schema) on chat and completions, vLLM's
`guided_json` / `guided_regex` / `guided_choice`, and 400s naming the field
(a bad schema, two constraints at once, the grammar engine missing)."""
import json
import re

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")

import hybridspec as hs  # noqa: E402
from hybridspec.serve.protocol import ChatRequest  # noqa: E402
from hybridspec.serve.structured import structured_output  # noqa: E402

from test_serve import NAME, LiveServer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer",
                                                                                       "minimum": 0,
                                                                                       "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client():
    llm = hs.LLM(max_batch_size=8, max_model_len=512)
    with LiveServer(llm, chat_template=None) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_response_format_json_schema_on_chat_and_completions(client):
    import jsonschema
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Is it?"}],
                                          response_format=fmt, max_tokens=40, temperature=0.7, seed=1, n=2)
    completion = client.completions.create(model=NAME, prompt="Verdict:", max_tokens=40,
                                           extra_body={"response_format": fmt})
    texts = [c.message.content for c in chat.choices] + [completion.choices[0].text]
    for text, reason in zip(texts, [c.finish_reason for c in chat.choices] + [completion.choices[0].finish_reason]):
        jsonschema.validate(json.loads(text), SCHEMA)
        assert reason == "stop"


def test_json_object_and_vllm_guided_fields(client):
    obj = client.completions.create(model=NAME, prompt="{", max_tokens=60, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].finish_reason != "stop" or isinstance(json.loads(obj.choices[0].text), dict)
    choice = client.completions.create(model=NAME, prompt="Pick:", max_tokens=10,
                                       extra_body={"guided_choice": ["red", "green", "blue"]})
    assert choice.choices[0].text in ("red", "green", "blue")
    regex = client.completions.create(model=NAME, prompt="Code:", max_tokens=10, temperature=1.0, seed=3,
                                      extra_body={"guided_regex": "[A-Z]{3}-[0-9]{3}"})
    assert re.fullmatch("[A-Z]{3}-[0-9]{3}", regex.choices[0].text)
    guided = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "go"}], max_tokens=40,
                                            extra_body={"guided_json": json.dumps(SCHEMA)})
    assert set(json.loads(guided.choices[0].message.content)) == {"answer", "score"}


def test_bad_constraints_are_400s_naming_the_field(client):
    def bad(**extra) -> dict:
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=NAME, prompt="x", max_tokens=4, extra_body=extra)
        return error.value.body
    schema = bad(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}})
    assert schema["param"] == "response_format" and "does not compile" in schema["message"]
    assert bad(guided_regex="(")["param"] == "guided_regex"
    assert bad(guided_choice=[])["param"] == "guided_choice"
    assert bad(response_format={"type": "xml"})["param"] == "response_format"
    both = bad(guided_regex="a", guided_choice=["a"])
    assert both["param"] == "guided_choice" and "send one" in both["message"]


def test_a_server_without_the_grammar_engine_names_the_extra(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_xgrammar(name, *args, **kwargs):
        if name == "xgrammar":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    body = ChatRequest(messages=[{"role": "user", "content": "x"}], response_format={"type": "json_object"})
    with pytest.raises(Exception) as error:
        structured_output(body)
    assert error.value.status == 400 and error.value.param == "response_format"
    assert "hybridspec[structured]" in error.value.message
    assert structured_output(ChatRequest(messages=[{"role": "user", "content": "x"}],
                                         response_format={"type": "text"})) is None
