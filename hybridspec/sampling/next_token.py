"""A plain step's sampling: each row's next token from the target's logits at
its pending position, with its log-probabilities. A decode step, a prompt's
first token and a speculative round in which no row drafted all sample
through `sample_next`, so they draw the same token with the same keyed noise
at the same position.
"""
from __future__ import annotations

import torch

from hybridspec.sampling.grammar import mask_logits
from hybridspec.sampling.logprobs import TokenLogprob, batch_logprobs
from hybridspec.sampling.penalties import penalty_context
from hybridspec.sampling.sampler import RowParams, argmax_suffices, process_logits, sample


def sample_next(logits: torch.Tensor, rows: RowParams, requests) -> tuple[list[int], list[list[TokenLogprob] | None]]:
    """logits [batch, vocab] at each request's next position (its committed
    length) -> (one token per row, per row its `TokenLogprob` list or None where
    the request asks for none). The argmax alone where it suffices
    (`argmax_suffices`); else the processed distribution, penalties from each
    request's committed tokens, sampled with the request's keyed noise.
    Grammar rows' logits are masked first (`hybridspec.sampling.grammar`)."""
    logits = mask_logits(logits, requests)
    if argmax_suffices(rows, requests):
        return logits.argmax(dim=-1).tolist(), [None] * len(requests)
    positions = torch.tensor([r.committed_len for r in requests], device=logits.device)  # [batch]
    probs = process_logits(logits, rows, penalty_context(requests, logits.shape[-1], logits.device))  # [batch, vocab]
    tokens = sample(probs, rows, positions).tolist()
    return tokens, batch_logprobs(probs[:, None], [[t] for t in tokens], requests)
