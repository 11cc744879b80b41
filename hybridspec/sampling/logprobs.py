"""Log-probabilities of emitted tokens under the target's processed
distribution (`SamplingParams.logprobs`).

A token emitted at a position gets log p(token) and the k most likely tokens
of p, the target's distribution there after penalties, temperature and
filters (`sampling.process_logits`; greedy rows: the plain softmax). Plain
decoding reads p from its decode step, a speculative round from the verify
forward's p_1..p_{n+1}: the same distribution for the same context, so the
same numbers for the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability (natural log) and the top k."""

    token_id: int
    logprob: float  # log p(token_id); -inf for a token the filters removed (a forced stop token, say)
    top: tuple[tuple[int, float], ...]  # the k most likely (token id, log p), most likely first

    def as_dict(self) -> dict:
        return dict(token_id=self.token_id, logprob=self.logprob, top=[list(t) for t in self.top])


def token_logprobs(probs: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """One TokenLogprob per token of one row: probs [len(tokens) or more, vocab]
    (row j is the distribution token j was drawn from), k >= 0."""
    logp = torch.log(probs[:len(tokens)].to(torch.float64))  # [n, vocab]
    rows = torch.arange(len(tokens), device=logp.device)
    chosen = logp[rows, torch.tensor(tokens, dtype=torch.long, device=logp.device)].tolist()
    top_values, top_ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return [TokenLogprob(t, lp, tuple(zip(ids, values)))
            for t, lp, ids, values in zip(tokens, chosen, top_ids.tolist(), top_values.tolist())]


def batch_logprobs(probs: torch.Tensor, tokens: list[list[int]], requests) -> list[list[TokenLogprob] | None]:
    """Per row b, `token_logprobs(probs[b], tokens[b], k_b)` where request b asks
    for k_b top tokens, None where it asks for none. probs [batch, T, vocab]."""
    return [None if r.params.logprobs is None else token_logprobs(probs[b], row, r.params.logprobs)
            for b, (r, row) in enumerate(zip(requests, tokens))]
