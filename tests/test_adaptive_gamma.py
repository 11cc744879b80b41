"""Adaptive γ (`num_draft_tokens="auto"`, `hybridspec.spec.gamma`): the
choice follows acceptance and costs, γ = 0 rounds (all rows, or some rows of
a drafting round) keep greedy and coupled parity, and the histogram of
chosen γ is reported."""
import random

import pytest

import hybridspec as hs
from hybridspec.errors import ConfigError
from hybridspec.rollback import perturbed_copy
from hybridspec.costs.round_terms import round_seconds
from hybridspec.spec.gamma import MIN_REALIZED, PROBE_EVERY, GammaController
from hybridspec.costs.round_costs import RoundCosts
from oracles import bamba, nemotron_h

GAMMA_MAX = 4


def costs(forward=(1.0, 1.1, 1.2, 1.3, 1.4), draft_step=0.05, row_draft=0.0, batches=(1, 8)) -> RoundCosts:
    """Hand-made costs: a forward of 1..5 tokens per row, the same at every batch."""
    return RoundCosts(batches, (1, 2, 3, 4, 5), tuple(tuple(forward) for _ in batches),
                      tuple(draft_step for _ in batches), tuple(row_draft for _ in batches))


def teach(controller, seq_ids, alpha_hits: int, rounds: int = 20) -> None:
    """Rounds in which every row drafts 4 and keeps `alpha_hits` of them."""
    for _ in range(rounds):
        controller.observe(seq_ids, [4] * len(seq_ids), [alpha_hits] * len(seq_ids), [4] * len(seq_ids))


def test_cheap_drafts_with_high_acceptance_draft_the_most():
    controller = GammaController(GAMMA_MAX, costs())
    teach(controller, [0, 1], alpha_hits=4)
    assert controller.choose([0, 1], [10, 10]) == [4, 4]
    assert controller.choose([0, 1], [10, 2]) == [4, 2]  # a row near max_new_tokens is capped


