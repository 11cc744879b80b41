import random

import pytest

from hybridspec.cache import BlockPool
from hybridspec.cache.block_pool import consecutive_runs
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


def test_consecutive_runs():
    assert consecutive_runs([4, 5, 6, 9, 10, 3]) == [(4, 3), (9, 2), (3, 1)]
    assert consecutive_runs([]) == []


def test_pages_after_a_sequence_continue_its_run():
    pool = BlockPool(16)
    first = pool.allocate(3)
    assert first == [0, 1, 2]  # an empty pool: a run from page 0
    other = pool.allocate(2)  # a second sequence: mid-way into the spare room after the first
    assert other == [8, 9]
    assert pool.allocate(2, after=first[-1]) == [3, 4]
    assert pool.allocate(1, after=other[-1]) == [10]
    assert pool.free_runs() == [(5, 3), (11, 5)]


def test_a_taken_neighbour_starts_a_new_run_in_the_largest_free_stretch():
    pool = BlockPool(10)
    pool.allocate(2)  # 0, 1
    pool.allocate(1, after=9 - 1)  # page 9 (the page after 8 is free)
    assert pool.free_runs() == [(2, 7)]
    assert pool.allocate(1, after=9) == [5]  # nothing follows page 9: the middle of 2..8


def test_fragmented_pool_takes_pieces_of_the_longest_runs():
    pool = BlockPool(8)
    pool.allocate(8)
    pool.free([1, 2, 4, 6, 7])
    taken = pool.allocate(4)
    assert sorted(taken) == [1, 2, 6, 7] and pool.free_runs() == [(4, 1)]
    assert [pool.ref_count(b) for b in taken] == [1] * 4


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
    with pytest.raises(ValueError, match="outside the pool"):
        pool.allocate(1, after=2)


def test_free_runs_follow_every_allocation_and_release():
    """The free-page map behind `free_runs` against the free pages themselves,
    over random allocations (extending runs or new ones), shares and releases."""
    rng = random.Random(3)
    pool, held = BlockPool(64), []
    for _ in range(400):
        if held and rng.random() < 0.45:
            block = held.pop(rng.randrange(len(held)))
            pool.decref(block)
        elif held and rng.random() < 0.1:
            block = rng.choice(held)
            pool.incref(block)
            held.append(block)
        elif pool.num_free:
            after = rng.choice(held) if held and rng.random() < 0.5 else None
            held += pool.allocate(rng.randint(1, min(4, pool.num_free)), after=after)
        free = [b for b in range(64) if pool.ref_count(b) == 0]
        assert pool.free_runs() == consecutive_runs(free)
