"""Prefix cache for a hybrid model: reuse the attention K/V pages of a cached
prefix and restart the recurrent layers from a saved state.

Attention layers can reuse any prefix's K/V; Mamba layers cannot, because
their state is one point at one position. So a request finds the longest
cached prefix H of its prompt (`PrefixIndex`, a token radix tree of KV pages)
and the nearest valid saved state C <= H, copies that state into its ring
head, and runs the model over the tail C..H reading the tail's cached K/V
(those positions are never written: the pages stay shared), then over the
rest of its prompt as a plain prefill. Nothing is skipped at the end: the
last prompt token is always computed, so the first token's logits are the
ones a prefill from scratch gives (C <= len(prompt) - 1).

States are saved where the forward passes them (the prefill runs in
chunks ending there):
  - at len(prompt) - 1: the state with the last prompt token pending, which
    an identical prompt (or any longer one) restores with a one-token tail;
  - every `save_every` tokens of a prompt;
  - at each position the request marks (`SamplingParams(save_states_at=...)`);
  - at the hit H when the prompt leaves the cached path there past its
    saved state (a branch point: the next prompt sharing that prefix, e.g. the
    next question over the same document, restores it with no replay);
  - at the end of a finished request (computed_len = committed - 1), so the
    next chat turn, which re-sends the conversation, hits.
Saved states live under `memory_budget_bytes`, evicted least recently used;
cached pages live in the model's block pool, evicted (leaves first, least
recently used) when the scheduler needs room. While a prompt is restored and
replayed, its hit (the deepest node, the saved state) is locked; afterwards the
sequence holds its own reference to every page it shares and its own copy of
the state, so evicting an index entry never frees what a running sequence uses.

Cost model. The tail C..H is replayed by token replay (no input log exists
for a prefix), a forward over H - C tokens that a prefill from C would run
anyway; replaying only saves the tail's K/V writes and keeps its pages
shared, so it never costs more than stopping the hit at C. What can make it
not worth it is its length: with `max_replay_tokens` set, a tail longer than
that stops the hit at C (`plan_hit`); `max_replay_tokens=0` makes hits land
only on saved states, which with `save_every=N` and no end states
(and `at_hit=False`) is the block-grid scheme of vLLM.

Prompt log-probs (`SamplingParams.prompt_logprobs`) need the logits of every
prompt position, which cached K/V and saved states do not give back: such a
prompt takes no hit and runs whole (`prefill_scoring`), as vLLM v1 skips the
prefix cache for it; its pages and states are indexed as any prompt's, for
the requests after it. Storing each cached position's log-probs instead would
tie a top-k to the cache and cost memory per token for the rare request that
asks (cost of the recompute: benches/prompt_logprobs.py).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from hybridspec.deprecated import renamed_fields
from hybridspec.errors import ConfigError
from hybridspec.cache.prefix_index import Node, PrefixIndex, SavedState


@renamed_fields({"checkpoint_every": "save_every"})  # "checkpoint" names the ring snapshots
@dataclass(frozen=True)
class PrefixCache:
    """Settings of an Engine's prefix cache (`hs.Engine(..., prefix_cache=hs.PrefixCache(...))`).

    memory_budget_bytes: most bytes of saved states kept per model (the
        target's and a model drafter's each; default 256 MiB); KV pages are
        bounded by the block pool (`Engine(num_blocks=...)`).
    save_every: also save the state every N prompt tokens (positions N, 2N, …);
        None (default): only at prompt ends, request ends and marks.
    at_prompt_end: save the state at len(prompt) - 1 (default True).
    at_request_end: save a finished request's state at its end (default True).
    at_hit: save a prompt's state at its hit when the hit lies past the saved state it
        restored (the replayed tail's end, where the prompt branches off; default True).
    max_replay_tokens: longest tail replayed from a saved state; a longer one
        stops the hit at the saved state. None (default): no limit; 0: no replay.
    """

    memory_budget_bytes: int = 256 * 2 ** 20
    save_every: int | None = None
    at_prompt_end: bool = True
    at_request_end: bool = True
    at_hit: bool = True
    max_replay_tokens: int | None = None

    def __post_init__(self):
        def integer(name, value, low, fix):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"PrefixCache({name}={value!r}): must be an integer >= {low}{fix}")
        integer("memory_budget_bytes", self.memory_budget_bytes, 0, " (bytes of saved states)")
        if self.save_every is not None:
            integer("save_every", self.save_every, 1, ", or None for no grid of saved states")
        if self.max_replay_tokens is not None:
            integer("max_replay_tokens", self.max_replay_tokens, 0, ", or None for no limit")
        for name in ("at_prompt_end", "at_request_end", "at_hit"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"PrefixCache({name}={getattr(self, name)!r}): must be True or False")


def as_prefix_settings(value) -> PrefixCache | None:
    """`Engine(prefix_cache=...)`: None/False (off), True (the defaults) or a PrefixCache."""
    if value is None or value is False:
        return None
    if value is True:
        return PrefixCache()
    if isinstance(value, PrefixCache):
        return value
    raise ConfigError(f"prefix_cache={value!r} must be True, False, None or hs.PrefixCache(...)")


@dataclass
class PrefixHit:
    """Where a prompt starts: the K/V of [0, num_cached) from `nodes`' pages, the
    recurrent state after `state_position` tokens from `saved_state` (None: zeros)."""

    num_cached: int
    state_position: int
    nodes: list[Node]
    saved_state: SavedState | None

    @property
    def num_replayed(self) -> int:
        return self.num_cached - self.state_position


def plan_hit(num_cached: int, state_position: int, max_replay_tokens: int | None) -> int:
    """The hit length to use: `num_cached`, or `state_position` when the tail
    between them is longer than `max_replay_tokens` (see the module's cost model)."""
    if max_replay_tokens is not None and num_cached - state_position > max_replay_tokens:
        return state_position
    return num_cached


def save_positions(prompt_len: int, start: int, settings: PrefixCache, marks=(), hit: int = 0) -> list[int]:
    """Positions in (start, prompt_len] where the prefill of a prompt restored at `start`
    with a cached prefix of `hit` tokens saves the state."""
    wanted = set(m for m in marks if start < m <= prompt_len)
    if settings.at_hit and hit > start:
        wanted.add(hit)
    if settings.save_every is not None:
        wanted.update(range(settings.save_every, prompt_len + 1, settings.save_every))
    if settings.at_prompt_end and prompt_len >= 2:
        wanted.add(prompt_len - 1)
    return sorted(p for p in wanted if start < p)


@dataclass
class PrefixCounts:
    """What a PrefixStore did since its counts were last moved (`move_counts`); the
    names are `EngineStats`'s."""

    prefill_computed_tokens: int = 0  # prompt tokens run through the model (from each restored state on)
    prefix_hit_tokens: int = 0  # prompt tokens whose K/V was found cached
    prefix_replayed_tokens: int = 0  # of those, the tails replayed from a saved state
    prefix_saved_state_hits: int = 0  # prompts started from a saved state
    prefix_evictions: int = 0  # cached pages and saved states evicted


class PrefixStore:
    """The prefix cache of one model and its `HybridCache` (the target's, or a
    model drafter's): index, saved states, lookup/restore, insertion, eviction.
    `counts` (`PrefixCounts`) add up what it did until `move_counts` hands them
    to an `EngineStats`.

    Hooks (plain inputs, callable from any scheduler):
      prefill(seq_ids, prompts, marks) -> first-token logits   instead of model.prefill
      release(seq_ids, token_lists)     before freeing sequences (Engine._release)
      make_room(num_pages)              when the scheduler needs pages (its `reclaim`)
    """

    def __init__(self, model, cache, settings: PrefixCache):
        self.model, self.cache, self.settings = model, cache, settings
        self.counts = PrefixCounts()
        self.index = PrefixIndex(cache.block_size)
        self.saved_state_bytes = 0

    # -- lookup and restore -------------------------------------------------------------------

    def lookup(self, tokens: list[int], wants_logits: bool = True) -> PrefixHit:
        """Where `tokens` (a prompt) can start: the longest cached prefix, at most the whole
        prompt, and the nearest saved state at or before it and, when the last token's logits
        are wanted, before the last token."""
        match = self.index.match(tokens)
        limit = min(match.num_cached, len(tokens) - int(wants_logits))
        if self.cache.states is None:  # no recurrent state: any position can be restored
            saved, position = None, limit
        else:
            saved = match.nearest_saved_state(limit)
            position = 0 if saved is None else saved.position
        num_cached = plan_hit(match.num_cached, position, self.settings.max_replay_tokens)
        if self.cache.kv is None:
            num_cached = position  # without K/V there is nothing to share past the state
        return PrefixHit(num_cached, position, match.nodes_for(num_cached, self.cache.block_size), saved)

    def prefill(self, seq_ids: list[int], token_lists: list[list[int]], marks=None,
                wants_logits: list[bool] | None = None) -> torch.Tensor:
        """Absorb each prompt, from its prefix hit on; returns the logits at the last prompt
        token of each row that wants them (default: every row) [rows wanting logits, vocab].
        A row that wants none (a preempted sequence resuming) may be restored whole, with
        no forward. A row that raises leaves no trace of itself."""
        return self.prefill_scoring(seq_ids, token_lists, marks, wants_logits)[0]

    def prefill_scoring(self, seq_ids: list[int], token_lists: list[list[int]], marks=None,
                        wants_logits: list[bool] | None = None,
                        every_position: list[bool] | None = None) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """`prefill`, and for each row marked in `every_position` (prompt log-probs) the logits
        at every prompt position [len(prompt), vocab] (None for the others). Such a row takes
        no prefix hit: its prompt runs whole, as from an empty cache (a cached prefix holds
        K/V and saved states, not the logits of its positions), and is indexed as any other
        for the requests after it."""
        marks = marks or [()] * len(seq_ids)
        wants_logits = [True] * len(seq_ids) if wants_logits is None else wants_logits
        every_position = every_position or [False] * len(seq_ids)
        logits = [torch.empty(0, self.model.vocab_size, dtype=self.model.dtype, device=self.model.device)]
        every = []
        for s, tokens, m, wants, whole in zip(seq_ids, token_lists, marks, wants_logits, every_position):
            rows = self._prefill_one(s, list(tokens), tuple(m), wants, whole)  # [1 or len(tokens), vocab]
            if wants:
                logits.append(rows[-1:])
            every.append(rows if whole else None)
        return torch.cat(logits, 0), every

    def _prefill_one(self, seq_id: int, tokens: list[int], marks: tuple[int, ...],
                     wants_logits: bool, every_position: bool) -> torch.Tensor | None:
        hit = PrefixHit(0, 0, [], None) if every_position else self.lookup(tokens, wants_logits)
        self.cache.add_sequences([seq_id])
        locked = hit.nodes[-1:] + ([hit.saved_state.node] if hit.saved_state is not None else [])
        self.index.lock(locked, hit.saved_state)  # in use until the prompt is absorbed and indexed
        self.index.touch(hit.nodes, hit.saved_state)
        try:
            try:
                state = None if hit.saved_state is None else hit.saved_state.state
                self.cache.restore_prefix(seq_id, [n.page for n in hit.nodes], hit.num_cached,
                                          hit.state_position, state)
                logits, states = self._forward_from(seq_id, tokens, hit, marks, every_position)
            except Exception:
                self.cache.free_sequences([seq_id])
                raise
            self._count_hit(hit, len(tokens))
            self._insert(tokens, seq_id, states)
        finally:
            self.index.lock(locked, hit.saved_state, -1)
        return logits

    def _forward_from(self, seq_id: int, tokens: list[int], hit: PrefixHit, marks,
                      every_position: bool = False) -> tuple[torch.Tensor | None, list]:
        """The model over the prompt from the hit's state position, in chunks ending at each
        position that saves the state; returns the last logits [1, vocab] (with
        `every_position`: the logits of every position run [len(tokens) - start, vocab]; None:
        nothing to run) and the (position, state) pairs saved."""
        start = hit.state_position
        stops = save_positions(len(tokens), start, self.settings, marks, hit.num_cached)
        ends = sorted(set(stops) | {len(tokens)}) if start < len(tokens) else []
        taken, chunks = [], []
        for end in ends:
            chunks.append(self.model.extend(self.cache, [seq_id], [tokens[start:end]],
                                            last_only=not every_position)[0])  # [1 or end - start, vocab]
            if end in stops and self.cache.states is not None:
                taken.append((end, self.cache.states.read_slot(self.cache.head(seq_id))))
            start = end
        if not chunks:
            return None, taken
        return (torch.cat(chunks, 0) if every_position else chunks[-1]), taken

    def move_counts(self, stats) -> None:
        """Add the counts to `stats` (an EngineStats) and start them again from zero."""
        for f in fields(PrefixCounts):
            setattr(stats, f.name, getattr(stats, f.name) + getattr(self.counts, f.name))
        self.counts = PrefixCounts()

    def _count_hit(self, hit: PrefixHit, prompt_len: int) -> None:
        counts = self.counts
        counts.prefix_hit_tokens += hit.num_cached
        counts.prefix_replayed_tokens += hit.num_replayed
        counts.prefix_saved_state_hits += int(hit.saved_state is not None)
        counts.prefill_computed_tokens += prompt_len - hit.state_position

    # -- insertion and release ----------------------------------------------------------------

    def _insert(self, tokens: list[int], seq_id: int, states: list) -> None:
        """Index the sequence's first computed_len tokens (its pages) and hang `states`
        [(position, SlotState)] on the path."""
        n = self.cache.computed_len[seq_id]
        if n == 0:
            return
        kv = self.cache.kv
        pages = kv.block_table(seq_id)[: -(-n // kv.block_size)] if kv is not None else \
            [None] * -(-n // self.cache.block_size)
        path, taken = self.index.insert(tokens[:n], pages)
        for page in taken:
            kv.pool.incref(page)
        for position, state in states:
            if 0 < position <= n:
                self._save_state(path[(position - 1) // self.cache.block_size], position, state)

    def _save_state(self, node: Node, position: int, state) -> None:
        nbytes = state.nbytes
        if position in node.saved_states:
            self.index.add_saved_state(node, position, state, nbytes)  # already kept: only touched
            return
        if nbytes > self.settings.memory_budget_bytes:
            return
        while self.saved_state_bytes + nbytes > self.settings.memory_budget_bytes:
            victim = self.index.evictable_saved_state()
            if victim is None:
                return  # everything stored is in use: this one is not kept
            self._drop_saved_state(victim)
        if self.index.add_saved_state(node, position, state, nbytes) is not None:
            self.saved_state_bytes += nbytes

    def release(self, seq_ids: list[int], token_lists: list[list[int] | None]) -> None:
        """Sequences about to be freed (finished, preempted or aborted): each one given its
        committed tokens and standing at a boundary is indexed up to its computed_len,
        with its end state saved (None: nothing is indexed). Call before
        `HybridCache.free_sequences`."""
        for s, tokens in zip(seq_ids, token_lists):
            if tokens is None or not self.cache.has_sequence(s) or not self._is_consistent(s):
                continue
            n = self.cache.computed_len[s]
            end = [] if not self.settings.at_request_end or self.cache.states is None or n == 0 else \
                [(n, self.cache.states.read_slot(self.cache.head(s)))]
            self._insert(list(tokens), s, end)

    def _is_consistent(self, seq_id: int) -> bool:
        """KV holds computed_len positions and the head state sits there (a sequence at a boundary)."""
        n = self.cache.computed_len[seq_id]
        kv_ok = self.cache.kv is None or self.cache.kv.kv_len(seq_id) == n
        state_ok = self.cache.states is None or self.cache.states.head_position(seq_id) == n
        return kv_ok and state_ok

    # -- eviction -----------------------------------------------------------------------------

    def make_room(self, num_pages: int) -> None:
        """Evict cached pages (least recently used unlocked leaves first) until the block
        pool has `num_pages` free, or nothing more can be evicted. Leaves whose page the
        index alone holds go first (each frees a page); then leaves holding a page a
        running sequence writes next: that frees none, but the sequence then writes it in
        place instead of taking a page for a copy (a running sequence's pages are indexed
        again when it leaves)."""
        kv = self.cache.kv
        if kv is None:
            return
        while kv.pool.num_free < num_pages:
            leaf = self.index.evictable_leaf(lambda node: kv.pool.ref_count(node.page) == 1)
            if leaf is None:
                written = kv.pages_written_next()
                leaf = self.index.evictable_leaf(lambda node: node.page in written)
            if leaf is None:
                return
            self._drop_leaf(leaf)

    def _drop_leaf(self, node: Node) -> None:
        for saved in self.index.remove_leaf(node):
            self.saved_state_bytes -= saved.nbytes
            self.counts.prefix_evictions += 1
        if node.page is not None:
            self.cache.kv.pool.decref(node.page)
        self.counts.prefix_evictions += 1

    def _drop_saved_state(self, saved: SavedState) -> None:
        self.index.remove_saved_state(saved)
        self.saved_state_bytes -= saved.nbytes
        self.counts.prefix_evictions += 1
        node = saved.node
        while node.parent is not None and node.page is None and not node.children and not node.saved_states \
                and node.lock_count == 0:  # a page-less node (no attention layers) only carried saved states
            parent = node.parent
            self.index.remove_leaf(node)
            node = parent

    def clear(self) -> None:
        """Evict everything not locked."""
        while (saved := self.index.evictable_saved_state()) is not None:
            self._drop_saved_state(saved)
        while (leaf := self.index.evictable_leaf()) is not None:
            self._drop_leaf(leaf)

    # -- checks -------------------------------------------------------------------------------

    def cached_pages(self) -> list[int]:
        """Every page the index holds (one holder each)."""
        return [n.page for n in self.index.nodes() if n.page is not None]

    def num_saved_states(self) -> int:
        return len(self.index.saved_states())