def test_expensive_drafts_or_low_acceptance_give_plain_steps():
    expensive = GammaController(GAMMA_MAX, costs(draft_step=0.6))  # pays only if nearly every draft is accepted
    assert expensive.choose([0], [10]) == [GAMMA_MAX // 2]  # the first round probes
    assert GammaController(GAMMA_MAX, costs(draft_step=0.3)).choose([0], [10]) == [GAMMA_MAX // 2]  # not G = 1
    expensive.observe([0], [2], [1], [2])
    assert expensive.choose([0], [10]) == [0]
    controller = GammaController(GAMMA_MAX, costs())
    teach(controller, [0], alpha_hits=0)
    assert controller.choose([0], [10]) == [0]


def test_where_no_gamma_pays_even_at_full_acceptance_rows_run_plain_and_nothing_is_probed():
    """Drafter steps so dear that G + 1 tokens per round lose to G + 1 plain
    steps: no first-round probe, no probe after PROBE_EVERY idle rounds, at any
    acceptance the controller has seen."""
    never = GammaController(GAMMA_MAX, costs(draft_step=2.0))
    for _ in range(3 * PROBE_EVERY):
        assert never.choose([0, 1], [100, 100]) == [0, 0]
        never.observe([0, 1], [0, 0], [0, 0], [0, 0], {"verify": 1.0, "sampling": 0.1})
    teach(never, [0, 1], alpha_hits=4)  # even after perfect acceptance
    assert never.choose([0, 1], [100, 100]) == [0, 0]
    # the same drafter with the non-forward terms measured: they tip a narrow win into a loss
    terms = dict(sampling_s=((0.1,) * 5,) * 2, commit_s=((0.0,) + (0.8,) * 4,) * 2, host_s=((0.0,) + (0.9,) * 4,) * 2)
    narrow = costs(draft_step=0.6)
    assert GammaController(GAMMA_MAX, narrow).choose([0], [100]) == [GAMMA_MAX // 2]
    dear = RoundCosts(narrow.batches, narrow.tokens, narrow.forward_s, narrow.draft_step_s, narrow.row_draft_s, **terms)
    assert GammaController(GAMMA_MAX, dear).choose([0], [100]) == [0]


def test_the_round_cost_is_the_sum_of_its_measured_terms():
    """`round_cost` before anything is learned is `hs.sim.round_seconds` of the
    start-up terms; a term measured as a table replaces G · draft_step."""
    table = lambda *values: (tuple(values),) * 2  # the same at both measured batches
    measured = RoundCosts((1, 8), (1, 2, 3, 4, 5), table(1.0, 1.1, 1.2, 1.3, 1.4), (0.05, 0.05), (0.0, 0.0),
                          draft_s=table(0.0, 0.2, 0.3, 0.4, 0.5), sampling_s=table(0.01, 0.02, 0.03, 0.04, 0.05),
                          commit_s=table(0.0, 0.1, 0.1, 0.1, 0.1), host_s=table(0.05, 0.06, 0.07, 0.08, 0.09))
    controller = GammaController(GAMMA_MAX, measured)
    assert controller.round_cost(1, 0) == pytest.approx(1.0 + 0.01 + 0.05)
    assert controller.round_cost(4, 3) == pytest.approx(1.3 + 0.4 + 0.04 + 0.1 + 0.08)
    assert measured.terms(4, 3) == hs.sim.RoundTerms(forward_s=1.3, draft_s=0.4, sampling_s=0.04, commit_s=0.1,
                                                     host_s=0.08)
    assert controller.round_cost(1, 2) == pytest.approx(hs.sim.round_seconds(measured.terms(1, 2)))
    for _ in range(40):  # sampling, commit and host really cost 0.1 more than measured
        controller.observe([0], [4], [2], [4], {"verify": 1.4, "draft": 0.5, "sampling": 0.05, "commit": 0.1,
                                                "round": 1.4 + 0.5 + 0.05 + 0.1 + 0.09 + 0.1})
    assert controller.round_cost(1, 4) == pytest.approx(1.4 + 0.5 + 0.05 + 0.1 + 0.09 + 0.1, rel=0.02)


def test_the_choice_maximises_expected_tokens_per_second():
    c = costs(draft_step=0.2)
    controller = GammaController(GAMMA_MAX, c)
    teach(controller, [0], alpha_hits=2)  # each draft tried is accepted 2 times in 3
    alpha = controller.alpha(0)
    tokens = [sum(alpha ** i for i in range(g + 1)) for g in range(GAMMA_MAX + 1)]  # E[tokens], γ = 0 included
    rates = [t / (c.forward(1, g + 1) + g * 0.2) for g, t in enumerate(tokens)]
    assert controller.choose([0], [10]) == [max(range(GAMMA_MAX + 1), key=rates.__getitem__)]


def test_a_row_whose_own_cost_outweighs_its_gain_stops_drafting():
    """With per-row draft costs, a low-acceptance row drafts less than a high one in the same round."""
    controller = GammaController(GAMMA_MAX, costs(row_draft=0.02))
    teach(controller, [0], alpha_hits=4)
    teach(controller, [1], alpha_hits=0, rounds=40)
    controller.choose([0, 1], [10, 10])  # sets λ
    good, bad = controller.choose([0, 1], [10, 10])
    assert good == GAMMA_MAX and bad < good


def test_pessimism_is_probed_again():
    controller = GammaController(GAMMA_MAX, costs(draft_step=0.4))
    teach(controller, [0], alpha_hits=0)
    choices = []
    for _ in range(PROBE_EVERY):
        gammas = controller.choose([0], [10])
        choices.append(gammas[0])
        controller.observe([0], gammas, [0], gammas)
    assert choices[:-1] == [0] * (PROBE_EVERY - 1) and choices[-1] >= 1


def test_a_drafter_price_learned_from_one_outlier_round_is_probed_again():
    """One drafting round whose drafter took a hundred times its start-up price (a forward on
    memory not yet backed) prices every G out at full acceptance; start-up's prices do not, so
    the idle probes go on, each probe's round moving the learned price toward what it measures."""
    controller = GammaController(GAMMA_MAX, costs(draft_step=0.05))
    first = controller.choose([0], [1000])
    assert first[0] >= 1
    controller.observe([0], first, first, first, {"draft": 100 * 0.05 * first[0], "verify": 1.3})
    assert not any(controller.round_cost(1, G) * 1.0 < (G + 1) * controller.round_cost(1, 0)
                   for G in range(1, GAMMA_MAX + 1))  # at the learned prices no G pays, even all accepted
    choices = []
    for _ in range(PROBE_EVERY):
        gammas = controller.choose([0], [1000])
        choices.append(gammas[0])
        seconds = {"draft": 0.05 * gammas[0], "verify": 1.3} if gammas[0] else {"verify": 1.0}
        controller.observe([0], gammas, gammas, gammas, seconds)
    assert choices[:-1] == [0] * (PROBE_EVERY - 1) and choices[-1] >= 1
    assert controller.learned[0].draft_scale_at(choices[-1]) < 100


def test_one_unlucky_round_does_not_stop_drafting_before_rounds_measure_it(monkeypatch):
    """While few drafts were tried the engine-wide estimate is raised by its
    uncertainty (an upper confidence bound): one round that accepted nothing
    leaves a drafter that pays at moderate acceptance drafting; rounds that keep
    accepting nothing stop it. Without the bound the one round stops it."""
    import hybridspec.spec.gamma as gamma
    controller = GammaController(GAMMA_MAX, costs(draft_step=0.3))
    first = controller.choose([0], [100])
    controller.observe([0], first, [0], first)
    assert controller.choose([0], [100])[0] >= 1
    teach(controller, [0], alpha_hits=0, rounds=10)
    assert controller.choose([0], [100]) == [0]
    monkeypatch.setattr(gamma, "OPTIMISM_Z", 0.0)
    unbounded = GammaController(GAMMA_MAX, costs(draft_step=0.3))
    first = unbounded.choose([0], [100])
    unbounded.observe([0], first, [0], first)
    assert unbounded.choose([0], [100]) == [0]


def test_a_probe_drafts_only_the_row_the_drafter_is_least_behind():
    controller = GammaController(GAMMA_MAX, costs(draft_step=0.4))
    teach(controller, [0, 1, 2], alpha_hits=0)
    for _ in range(PROBE_EVERY - 1):
        assert controller.choose([0, 1, 2], [10, 10, 10], behind=[5, 1, 9]) == [0, 0, 0]
        controller.observe([0, 1, 2], [0, 0, 0], [0, 0, 0], [0, 0, 0])
    assert controller.choose([0, 1, 2], [10, 10, 10], behind=[5, 1, 9]) == [0, GAMMA_MAX // 2, 0]
    controller.idle_rounds = controller.probe_every - 1  # the next probe, the drafter caught up everywhere
    assert controller.choose([0, 1, 2], [10, 10, 10], behind=[0, 0, 0]) == [GAMMA_MAX // 2] * 3


def test_online_costs_follow_the_measured_rounds():
    controller = GammaController(GAMMA_MAX, costs())
    for _ in range(30):  # drafting rounds really cost twice what start-up measured
        controller.observe([0], [4], [2], [4], {"verify": 2 * 1.4, "draft": 4 * 0.05, "sampling": 0.1})
    assert controller.round_cost(1, 4) == pytest.approx(2 * 1.4 + 4 * 0.05 + 0.1, rel=0.02)


def test_each_g_learns_its_drafter_cost():
    """A G = 1 round's drafter step (its fixed costs in one step) prices G = 4
    only until a G = 4 round is seen."""
    controller = GammaController(GAMMA_MAX, costs(draft_step=0.05))
    for _ in range(10):
        controller.observe([0], [1], [1], [1], {"verify": 1.1, "draft": 0.15, "sampling": 0.1})
    assert controller.round_cost(1, 4) == pytest.approx(1.4 + 3 * 4 * 0.05 + 0.1, rel=0.02)  # the nearest G seen
    controller.observe([0], [4], [3], [4], {"verify": 1.4, "draft": 0.1, "sampling": 0.1})
    assert controller.round_cost(1, 4) == pytest.approx(1.4 + 0.1 + 0.1, rel=0.02)
    assert controller.round_cost(1, 1) == pytest.approx(1.1 + 0.15 + 0.1, rel=0.02)


def test_plain_steps_learn_their_own_scale_but_not_from_the_round_after_a_prefill():
    """Start-up measured forwards half as slow as they run: verify rounds teach
    their scale, which prices plain steps until a steady one is seen; a slow
    plain step right after a prefill teaches nothing."""
    controller = GammaController(GAMMA_MAX, costs())
    for _ in range(30):
        controller.observe([0], [4], [2], [4], {"verify": 2 * 1.4, "draft": 4 * 0.05, "sampling": 0.1})
    assert controller.round_cost(1, 0) == pytest.approx(2 * 1.0 + 0.1, rel=0.02)  # the drafting kind's stands in
    controller.observe([0], [0], [0], [0], {"verify": 6.0, "sampling": 0.05}, after_prefill=True)
    assert controller.round_cost(1, 0) == pytest.approx(2 * 1.0 + 0.05, rel=0.02)  # the residual is learned
    controller.observe([0], [0], [0], [0], {"verify": 0.7, "sampling": 0.05})
    assert controller.round_cost(1, 0) == pytest.approx(0.7 + 0.05, rel=0.02)


def test_a_plain_step_is_run_to_price_plain_steps_where_drafting_wins_narrowly():
    spec_round = {"verify": 1.2, "draft": 0.2, "sampling": 0.1}
    for hits, probes in ((1, True), (4, False)):  # drafting ahead of plain by under 1.5x; by far more
        controller = GammaController(GAMMA_MAX, costs(forward=(1.0, 1.05, 1.1, 1.15, 1.2)))
        for _ in range(PROBE_EVERY - 1):
            controller.observe([0], [4], [hits], [4], spec_round)
        assert controller.choose([0], [100]) == ([0] if probes else [GAMMA_MAX])
    controller = GammaController(GAMMA_MAX, costs(forward=(1.0, 1.05, 1.1, 1.15, 1.2)))
    for _ in range(PROBE_EVERY - 1):
        controller.observe([0], [4], [1], [4], spec_round)
    assert controller.choose([0], [100]) == [0]
    controller.observe([0], [0], [0], [0], {"verify": 1.0, "sampling": 0.1}, after_prefill=True)
    assert controller.choose([0], [100]) == [0]  # that one taught nothing: again
    controller.observe([0], [0], [0], [0], {"verify": 1.0, "sampling": 0.1})
    assert controller.choose([0], [100])[0] > 0
    assert controller.plain_probe_every == 2 * PROBE_EVERY


def test_a_drafter_far_behind_a_row_near_its_end_gives_plain_steps():
    """Absorbing a long backlog is one-off work spread over the tokens a row has
    left: worth it with many left, not with two."""
    controller = GammaController(GAMMA_MAX, costs(draft_step=0.05))
    teach(controller, [0], alpha_hits=3)
    assert controller.choose([0], [100], behind=[50]) == [4]  # nothing learned about absorbing yet
    controller.observe([0], [4], [3], [4], {"verify": 1.4, "draft": 0.2, "sampling": 0.1, "backlog": 5.0}, 50)
    assert controller.absorb_s == pytest.approx(0.1)
    assert controller.choose([0], [1000], behind=[50]) == [4]
    assert controller.choose([0], [2], behind=[50]) == [0]
    assert controller.choose([0], [2], behind=[0]) == [2]


class FixedModel(GammaController):
    """The model's prices fixed at start-up's (nothing learned online): a
    model that stays wrong, for the measured rounds to overrule."""

    def round_cost(self, batch, G, sampled=0):
        return round_seconds(self.costs.terms(batch, G), 1.0, 1.0)


def measured(controller, drafting_seconds, plain_seconds) -> None:
    """Rounds of one row at 4 drafts, 3 accepted (4 tokens), then plain steps (1 token), timed as given."""
    for seconds in drafting_seconds:
        controller.observe([0], [4], [3], [4], {"round": seconds})
    for seconds in plain_seconds:
        controller.observe([0], [0], [0], [0], {"verify": 0.9 * seconds, "round": seconds})


def test_drafting_measured_slower_per_token_than_plain_steps_gives_plain_steps_probed_on_schedule():
    controller = FixedModel(GAMMA_MAX, costs())
    teach(controller, [0], alpha_hits=3)
    assert controller.choose([0], [1000]) == [4]  # the model's choice
    measured(controller, [4.0, 4.4, 3.6], [])  # about 1 token per second drafting ...
    assert controller.choose([0], [1000]) == [4]  # ... plain steps unmeasured: the model decides
    measured(controller, [], [0.5, 0.55, 0.45][:MIN_REALIZED])  # ... about 2 plain
    choices = []
    for _ in range(3 * PROBE_EVERY):
        gammas = controller.choose([0], [1000])
        choices.append(gammas[0])
        if gammas[0]:  # the probe measures drafting as slow again
            controller.observe([0], gammas, [gammas[0] - 1], gammas, {"round": 4.0})
        else:
            controller.observe([0], [0], [0], [0], {"verify": 0.45, "round": 0.5})
    probes = [i for i, g in enumerate(choices) if g]
    assert choices[0] == 0 and len(probes) == 2  # the model's G at each probe, for the one row
    # the first probe after PROBE_EVERY rounds without drafts (counting the measured plain steps), then twice that
    assert probes[0] == PROBE_EVERY - MIN_REALIZED - 1 and probes[1] - probes[0] == 2 * PROBE_EVERY


def test_drafting_measured_faster_than_plain_steps_keeps_drafting():
    controller = FixedModel(GAMMA_MAX, costs())
    teach(controller, [0], alpha_hits=3)
    measured(controller, [1.0, 1.1, 0.9], [0.5, 0.55, 0.45])  # about 4 tokens per second drafting, 2 plain
    for _ in range(3 * PROBE_EVERY):
        assert controller.choose([0], [1000]) == [4]
        controller.observe([0], [4], [3], [4], {"round": 1.0})


def test_measured_goodputs_within_their_spread_leave_the_choice_to_the_model():
    controller = FixedModel(GAMMA_MAX, costs())
    teach(controller, [0], alpha_hits=3)
    measured(controller, [1.5, 3.5, 1.5, 3.5], [0.5, 0.5, 0.5])  # drafting 2.7 or 1.1 tokens per second, plain 2
    assert controller.choose([0], [1000]) == [4]
    measured(controller, [3.5] * 4, [])  # now consistently slower
    assert controller.choose([0], [1000]) == [0]


def test_plain_steps_are_probed_every_probe_every_rounds_until_their_goodput_is_measured():
    controller = GammaController(GAMMA_MAX, costs(forward=(1.0, 1.05, 1.1, 1.15, 1.2)))  # drafting wins narrowly
    plain = []
    for i in range(4 * PROBE_EVERY):
        gammas = controller.choose([0], [1000])
        if gammas[0]:
            controller.observe([0], gammas, [1], gammas, {"verify": 1.2, "draft": 0.2, "sampling": 0.1})
        else:
            plain.append(i)
            controller.observe([0], [0], [0], [0], {"verify": 1.0, "sampling": 0.1})
    # MIN_REALIZED plain steps PROBE_EVERY rounds apart, then the doubled wait (longer than what is left)
    assert len(plain) == MIN_REALIZED and all(b - a == PROBE_EVERY for a, b in zip(plain, plain[1:]))
    assert controller.plain_probe_every == 2 ** MIN_REALIZED * PROBE_EVERY


def test_a_plain_step_is_run_where_drafting_is_predicted_far_ahead_but_measured_not():
    """The model predicts drafting ahead of plain steps by about 1.9x; measured
    drafting rounds at 1 token per second (plain predicted at 1) get plain
    steps probed, measured ones at 4 do not."""
    for seconds, probes in ((4.0, True), (1.0, False)):
        controller = FixedModel(GAMMA_MAX, costs())
        teach(controller, [0], alpha_hits=3)
        choices = []
        for _ in range(2 * PROBE_EVERY):
            gammas = controller.choose([0], [1000])
            choices.append(gammas[0])
            if gammas[0]:
                controller.observe([0], gammas, [gammas[0] - 1], gammas, {"verify": 1.0, "round": seconds})
                continue
            controller.observe([0], [0], [0], [0], {"verify": 0.9, "round": 1.0})
        if probes:
            assert choices.index(0) == PROBE_EVERY - 1
        else:
            assert 0 not in choices


def test_mixed_rounds_and_rounds_after_a_prefill_measure_neither_kind():
    controller = FixedModel(GAMMA_MAX, costs())
    teach(controller, [0, 1], alpha_hits=3)
    for _ in range(PROBE_EVERY // 2):
        controller.observe([0, 1], [4, 0], [3, 0], [4, 0], {"round": 9.0})  # one row drafts: a mixed round
        controller.observe([0, 1], [4, 4], [3, 3], [4, 4], {"round": 9.0}, after_prefill=True)
        controller.observe([0, 1], [0, 0], [0, 0], [0, 0], {"verify": 0.5, "round": 0.5})
    assert controller.choose([0, 1], [1000, 1000]) == [4, 4]


def test_engine_arguments_are_checked():
    target = hs.from_hf(bamba(seed=0))
    with pytest.raises(ConfigError, match="max_draft_tokens=3 is for num_draft_tokens='auto'"):
        hs.Engine(target, draft=hs.NgramDrafter(), num_draft_tokens=4, max_draft_tokens=3)
    with pytest.raises(ConfigError, match="max_draft_tokens=0 must be an integer >= 1"):
        hs.Engine(target, draft=hs.NgramDrafter(), num_draft_tokens="auto", max_draft_tokens=0)
    with pytest.raises(ConfigError, match="num_draft_tokens='four'"):
        hs.Engine(target, draft=hs.NgramDrafter(), num_draft_tokens="four")


class ScriptedGammas(GammaController):
    """Random γ per row in 0..γ_max, every round (all-zero rounds included)."""

    def __init__(self, gamma_max: int, seed: int):
        super().__init__(gamma_max, costs())
        self.rng = random.Random(seed)
        self.chosen: list[list[int]] = []

    def choose(self, seq_ids, caps, behind=None, sampled=0):
        gammas = [self.rng.choice([0, 0, 1, self.gamma_max]) if self.rng.random() < 0.7 else 0 for _ in seq_ids]
        self.chosen.append(gammas)
        return gammas


@pytest.mark.parametrize("family", [bamba, nemotron_h])
@pytest.mark.parametrize("verify", ["rejection", "coupled"])
def test_zero_and_mixed_gamma_rounds_keep_parity(family, verify):
    target = hs.from_hf(family(seed=0))
    draft = perturbed_copy(target, seed=2)
    rng = random.Random(4)
    prompts = [[rng.randrange(target.vocab_size) for _ in range(rng.randint(1, 8))] for _ in range(6)]
    params = [hs.SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9 if verify == "coupled" and i % 2
                                else 0.0, seed=i) for i in range(6)]
    expected = [o.token_ids for o in hs.Engine(target).generate(prompts, params)]
    engine = hs.Engine(target, draft=draft, num_draft_tokens="auto", max_draft_tokens=GAMMA_MAX, verify=verify,
                       max_batch_size=3, block_size=4)
    engine.check_invariants = True
    engine.gamma_controller = scripted = ScriptedGammas(GAMMA_MAX, seed=5)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    rounds = scripted.chosen
    assert any(not any(g) for g in rounds) and any(0 in g and any(g) for g in rounds)  # all-zero and mixed rounds
    stats = engine.stats
    assert sum(stats.gamma_counts.values()) == stats.sequence_rounds
    assert stats.gamma_counts.get(0, 0) > 0 and stats.gamma_counts.get(GAMMA_MAX, 0) > 0


def test_auto_measures_costs_and_keeps_greedy_parity():
    target = hs.from_hf(bamba(seed=0))
    draft = perturbed_copy(target, seed=2)
    prompts, params = [[3, 4, 5], [6, 7], [8]], hs.SamplingParams(max_new_tokens=10, ignore_eos=True)
    expected = [o.token_ids for o in hs.Engine(target).generate(prompts, params)]
    engine = hs.Engine(target, draft=draft, num_draft_tokens="auto", max_draft_tokens=3, max_batch_size=4)
    measured = engine.gamma_controller.costs
    assert measured.batches == (1, 2, 4) and measured.tokens == (1, 2, 3, 4)
    assert all(t > 0 for row in measured.forward_s for t in row) and all(t > 0 for t in measured.draft_step_s)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert sum(engine.stats.gamma_counts.values()) == engine.stats.sequence_rounds


def test_start_up_times_each_kind_at_the_end_of_a_run_of_its_own_and_takes_the_median():
    from hybridspec.engine import startup_costs

    class Scripted:  # a ScratchRounds whose calls cost what the test says: a call after another kind is slow
        target, ids, new_cache = None, [0], None

        def __init__(self):
            self.calls, self.last = [], None

        def _cost(self, kind, run_costs):
            warm = self.last == kind
            self.last = kind
            self.calls.append(kind)
            return run_costs[len(self.calls) % len(run_costs)] if warm else 1.0

        def plain_step(self, clock):
            return {"forward_s": self._cost(1, [0.10, 0.12, 0.11])}

        def round(self, G, clock):
            return {"forward_s": self._cost(G + 1, [0.30, 0.50, 0.40]), "draft_s": 0.05}

    scratch = Scripted()
    terms = startup_costs._measure_batch(scratch, [1, 3], repeats=3, clock=None)
    warm = startup_costs.WARM_CALLS
    assert scratch.calls == ([1] * (warm[True] + 1) + [3] * (warm[False] + 1)) * 3
    assert 0.10 <= terms[1].forward_s <= 0.12 and terms[1].draft_s == 0.0  # no cold call counted
    assert 0.30 <= terms[3].forward_s <= 0.50 and terms[3].draft_s == 0.05


def test_rows_that_sample_add_their_measured_extra_linear_in_batch_and_tokens():
    from hybridspec.engine.startup_costs import _sampled_terms
    terms = lambda sampling, draft: hs.sim.RoundTerms(forward_s=1.0, draft_s=draft, sampling_s=sampling)
    greedy = {1: terms(0.1, 0.0), 3: terms(0.2, 0.4), 5: terms(0.3, 0.8)}
    extra = {1: {1: {"sampling_s": 0.1, "draft_s": 0.0}, 5: {"sampling_s": 0.5, "draft_s": 0.2}},
             9: {1: {"sampling_s": 0.9, "draft_s": 0.0}, 5: {"sampling_s": 4.5, "draft_s": 1.8}}}
    at_1 = _sampled_terms(greedy, 1, extra, [1, 3, 5])
    assert at_1[1] == terms(0.2, 0.0) and at_1[5].sampling_s == pytest.approx(0.8)
    assert at_1[3].sampling_s == pytest.approx(0.2 + 0.3) and at_1[3].draft_s == pytest.approx(0.4 + 0.1)
    at_5 = _sampled_terms(greedy, 5, extra, [1, 3, 5])  # halfway between the measured batches
    assert at_5[5].sampling_s == pytest.approx(0.3 + 2.5) and at_5[5].draft_s == pytest.approx(0.8 + 1.0)
    assert at_5[1].draft_s == 0.0 and at_5[5].forward_s == 1.0  # a plain step drafts nothing; the forward is shared


def test_auto_prices_rows_that_sample_with_their_own_terms():
    target = hs.from_hf(bamba(seed=0))
    engine = hs.Engine(target, draft=perturbed_copy(target, seed=2), num_draft_tokens="auto", max_draft_tokens=3,
                       max_batch_size=2)
    measured, controller = engine.gamma_controller.costs, engine.gamma_controller
    assert measured.sampled_sampling_s is not None and measured.sampled_draft_s is not None
    for G in range(4):
        greedy, sampled = measured.terms(2, G), measured.terms(2, G, sampled=True)
        assert sampled.forward_s == greedy.forward_s and sampled.commit_s == greedy.commit_s
        half = hs.sim.mixed_terms(greedy, sampled, 0.5)
        assert controller.round_cost(2, G, sampled=1) == pytest.approx(hs.sim.round_seconds(half))
    seen = []  # (rows, rows that sample) per round
    original = controller.choose
    controller.choose = lambda *args: seen.append((len(args[0]), args[3])) or original(*args)
    params = [hs.SamplingParams(max_new_tokens=4, ignore_eos=True),
              hs.SamplingParams(max_new_tokens=4, temperature=0.8, seed=3, ignore_eos=True)]
    engine.generate([[3, 4, 5], [6, 7]], params)
    assert seen[0] == (2, 1) and all(sampled == 1 for rows, sampled in seen if rows == 2)


def test_a_sparse_policy_prices_its_expected_replay_and_keeps_parity():
    from hybridspec.checkpoints.auto import ReplayPrice, expected_replay_s
    target = hs.from_hf(bamba(seed=0))
    prompts, params = [[3, 4, 5], [6, 7]], hs.SamplingParams(max_new_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in hs.Engine(target).generate(prompts, params)]
    engine = hs.Engine(target, draft=perturbed_copy(target, seed=2), num_draft_tokens="auto", max_draft_tokens=3,
                       max_batch_size=2, checkpoint=hs.CheckpointPolicy(snapshot_every=0))
    controller = engine.gamma_controller
    replay = controller.costs.replay
    assert isinstance(replay, ReplayPrice) and replay.policy.snapshot_every == 0
    assert controller.replay_s(2, 0, 0.5) == 0.0
    assert controller.replay_s(2, 3, 0.5) == pytest.approx(expected_replay_s(replay.costs, 2, 3, 0.5, 0, True))
    assert controller.replay_s(2, 3, 0.5) > controller.replay_s(2, 1, 0.5) > 0.0  # more drafts, more to replay
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    every = hs.Engine(target, draft=perturbed_copy(target, seed=2), num_draft_tokens="auto", max_draft_tokens=3,
                      max_batch_size=2)
    assert every.gamma_controller.costs.replay is None and every.gamma_controller.replay_s(2, 3, 0.5) == 0.0


def test_a_replay_is_priced_from_its_rows_and_steps():
    from hybridspec.checkpoints.auto import ReplayPrice
    from hybridspec.costs.checkpoint_costs import CheckpointCosts
    costs = CheckpointCosts(batches=(1, 4), snapshot_write_s=(0.0, 0.0), log_write_s=(0.0, 0.0),
                            log_replay_fixed_s=(1.0, 1.0), restore_s=(0.1, 0.1), log_replay_step_s=(0.01, 0.01),
                            token_replay_fixed_s=(5.0, 5.0), token_replay_step_s=(0.5, 0.5))
    price = ReplayPrice(hs.CheckpointPolicy(snapshot_every=2), costs)
    assert price.spent(0, 0, 0, batch=4) == 0.0
    assert price.spent(2, 3, 0, batch=4) == pytest.approx(2 * 0.1 + 3 * 0.01 + 1.0)
    assert price.spent(1, 0, 2, batch=4) == pytest.approx(0.1 + 2 * 0.5 + 5.0)
    assert ReplayPrice(hs.CheckpointPolicy(), costs).seconds(4, 3, 0.5) == 0.0  # a snapshot after every input
