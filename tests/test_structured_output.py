"""Structured output (`SamplingParams(structured=...)`): every output matches
its constraint, constrained speculative decoding equals constrained plain
decoding (greedy and coupled, model and n-gram drafters), the first
constrained token of a speculative round follows the target's masked
distribution (chi-square), and each request's matcher holds exactly its
committed tokens after every round, one that raises included.

Tiny float64 Bamba models over 256 tokens: token id = byte value, so the
grammars apply to them directly.
"""
import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")

import hybridspec as hs
from hybridspec.errors import InvalidRequestError
from hybridspec.sampling.grammar import GrammarCompiler, unpack_bits
from hybridspec.spec.speculator import RoundHook

from oracles import bamba

S = hs.StructuredOutput
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "owl"]}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["kind", "ok", "n"], "additionalProperties": False}
CONSTRAINTS = {"json_schema": S.json_schema(SCHEMA), "choice": S.choice(["yes", "no", "maybe so"]),
               "regex": S.regex(r"[a-f]{2,4}-[0-9]{2}"), "grammar": S.grammar('root ::= "<" [xyz]+ ">"')}
PROMPTS = [list(b"Answer: "), list(b"{"), list(b"The pet is a")]


@pytest.fixture(scope="module")
def hf_target():
    return bamba(seed=0, vocab=256)


@pytest.fixture(scope="module")
def models(hf_target):
    return hs.from_hf(hf_target), hs.from_hf(bamba(seed=1, vocab=256))


def matches(structured: S, text: str) -> bool:
    if structured.kind == "json_schema":
        import jsonschema
        jsonschema.validate(json.loads(text), json.loads(structured.spec))
        return True
    if structured.kind == "choice":
        return text in structured.choices
    if structured.kind == "regex":
        return re.fullmatch(structured.spec, text) is not None
    return re.fullmatch(r"<[xyz]+>", text) is not None


EOS = 1  # the oracle models' eos_token_id: the grammar allows it wherever it may end


def text_of(output) -> str:
    """The output's text, its EOS left out (as a tokenizer's decode skips special tokens)."""
    return bytes(t for t in output.token_ids if t != EOS).decode()


def test_constructors_check_their_arguments():
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        S.json_schema("{nope")
    with pytest.raises(InvalidRequestError, match="is an object"):
        S.json_schema([1])
    with pytest.raises(InvalidRequestError, match="choice is empty"):
        S.choice([])
    with pytest.raises(InvalidRequestError, match="non-empty string"):
        S.choice(["a", ""])
    with pytest.raises(InvalidRequestError, match="regex"):
        S.regex("")
    with pytest.raises(InvalidRequestError, match="StructuredOutput"):
        hs.SamplingParams(structured={"type": "json_object"})
    assert S.json_schema('{"type": "object"}') == S.json_schema({"type": "object"})


def test_a_constraint_that_does_not_compile_is_refused_before_anything_runs(models):
    engine = hs.Engine(models[0], draft=models[1])
    with pytest.raises(InvalidRequestError, match="json_schema constraint does not compile"):
        engine.generate(PROMPTS, hs.SamplingParams(structured=S.json_schema({"type": "bogus"})))
    with pytest.raises(InvalidRequestError, match="regex constraint does not compile"):
        engine.generate(PROMPTS, hs.SamplingParams(structured=S.regex("(")))
    assert engine.total_stats.sequences == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_every_output_matches_its_constraint(models, kind, temperature):
    structured = CONSTRAINTS[kind]
    engine = hs.Engine(models[0], draft=models[1], num_draft_tokens=3)
    params = [hs.SamplingParams(max_new_tokens=48, temperature=temperature, seed=s, structured=structured)
              for s in range(len(PROMPTS))]
    for out in engine.generate(PROMPTS, params):
        assert out.finish_reason == "stop", (kind, text_of(out))
        assert matches(structured, text_of(out)), text_of(out)


