"""`Scheduler`: which requests run in the next engine step (continuous batching).

Requests wait in a FIFO queue and run in a batch of at most `max_running`
sequences. Every step the engine asks the scheduler two things:

- `admit(tokens_per_round)`: waiting requests to start now. A request is
  admitted while a state ring is free and every cache it occupies (the
  target's, a model drafter's) has the pages for its committed tokens plus one
  round, on top of what the running sequences need for their next round.
  Admission stops at the first request that does not fit (FIFO: no request
  overtakes an earlier one).
- `reserve(tokens_per_round)`: make room for the next round of every running
  sequence. While the pages it needs exceed the free pages, the newest running
  request is preempted: its pages and ring go back to the pools and it returns
  to the front of the queue with its committed tokens, to be prefilled again
  later (recompute). Nothing committed is lost: tokens are only ever appended
  to a request at a commit.

What one round takes from each cache is one rule, `round_positions`: every
page admission and `reserve` count comes from it, so a full pool ends in a
request waiting or being preempted, never in a forward that finds no page.

A request that could never run (its longest sequence, prompt plus
max_new_tokens, needs more pages than a whole pool) is refused at submission
(`check_fits`), so the oldest running request always fits alone and the
preemption loop ends; the queue never deadlocks.

The scheduler is bookkeeping over lengths and page counts: the engine runs the
forwards, frees caches through `release`, and owns the requests.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.errors import InvalidRequestError


def pages_for(cache: HybridCache, num_tokens: int) -> int:
    """KV pages that `num_tokens` positions of one sequence occupy in `cache`."""
    return -(-num_tokens // cache.block_size) if cache.kv is not None else 0


def round_positions(committed_len: int, round_tokens: int) -> int:
    """The reservation rule: positions one running sequence occupies in a cache
    once its next round has run, the most that any forward of the round writes.
    Every page the scheduler reserves (admission, `reserve`) comes from here.

    round_tokens: the sequence's verify inputs at most (its last token and its
        γ_b drafts, γ_b clamped to what is left of max_new_tokens; 1 for a
        plain decode step), the engine's `tokens_per_round`.

    The target's cache: the verify forward (or the plain step) writes positions
    committed_len - 1 … committed_len - 2 + round_tokens; token replay and a
    prefix-cache restore only rewrite positions below committed_len.
    A model drafter's cache: a drafting row is caught up to committed_len and
    then decodes its own γ_b - 1 drafts (`ModelDrafter.propose` steps no row
    past its γ_b), the same positions."""
    return committed_len - 1 + round_tokens


class Scheduler:
    """caches: every HybridCache a running sequence occupies (the target's
    first, then a model drafter's); max_running: the concurrency limit, at
    most each cache's `max_seqs` (one state ring per running sequence);
    release(requests): frees the sequences of `requests` in every cache (the
    engine's, since the drafter's state is the drafter's business);
    reclaim(cache, num_pages): None, or a way to free pages held by cached
    prefixes (the prefix cache) until `num_pages` are free, tried before a
    request waits or a running one is preempted."""

    def __init__(self, caches: list[HybridCache], max_running: int, release: Callable[[list], None],
                 reclaim: Callable[[HybridCache, int], None] | None = None):
        self.caches = caches
        self.max_running = max_running
        self.release = release
        self.reclaim = reclaim
        self.waiting: deque = deque()  # FIFO; preempted requests return to the front
        self.running: list = []  # in admission order: the last is the newest
        self.preemptions = 0  # over the scheduler's life

    # -- submission --------------------------------------------------------------------------

    def check_fits(self, prompt_len: int, max_new_tokens: int, what: str = "the request") -> None:
        """InvalidRequestError if one sequence of `prompt_len + max_new_tokens`
        tokens needs more KV pages than a whole pool holds (it could never run)."""
        for cache in self.caches:
            if cache.kv is None:
                continue
            needed = pages_for(cache, prompt_len + max_new_tokens)
            if needed > cache.kv.num_blocks:
                raise InvalidRequestError(
                    f"{what}: {prompt_len} prompt tokens + max_new_tokens={max_new_tokens} need {needed} KV pages "
                    f"of {cache.block_size} tokens but the whole pool holds {cache.kv.num_blocks}; shorten the "
                    "prompt, lower max_new_tokens or build the Engine with a larger num_blocks")

    def add(self, requests: Iterable) -> None:
        self.waiting.extend(requests)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- every step ---------------------------------------------------------------------------

    def admit(self, tokens_per_round: Callable[[object], int]) -> list:
        """Waiting requests to start this step (already moved to `running`), in queue order."""
        admitted = []
        if not self.waiting or len(self.running) >= self.max_running:
            return admitted  # (the page arithmetic below is a round's largest host cost at batch 8)
        reserved = self._reserved(self.running, tokens_per_round)
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting[0]
            # not prefilled yet: its prefill emits a first token before the round
            positions = round_positions(request.committed_len + 1, tokens_per_round(request))
            need = [pages_for(cache, positions) for cache in self.caches]
            if not self._make_free(lambda: [r + n for r, n in zip(reserved, need)]):
                break
            self.waiting.popleft()
            self.running.append(request)
            admitted.append(request)
            reserved = [r + n for r, n in zip(reserved, need)]
        return admitted

    def reserve(self, tokens_per_round: Callable[[object], int]) -> list:
        """Preempt the newest running requests until the next round of the rest
        fits every cache; returns the preempted ones (now first in the queue)."""
        preempted = []
        while not self._make_free(lambda: self._reserved(self.running, tokens_per_round)) and len(self.running) > 1:
            request = self.running.pop()
            self.release([request])
            self.waiting.appendleft(request)
            preempted.append(request)
            self.preemptions += 1
        return preempted

    def finish(self, requests: list) -> None:
        """Requests that ended (finished or aborted) leave the batch; their caches are freed."""
        done = {id(r) for r in requests}
        self.running = [r for r in self.running if id(r) not in done]
        waiting = [r for r in self.waiting if id(r) in done]
        for r in waiting:
            self.waiting.remove(r)
        self.release(list(requests))

    # -- page arithmetic ----------------------------------------------------------------------

    def _make_free(self, need: Callable[[], list[int]]) -> bool:
        """Whether every cache has the `need()[i]` pages free, reclaiming cached prefixes' pages first
        if not (which can also lower the need: a page no longer shared is written without a copy)."""
        pages = need()
        if self.reclaim is not None and not self._fits(pages):
            for cache, n in zip(self.caches, pages):
                if n > self._free_pages(cache):
                    self.reclaim(cache, n)
            pages = need()
        return self._fits(pages)

    def _fits(self, pages: list[int]) -> bool:
        return all(n <= self._free_pages(cache) for cache, n in zip(self.caches, pages))

    def _reserved(self, requests: list, tokens_per_round) -> list[int]:
        """Per cache, the pages the next round of `requests` takes from its pool."""
        tokens = [tokens_per_round(r) for r in requests]
        return [self._round_pages(cache, requests, tokens) for cache in self.caches]

    @staticmethod
    def _round_pages(cache: HybridCache, requests: list, tokens: list[int]) -> int:
        """Pages the next round of `requests` (`tokens[b]`: row b's round tokens)
        takes from `cache`'s pool (they already hold the rest)."""
        if cache.kv is None:
            return 0
        total, held = 0, []
        for r, n in zip(requests, tokens):
            if cache.has_sequence(r.seq_id):
                held.append((r.seq_id, round_positions(r.committed_len, n)))
            else:  # admitted but not prefilled yet: its prefill emits a first token before the round
                total += pages_for(cache, round_positions(r.committed_len + 1, n))
        return total + cache.kv.blocks_needed_each(held)

    @staticmethod
    def _free_pages(cache: HybridCache) -> int:
        return cache.kv.num_free_blocks if cache.kv is not None else 0
