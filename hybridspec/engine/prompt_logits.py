"""The prefill of newly admitted requests that keeps every prompt position's
logits for those asking for prompt log-probs (`SamplingParams.prompt_logprobs`).

Rows asking for them run as a forward of their own with the logits of every
position; the others as one forward keeping only their last logits, as
before. A row's logits do not depend on the other rows of a forward
(`HybridModel.extend`), so splitting the batch changes no row's numbers. With
the prefix cache on, `PrefixStore.prefill_scoring` does the same per row.
"""
from __future__ import annotations

import torch

from hybridspec.models.hybrid import HybridModel


def prefill_logits(target: HybridModel, cache, seq_ids: list[int], token_lists: list[list[int]],
                   every_position: list[bool]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """`target.prefill` of every row: the logits at each row's last token
    [batch, vocab], and for each row marked in `every_position` the logits at
    every position [len(token_lists[b]), vocab] (None for the others). A
    failure leaves no row's sequence behind."""
    if not any(every_position):
        return target.prefill(cache, seq_ids, token_lists, last_only=True)[:, 0], [None] * len(seq_ids)
    scored = [b for b, whole in enumerate(every_position) if whole]
    plain = [b for b, whole in enumerate(every_position) if not whole]
    last = torch.empty(len(seq_ids), target.vocab_size, dtype=target.dtype, device=target.device)
    if plain:
        last[plain] = target.prefill(cache, [seq_ids[b] for b in plain], [token_lists[b] for b in plain],
                                     last_only=True)[:, 0]  # [plain, vocab]
    try:
        full = target.prefill(cache, [seq_ids[b] for b in scored], [token_lists[b] for b in scored])  # [scored, T, vocab]
    except Exception:
        cache.free_sequences([seq_ids[b] for b in plain])
        raise
    every: list[torch.Tensor | None] = [None] * len(seq_ids)
    for i, b in enumerate(scored):
        every[b] = full[i, :len(token_lists[b])]
        last[b] = every[b][-1]
    return last, every
