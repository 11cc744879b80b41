"""Start-up round costs timed at a few batch sizes (`anchor_batches`, read
between and past them by `RoundCosts.resampled`) and kept on disk between
starts (`hybridspec.engine.cost_cache`): a later engine of the same key reuses
them, a changed key or a larger batch times again, and a corrupt, foreign or
unwritable file is passed over, never fatal."""
import json

import pytest

import hybridspec as hs
from hybridspec.kernels.cpu.native import CACHE_ENV  # the root the costs share with the kernels' builds
from hybridspec.costs.checkpoint_costs import COST_FIELDS, CheckpointCosts
from hybridspec.costs.round_costs import RoundCosts, anchor_batches, measured_batches
from hybridspec.engine import cost_cache, startup_costs
from hybridspec.rollback import perturbed_copy
from oracles import bamba

TOKENS = (1, 2, 3)


def table(batches, per_row: float, fixed: float) -> tuple:
    """A term linear in the batch: fixed + per_row · batch, per token count (more tokens cost more)."""
    return tuple(tuple(T * (fixed + per_row * b) for T in TOKENS) for b in batches)


def linear_costs(batches=(1, 8, 32)) -> RoundCosts:
    return RoundCosts(tuple(batches), TOKENS, table(batches, 0.01, 0.1), tuple(0.002 * b for b in batches),
                      tuple(0.0001 for _ in batches), draft_s=table(batches, 0.003, 0.02),
                      host_s=table(batches, 0.0005, 0.001), absorb_s=tuple(0.001 for _ in batches))


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv(cost_cache.SWITCH_ENV, "1")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path


def key(**changes) -> dict:
    return {"format": cost_cache.FORMAT, "target": "t", "gamma_max": 4, **changes}


def test_anchor_batches_are_few_and_end_at_the_limit_or_the_largest_anchor():
    assert anchor_batches(1) == [1]
    assert anchor_batches(4) == [1, 4]
    assert anchor_batches(8) == [1, 8]
    assert anchor_batches(16) == anchor_batches(32) == anchor_batches(256) == [1, 8]


def test_resampled_costs_agree_at_the_timed_batches_and_follow_the_line_between_and_past_them():
    timed = linear_costs()
    full = timed.resampled(measured_batches(128))
    assert full.batches == (1, 2, 4, 8, 16, 32, 64, 128)
    for batch in (1, 8, 32):
        for G in (0, 1, 2):
            assert full.terms(batch, G).as_dict() == pytest.approx(timed.terms(batch, G).as_dict())
    for batch in (2, 4, 16, 64, 128):  # every term is linear in the batch here: read exactly
        exact = linear_costs(batches=(batch,)).terms(batch, 2).as_dict()
        assert full.terms(batch, 2).as_dict() == pytest.approx(exact)
        assert full.row_draft(batch) == pytest.approx(1e-4) and full.absorb(batch) == pytest.approx(1e-3)
    assert full.sampling_s is None and full.commit_s is None  # terms not measured stay unmeasured


def test_kept_costs_come_back_as_written(cache_on):
    costs = linear_costs()
    replay = CheckpointCosts(batches=(1, 32), **{name: (0.001, 0.01) for name in COST_FIELDS})
    cost_cache.store(key(), costs, replay)
    assert cost_cache.load(key(), 32) == (costs, replay)
    assert cost_cache.load(key(), 8) == (costs, replay)  # a smaller engine reads within them
    cost_cache.store(key(gamma_max=5), costs, None)
    assert cost_cache.load(key(gamma_max=5), 1) == (costs, None)


def test_a_changed_key_or_a_larger_batch_finds_nothing(cache_on):
    cost_cache.store(key(), linear_costs(), None)
    assert cost_cache.load(key(gamma_max=5), 1) is None
    assert cost_cache.load(key(target="another"), 1) is None
    assert cost_cache.load(key(), 64) is None  # timed up to 32 rows: a 64-row engine times its own


@pytest.mark.parametrize("text", ["{not json", json.dumps({"key": None}), json.dumps([1, 2]), ""])
def test_a_corrupt_file_is_passed_over(cache_on, text):
    path = cost_cache.path_of(key())
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert cost_cache.load(key(), 1) is None


def test_a_file_of_bad_costs_or_another_key_is_passed_over(cache_on):
    cost_cache.store(key(), linear_costs(), None)
    path = cost_cache.path_of(key())
    stored = json.loads(path.read_text())
    stored["costs"]["forward_s"][0][0] = -1.0  # RoundCosts refuses it
    path.write_text(json.dumps(stored))
    assert cost_cache.load(key(), 1) is None
    stored["costs"]["forward_s"][0][0], stored["key"] = 1.0, key(target="another")  # a digest collision
    path.write_text(json.dumps(stored))
    assert cost_cache.load(key(), 1) is None


def test_an_unwritable_folder_or_the_switch_off_keeps_nothing(cache_on, monkeypatch):
    blocked = cache_on / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocked))  # the folder would lie under a file
    cost_cache.store(key(), linear_costs(), None)  # passed over
    assert cost_cache.load(key(), 1) is None
    monkeypatch.setenv(CACHE_ENV, str(cache_on))
    monkeypatch.setenv(cost_cache.SWITCH_ENV, "0")
    cost_cache.store(key(), linear_costs(), None)
    assert not cost_cache.cache_dir().exists() and cost_cache.load(key(), 1) is None


def test_a_model_fingerprint_follows_its_weights():
    target = hs.from_hf(bamba(seed=0))
    assert cost_cache.model_fingerprint(target) == cost_cache.model_fingerprint(hs.from_hf(bamba(seed=0)))
    assert cost_cache.model_fingerprint(target) != cost_cache.model_fingerprint(perturbed_copy(target, seed=2))


def test_an_engine_reuses_the_costs_an_earlier_one_timed(cache_on, monkeypatch):
    target = hs.from_hf(bamba(seed=0))
    draft = perturbed_copy(target, seed=2)
    timed = []
    measure = startup_costs.measure_round_costs

    def counted(*args, **kwargs):
        timed.append(args[4])  # the batch sizes timed
        return measure(*args, **kwargs)

    monkeypatch.setattr(startup_costs, "measure_round_costs", counted)

    def engine(**settings):
        settings = {"max_draft_tokens": 3, "max_batch_size": 4, **settings}
        return hs.Engine(target, draft=draft, num_draft_tokens="auto", **settings)

    first = engine().gamma_controller.costs
    assert timed == [[1, 4]] and first.batches == (1, 2, 4)
    again = engine().gamma_controller.costs
    assert timed == [[1, 4]] and again == first
    assert engine(max_batch_size=2).gamma_controller.costs.batches == (1, 2)  # read within the kept costs
    engine(max_draft_tokens=2)  # another key
    engine(max_batch_size=16)  # more rows than were timed
    assert timed == [[1, 4], [1, 4], [1, 8]]
    assert engine(max_batch_size=64).gamma_controller.costs.batches == (1, 2, 4, 8, 16, 32, 64)  # past the anchors
    assert timed == [[1, 4], [1, 4], [1, 8]]
