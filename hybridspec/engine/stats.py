"""`EngineStats`: what a generate call did and what each phase cost."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from hybridspec.deprecated import renamed_fields

PHASES = ("draft", "verify", "commit", "sampling")


@renamed_fields({"prefix_checkpoint_hits": "prefix_saved_state_hits"})  # "checkpoint" names the ring snapshots
@dataclass
class EngineStats:
    """Counts and phase times of `Engine.generate` calls: `engine.stats` holds
    the last call's, `engine.total_stats` the sum over every call.

    rounds: speculative rounds (plain decoding: decode steps) of the batch.
    drafted_tokens, accepted_tokens: drafts proposed and drafts kept (tokens).
    emitted_tokens: every generated token, the first of each request included.
    sequences: requests prefilled; sequence_rounds: (round, sequence) pairs.
    snapshot_hits: live rows restored by moving the ring head (no copy);
    log_replayed_tokens, token_replayed_tokens: steps replayed from the input
        log or by running the model over tokens.
    peak_checkpoint_bytes: most bytes the snapshots and input log held at once.
    prefill_computed_tokens: prompt tokens the target's prefill ran the model over
        (with the prefix cache: from each prompt's restored saved state on).
    prefix_hit_tokens: prompt tokens found in the prefix cache (K/V shared);
    prefix_replayed_tokens: of those, the tail from the saved state to the hit,
        replayed for the recurrent layers over the cached K/V;
    prefix_saved_state_hits: prompts started from a saved state;
    prefix_evictions: cached pages and saved states evicted.
    preemptions: running requests the scheduler preempted (freed, to be recomputed).
    gamma_counts: γ (drafts asked for) -> sequence-rounds that drafted that many
        (speculative rounds only; 0 is a plain step inside a round).
    seconds: wall seconds per phase ("draft", "verify", "commit", "sampling").
    """

    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # every generated token, the first one (sampled from the prefill logits) included
    sequences: int = 0  # requests prefilled
    sequence_rounds: int = 0  # (round, sequence) pairs: a plain decode step or a speculative round of one sequence
    snapshot_hits: int = 0
    log_replayed_tokens: int = 0
    token_replayed_tokens: int = 0
    peak_checkpoint_bytes: int = 0
    prefill_computed_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_replayed_tokens: int = 0
    prefix_saved_state_hits: int = 0
    prefix_evictions: int = 0
    preemptions: int = 0
    gamma_counts: dict[int, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens a sequence gains per round (the simulator's E[tokens]); the
        first token of each request comes from the prefill, not from a round."""
        return (self.emitted_tokens - self.sequences) / self.sequence_rounds if self.sequence_rounds else 0.0

    clock = staticmethod(time.perf_counter)  # what the phase timers read (start-up measurement sets its own)

    @contextmanager
    def phase(self, name: str):
        start = self.clock()
        try:
            yield
        finally:
            self.seconds[name] += self.clock() - start

    def add(self, other: "EngineStats") -> None:
        """Add `other`'s counts and seconds to these (peak bytes: the larger)."""
        for name in ("rounds", "drafted_tokens", "accepted_tokens", "emitted_tokens", "sequences",
                     "sequence_rounds", "snapshot_hits", "log_replayed_tokens", "token_replayed_tokens", "preemptions",
                     "prefill_computed_tokens", "prefix_hit_tokens", "prefix_replayed_tokens",
                     "prefix_saved_state_hits", "prefix_evictions"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.peak_checkpoint_bytes = max(self.peak_checkpoint_bytes, other.peak_checkpoint_bytes)
        for gamma, count in other.gamma_counts.items():
            self.gamma_counts[gamma] = self.gamma_counts.get(gamma, 0) + count
        for phase, seconds in other.seconds.items():
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def reset(self) -> None:
        fresh = EngineStats()
        self.__dict__.update(fresh.__dict__)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["acceptance_rate"] = self.acceptance_rate
        out["tokens_per_round"] = self.tokens_per_round
        return out
