"""`SuffixDrafter`: model-free drafting from the counts of the n-grams seen so
far (suffix decoding, Oliaro et al. 2024): each sequence's own prompt and
output, and the outputs of requests that ended before it.

Per sequence, a `SuffixTrie` over its committed tokens, grown by the tokens
committed since its last round (an append costs `max_depth` node steps
whatever the context's length); and one global trie over earlier requests'
outputs, holding at most `global_tokens` tokens (the oldest requests'
contributions are removed first). A round looks up, in each trie, every
suffix of the context up to `max_depth - 1` tokens long (the frontier, or
one root walk each in the global trie), follows each one's most frequent
continuation while its empirical probability stays at or above `min_prob`,
and proposes the continuation with the largest expected accepted length
(ties: the longer match, then the sequence's own trie): the draft's length
is the drafter's own choice, at most the γ it is given. A round's cost is
bounded by `max_depth` and γ (a tree's also by the distinct tokens that
followed the spine's n-grams), never by the context's length.

The tries only ever take committed tokens, read from the requests when a
round proposes: a draft is never put in, so a rejected draft token is never
kept, and `commit`/`revert` have nothing to undo. A preempted sequence is
forgotten and rebuilt from its committed tokens when it resumes (`start`).
Drafts are one-hot (q is the draft itself: `Proposal.probs` is None).

With a `TreeShape` (`tree=`, or `Engine(tree=...)`) it proposes the branches
of its trie (`spec.tree`): the chosen continuation as the spine and, at each
depth, the other tokens that followed the same n-gram there, most frequent
first and above `min_prob` themselves, as leaves beside it, within the row's
node budget (`spec.tree.fitted_tree`). A round where no row branches is a
chain round.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hybridspec.errors import ConfigError, InvariantError
from hybridspec.sampling.sampler import RowParams
from hybridspec.spec.protocol import Proposal, StatelessDrafter
from hybridspec.spec.suffix_trie import NO_DRAFT, ROOT, Draft, Frontier, SuffixTrie
from hybridspec.spec.tree import TreeShape, chain_parents, checked_tree, fitted_tree, tree_parents

DEPTH_LIMIT = 64  # deeper tries cost memory per token with nothing to show for it


@dataclass
class _Sequence:
    """One running sequence: its request, its trie and where its stream ends."""

    request: object
    trie: SuffixTrie
    frontier: Frontier = field(default_factory=Frontier)


class SuffixDrafter(StatelessDrafter):
    """Suffix decoding: propose the most frequent continuation of the longest
    suffix of the context seen before, in the sequence itself or in earlier
    requests' outputs; no model, no probabilities (q is one-hot); a round
    with no match drafts nothing.

    max_depth: the longest n-gram counted (default 12): a match plus its
        draft is at most this long; 2..64.
    min_prob: stop a draft where its empirical probability (the product of
        each step's count / total) falls below this (default 0.1); 0..1.
    global_tokens: the most tokens of earlier requests' outputs kept for
        lookup (default 16384; 0: each sequence's own tokens only).
    tree: None (chains, the default) or a `TreeShape`: propose the trie's
        branches (module docstring); `Engine(tree=...)` sets it."""

    def __init__(self, max_depth: int = 12, min_prob: float = 0.1, global_tokens: int = 16384,
                 tree: TreeShape | None = None):
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or not 2 <= max_depth <= DEPTH_LIMIT:
            raise ConfigError(f"max_depth={max_depth!r} must be an int in 2..{DEPTH_LIMIT} (the longest n-gram "
                              "counted: a match plus its draft); the default is 12")
        if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float)) or not 0.0 <= min_prob <= 1.0:
            raise ConfigError(f"min_prob={min_prob!r} must be a number in [0, 1] (the empirical probability below "
                              "which a draft stops); the default is 0.1")
        if isinstance(global_tokens, bool) or not isinstance(global_tokens, int) or global_tokens < 0:
            raise ConfigError(f"global_tokens={global_tokens!r} must be an int >= 0 (tokens of earlier outputs kept; "
                              "0 turns the global lookup off); the default is 16384")
        self.tree = checked_tree(tree)
        self.max_depth, self.min_prob, self.global_tokens = max_depth, float(min_prob), global_tokens
        self.sequences: dict[int, _Sequence] = {}
        self.shared = SuffixTrie(max_depth)  # earlier requests' outputs
        self.contributions: deque[list[int]] = deque()  # what `shared` holds, oldest first
        self.shared_tokens = 0

    # -- the Drafter protocol --------------------------------------------------------------------

    def start(self, requests) -> None:
        """Build each new (or resumed) sequence's trie over its committed tokens."""
        for r in requests:
            self.sequences[r.seq_id] = self._build(r)

    def propose(self, requests, gammas: list[int], rows: RowParams, coupled: list[bool]) -> Proposal:
        trees = []  # per row (tokens, parents)
        for r, g in zip(requests, gammas):
            seq = self._catch_up(r)
            draft, trie, node = self._draft(seq, g) if g > 0 else (NO_DRAFT, seq.trie, ROOT)
            if self.tree is None or not draft.tokens:
                trees.append((draft.tokens, chain_parents(len(draft.tokens))))
            else:
                # the spine's token leads each depth's ranking: the widest depth's candidates suffice
                ranked = trie.alternatives(node, draft.tokens, self.min_prob, max(self.tree.widths))
                trees.append(fitted_tree(draft.tokens, ranked, self.tree, self.tree.budget(g)))
        return Proposal([tokens for tokens, _ in trees], None, parents=tree_parents(trees))

    def release(self, seq_ids: list[int]) -> None:
        """Forget these sequences; one that ended (not a preempted one) leaves
        its output to the global trie."""
        for s in seq_ids:
            seq = self.sequences.pop(s, None)
            if seq is not None and seq.request.finished:
                self._remember(list(seq.request.output.token_ids))

    def check_invariant(self, seq_id: int, boundary: int) -> None:
        """The trie holds committed tokens only: never more than the
        `boundary + 1` committed at the boundary (t[0..boundary])."""
        seq = self.sequences.get(seq_id)
        if seq is not None and seq.frontier.length > boundary + 1:
            raise InvariantError(f"sequence {seq_id}: the suffix trie holds {seq.frontier.length} tokens but only "
                                 f"{boundary + 1} are committed at boundary {boundary}")

    # -- per sequence ----------------------------------------------------------------------------

    def _build(self, request) -> _Sequence:
        seq = _Sequence(request, SuffixTrie(self.max_depth))
        seq.trie.extend(seq.frontier, request.output.prompt_token_ids)
        seq.trie.extend(seq.frontier, request.output.token_ids)
        return seq

    def _catch_up(self, request) -> _Sequence:
        """The sequence's trie, grown by the tokens committed since it last grew
        (a sequence never started is built now)."""
        seq = self.sequences.get(request.seq_id)
        if seq is None:
            seq = self.sequences[request.seq_id] = self._build(request)
            return seq
        prompt, output = request.output.prompt_token_ids, request.output.token_ids
        done = seq.frontier.length
        if done < len(prompt):
            seq.trie.extend(seq.frontier, prompt[done:])
            done = len(prompt)
        seq.trie.extend(seq.frontier, output[done - len(prompt):])
        return seq

    def _draft(self, seq: _Sequence, gamma: int) -> tuple[Draft, SuffixTrie, int]:
        """The best draft, the trie it was found in and the node of the n-gram it continues."""
        own = seq.trie.best_draft(seq.frontier.nodes, gamma, self.min_prob)
        found = (own, seq.trie, seq.frontier.nodes)
        if self.contributions:
            matches = self._shared_matches(seq)
            shared = self.shared.best_draft(matches, gamma, self.min_prob)
            if (shared.score, shared.match) > (own.score, own.match):
                found = (shared, self.shared, matches)
        draft, trie, matches = found
        return draft, trie, matches[draft.match] if draft.tokens else ROOT

    def _shared_matches(self, seq: _Sequence) -> list[int]:
        """matches[k]: the global trie's node of the context's last k tokens (-1: none)."""
        tail = self._tail(seq.request, self.max_depth - 1)
        matches = [0]
        for k in range(1, len(tail) + 1):
            node = self.shared.find(tail[-k:])
            if node < 0:  # a longer suffix cannot occur where this one does not
                break
            matches.append(node)
        return matches

    @staticmethod
    def _tail(request, n: int) -> list[int]:
        """The last n committed tokens (fewer if the context is shorter)."""
        output = request.output.token_ids
        if len(output) >= n:
            return output[-n:]
        return request.output.prompt_token_ids[-(n - len(output)):] + output

    # -- across requests -------------------------------------------------------------------------

    def _remember(self, output: list[int]) -> None:
        """Put an ended request's output in the global trie; remove the oldest
        contributions while it holds more than `global_tokens` tokens."""
        output = output[-self.global_tokens:] if self.global_tokens else []
        if not output:
            return
        self.shared.add(output)
        self.contributions.append(output)
        self.shared_tokens += len(output)
        while self.shared_tokens > self.global_tokens:
            oldest = self.contributions.popleft()
            self.shared.remove(oldest)
            self.shared_tokens -= len(oldest)
