"""The greedy drafter's chain: a model's decode steps, each over the argmax of
the last step's logits, with the catch-up before them, in one native call
(`kernels.cpu_forward`). A capability of a backend with the whole forward
(`HybridModel.greedy_chain`, None elsewhere); a `ModelDrafter` asks for it
and decodes step by step where it is None or declines a call."""
from __future__ import annotations

import torch

from hybridspec.models.common import check_finite


class GreedyChain:
    """`decode` and `extend` of one model through its whole-forward kernel `whole`;
    the cache they run on plans and commits them (ring slots, K/V pages)."""

    def __init__(self, model, whole):
        self.model, self.whole = model, whole

    @torch.inference_mode()
    def decode(self, cache, seq_ids: list[int], tokens: list[int], steps: int,
               argmax_only: bool = False) -> tuple[list[list[int]], torch.Tensor, list[list[int]]] | None:
        """`steps` decode steps, the first over `tokens`, each later one over the
        argmax of the last step's logits (a greedy drafter's loop), in one C call
        (`WholeForward.greedy_steps`): the steps `decode` would run, with the same
        bits. Returns (each row's argmax tokens [batch][steps], logits [batch,
        steps, vocab], the ring head after each step [batch][steps]), committed
        like `steps` decodes; None, with nothing changed, where the whole forward
        does not run (the caller then decodes step by step). `argmax_only`: the
        caller reads the tokens, not the logits, and a Q6_K LM head's logits are
        those of the columns a coarse pass ranks best, −∞ elsewhere
        (`cpu_forward.DRAFT_HEAD_TOP`): the tokens are the argmax wherever it is
        among them, a draft's otherwise (verification keeps the output exact)."""
        if steps < 1:
            return None
        return self._chained(cache, seq_ids, steps, steps,
                             lambda plan: self.whole.greedy_steps(cache, tokens, steps, plan, argmax_only))

    @torch.inference_mode()
    def extend(self, cache, seq_ids: list[int], token_lists: list[list[int]], steps: int,
               argmax_only: bool = False) -> tuple[list[int], list[list[int]], torch.Tensor, list[list[int]]] | None:
        """A greedy drafter's catch-up and steps in one C call
        (`WholeForward.extend_greedy`): `extend(cache, seq_ids, token_lists,
        last_only=True)`, then `decode` over its argmax for `steps`
        steps, with the same bits. Every row's catch-up has the same length.
        Returns (each row's catch-up argmax [batch], the steps' tokens
        [batch][steps], logits [batch, steps + 1, vocab], the ring head after
        the catch-up and after each step [batch][steps + 1]), committed like
        those calls; None, with nothing changed, where it does not run (the
        rows' lengths differ, more rows than the blocks take, or
        `decode`'s reasons). `argmax_only` as `decode`."""
        T = len(token_lists[0]) if token_lists else 0
        if steps < 1 or T < 1 or any(len(t) != T for t in token_lists):
            return None

        def call(plan):
            done = self.whole.extend_greedy(cache, token_lists, steps, plan, argmax_only)
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
        over `num_new` new positions per row, a transaction over the cache
        (`HybridCache.plan_chain`, then `commit_chain` or `abort_chain`).
        `call(plan)` runs them through the kernel, which calls `plan()` once it
        takes the call (None: it cannot be planned) and returns (out, logits,
        finite), or None where it declines. Returns (out, logits, the ring head
        after each forward [batch][forwards]) with every row committed at its
        last position; None, with nothing changed, where the kernel declines or
        the cache cannot plan the chain (the caller takes the plain calls). A
        failing call changes nothing either."""
        planned = []

        def plan():
            chain = cache.plan_chain(seq_ids, forwards, num_new)
            if chain is None:
                return None
            planned.append(chain)
            return chain.chains, chain.kv, chain.start_lens

        try:
            done = call(plan)
            if done is None:
                return None
            out, logits, finite = done
            if not finite:
                check_finite(logits, None, True)
            self.model.forward_done(forwards)
        except Exception:
            if planned:
                cache.abort_chain(planned[0])
            raise
        return out, logits, cache.commit_chain(planned[0])
