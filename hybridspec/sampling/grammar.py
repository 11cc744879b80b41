"""Grammar-constrained sampling: each structured request's matcher (xgrammar),
the masks it gives and how they apply to the target's and the drafter's
logits, exactly under speculation.

The mask is applied to the logits first (−inf outside the tokens the grammar
allows), then the usual post-processing runs (penalties, temperature, top-k,
top-p, min-p: `process_logits`), as vLLM applies its grammar bitmask to the
logits before its sampler. Masking first keeps the filters meaningful (top-k
picks among allowed tokens, min-p and top-p renormalise over them).

A matcher holds the request's committed output tokens, always: every walk
over drafts (the drafter's, `DraftWalk`; the verifier's, `verify_masks`)
rolls the matcher back when it ends, and a request's matcher accepts the
tokens a round or a plain step keeps when they are emitted
(`GrammarState.advance`). So a round that raises leaves the matcher where the
round found it, and after every round it equals a fresh matcher fed the
committed tokens (docs/design.md, "Round structure").

A grammar-constrained request finishes (reason "stop") at the token after
which the grammar allows no token of the model's vocabulary
(`GrammarState.end_in`): a model without EOS ends where the grammar
ends; a model with EOS ids (xgrammar's stop tokens) may end at EOS wherever
the grammar may end, by the usual stop rule.

Requests without a grammar cost one host-side check per step and change no
bit: the masking functions return their input when no row has a grammar.
"""
from __future__ import annotations

import json
import math

import torch

from hybridspec.errors import ConfigError, InvalidRequestError, InvariantError
from hybridspec.sampling.structured import StructuredOutput

EXTRA = "structured"  # pyproject.toml's extra that installs the grammar engine
MISSING = (f"structured output needs the grammar engine xgrammar, which is not installed; "
           f"pip install 'hybridspec[{EXTRA}]'")


def grammar_engine():
    """The xgrammar module, or ConfigError naming the extra that installs it."""
    try:
        import xgrammar
    except ImportError:
        raise ConfigError(MISSING) from None
    return xgrammar


def available() -> bool:
    """Whether the grammar engine is installed."""
    try:
        grammar_engine()
    except ConfigError:
        return False
    return True


class GrammarCompiler:
    """Compiles `StructuredOutput`s against one model's vocabulary (each
    distinct one once). `tokenizer`: an HF tokenizer of the model (its stop
    tokens are its EOS ids), or None for a byte-level model (token id = byte
    value, no stop tokens); `vocab_size`: the model's."""

    def __init__(self, vocab_size: int, tokenizer=None, eos_token_ids: tuple[int, ...] = ()):
        xgr = grammar_engine()
        if tokenizer is None:
            if vocab_size != 256:
                raise ConfigError(f"structured output on a model of {vocab_size} tokens needs its tokenizer (the "
                                  "byte vocabulary fits only 256-token models); build the Engine through hs.LLM "
                                  "or pass grammar_tokenizer=")
            info = xgr.TokenizerInfo([bytes([b]) for b in range(256)], xgr.VocabType.RAW, vocab_size=256,
                                     stop_token_ids=list(eos_token_ids))
        else:
            stop = list(eos_token_ids) or None
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        self.xgr, self.vocab_size = xgr, vocab_size
        self.compiler = xgr.GrammarCompiler(info)
        self._compiled: dict[StructuredOutput, object] = {}

    def compile(self, structured: StructuredOutput):
        """The compiled grammar, or InvalidRequestError naming what does not compile."""
        if structured not in self._compiled:
            try:
                self._compiled[structured] = self._compile(structured)
            except RuntimeError as error:
                reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
                reason = reason.split(": ", 1)[-1] if reason.startswith("[") else reason  # xgrammar's source prefix
                raise InvalidRequestError(f"the {structured.kind} constraint does not compile: {reason}") from None
        return self._compiled[structured]

    def _compile(self, s: StructuredOutput):
        # compact JSON: a model cannot spend its tokens on unbounded whitespace
        compact = dict(any_whitespace=False, separators=(",", ":"))
        if s.kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', **compact)
        if s.kind == "json_schema":
            return self.compiler.compile_json_schema(s.spec, **compact)
        if s.kind == "regex":
            return self.compiler.compile_regex(s.spec)
        if s.kind == "choice":
            return self.compiler.compile_grammar("root ::= " + " | ".join(_literal(c) for c in s.choices))
        return self.compiler.compile_grammar(s.spec)

    def state(self, structured: StructuredOutput) -> "GrammarState":
        return GrammarState(self.xgr, self.compile(structured), self.vocab_size)


