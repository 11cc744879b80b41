"""xgrammar against llguidance as the grammar engine of structured output.

For each engine and tokenizer: the one-off tokenizer setup, the compile time
of a JSON schema (and of "any JSON object" and a regex), the time of one
token's mask (fill the bitmask, accept the token) walking a valid document
token by token, and the time of a rollback of 4 tokens (what a speculative
round undoes), checked to give back the same mask.

Tokenizers: the embedded pair's byte-level tokenizer (256 tokens, the file
`hybridspec/assets/embedded/target/tokenizer.json`, plus one stop token the
engines need), and a byte-level BPE of 4096 tokens trained here on the
repository's Python sources (no tokenizer of a real model is on this machine
offline).

    python benches/grammar_engines.py            # 20 repeats
    python benches/grammar_engines.py --quick    # a smoke run
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from common import bench_parser, describe_machine, print_table, write_json

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                    "pattern": "[0-9]{5}"}},
                "required": ["city", "zip"]},
    "kind": {"enum": ["person", "robot"]}}, "required": ["name", "age", "tags", "address", "kind"],
    "additionalProperties": False}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"],
                       "address": {"city": "London", "zip": "12345"}, "kind": "person"})
REGEX = r"[a-z]+@[a-z]+\.(com|org)"


def tokenizers(workdir: Path) -> dict:
    """name -> (HF fast tokenizer with a stop token, its vocabulary size, the stop token id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    byte = PreTrainedTokenizerFast(tokenizer_file=str(ROOT / "hybridspec/assets/embedded/target/tokenizer.json"))
    byte.add_special_tokens({"eos_token": "<|end|>"})  # id 256: the stop token both engines need
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    sources = [str(p) for p in sorted((ROOT / "hybridspec").rglob("*.py"))]
    bpe.train(sources, trainers.BpeTrainer(vocab_size=4096, special_tokens=["<|end|>"],
                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(workdir / "bpe.json"))
    trained = PreTrainedTokenizerFast(tokenizer_file=str(workdir / "bpe.json"), eos_token="<|end|>")
    return {"bytes-256": (byte, len(byte), byte.eos_token_id), "bpe-4096": (trained, len(trained),
                                                                           trained.eos_token_id)}


class XGrammar:
    name = "xgrammar 0.2.8"

    def __init__(self, tokenizer, vocab: int, stop: int):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[stop])
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, kind: str, spec):
        if kind == "schema":
            return self.compiler.compile_json_schema(json.dumps(spec))
        if kind == "object":
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_regex(spec)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled, max_rollback_tokens=16)

    def fill(self, matcher):
        matcher.fill_next_token_bitmask(self.mask)
        return self.mask.clone()

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def rollback(self, matcher, k: int) -> None:
        matcher.rollback(k)


class LLGuidance:
    name = "llguidance 1.9.1"

    def __init__(self, tokenizer, vocab: int, stop: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll, self.lt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=stop)
        self.mask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def compile(self, kind: str, spec):
        M = self.ll.LLMatcher
        grammar = (M.grammar_from_json_schema(spec) if kind == "schema" else
                   M.grammar_from_json_schema({"type": "object"}) if kind == "object" else M.grammar_from_regex(spec))
        matcher = M(self.tokenizer, grammar)  # llguidance compiles lazily, per matcher: its creation is the cost
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tokenizer, compiled)

    def fill(self, matcher):
        self.lt.fill_next_token_bitmask(matcher, self.mask, 0)
        return self.mask.clone()

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def rollback(self, matcher, k: int) -> None:
        matcher.rollback(k)


def measure(engine_cls, tokenizer, vocab: int, stop: int, repeats: int) -> dict:
    began = time.perf_counter()
    engine = engine_cls(tokenizer, vocab, stop)
    setup = time.perf_counter() - began
    compile_ms = {}
    for kind, spec in (("schema", SCHEMA), ("object", None), ("regex", REGEX)):
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            engine.compile(kind, spec)
            times.append(time.perf_counter() - began)
        compile_ms[kind] = 1e3 * statistics.median(times)
    compiled = engine.compile("schema", SCHEMA)
    ids = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    per_token, rollback, rollback_ok = [], [], True
    for _ in range(repeats):
        matcher = engine.matcher(compiled)
        began = time.perf_counter()
        for t in ids:
            engine.fill(matcher)
            assert engine.accept(matcher, t), "the document's tokens must be accepted"
        per_token.append((time.perf_counter() - began) / len(ids))
        matcher = engine.matcher(compiled)
        for t in ids[:len(ids) // 2]:
            engine.accept(matcher, t)
        before = engine.fill(matcher)
        for t in ids[len(ids) // 2:len(ids) // 2 + 4]:
            engine.accept(matcher, t)
        began = time.perf_counter()
        engine.rollback(matcher, 4)
        rollback.append(time.perf_counter() - began)
        rollback_ok &= bool((engine.fill(matcher) == before).all())
    return dict(engine=engine.name, setup_ms=1e3 * setup, **{f"compile_{k}_ms": v for k, v in compile_ms.items()},
                tokens=len(ids), mask_us_per_token=1e6 * statistics.median(per_token),
                rollback4_us=1e6 * statistics.median(rollback), rollback_same_mask=rollback_ok)


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    repeats = 3 if args.quick else 20
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name, (tokenizer, vocab, stop) in tokenizers(Path(workdir)).items():
            for engine_cls in (XGrammar, LLGuidance):
                rows.append(dict(tokenizer=name, **measure(engine_cls, tokenizer, vocab, stop, repeats)))
    print_table(rows)
    write_json("grammar_engines.json", dict(machine=describe_machine(), repeats=repeats, rows=rows))


if __name__ == "__main__":
    main()
