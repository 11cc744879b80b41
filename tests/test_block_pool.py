import pytest

from hybridspec.cache import BlockPool
from hybridspec.errors import CacheFullError


def test_allocate_takes_distinct_pages_with_one_holder():
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and all(0 <= b < 5 for b in blocks)
    assert [pool.ref_count(b) for b in blocks] == [1, 1, 1]
    assert pool.num_free == 2 and pool.num_used == 3
    rest = pool.allocate(2)
    assert set(blocks).isdisjoint(rest)
    assert pool.num_free == 0


def test_allocate_zero_is_empty():
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free == 2


def test_allocate_too_many_raises_and_allocates_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    before = pool.snapshot()
    assert pool.can_allocate(2) and not pool.can_allocate(3)
    with pytest.raises(CacheFullError, match=r"need 3 .* only 2 of 4.*num_blocks"):
        pool.allocate(3)
    assert pool.snapshot() == before


def test_page_returns_to_free_list_only_at_zero_references():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.incref(block)
    pool.incref(block)
    assert pool.ref_count(block) == 3
    pool.decref(block)
    pool.free([block])
    assert pool.ref_count(block) == 1 and pool.num_free == 2
    pool.decref(block)
    assert pool.ref_count(block) == 0 and pool.num_free == 3
    assert block in pool.snapshot().free_blocks


def test_freed_pages_are_reused():
    pool = BlockPool(2)
    a = pool.allocate(2)
    pool.free(a)
    assert sorted(pool.allocate(2)) == sorted(a)


def test_snapshot_tracks_free_order_and_counts():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.incref(a)
    state = pool.snapshot()
    assert state.free_blocks == (2,)
    assert state.ref_counts[a] == 2 and state.ref_counts[b] == 1 and state.ref_counts[2] == 0


@pytest.mark.parametrize("op", ["incref", "decref"])
def test_sharing_or_releasing_a_free_page_is_misuse(op):
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="page 1 is free"):
        getattr(pool, op)(1)
    assert pool.num_free == 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockPool(0)
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="outside the pool"):
        pool.ref_count(2)
    with pytest.raises(ValueError, match="outside the pool"):
        pool.incref(-1)
    with pytest.raises(ValueError, match="n=-1"):
        pool.allocate(-1)