@pytest.mark.parametrize("draft", ["model", "ngram"])
@pytest.mark.parametrize("verify", ["greedy", "coupled"])
def test_speculative_equals_plain(models, draft, verify):
    temperature = 0.0 if verify == "greedy" else 0.8
    params = [hs.SamplingParams(max_new_tokens=40, temperature=temperature, seed=7 + i, structured=s)
              for i, s in enumerate(CONSTRAINTS.values()) for _ in PROMPTS[:2]]
    prompts = [p for _ in CONSTRAINTS for p in PROMPTS[:2]]
    plain = hs.Engine(models[0], max_batch_size=4).generate(prompts, params)
    spec = hs.Engine(models[0], draft=models[1] if draft == "model" else "ngram", num_draft_tokens=4,
                     verify="coupled", max_batch_size=4)
    spec.check_invariants = spec.speculator.check = True
    out = spec.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in out] == [o.finish_reason for o in plain]
    assert spec.total_stats.accepted_tokens > 0


def fresh_mask(compiler: GrammarCompiler, structured: S, tokens: list[int]) -> torch.Tensor | None:
    state = compiler.state(structured)
    state.advance(tokens)
    return state.allowed()


class MatcherWatch(RoundHook):
    """At every round's end each request's matcher equals a fresh one fed its
    committed output tokens (the round's own are applied after it); with
    `fail_at`, the commit phase of that round raises."""

    def __init__(self, compiler: GrammarCompiler, fail_at: int | None = None):
        self.compiler, self.fail_at, self.rounds, self.errors = compiler, fail_at, 0, 0

    def round_started(self, round):
        pass

    def phase_started(self, phase):
        if phase == "commit" and self.rounds == self.fail_at:
            raise RuntimeError("injected")

    def committed(self, round):
        pass

    def round_ended(self, round, error):
        self.rounds += 1
        self.errors += error is not None
        for r in round.requests:
            assert r.grammar.accepted == len(r.output.token_ids)
            expected = fresh_mask(self.compiler, r.params.structured, r.output.token_ids)
            got = r.grammar.allowed()
            assert (got is None and expected is None) or torch.equal(got, expected)


@pytest.mark.parametrize("fail_at", [None, 2])
def test_matcher_holds_the_committed_tokens_after_every_round(models, fail_at):
    engine = hs.Engine(models[0], draft=models[1], num_draft_tokens=4)
    engine.check_invariants = engine.speculator.check = True
    watch = MatcherWatch(engine.grammars, fail_at)
    engine.speculator.hooks.append(watch)
    params = hs.SamplingParams(max_new_tokens=40, temperature=1.0, structured=CONSTRAINTS["json_schema"])
    if fail_at is None:
        outs = engine.generate(PROMPTS, params)
        assert all(matches(CONSTRAINTS["json_schema"], text_of(o)) for o in outs)
    else:
        with pytest.raises(RuntimeError, match="injected"):
            engine.generate(PROMPTS, params)
        assert watch.errors == 1
    assert watch.rounds > fail_at if fail_at else watch.rounds > 2


def test_first_constrained_token_of_a_round_follows_the_masked_target(models, hf_target):
    """Rejection sampling (no seed) with the model drafter's masked q: the
    grammar forces the first token ("a"), so the second comes from the first
    speculative round, at one context for every request; its frequencies fit
    the target's softmax over the allowed tokens [b-k]."""
    from scipy import stats
    target, draft = models
    prompt, n = list(b"xy"), 1500
    engine = hs.Engine(target, draft=draft, num_draft_tokens=2, max_batch_size=64)
    params = hs.SamplingParams(max_new_tokens=3, temperature=1.0, structured=S.regex("a[b-k]{2}"))
    outs = engine.generate([prompt] * n, params)
    assert all(o.token_ids[0] == ord("a") for o in outs)
    assert engine.total_stats.drafted_tokens > 0
    with torch.no_grad():
        logits = hf_target(torch.tensor([prompt + [ord("a")]])).logits[0, -1]  # [vocab]
    allowed = torch.tensor([ord(c) for c in "bcdefghijk"])
    probs = torch.softmax(logits[allowed].double(), 0)
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=256).double()
    assert counts.sum() == counts[allowed].sum(), "a token outside the grammar"
    pvalue = stats.chisquare(counts[allowed].numpy(), (n * probs).numpy()).pvalue
    assert pvalue > 0.001, (pvalue, counts[allowed].tolist(), (n * probs).tolist())


def test_bitmask_unpacking():
    bits = torch.tensor([0b101, -2 ** 31], dtype=torch.int32)  # bits 0 and 2; bit 31 of the second word
    allowed = unpack_bits(bits, 64)
    assert allowed.nonzero().flatten().tolist() == [0, 2, 63]
