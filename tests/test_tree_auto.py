"""`Engine(tree="auto")` (`spec.tree_auto`): chain where trees lose (high α),
tree where they win (low α, extra verify inputs free), the tree price and the
rescue rate learned from tree rounds, a tree round's outcome read off its
paths, the settings checked; and whatever shape a round takes, greedy and
coupled rows beside others emit plain decoding's tokens."""
import random

import pytest

import hybridspec as hs
from hybridspec.costs.round_costs import RoundCosts
from hybridspec.costs.tree_form import DEFAULT_RESCUE
from hybridspec.errors import ConfigError
from hybridspec.rollback.models import perturbed_copy, plain_outputs, tiny_model
from hybridspec.spec.gamma import GammaController
from hybridspec.spec.tree import TreeShape, chain_parents
from hybridspec.spec.tree_auto import DECLINED_SCALE, TreeAuto, TreeOutcome, tree_outcome

GAMMA_MAX = 4


def costs(forward=(1.0,) * 5, draft_step=0.05) -> RoundCosts:
    """Hand-made costs at batches 1 and 8; the default forward is flat: extra verify inputs are free."""
    return RoundCosts((1, 8), (1, 2, 3, 4, 5), (tuple(forward),) * 2, (draft_step,) * 2, (0.0,) * 2)


def taught(hits: int, forward=(1.0,) * 5, rounds: int = 30) -> GammaController:
    """A controller whose rows 0 and 1 kept `hits` of 4 drafts each round."""
    controller = GammaController(GAMMA_MAX, costs(forward))
    for _ in range(rounds):
        controller.observe([0, 1], [4, 4], [hits, hits], [4, 4])
    return controller


def test_low_acceptance_with_free_extra_inputs_picks_a_tree():
    auto = TreeAuto(taught(hits=0))
    gammas, tree = auto.choose([0, 1], [2, 2])
    assert tree is not None and auto.choice.tree == tree
    assert gammas == [auto.choice.gamma] * 2
    chain = next(o for o in auto.options([0, 1], 2) if o.tree is None)
    assert auto.choice.goodput > chain.goodput


def test_high_acceptance_picks_the_chain_and_leaves_gammas_alone():
    auto = TreeAuto(taught(hits=4))
    assert auto.choose([0, 1], [4, 3]) == ([4, 3], None)
    assert auto.choice.tree is None


def test_trees_lose_where_extra_inputs_cost_what_chains_gain_or_the_forward_declines_trees():
    steep = TreeAuto(taught(hits=0, forward=(1.0, 2.0, 3.0, 4.0, 5.0)))  # every input as dear as a plain step
    assert steep.choose([0, 1], [1, 1])[1] is None
    declined = TreeAuto(taught(hits=0), prior_scale=DECLINED_SCALE)
    assert declined.choose([0, 1], [2, 2])[1] is None


def test_no_drafting_row_gives_no_tree():
    auto = TreeAuto(taught(hits=0))
    assert auto.choose([0, 1], [0, 0]) == ([0, 0], None) and auto.choice is None
    gammas, tree = auto.choose([0, 1], [0, 2])
    assert tree is not None and gammas[0] == 0  # a row the controller left plain stays plain


def test_tree_rounds_measured_dear_teach_the_tree_scale_until_chains_win():
    auto = TreeAuto(taught(hits=0))
    _, tree = auto.choose([0, 1], [2, 2])
    assert tree is not None
    outcome = TreeOutcome([1, 1], [0, 0], 0, 2, spine=1, nodes=2)
    priced = auto.controller.shape_cost(2, 1, 2)
    for _ in range(30):
        auto.observe(2, outcome, {"round": 4.0 * priced})
    assert auto.scale(2) == pytest.approx(4.0, rel=0.05)
    assert auto.choose([0, 1], [2, 2])[1] is None
    assert auto.scale(8) == 1.0  # another batch bucket keeps its prior


def test_rescue_rate_is_learned_from_tree_rounds_shrunk_toward_the_prior():
    auto = TreeAuto(taught(hits=0))
    assert auto.rescue() == DEFAULT_RESCUE
    auto.observe(2, None, {"round": 1.0})  # a chain round teaches nothing here
    assert auto.rescue() == DEFAULT_RESCUE and auto.scales == [None, None]
    for _ in range(30):
        auto.observe(2, TreeOutcome([1, 1], [0, 0], 2, 2, 1, 2), None)  # every miss rescued
    assert auto.rescue() > 0.75  # the prior's pseudo-misses still weigh
    for _ in range(30):
        auto.observe(2, TreeOutcome([1, 1], [0, 0], 0, 2, 1, 2), None)  # none rescued
    assert auto.rescue() < 0.1


def test_tree_outcome_reads_spines_misses_and_rescues_off_the_paths():
    # row 0: spine 0-1-2 with an alternative 3 beside node 1; the path took the alternative (rescued)
    # row 1: the same tree; the path stopped at node 0 (a miss at a depth with an alternative)
    # row 2: a chain of 3 fully accepted; row 3: drafted nothing
    parents = [[-1, 0, 1, 0], [-1, 0, 1, 0], chain_parents(3), []]
    paths = [[0, 1, 4], [0, 1], [0, 1, 2, 3], [0]]
    outcome = tree_outcome(parents, paths)
    assert outcome.spine_drafted == [3, 3, 3, 0]
    assert outcome.spine_accepted == [1, 1, 3, 0]
    assert (outcome.rescued, outcome.misses, outcome.spine, outcome.nodes) == (1, 2, 3, 4)


