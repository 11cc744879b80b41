"""`StructuredOutput`: what a request's output must match (a JSON object, a
JSON schema, a regular expression, one of a list of strings, or an EBNF
grammar), as one typed, checked value (`SamplingParams(structured=...)`).

Built by its constructors (`StructuredOutput.json_schema(schema)`, ...),
each checking its argument's form and raising `InvalidRequestError` naming
the bad value and the fix. Whether a schema, pattern or grammar compiles is
the grammar engine's to say (`hybridspec.sampling.grammar`), when a request
carrying it is submitted, before any state changes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from hybridspec.errors import InvalidRequestError

Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """One structured-output constraint. `spec` is the canonical text of the
    constraint (a schema as compact JSON, its keys in order, a pattern, a
    grammar; None for json_object), `choices` the strings of a choice."""

    kind: Kind
    spec: str | None = None
    choices: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidRequestError(f"structured output kind {self.kind!r} is not one of {', '.join(KINDS)}; "
                                      "build one with StructuredOutput.json_schema(...) and the other constructors")

    @classmethod
    def json_object(cls) -> "StructuredOutput":
        """Any JSON object (OpenAI's `response_format={"type": "json_object"}`)."""
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> "StructuredOutput":
        """A JSON document valid against `schema`: a dict (or a boolean schema), or its JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise InvalidRequestError(f"the JSON schema is not valid JSON ({error.msg} at character "
                                          f"{error.pos}); pass a dict or its JSON text") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"a JSON schema is an object (a dict) or a boolean, not a "
                                      f"{type(schema).__name__} ({_short(schema)})")
        try:
            text = json.dumps(schema, separators=(",", ":"), allow_nan=False)  # key order kept: it orders the properties
        except (TypeError, ValueError) as error:
            raise InvalidRequestError(f"the JSON schema cannot be written as JSON ({error}); use only dicts, "
                                      "lists, strings, finite numbers, booleans and None") from None
        return cls("json_schema", text)

    @classmethod
    def regex(cls, pattern: str) -> "StructuredOutput":
        """Text matching the regular expression `pattern` (whole output)."""
        return cls("regex", _text("regex", pattern, 'such as "[a-z]+@[a-z]+\\\\.com"'))

    @classmethod
    def choice(cls, choices) -> "StructuredOutput":
        """Exactly one of the strings `choices` (a non-empty list of non-empty strings)."""
        if isinstance(choices, (str, bytes)) or not isinstance(choices, (list, tuple)):
            raise InvalidRequestError(f"choice={_short(choices)} is not a list of strings; pass e.g. "
                                      '["yes", "no"]')
        items = tuple(choices)
        bad = [c for c in items if not isinstance(c, str) or not c]
        if not items or bad:
            what = "is empty" if not items else f"holds {_short(bad[0])}, not a non-empty string"
            raise InvalidRequestError(f"choice {what}; pass a list of non-empty strings such as [\"yes\", \"no\"]")
        return cls("choice", None, items)

    @classmethod
    def grammar(cls, ebnf: str) -> "StructuredOutput":
        """Text of the EBNF grammar `ebnf` (xgrammar's GBNF dialect, start rule `root`)."""
        return cls("grammar", _text("grammar", ebnf, 'such as \'root ::= "yes" | "no"\''))


def _text(name: str, value, example: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{name}={_short(value)} is not a non-empty string; pass one {example}")
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