class GrammarState:
    """One request's matcher, holding its committed output tokens."""

    def __init__(self, xgr, compiled, vocab_size: int):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._bits = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32
        self.accepted = 0  # tokens the matcher holds

    def allowed(self) -> torch.Tensor | None:
        """bool [vocab]: the tokens the grammar allows next; None where it allows none (it ended)."""
        if self.matcher.is_terminated():
            return None
        self.matcher.fill_next_token_bitmask(self._bits)
        allowed = unpack_bits(self._bits[0], self.vocab_size)
        return allowed if bool(allowed.any()) else None

    def accept(self, token: int) -> bool:
        """Take `token` if the grammar allows it (True), else change nothing (False)."""
        if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
            return False
        self.accepted += 1
        return True

    def rollback(self, k: int) -> None:
        """Undo the last k accepted tokens."""
        if k:
            self.matcher.rollback(k)
            self.accepted -= k

    def end_in(self, tokens: list[int]) -> int | None:
        """How many of `tokens` (emitted after the held ones) the request keeps
        when the grammar ends within them (the token after which it allows
        nothing more), else None. The matcher is left as it was."""
        taken = 0
        try:
            for i, t in enumerate(tokens):
                if not self.accept(t):
                    raise InvariantError(f"token {t} was emitted where the grammar forbids it (output position "
                                         f"{self.accepted}); the grammar mask was not applied")
                taken += 1
                if self.allowed() is None:
                    return i + 1
            return None
        finally:
            self.rollback(taken)

    def advance(self, tokens: list[int]) -> None:
        """Accept the tokens a round or a plain step emitted (all allowed: they were sampled under the mask)."""
        for t in tokens:
            if not self.accept(t):
                raise InvariantError(f"the grammar refuses emitted token {t}; the grammar mask was not applied")


def unpack_bits(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """An xgrammar bitmask row int32 [ceil(vocab / 32)] as bool [vocab]."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bits[:, None] >> shifts) & 1).bool().reshape(-1)[:vocab_size]


def _literal(text: str) -> str:
    """`text` as an EBNF string literal (JSON's escapes, which xgrammar reads)."""
    return '"' + "".join(c if c.isprintable() and c not in '"\\' else
                         json_escape(c) for c in text) + '"'


def json_escape(char: str) -> str:
    return json.dumps(char)[1:-1]


def grammar_of(request) -> GrammarState | None:
    """A request's matcher; None without one (or for a request-like object that carries none)."""
    return getattr(request, "grammar", None)


def has_grammar(requests) -> bool:
    return any(grammar_of(r) is not None for r in requests)


def mask_logits(logits: torch.Tensor, requests) -> torch.Tensor:
    """logits [batch, vocab] at each request's committed state, −inf where its
    grammar forbids a token; the input itself when no request has a grammar."""
    if not has_grammar(requests):
        return logits
    allowed = torch.ones(logits.shape, dtype=torch.bool)  # [batch, vocab]
    for b, r in enumerate(requests):
        if grammar_of(r) is not None and (row := r.grammar.allowed()) is not None:
            allowed[b] = row
    return logits.masked_fill(~allowed.to(logits.device), -math.inf)


def verify_masks(requests, drafts: list[list[int]], num_inputs: int) -> torch.Tensor | None:
    """bool [batch, T, vocab]: at verify input j, what each grammar row's
    matcher allows after d_1..d_j; True everywhere for rows without a grammar,
    past a draft the grammar forbids (that draft is rejected: p is 0 there)
    and past the grammar's end (the stop rule cuts the row there). None when
    no request has a grammar. Every matcher ends as it began."""
    if not has_grammar(requests):
        return None
    vocab = next(grammar_of(r).vocab_size for r in requests if grammar_of(r) is not None)
    allowed = torch.ones(len(requests), num_inputs, vocab, dtype=torch.bool)  # [batch, T, vocab]
    for b, (r, d) in enumerate(zip(requests, drafts)):
        if grammar_of(r) is None:
            continue
        taken = 0
        try:
            for j in range(num_inputs):
                row = r.grammar.allowed()
                if row is None:
                    break
                allowed[b, j] = row
                if j == len(d) or not r.grammar.accept(d[j]):
                    break
                taken += 1
        finally:
            r.grammar.rollback(taken)
    return allowed


class DraftWalk:
    """A model drafter's walk of its drafting rows' matchers over the drafts it
    samples, so that q at draft step i is masked as p at verify input i-1
    is. `close` rolls every matcher back to the committed tokens."""

    def __init__(self, requests):
        self.grammars = [grammar_of(r) for r in requests]  # [live] the rows still drafting
        self.taken = {id(g): 0 for g in self.grammars if g is not None}
        self.off = set()  # ids of matchers past a refused token or the grammar's end: masks no more
        self.active = bool(self.taken)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [live, vocab] of the live rows, −inf where their grammar forbids a token."""
        if not self.active:
            return logits
        allowed = torch.ones(logits.shape, dtype=torch.bool)
        for k, g in enumerate(self.grammars):
            if g is not None and id(g) not in self.off:
                row = g.allowed()
                if row is None:
                    self.off.add(id(g))
                else:
                    allowed[k] = row
        return logits.masked_fill(~allowed.to(logits.device), -math.inf)

    def advance(self, tokens: list[int]) -> None:
        """Each live row's matcher takes its sampled draft."""
        if not self.active:
            return
        for g, t in zip(self.grammars, tokens):
            if g is not None and id(g) not in self.off:
                if g.accept(t):
                    self.taken[id(g)] += 1
                else:
                    self.off.add(id(g))

    def select(self, keep: list[int]) -> None:
        """Only the rows `keep` (indices into the live rows) draft on."""
        self.grammars = [self.grammars[k] for k in keep]

    def close(self, requests) -> None:
        for r in requests:
            if grammar_of(r) is not None and id(r.grammar) in self.taken:
                r.grammar.rollback(self.taken.pop(id(r.grammar)))
