"""Lossless multi-draft acceptance over a draft tree for sampled rows
verified by rejection (`verify="rejection"`, no seed): recursive rejection
over the children of each node, SpecInfer-style (Miao et al. 2024), with
the tree's candidates as they are (a sample of q, then fixed alternatives).

Rule at a node c with target distribution p = p_c (post-processed) and
children x_1 .. x_k in order, r ← p:
- x_1, when the drafter drew it from q (the spine's child of a spine node,
  `Proposal.probs` given): accept with probability min(1, r(x_1) / q(x_1));
  on rejection r ← max(0, r − q) (p itself where that is all but zero, as
  the chain kernel does);
- every other x_j (an alternative, fixed once x_1 is drawn), and x_1 of a
  one-hot drafter: accept with probability r(x_j) / Σr; on rejection
  r(x_j) ← 0;
- the first accepted child becomes c; with none accepted the row emits a
  draw from r / Σr (the recovered token); at a leaf, a draw from p there
  (the bonus token).
Uniforms and Gumbel noise are keyed like a chain's: candidate j's accept
uniform is index j of (seed, position, PURPOSE_ACCEPT), so a tree of width
one is verified exactly as `rejection` verifies its chain.

Proof sketch that the emitted token at c is distributed as p. (i) A step
with a fixed candidate x against a distribution r: P(x) = r(x); for y ≠ x,
P(y) = (1 − r(x)) · r(y) / (1 − r(x)) = r(y): whatever follows the
rejection draws from r with x removed and renormalised, and by induction
over the remaining candidates (each fixed given what came before) the token
that leaves the node, accepted or recovered, is distributed as r. (ii) The
first candidate drawn from q is the chain's rejection step: P(accept y) =
q(y) · min(1, p(y)/q(y)) = min(p(y), q(y)), P(reject) = Σ max(0, p − q), and
conditioned on the rejection (and on x_1) the rest draws from
norm(max(0, p − q)) by (i), so P(y) = min(p, q)(y) + max(0, p − q)(y) = p(y).
(iii) Along the path: given the tokens emitted so far, the next node's p is
the target's distribution after them, and the candidates there are drawn
from the drafter's distribution after the same tokens (spine) or fixed, so
(i)–(ii) apply at every depth: the emitted sequence is distributed as the
target's own sampling.
"""
from __future__ import annotations

import torch

from hybridspec.kernels.keyed_random import PURPOSE_ACCEPT, PURPOSE_RECOVER, PURPOSE_SAMPLE, gumbel_argmax, keyed_uniform

RESIDUAL_EPS = 1e-12  # the chain kernel's: residual mass below RESIDUAL_EPS · Σp counts as zero


def multi_draft_accept(p: torch.Tensor, q: torch.Tensor | None, in_parents: list[int], inputs: list[int],
                       drawn_from_q: list[bool], seed: int, positions: list[int]) -> tuple[list[int], int]:
    """One row's path and final token.
    p [T, vocab] float64: the target's post-processed distribution after each verify input;
    q [T - 1, vocab] or None: the drafter's distribution each node was drawn from (None: one-hot);
    in_parents, inputs [T]: each input's parent input and token; drawn_from_q [T]: input i was
    sampled from q[i - 1]; positions [T]: the position of the token drawn after each input.
    Returns (the accepted path's verify inputs from 0, the recovered or bonus token)."""
    seeds = torch.tensor([seed], dtype=torch.long, device=p.device)
    path = [0]
    while True:
        c = path[-1]
        position = torch.tensor([positions[c]], dtype=torch.long, device=p.device)
        children = [i for i, parent in enumerate(in_parents) if parent == c]
        if not children:  # a leaf: the bonus token
            return path, int(gumbel_argmax(p[c][None], seeds, position, PURPOSE_SAMPLE))
        residual, accepted = p[c], None
        uniforms = keyed_uniform(seeds, position, PURPOSE_ACCEPT,
                                 torch.arange(len(children), device=p.device)).tolist()
        for u, child in zip(uniforms, children):
            token = inputs[child]
            if q is not None and drawn_from_q[child]:
                q_child = q[child - 1].to(torch.float64)
                if q_child[token] > 0 and u * q_child[token] < residual[token]:
                    accepted = child
                    break
                residual = torch.clamp(residual - q_child, min=0.0)
                if residual.sum() <= RESIDUAL_EPS * p[c].sum():
                    residual = p[c]
            else:
                if u * residual.sum() < residual[token]:
                    accepted = child
                    break
                residual = residual.clone()
                residual[token] = 0.0
        if accepted is None:  # every child rejected: the recovered token
            return path, int(gumbel_argmax(residual[None], seeds, position, PURPOSE_RECOVER))
        path.append(accepted)
