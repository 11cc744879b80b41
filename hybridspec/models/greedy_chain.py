"""The greedy drafter's chain: a model's decode steps, each over the argmax of
the last step's logits, with the catch-up before them, in one native call
(`kernels.cpu_forward`). A capability of a backend with the whole forward
(`HybridModel.greedy_chain`, None elsewhere); a `ModelDrafter` asks for it
and decodes step by step where it is None or declines a call."""
from __future__ import annotations

import torch

from hybridspec.models.common import check_finite


class GreedyChain:
    """`decode` and `extend` of one model through its whole-forward kernel `whole`,
    with the bookkeeping of the cache they run on (ring slots, K/V pages, commits)."""

    def __init__(self, model, whole):
        self.model, self.whole = model, whole

    @torch.inference_mode()
    def decode(self, cache, seq_ids: list[int], tokens: list[int],
               steps: int) -> tuple[list[list[int]], torch.Tensor, list[list[int]]] | None:
        """`steps` decode steps, the first over `tokens`, each later one over the
        argmax of the last step's logits (a greedy drafter's loop), in one C call
        (`WholeForward.greedy_steps`): the steps `decode` would run, with the same
        bits. Returns (each row's argmax tokens [batch][steps], logits [batch,
        steps, vocab], the ring head after each step [batch][steps]), committed
        like `steps` decodes; None, with nothing changed, where the whole forward
        does not run (the caller then decodes step by step)."""
        if steps < 1:
            return None
        return self._chained(cache, seq_ids, steps, steps,
                             lambda plan: self.whole.greedy_steps(cache, tokens, steps, plan))

    @torch.inference_mode()
    def extend(self, cache, seq_ids: list[int], token_lists: list[list[int]],
               steps: int) -> tuple[list[int], list[list[int]], torch.Tensor, list[list[int]]] | None:
        """A greedy drafter's catch-up and steps in one C call
        (`WholeForward.extend_greedy`): `extend(cache, seq_ids, token_lists,
        last_only=True)`, then `decode` over its argmax for `steps`
        steps, with the same bits. Every row's catch-up has the same length.
        Returns (each row's catch-up argmax [batch], the steps' tokens
        [batch][steps], logits [batch, steps + 1, vocab], the ring head after
        the catch-up and after each step [batch][steps + 1]), committed like
        those calls; None, with nothing changed, where it does not run (the
        rows' lengths differ, more rows than the blocks take, or
        `decode`'s reasons)."""
        T = len(token_lists[0]) if token_lists else 0
        if steps < 1 or T < 1 or any(len(t) != T for t in token_lists):
            return None

        def call(plan):
            done = self.whole.extend_greedy(cache, token_lists, steps, plan)
            if done is None:
                return None
            first, drafts, logits, finite = done
            return (first, drafts), logits, finite
        done = self._chained(cache, seq_ids, steps + 1, T + steps, call)
        if done is None:
            return None
        (first, drafts), logits, heads = done
        return first, drafts, logits, heads

    def _chained(self, cache, seq_ids: list[int], forwards: int, num_new: int, call):
        """What `decode` and `extend` share: `forwards` forwards one after another
        over `num_new` new positions per row, row b's state passing along its
        ring from the head (`chains[b]`, forwards + 1 slots; the head is never
        written), the K/V of every position reserved at once. `call(plan)` runs
        them through the kernel, which calls `plan()` once it takes the call
        (None: it cannot be planned) and returns (out, logits, finite), or None
        where it declines. Returns (out, logits, the ring head after each forward
        [batch][forwards]) with every row committed at its last position; None,
        with nothing changed, where the kernel declines, a ring is too short for
        the chain or a row replays over cached K/V (prefix cache: the caller
        takes the plain calls). A failing call changes nothing either."""
        planned = []

        def plan():
            starts = [cache.computed_len[s] for s in seq_ids]
            if cache.kv is not None and any(cache.kv.kv_len(s) != n for s, n in zip(seq_ids, starts)):
                return None
            chains = None
            if cache.states is not None:
                chains = []
                for s in seq_ids:
                    ring = cache.states.ring_slots(s)
                    if len(ring) < forwards + 1:  # the chain would come back to the head
                        return None
                    at = ring.index(cache.head(s))
                    chains.append([ring[(at + k) % len(ring)] for k in range(forwards + 1)])
            meta = cache.kv.prepare_write(seq_ids, [num_new] * len(seq_ids), starts) if cache.kv is not None else None
            planned.append((chains, starts))
            return chains, meta, starts

        try:
            done = call(plan)
            if done is None:
                return None
            out, logits, finite = done
            if not finite:
                check_finite(logits, None, True)
            self.model.forward_done(forwards)
        except Exception:
            if cache.kv is not None and planned:
                for s, n in zip(seq_ids, planned[0][1]):
                    cache.kv.truncate(s, n)
            raise
        chains, starts = planned[0]
        for b, (s, start) in enumerate(zip(seq_ids, starts)):
            cache.commit(s, start + num_new, chains[b][forwards] if chains else -1)
        heads = [chain[1:] for chain in chains] if chains else [[-1] * forwards for _ in seq_ids]
        return out, logits, heads