def test_a_spine_miss_without_alternatives_is_not_counted():
    outcome = tree_outcome([[-1, -1, 0, 2]], [[0, 1]])  # spine 1-3-4, alternative 2 at depth 1; missed at depth 2
    assert outcome.spine_accepted == [1] and (outcome.rescued, outcome.misses) == (0, 0)


def test_settings_are_checked():
    target = tiny_model(0)
    with pytest.raises(ConfigError, match="tree='bushy'"):
        hs.Engine(target, draft="suffix", num_draft_tokens="auto", tree="bushy")
    with pytest.raises(ConfigError, match="pass num_draft_tokens='auto'"):
        hs.Engine(target, draft="suffix", num_draft_tokens=4, tree="auto")
    with pytest.raises(ConfigError, match="does not branch"):
        hs.Engine(target, num_draft_tokens="auto", tree="auto")


class AlwaysDrafts(GammaController):
    """γ_max for every row, every round, whatever was timed or learned."""

    def choose(self, seq_ids, caps, behind=None, sampled=0):
        return [self.gamma_max] * len(seq_ids)


class ScriptedShapes(TreeAuto):
    """Chain or a random tree each round, whatever the costs: every shape a round may take."""

    def __init__(self, controller: GammaController, seed: int):
        super().__init__(controller)
        self.rng, self.shapes = random.Random(seed), []

    def choose(self, seq_ids, gammas, sampled=0):
        tree = self.rng.choice([None, TreeShape((2,)), TreeShape((3, 2)), TreeShape((2, 2))])
        self.shapes.append(tree)
        return [GAMMA_MAX if g else 0 for g in gammas], tree


@pytest.mark.parametrize("layers", [("mamba2", "attention", "mamba2"), ("gdn", "attention", "mamba1")])
def test_any_shape_per_round_keeps_greedy_and_coupled_rows_plain_beside_others(layers):
    """Rows greedy, seeded-coupled and unseeded-sampled in one batch; the greedy and
    coupled rows emit what each emits alone under plain decoding."""
    target = tiny_model(0, layers)
    draft = perturbed_copy(target, 0.3, 1)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [40, 41], [3, 4]]
    params = [hs.SamplingParams(max_new_tokens=14, ignore_eos=True),
              hs.SamplingParams(max_new_tokens=12, temperature=0.9, seed=3, ignore_eos=True),
              hs.SamplingParams(max_new_tokens=13, temperature=0.8, ignore_eos=True),  # unseeded: its own rule
              hs.SamplingParams(max_new_tokens=11, ignore_eos=True)]
    engine = hs.Engine(target, draft=draft, num_draft_tokens="auto", max_draft_tokens=GAMMA_MAX, tree="auto",
                       block_size=4, max_batch_size=4)
    engine.speculator.check = True
    engine.gamma_controller = AlwaysDrafts(GAMMA_MAX, costs())
    engine.tree_auto = scripted = ScriptedShapes(engine.gamma_controller, seed=1)
    outputs = engine.generate(prompts, params)
    for b in (0, 1, 3):  # alone, plain
        assert outputs[b].token_ids == plain_outputs(target, [prompts[b]], [params[b]])[0].token_ids
    assert len(outputs[2].token_ids) == 13
    assert None in scripted.shapes and any(s is not None for s in scripted.shapes)


def test_auto_engine_gives_plain_output_and_learns_from_its_tree_rounds():
    """The real choice over hand-made costs (timed ones could price every draft
    out), trees priced near free so the first round (which drafts to measure)
    verifies one: output is plain decoding's, and tree rounds reach the
    chooser's learning."""
    target = tiny_model(0)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 13, 11, 12]]
    params = hs.SamplingParams(max_new_tokens=16, ignore_eos=True)
    engine = hs.Engine(target, draft=perturbed_copy(target, 1.0, 2), num_draft_tokens="auto",
                       max_draft_tokens=GAMMA_MAX, tree="auto", block_size=4, max_batch_size=2)
    assert engine.speculator.drafter.tree is None  # set per round
    assert isinstance(engine.tree_auto, TreeAuto)
    engine.gamma_controller = GammaController(GAMMA_MAX, costs())
    engine.tree_auto = auto = TreeAuto(engine.gamma_controller, prior_scale=1e-6)
    outcomes = []
    observe = auto.observe
    auto.observe = lambda batch, outcome, *rest: (outcomes.append(outcome), observe(batch, outcome, *rest))
    outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain_outputs(target, prompts, [params] * 2)]
    assert any(o is not None and o.nodes > o.spine for o in outcomes)


def test_tree_rounds_teach_acceptance_along_the_spine_and_no_chain_cost():
    """A tree of 4 nodes whose spine of 3 was wholly accepted is no rejection;
    its seconds leave the chain's learned scales alone."""
    chain, tree = GammaController(GAMMA_MAX, costs()), GammaController(GAMMA_MAX, costs())
    outcome = TreeOutcome([3, 3], [3, 3], 0, 0, spine=3, nodes=4)
    for _ in range(10):
        chain.observe([0, 1], [4, 4], [3, 3], [4, 4])
        tree.observe([0, 1], [4, 4], [3, 3], [4, 4], {"verify": 9.0, "draft": 9.0, "round": 20.0}, tree=outcome)
    assert tree.alpha(0) > chain.alpha(0)
    assert tree.round_cost(2, 4) == chain.round_cost(2, 4)
