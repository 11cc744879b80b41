"""The wall time of one round, term by term, and the speedup it implies: the one
formula both the simulator (`hybridspec simulate --measured`, the benches) and
adaptive γ (`hybridspec.spec.gamma`) use.

A round of B rows drafting G each (G = 0: a plain decode step) costs

    round(B, G) = forward + draft + sampling + commit + replay + host

- forward:  the target forward of G + 1 inputs per row, the policy's snapshot
            (and input-log) writes included;
- draft:    the drafter's part of the round: its catch-up of the committed
            tokens and its G steps, as the drafter runs them (0 at G = 0);
- sampling: turning logits into tokens: acceptance (greedy or rejection) of
            G + 1 distributions per row, or a plain step's sampling;
- commit:   the stop rules, the restore of every row to its boundary (head
            moves) and the drafter's commit (0 at G = 0);
- replay:   the expected replay a sparse checkpoint policy adds to the commit
            (0 where every boundary is a snapshot);
- host:     the round's own bookkeeping outside those phases (planning the
            snapshots, counting, the row results of a plain step).

The speedup over plain decoding of rounds that emit E tokens per row is

    speedup = E · round(B, 0) / round(B, G)

docs/simulator.md, "7. The whole round", says where each term is measured.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridspec.costs.validation import check_cost

TERMS = ("forward_s", "draft_s", "sampling_s", "commit_s", "replay_s", "host_s")


@dataclass(frozen=True)
class RoundTerms:
    """Seconds of one round (or plain step) of a whole batch, by term (module docstring)."""

    forward_s: float = 0.0
    draft_s: float = 0.0
    sampling_s: float = 0.0
    commit_s: float = 0.0
    replay_s: float = 0.0
    host_s: float = 0.0

    def __post_init__(self) -> None:
        for name in TERMS:
            check_cost(getattr(self, name), f"RoundTerms.{name}")

    @property
    def total_s(self) -> float:
        return round_seconds(self)

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in TERMS}


def mixed_terms(greedy: RoundTerms, sampled: RoundTerms, fraction: float) -> RoundTerms:
    """The terms of a round in which `fraction` of the rows sample and the rest
    are greedy, from the two kinds' terms measured on whole batches of each:
    a row's share of a term is its kind's."""
    if fraction <= 0.0:
        return greedy
    return RoundTerms(**{name: (1.0 - fraction) * getattr(greedy, name) + fraction * getattr(sampled, name)
                         for name in TERMS})


def round_seconds(terms: RoundTerms, forward_scale: float = 1.0, draft_scale: float = 1.0) -> float:
    """round(B, G) of the module docstring; the forward and draft terms may carry
    a scale learned online (adaptive γ), 1 for the measured figures."""
    return (forward_scale * terms.forward_s + draft_scale * terms.draft_s + terms.sampling_s + terms.commit_s
            + terms.replay_s + terms.host_s)


def round_speedup(tokens_per_round: float, plain: RoundTerms, spec: RoundTerms) -> float:
    """E · round(B, 0) / round(B, G): tokens per second of the rounds over a plain step's."""
    return tokens_per_round * round_seconds(plain) / round_seconds(spec)


def generation_speedup(num_tokens: int, tokens_per_round: float, plain: RoundTerms, spec: RoundTerms,
                       prefill_s: float = 0.0, absorb_s: float = 0.0) -> float:
    """Speedup of generating `num_tokens` tokens per row of a batch from its
    prompts: both pay the target's prefill (`prefill_s`, which gives the first
    token); then num_tokens − 1 plain steps against the drafter's absorption
    of the prompts (`absorb_s`, speculative only) and (num_tokens − 1) / E rounds."""
    steps = num_tokens - 1
    plain_s = prefill_s + steps * round_seconds(plain)
    return plain_s / (prefill_s + absorb_s + steps / tokens_per_round * round_seconds(spec))
