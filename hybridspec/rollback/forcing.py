"""Forced rejections: a drafter wrapper that makes the greedy verifier reject
where a check needs it, so that every restore path and fault site is reached
on any model, however well or badly its drafter agrees with it.

`ForcedRejections` wraps the drafter an Engine built (through the `Drafter`
protocol) and knows the target's greedy continuation of every request (its
plain outputs, the reference the checks already compare with). In each round
it asks for an acceptance length n from its schedule and, where the wrapped
drafter's drafts agree with the target up to d_n, replaces d_{n+1} with a
token other than the target's greedy token there: the verifier must reject
it and emits the target's own token instead, so the output stays exact. A
model drafter absorbed d_1..d_n itself and they are the target's tokens, so
its state at the boundary is what it would be anyway. A stateless drafter
keeps nothing, so for it the wrapper proposes the target's d_1..d_γ itself
before forcing: every n of the schedule is reached exactly.

Tree rounds (`Engine(tree=...)`, `Proposal.parents`) pass through unforced:
a forced token in a tree would only move the walk to a sibling.

As a round hook it compares every greedy row's accepted count with the one it
predicted (`broken`) and records each rejection (`rejections`), which a check
requires to be non-empty: a case that reached no rejection fails.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridspec.engine.engine import Engine
from hybridspec.sampling.sampler import RowParams
from hybridspec.spec.protocol import Drafter, Proposal


@dataclass(frozen=True)
class Rejection:
    """A row whose verifier rejected a draft, as predicted."""

    accepted: int  # n: the boundary is m + n
    live: bool  # the round did not finish the row: it was restored to its boundary


class ForcedRejections:
    """`inner` with a rejection forced after `schedule[k]` accepted drafts in a
    sequence's k-th round (cycling; a value >= the round's γ forces nothing),
    for greedy rows whose committed tokens are a prefix of a known plain
    output (`prompts[i]` + `outputs[i]`)."""

    def __init__(self, inner: Drafter, prompts: list[list[int]], outputs: list[list[int]],
                 schedule: tuple[int, ...], vocab_size: int):
        if not schedule or min(schedule) < 0:
            raise ValueError(f"schedule={schedule!r} must be a non-empty tuple of acceptance lengths >= 0")
        self.inner, self.schedule, self.vocab_size = inner, tuple(schedule), vocab_size
        self.model, self.cache, self.prefix = inner.model, inner.cache, inner.prefix
        self.hidden = getattr(inner, "hidden", None)  # the target's hidden states it reads (MTP, EAGLE-3)
        self.known = [(list(p), list(o)) for p, o in zip(prompts, outputs)]
        self.rounds_of: dict[int, int] = {}  # seq -> rounds it was drafted for
        self.predicted: dict[int, int] = {}  # seq -> accepted count predicted for the current round
        self.rejections: list[Rejection] = []
        self.own_drafted = self.own_agreed = 0  # the wrapped drafter's own drafts, and those the target agrees with
        self.broken: list[str] = []  # predictions the verifier did not meet

    # -- Drafter ------------------------------------------------------------------------------

    def start(self, requests) -> None:
        self.inner.start(requests)

    def backlog(self, requests) -> list[int]:
        return self.inner.backlog(requests)

    def propose(self, requests, gammas: list[int], rows: RowParams, coupled: list[bool]) -> Proposal:
        proposal = self.inner.propose(requests, gammas, rows, coupled)
        self.predicted = {}
        if proposal.parents is not None:  # a tree round: its walk, not a forcing, decides what it accepts
            return proposal
        tokens = [list(d) for d in proposal.tokens]
        for b, (request, g) in enumerate(zip(requests, gammas)):
            truth = self._truth(request, g)
            if truth is None or not request.params.is_greedy or g == 0:
                continue
            k = self.rounds_of.get(request.seq_id, 0)
            self.rounds_of[request.seq_id] = k + 1
            want = self.schedule[k % len(self.schedule)]
            self.own_drafted += len(tokens[b])
            self.own_agreed += _agreement(tokens[b], truth)
            if want < g and self.inner.model is None:  # nothing absorbed: the target's own drafts are free
                tokens[b] = truth[:g]  # all γ of them, so that n = want is the boundary it is for a model
            agree = _agreement(tokens[b], truth)
            if want < min(agree, len(tokens[b])):
                tokens[b][want] = (truth[want] + 1) % self.vocab_size  # not the target's greedy token at d_{want+1}
            self.predicted[request.seq_id] = min(agree, want)
        return Proposal(tokens, proposal.probs, proposal.backlog_seconds, proposal.backlog_tokens)

    def commit(self, seq_ids: list[int], boundaries: list[int]) -> None:
        self.inner.commit(seq_ids, boundaries)

    def revert(self, seq_ids: list[int]) -> None:
        self.inner.revert(seq_ids)

    def release(self, seq_ids: list[int]) -> None:
        self.inner.release(seq_ids)

    def check_invariant(self, seq_id: int, boundary: int) -> None:
        self.inner.check_invariant(seq_id, boundary)

    def _truth(self, request, gamma: int) -> list[int] | None:
        """The target's greedy tokens at d_1..d_γ (the next γ tokens of a known
        plain output the committed tokens follow), or None if unknown."""
        prompt, output = request.output.prompt_token_ids, request.output.token_ids
        for known_prompt, known_output in self.known:
            done = len(output)
            if known_prompt == prompt and known_output[:done] == output and len(known_output) >= done + gamma:
                return known_output[done:done + gamma]
        return None

    @property
    def own_acceptance(self) -> float | None:
        """The greedy acceptance the wrapped drafter's own drafts would have had
        (the drafts before the first disagreement, per drafted token); None: none drafted."""
        return self.own_agreed / self.own_drafted if self.own_drafted else None

    # -- RoundHook ----------------------------------------------------------------------------

    def round_started(self, round) -> None:
        pass

    def phase_started(self, phase: str) -> None:
        pass

    def committed(self, round) -> None:
        pass

    def round_ended(self, round, error: BaseException | None) -> None:
        if error is not None:
            return
        for b, s in enumerate(round.seq_ids):
            if s not in self.predicted:
                continue
            drafts, accepted = round.drafts[b], round.accepted[b]
            if accepted != self.predicted[s]:
                self.broken.append(f"sequence {s}: drafts {drafts}, predicted {self.predicted[s]} accepted, the "
                                   f"verifier accepted {accepted}")
            elif accepted < len(drafts):
                self.rejections.append(Rejection(accepted, b in round.live))


def _agreement(drafts: list[int], truth: list[int]) -> int:
    """How many leading drafts are the target's greedy tokens: the accepted count without forcing."""
    return next((i for i, (d, t) in enumerate(zip(drafts, truth)) if d != t), len(drafts))


def force_rejections(engine: Engine, prompts: list[list[int]], outputs: list[list[int]],
                     schedule: tuple[int, ...]) -> ForcedRejections:
    """Wrap `engine`'s drafter in `ForcedRejections` (and watch its rounds);
    `outputs`: the plain greedy token ids of `prompts`."""
    spec = engine.speculator
    forcing = ForcedRejections(spec.drafter, prompts, outputs, schedule, engine.target.vocab_size)
    spec.drafter = forcing
    spec.hooks.append(forcing)
    return forcing
