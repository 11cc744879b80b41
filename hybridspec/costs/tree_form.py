"""Expected tokens per round of a tree draft (a spine with leaf alternatives), in closed form.

A tree of `spec.tree` is the drafter's own chain d_1..d_L (the spine) with,
at depth d, w_d − 1 leaf alternatives: the drafter's next most likely tokens
there (`TreeShape`, `leaf_widths`). Acceptance walks one root-to-node path
(`spec.tree_accept`); this module prices that walk under the simulator's
i.i.d. model, extended by one parameter:

    α_d  the spine's token at depth d is the target's (given the spine reached d);
    β    "rescue": given that the drafter's first k ranked tokens at a depth all
         missed the target's token (k ≥ 1), its next ranked token is the
         target's with probability β. The probability that one of the
         w − 1 alternatives holds the target's token, given the spine's missed, is
             ρ(w) = 1 − (1 − β)^(w − 1)
         (a geometric rank profile past the first rank; ρ(1) = 0: a chain).

Depths are independent, as α is per draft in `closed_form`. An accepted
alternative is a leaf, so the round ends there. With π_d = α_1 ⋯ α_(d−1)
(π_1 = 1) the probability that the spine reached depth d,

    E[tokens] = 1 + Σ_{d=1..L} π_d · (α_d + (1 − α_d) · ρ(w_d))

which is `closed_form.expected_tokens` when every w_d = 1. The model fits
greedy and coupled rows (the walk follows the target's own token); rows that
sample with recursive rejection (`spec.tree_sampling`) accept an alternative
at least as often, so the figure is their lower end. `sim.montecarlo.
simulate_tree` runs the same process draw by draw.
"""
from __future__ import annotations

from typing import Sequence, Union

from hybridspec.costs.validation import check_alpha, check_int
from hybridspec.errors import ConfigError

DEFAULT_RESCUE = 0.3  # β assumed where none was measured: a third of the spine's misses are the next ranks'
Alphas = Union[float, Sequence[float]]  # one α for every depth, or α_d per depth


def rescue_probability(rescue: float, width: int) -> float:
    """ρ(w): one of a depth's w − 1 alternatives is the target's token, given the spine's was not."""
    rescue = check_alpha(rescue, name="rescue")
    check_int(width, "width", minimum=1)
    return 1.0 - (1.0 - rescue) ** (width - 1)


def depth_alphas(alpha: Alphas, depths: int) -> list[float]:
    """α_d for d = 1..depths: a float repeated, or a sequence of at least `depths` values."""
    if isinstance(alpha, (int, float)) and not isinstance(alpha, bool):
        return [check_alpha(alpha)] * depths
    values = [check_alpha(a) for a in alpha]
    if len(values) < depths:
        raise ConfigError(f"alpha gives {len(values)} per-depth values for a spine of {depths} drafts; "
                          "pass one per depth, or one float for all")
    return values[:depths]


def tree_expected_tokens(alpha: Alphas, widths: Sequence[int], rescue: float) -> float:
    """E[tokens] of one round whose spine has len(widths) drafts, widths[d − 1]
    candidates at depth d (the spine's token and its alternatives)."""
    widths = [check_int(w, "width", minimum=1) for w in widths]
    reach, total = 1.0, 1.0  # reach: π_d, the spine reached depth d
    for a, w in zip(depth_alphas(alpha, len(widths)), widths):
        total += reach * (a + (1.0 - a) * rescue_probability(rescue, w))
        reach *= a
    return total
