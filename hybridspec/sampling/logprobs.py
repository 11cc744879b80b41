"""Log-probabilities of emitted tokens under the target's processed
distribution (`SamplingParams.logprobs`), and of prompt tokens under its raw
distribution (`SamplingParams.prompt_logprobs`).

A token emitted at a position gets log p(token) and the k most likely tokens
of p, the target's distribution there after penalties, temperature and
filters (`sampling.process_logits`; greedy rows: the plain softmax). Plain
decoding reads p from its decode step, a speculative round from the verify
forward's p_1..p_{n+1}: the same distribution for the same context, so the
same numbers for the same tokens.

A prompt token j >= 1 gets log p(prompt[j] | prompt[:j]) under the target's
raw distribution: log_softmax of the logits its prefill computed at position
j - 1, in the logits' dtype widened to at least float32, with nothing else
applied (no penalties, temperature or filters: vLLM's default
`raw_logprobs`), and its rank there. The first prompt token has none.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridspec.kernels.backend import torch_threads


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability (natural log) and the top k."""

    token_id: int
    logprob: float  # log p(token_id); -inf for a token the filters removed (a forced stop token, say)
    top: tuple[tuple[int, float], ...]  # the k most likely (token id, log p), most likely first
    rank: int | None = None  # prompt tokens: 1 + how many tokens are more likely; None for generated tokens

    def as_dict(self) -> dict:
        ranked = {} if self.rank is None else dict(rank=self.rank)
        return dict(token_id=self.token_id, logprob=self.logprob, top=[list(t) for t in self.top], **ranked)


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


PROMPT_ROWS_PER_CHUNK = 512  # positions whose log_softmax is held at once: bounds the extra memory of a long prompt


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], k: int) -> list[TokenLogprob | None]:
    """The prompt log-probs of one sequence (see the module docstring): None
    for prompt[0], then one TokenLogprob (with its rank) per later token.
    logits [len(prompt) or len(prompt) - 1, vocab]: row i the raw logits after
    prompt[:i + 1] (a last row past the prompt is not read); k >= 0."""
    entries: list[TokenLogprob | None] = [None]
    dtype = torch.promote_types(logits.dtype, torch.float32)
    for start in range(0, len(prompt) - 1, PROMPT_ROWS_PER_CHUNK):
        tokens = prompt[start + 1:start + 1 + PROMPT_ROWS_PER_CHUNK]
        with torch_threads():  # a prompt's rows split well (an engine step runs torch on one thread)
            logp = torch.log_softmax(logits[start:start + len(tokens)].to(dtype), dim=-1)  # [n, vocab]
        ids = torch.tensor(tokens, dtype=torch.long, device=logp.device)
        chosen = logp.gather(1, ids[:, None])  # [n, 1]
        ranks = (logp > chosen).sum(dim=-1) + 1  # [n]
        top_values, top_ids = logp.topk(min(k, logp.shape[-1]), dim=-1)  # [n, k]
        entries += [TokenLogprob(t, lp, tuple(zip(i, v)), rank)
                    for t, lp, rank, i, v in zip(tokens, chosen[:, 0].tolist(), ranks.tolist(), top_ids.tolist(),
                                                 top_values.tolist())]
    return entries
