"""Structured output in an OpenAI body: OpenAI's `response_format`
(`{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"name",
"schema", "strict"}}`, `{"type": "text"}`) and vLLM's extensions
`guided_json` (a schema, dict or JSON text), `guided_regex`, `guided_choice`
(a list of strings) and `guided_grammar` (EBNF), read into one
`StructuredOutput`. Every refusal is an OpenAI 400 naming the field: a body
asking for two constraints, a malformed one, one that does not compile, or
any one when the grammar engine is not installed (the message names the
extra that installs it).
"""
from __future__ import annotations

from hybridspec.errors import ConfigError, InvalidRequestError
from hybridspec.sampling.grammar import grammar_engine
from hybridspec.sampling.structured import StructuredOutput
from hybridspec.serve.protocol import ApiError

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_output(body, compile=None) -> StructuredOutput | None:
    """The body's constraint (None: free text); `compile` (the engine's
    `GrammarCompiler.compile`) checks that it compiles. ApiError(400) naming the field."""
    asked = [(name, getattr(body, name)) for name in ("response_format", *GUIDED) if getattr(body, name) is not None]
    asked = [(name, value) for name, value in asked if not (name == "response_format" and _is_text(value))]
    if not asked:
        return None
    if len(asked) > 1:
        raise ApiError(400, f"'{asked[0][0]}' and '{asked[1][0]}' both constrain the output; send one of them",
                       param=asked[1][0])
    name, value = asked[0]
    try:
        grammar_engine()
        structured = _read(name, value)
        if compile is not None:
            compile(structured)
    except (ConfigError, InvalidRequestError) as error:
        raise ApiError(400, f"'{name}': {error}", param=name) from None
    return structured


def _is_text(value) -> bool:
    return isinstance(value, dict) and value.get("type") == "text"


def _read(name: str, value) -> StructuredOutput:
    if name == "guided_json":
        return StructuredOutput.json_schema(value)
    if name == "guided_regex":
        return StructuredOutput.regex(value)
    if name == "guided_choice":
        return StructuredOutput.choice(value)
    if name == "guided_grammar":
        return StructuredOutput.grammar(value)
    return _response_format(value)


def _response_format(value) -> StructuredOutput:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return StructuredOutput.json_object()
    if kind != "json_schema":
        raise InvalidRequestError(f"type {kind!r} is not one of 'text', 'json_object', 'json_schema'")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise InvalidRequestError('a json_schema response format needs "json_schema": {"name": ..., "schema": '
                                  '{...}}')
    return StructuredOutput.json_schema(spec["schema"])
