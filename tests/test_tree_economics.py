"""Tree drafts' economics: the closed form of a spine with leaf alternatives against a
Monte Carlo of the same process, the roofline pricing a tree by its nodes, and the
chain-or-tree choice on synthetic costs."""
import pytest

from hybridspec.costs.closed_form import expected_tokens
from hybridspec.costs.tree_form import rescue_probability, tree_expected_tokens
from hybridspec.errors import ConfigError
from hybridspec.sim.montecarlo import simulate_tree
from hybridspec.sim.presets import PRESETS
from hybridspec.spec.shape_choice import TREE_CANDIDATES, Candidate, candidates, choose, tree_widths
from hybridspec.spec.tree import TreeShape, branch


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9])
@pytest.mark.parametrize("widths,rescue", [((2,), 0.4), ((2, 2, 1), 0.3), ((3, 1, 1), 0.5), ((4, 2), 0.2)])
def test_closed_form_matches_a_monte_carlo_of_the_same_process(alpha, widths, rescue):
    simulated = simulate_tree(alpha, widths, rescue, rounds=50_000, seed=3)
    assert tree_expected_tokens(alpha, widths, rescue) == pytest.approx(simulated.mean, abs=4 * simulated.stderr)


def test_width_one_is_the_chain_and_alternatives_only_add():
    for alpha in (0.2, 0.7, 1.0):
        assert tree_expected_tokens(alpha, (1, 1, 1), 0.9) == pytest.approx(expected_tokens(alpha, 3))
        assert tree_expected_tokens(alpha, (2, 1, 1), 0.3) >= expected_tokens(alpha, 3)
    # one alternative at depth 1 rescues a share β of the first miss: 1 + α + α² + (1 − α)·β
    assert tree_expected_tokens(0.5, (2, 1), 0.4) == pytest.approx(1 + 0.5 + 0.25 + 0.5 * 0.4)
    assert rescue_probability(0.3, 3) == pytest.approx(1 - 0.7 ** 2) and rescue_probability(0.3, 1) == 0.0
    assert tree_expected_tokens([1.0, 0.0], (1, 3), 0.5) == pytest.approx(2 + rescue_probability(0.5, 3))


def test_bad_tree_inputs_raise():
    with pytest.raises(ConfigError, match="per-depth"):
        tree_expected_tokens([0.5], (2, 2), 0.3)
    with pytest.raises(ConfigError, match="rescue"):
        tree_expected_tokens(0.5, (2,), 1.5)
    with pytest.raises(ConfigError, match="width"):
        tree_expected_tokens(0.5, (0,), 0.3)


def test_leaf_widths_are_what_branch_drafts():
    import torch
    q = torch.arange(10.0).repeat(6, 1)  # [depths, vocab] every depth ranks 9, 8, 7, ...
    for shape, gamma in [(TreeShape((2,)), 4), (TreeShape((3, 2)), 5), (TreeShape((2, 2)), 3), (TreeShape((3,)), 2)]:
        spine = [0] * shape.spine_length(gamma)
        tokens, parents, rows = branch(spine, q, shape, shape.budget(gamma))
        assert tree_widths(shape, gamma) == [rows.count(k) for k in range(len(spine))]
        assert sum(tree_widths(shape, gamma)) == len(tokens) <= gamma


def test_the_roofline_prices_a_tree_by_its_nodes():
    model = next(iter(PRESETS.values())).cost_model(4096)
    # the same verify inputs: the tree pays the chain's forward and states, fewer draft steps
    chain = model.round_time(1, 4, 0.7, snapshot_every=1, log_inputs=False).total_s
    tree = model.tree_round_s(1, (2, 1, 1))
    assert tree == pytest.approx(chain - model.draft_step_time(1))
    for batch in (1, 64):
        ratio = model.tree_speedup(batch, (2, 1, 1), 0.6, 0.4) / model.speedup(batch, 4, 0.6, 1, False)
        gain = tree_expected_tokens(0.6, (2, 1, 1), 0.4) / expected_tokens(0.6, 4)
        assert ratio == pytest.approx(gain * model.round_time(batch, 4, 0.6, 1, False).total_s
                                      / model.tree_round_s(batch, (2, 1, 1)))


def _seconds(fixed: float, per_input: float, draft: float, tree_extra: float = 0.0):
    """Synthetic round seconds: a forward of fixed + per_input per verify input, draft steps."""
    return lambda spine, nodes, is_tree: fixed + per_input * (nodes + 1) + draft * spine + tree_extra * is_tree


def test_memory_bound_and_low_acceptance_picks_a_tree():
    pick = choose(candidates(0.5, 0.5, [2, 3, 4], TREE_CANDIDATES, _seconds(1.0, 0.01, 0.05)))
    assert pick.tree is not None


def test_compute_bound_large_batch_picks_a_chain():
    pick = choose(candidates(0.5, 0.5, [2, 3, 4], TREE_CANDIDATES, _seconds(1.0, 2.0, 0.05)))
    assert pick.tree is None


def test_high_acceptance_picks_the_deep_chain():
    pick = choose(candidates(0.95, 0.5, [2, 4, 6], TREE_CANDIDATES, _seconds(1.0, 0.01, 0.05)))
    assert (pick.tree, pick.gamma) == (None, 6)


def test_a_tree_within_the_margin_loses_to_the_chain():
    chain = Candidate(4, None, 3.0, 1.0)
    close = Candidate(4, TreeShape((2,)), 3.1, 1.0)  # 3 % better: noise
    clear = Candidate(4, TreeShape((2,)), 3.3, 1.0)  # 10 % better
    assert choose([chain, close]) is chain and choose([chain, clear]) is clear
    assert choose([chain, clear], margin=0.2) is chain


def test_a_dear_tree_forward_keeps_chains():
    cheap = choose(candidates(0.5, 0.5, [4], TREE_CANDIDATES, _seconds(1.0, 0.01, 0.05)))
    dear = choose(candidates(0.5, 0.5, [4], TREE_CANDIDATES, _seconds(1.0, 0.01, 0.05, tree_extra=2.0)))
    assert cheap.tree is not None and dear.tree is None


def test_choose_needs_a_chain_and_a_sane_margin():
    tree = Candidate(4, TreeShape((2,)), 3.0, 1.0)
    with pytest.raises(ConfigError, match="chain"):
        choose([tree])
    with pytest.raises(ConfigError, match="margin"):
        choose([Candidate(4, None, 3.0, 1.0)], margin=-1.0)
