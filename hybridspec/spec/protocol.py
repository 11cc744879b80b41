"""What a drafter is to the Engine and the round: the `Drafter` protocol, the
`Proposal` a round gets from it, and `StatelessDrafter`, the base of drafters
that keep nothing per sequence.

Lengths: `commit(seq_ids, boundaries)` and `check_invariant(seq_id,
boundary)` take the target's boundary of each row, a computed length (m + n
in docs/design.md's round indices).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.cache.prefix_cache import PrefixStore
from hybridspec.models.hybrid import HybridModel
from hybridspec.sampling.sampler import RowParams


@dataclass
class Proposal:
    tokens: list[list[int]]  # [batch][g_b] d_1..d_g of each row, g_b = gammas[b] or fewer
    probs: torch.Tensor | None  # [batch, G, vocab] q_1..q_G after post-processing; None: one-hot drafts
    backlog_seconds: float = 0.0  # of this propose, absorbing backlogs (prompts, skipped rounds): one-off work
    backlog_tokens: int = 0  # the tokens those absorbed
    parents: list[list[int]] | None = None  # [batch][g_b] each draft's parent draft, -1: the pending token's
    # child (`spec.tree`); None: every row's drafts are a chain


@runtime_checkable
class Drafter(Protocol):
    """Everything the Engine and the speculative round ask of a drafter.
    `requests` are the engine's requests (committed tokens =
    `prompt_token_ids + token_ids`).

    model: the HybridModel it runs, or None. The Engine measures its step for
        adaptive γ and captures its forwards with CUDA graphs; the rollback
        suite prefills it to check the drafter's state.
    cache: its HybridCache of `model` (one row per sequence), or None. The
        scheduler admits and preempts by its free pages too.
    prefix: its own prefix cache over `cache` (`PrefixStore`), or None. It
        gives up cached pages when the scheduler needs room in `cache`.
    A drafter without them (`StatelessDrafter`) has all three None."""

    model: HybridModel | None
    cache: HybridCache | None
    prefix: PrefixStore | None

    def start(self, requests) -> None:
        """Take on new requests (absorb their prompts)."""

    def backlog(self, requests) -> list[int]:
        """Per request, the committed tokens the next round that drafts for it
        absorbs before its catch-up (adaptive γ charges them); 0 for none."""

    def propose(self, requests, gammas: list[int], rows: RowParams, coupled: list[bool]) -> Proposal:
        """Up to gammas[b] drafts per row (gammas may all be 0: the round then
        drafts nothing); `coupled[b]`: row b is verified coupled
        (`Speculator.coupled_rows`), so a sampling drafter samples it with the
        target's own keyed noise instead of the drafter's."""

    def commit(self, seq_ids: list[int], boundaries: list[int]) -> None:
        """Move each sequence to its accepted boundary (a computed length)."""

    def revert(self, seq_ids: list[int]) -> None:
        """Undo the last `propose` and any commit since, for these sequences."""

    def release(self, seq_ids: list[int]) -> None:
        """Forget finished sequences."""

    def check_invariant(self, seq_id: int, boundary: int) -> None:
        """Raise InvariantError if the sequence's state is not at or before
        `boundary` (a computed length)."""


class StatelessDrafter:
    """Base for drafters that keep nothing per sequence: no model, cache or
    prefix store, nothing to absorb; only `propose` is theirs."""

    model = cache = prefix = None

    def start(self, requests) -> None:
        pass

    def backlog(self, requests) -> list[int]:
        return [0] * len(requests)

    def propose(self, requests, gammas: list[int], rows: RowParams, coupled: list[bool]) -> Proposal:
        raise NotImplementedError

    def commit(self, seq_ids: list[int], boundaries: list[int]) -> None:
        pass

    def revert(self, seq_ids: list[int]) -> None:
        pass

    def release(self, seq_ids: list[int]) -> None:
        pass

    def check_invariant(self, seq_id: int, boundary: int) -> None:
        pass
