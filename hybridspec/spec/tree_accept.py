"""Acceptance over a tree round's verify forward (`spec.tree` has the rules):
pick each row's candidate path, then lay the path out as a chain round for
`Speculator.accept`, which verifies it exactly as it verifies a chain.

The targets a walk follows are the ones the chain rules compute for the
path: greedy rows the argmax of the logits (every row greedy and nothing
reading p) or of p, coupled rows the Gumbel-max of p with the keyed noise of
(seed, position m - 1 + depth + 1, PURPOSE_SAMPLE), p post-processed row by
row as `Speculator.accept` processes it. So the chain verify accepts the
whole walked path and draws the same final token a chain would.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from hybridspec.kernels.keyed_random import PURPOSE_SAMPLE, gumbel_argmax
from hybridspec.sampling.grammar import has_grammar
from hybridspec.sampling.sampler import RowParams, argmax_suffices, process_logits
from hybridspec.spec.round import RoundBatch
from hybridspec.spec.tree import input_parents, spine_inputs, walk
from hybridspec.spec.tree_sampling import multi_draft_accept


def tree_paths(logits: torch.Tensor, round: RoundBatch, rows: RowParams, coupled: list[bool]) -> list[list[int]]:
    """Per row, the verify inputs of its candidate path from the root (input 0).
    logits [batch, T, vocab] of the tree forward."""
    B, T, V = logits.shape
    walks = [_walks(r, c) for r, c in zip(round.requests, coupled)]
    targets = _targets(logits, round, rows, coupled) if any(walks) else None  # [batch][T]
    paths = []
    for b, (parents, drafts) in enumerate(zip(round.parents, round.drafts)):
        in_parents = input_parents(parents)
        paths.append(walk(in_parents, [-1] + drafts, targets[b]) if walks[b] else spine_inputs(in_parents))
    return paths


def _walks(request, coupled: bool) -> bool:
    """Whether a row's path follows the target (greedy and coupled rows whose p does not
    depend on the drafts before it); else it is the drafter's spine."""
    return (request.params.is_greedy or coupled) and _context_free(request)


def _context_free(request) -> bool:
    """Whether the row's p at a node does not depend on the drafts above it."""
    return not request.params.has_penalties and not has_grammar([request])


def multi_draft(logits: torch.Tensor, round: RoundBatch, rows: RowParams,
                coupled: list[bool]) -> dict[int, tuple[list[int], list[int], torch.Tensor]]:
    """The sampled rows verified by rejection whose p needs no context: row b ->
    (its accepted path's verify inputs, its emitted tokens, p along the path [n + 1, vocab])
    by recursive rejection over each node's children (`tree_sampling`)."""
    picked = [b for b, (r, c) in enumerate(zip(round.requests, coupled))
              if not r.params.is_greedy and not c and _context_free(r)]
    if not picked:
        return {}
    B, T, V = logits.shape
    index = torch.tensor(picked, device=logits.device)
    p = process_logits(logits[index].reshape(-1, V), rows.select(index).repeat(T)).view(len(picked), T, V)
    out = {}
    for i, b in enumerate(picked):
        in_parents = input_parents(round.parents[b])
        spine = set(spine_inputs(in_parents)[1:])
        q = None if round.draft_probs is None else round.draft_probs[b]
        start = round.start_lens[b]
        path, final = multi_draft_accept(p[i], q, in_parents, [-1] + round.drafts[b],
                                         [t in spine for t in range(len(in_parents))], int(rows.seeds[b]),
                                         [start + 1 + d for d in round.tree.plan.depths[b]])
        out[b] = (path, [round.drafts[b][t - 1] for t in path[1:]] + [final], p[i, path])
    return out


def _targets(logits: torch.Tensor, round: RoundBatch, rows: RowParams, coupled: list[bool]) -> list[list[int]]:
    """[batch][T] the target's token after each verify input, by the row's rule."""
    B, T, V = logits.shape
    if argmax_suffices(rows, round.requests):
        return logits.argmax(dim=2).tolist()
    p = process_logits(logits.reshape(B * T, V), rows.repeat(T)).view(B, T, V)  # [batch, T, vocab]
    greedy = p.argmax(dim=2)  # [batch, T]
    positions = torch.tensor([[start + 1 + d for d in depths] + [start + 1] * (T - len(depths))
                              for start, depths in zip(round.start_lens, round.tree.plan.depths)],
                             device=p.device)  # [batch, T]: the position of the token drawn after each input
    seeds = rows.seeds.repeat_interleave(T)
    sampled = gumbel_argmax(p.reshape(B * T, V), seeds, positions.view(-1), PURPOSE_SAMPLE).view(B, T)
    is_greedy = torch.tensor([r.params.is_greedy for r in round.requests], device=p.device)[:, None]
    return torch.where(is_greedy, greedy, sampled).tolist()


def as_chains(logits: torch.Tensor, round: RoundBatch, paths: list[list[int]]) -> tuple[torch.Tensor, RoundBatch]:
    """The rows' paths as a chain round: logits [batch, L + 1, vocab] of each path's inputs
    (a shorter path's last repeated as padding), drafts the path's tokens, q the path's
    nodes' rows of the drafter's. The round shares everything else."""
    B, T, V = logits.shape
    width = max(map(len, paths))
    index = torch.tensor([p + [p[-1]] * (width - len(p)) for p in paths], device=logits.device)  # [batch, L + 1]
    chain_logits = logits.gather(1, index[..., None].expand(B, width, V))
    drafts = [[round.drafts[b][i - 1] for i in path[1:]] for b, path in enumerate(paths)]
    q = round.draft_probs
    if q is not None and width > 1:
        nodes = (index[:, 1:] - 1).clamp(min=0)  # [batch, L]: the path's nodes (padding: any)
        q = q.gather(1, nodes[..., None].expand(B, width - 1, q.shape[2]))  # [batch, L, vocab]
    return chain_logits, replace(round, drafts=drafts, draft_probs=q)
