"""Repetition, presence and frequency penalties as a function of each
position's context.

For a logit l_v of token v with context counts c_v (times v was generated so
far) and s_v (v occurs in the prompt or the generated tokens):

    repetition (Keskar et al. 2019, HF):  l_v / r  if l_v > 0 else l_v · r,  where s_v
    frequency and presence (OpenAI, vLLM): l_v - f · c_v - π · [c_v > 0]

Losslessness needs p_i (the target at verify input i-1) and q_i (the drafter
at draft step i) to see the same context: t[0..m-1] + d_1..d_{i-1}
(docs/design.md, "Round structure"). Both build it the same way from a
`PenaltyContext` of the committed tokens: the drafter by `append`ing each
draft after sampling it, the verifier by `with_drafts` for every verify input
at once. With every penalty off (r = 1, f = π = 0) the formula is the identity
bit for bit, so rows without penalties may share a batch with rows with them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridspec.sampling.sampler import RowParams


@dataclass
class PenaltyContext:
    """Token counts of each row's context: what the penalties read."""

    counts: torch.Tensor  # [N, vocab] float64: times each token was generated (output tokens only)
    seen: torch.Tensor  # [N, vocab] bool: the token occurs in the prompt or the output

    def penalize(self, logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
        """Penalised logits, float64. logits [N, vocab] -> [N, vocab]."""
        x = logits.to(torch.float64)
        r = rows.repetition_penalty[:, None]
        repeated = torch.where(x > 0, x / r, x * r)
        x = torch.where(self.seen, repeated, x)
        x = x - rows.frequency_penalty[:, None] * self.counts
        return x - rows.presence_penalty[:, None] * (self.counts > 0).to(x.dtype)

    def append(self, tokens: torch.Tensor) -> "PenaltyContext":
        """The context after each row generated tokens[b]. tokens [N] int64."""
        counts = self.counts.clone()
        counts[torch.arange(len(tokens), device=tokens.device), tokens] += 1
        seen = self.seen.clone()
        seen[torch.arange(len(tokens), device=tokens.device), tokens] = True
        return PenaltyContext(counts, seen)

    def select(self, rows: torch.Tensor) -> "PenaltyContext":
        """The context of rows `rows` [N'] int64 only."""
        return PenaltyContext(self.counts[rows], self.seen[rows])

    def with_drafts(self, drafts: list[list[int]], num_inputs: int) -> "PenaltyContext":
        """The context of every verify input, rows flattened: row b·T + j sees the
        committed tokens and d_1..d_j (T = num_inputs; j past g_b repeats d_1..d_g)."""
        batch, vocab = self.counts.shape
        added = torch.zeros(batch, num_inputs, vocab, dtype=torch.float64, device=self.counts.device)
        for b, d in enumerate(drafts):
            for j, token in enumerate(d[:num_inputs - 1]):
                added[b, j + 1:, token] += 1
        counts = self.counts[:, None] + added  # [batch, T, vocab]
        seen = self.seen[:, None] | (added > 0)
        return PenaltyContext(counts.reshape(batch * num_inputs, vocab), seen.reshape(batch * num_inputs, vocab))


def penalty_context(requests, vocab_size: int, device) -> PenaltyContext | None:
    """The `PenaltyContext` of the requests' committed tokens, or None when no
    request has a penalty (then nothing is built)."""
    if not any(r.params.has_penalties for r in requests):
        return None
    counts = torch.zeros(len(requests), vocab_size, dtype=torch.float64, device=device)
    seen = torch.zeros(len(requests), vocab_size, dtype=torch.bool, device=device)
    for b, r in enumerate(requests):
        output = torch.tensor(r.output.token_ids, dtype=torch.long, device=device)
        prompt = torch.tensor(r.output.prompt_token_ids, dtype=torch.long, device=device)
        counts[b] = torch.bincount(output, minlength=vocab_size).to(torch.float64)
        seen[b, prompt] = True
        seen[b, output] = True
    return PenaltyContext(counts, seen)
