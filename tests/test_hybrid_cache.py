"""`HybridCache`'s verbs: `commit` moves every layer to an accepted boundary,
`rewind_to` back to an earlier computed length; `check_invariant` takes the
boundary, a computed length, like both."""
import pytest

from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.errors import InvariantError
from hybridspec.rollback.models import tiny_model


@pytest.fixture
def model_and_cache():
    model = tiny_model(4)
    cache = HybridCache(model.config, max_seqs=1, num_blocks=8, block_size=4, ring_slots=4, dtype=model.dtype)
    model.prefill(cache, [0], [[3, 1, 4, 1, 5]], last_only=True)
    return model, cache


def test_rewind_to_moves_every_layer_back_and_refuses_to_move_forward(model_and_cache):
    model, cache = model_and_cache
    start_len, start_head = cache.computed_len[0], cache.head(0)
    pages = len(cache.kv.block_table(0))
    model.extend(cache, [0], [[9, 2, 6, 5]], last_only=True)  # 9 computed: a page more
    assert cache.computed_len[0] == 9 and len(cache.kv.block_table(0)) == pages + 1
    cache.rewind_to(0, start_len, start_head)
    assert (cache.computed_len[0], cache.kv.kv_len(0), cache.head(0)) == (start_len, start_len, start_head)
    assert cache.states.head_position(0) == start_len and len(cache.kv.block_table(0)) == pages
    with pytest.raises(ValueError, match="past its computed length 5"):
        cache.rewind_to(0, start_len + 1, start_head)


def test_check_invariant_takes_the_boundary(model_and_cache):
    _, cache = model_and_cache
    cache.check_invariant(0, 5)  # every layer has absorbed the five prompt tokens
    with pytest.raises(InvariantError, match="boundary 6"):
        cache.check_invariant(0, 6)


def test_a_chain_is_planned_then_committed_or_aborted(model_and_cache):
    """`plan_chain` reserves the K/V of every position and walks the ring from the
    head; `abort_chain` changes nothing back, `commit_chain` moves every layer to the
    chain's end with the head at the last forward's slot."""
    _, cache = model_and_cache
    before = cache.bookkeeping()
    ring, head = cache.states.ring_slots(0), cache.head(0)
    at = ring.index(head)
    assert cache.plan_chain([0], forwards=4, num_new=4) is None  # five slots: the chain would reach the head
    assert cache.bookkeeping() == before
    plan = cache.plan_chain([0], forwards=3, num_new=5)  # a catch-up of 3, then two steps
    assert plan.chains == [[ring[(at + k) % 4] for k in range(4)]]
    # positions 5..9 take a third page of four; the lengths stay until the commit
    assert len(cache.kv.block_table(0)) == 3 and cache.kv.kv_len(0) == cache.computed_len[0] == 5
    cache.abort_chain(plan)
    assert cache.bookkeeping() == before
    plan = cache.plan_chain([0], forwards=3, num_new=5)
    assert cache.commit_chain(plan) == [plan.chains[0][1:]]
    assert (cache.computed_len[0], cache.kv.kv_len(0), cache.head(0)) == (10, 10, plan.chains[0][3])
    assert cache.states.head_position(0) == 10


def test_a_chain_over_cached_prefix_pages_is_not_planned():
    """A row replaying over shared K/V (a prefix-cache hit) runs plain forwards."""
    model = tiny_model(4)
    cache = HybridCache(model.config, max_seqs=2, num_blocks=8, block_size=4, ring_slots=4, dtype=model.dtype)
    model.prefill(cache, [0], [[3, 1, 4, 1, 5, 9, 2, 6]], last_only=True)
    cache.add_sequences([1])
    cache.restore_prefix(1, cache.kv.block_table(0)[:1], 4, 0, None)
    before = cache.bookkeeping()
    assert cache.plan_chain([1], forwards=2, num_new=2) is None
    assert cache.bookkeeping() == before
