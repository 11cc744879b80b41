"""PrefixIndex bookkeeping on its own: hits to the token (inside a page),
saved-state validity, deduplicated insertion, locks and LRU eviction."""
import pytest

from hybridspec.cache.prefix_index import PrefixIndex


def tokens(n, offset=0):
    return [offset + i for i in range(n)]


def test_hit_ends_inside_a_page_and_follows_full_pages():
    index = PrefixIndex(block_size=4)
    path, taken = index.insert(tokens(10), [7, 8, 9])
    assert [n.tokens for n in path] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)] and taken == [7, 8, 9]
    match = index.match(tokens(6) + [99, 100])
    assert match.num_cached == 6 and match.pages == [7, 8]
    assert index.match(tokens(10)).num_cached == 10
    assert index.match(tokens(12)).num_cached == 10  # the partial page has no children
    assert index.match([5, 6]).num_cached == 0 and index.match([]).num_cached == 0


def test_insert_keeps_pages_already_cached():
    index = PrefixIndex(block_size=4)
    index.insert(tokens(8), [1, 2])
    path, taken = index.insert(tokens(12), [5, 6, 3])  # a second sequence with its own copies of pages 1, 2
    assert [n.page for n in path] == [1, 2, 3] and taken == [3]
    assert index.match(tokens(12)).pages == [1, 2, 3]


def test_saved_states_valid_only_as_far_as_the_prompt_agrees():
    index = PrefixIndex(block_size=4)
    path, _ = index.insert(tokens(7), [0, 1])  # (0..3), (4, 5, 6)
    index.add_saved_state(path[1], 6, "s6", 10)
    index.add_saved_state(path[0], 3, "s3", 10)
    full, _ = index.insert(tokens(8), [0, 2])  # a full sibling of the partial page
    assert full[1] is not path[1]
    match = index.match(tokens(6) + [50, 51])
    assert sorted(c.position for c in match.saved_states) == [3, 6]
    assert match.nearest_saved_state(5).position == 3 and match.nearest_saved_state(6).position == 6
    assert sorted(c.position for c in index.match(tokens(5) + [50]).saved_states) == [3]  # 6 needs token 5 too
    with pytest.raises(ValueError, match="belongs to the node holding position 8"):
        index.add_saved_state(path[0], 9, "s9", 10)


def test_eviction_takes_unlocked_leaves_least_recently_used():
    index = PrefixIndex(block_size=2)
    a, _ = index.insert([1, 2, 3, 4], [10, 11])
    b, _ = index.insert([1, 2, 5, 6], [10, 12])
    index.touch(a)  # b's leaf is now the oldest
    assert index.evictable_leaf() is b[1]
    index.lock([b[1]], None)
    assert index.evictable_leaf() is a[1]
    index.lock([a[1]], None)
    assert index.evictable_leaf() is None  # the shared first page is not a leaf
    index.lock([a[1]], None, -1)
    index.remove_leaf(a[1])
    assert index.match([1, 2, 3, 4]).num_cached == 2
    with pytest.raises(ValueError, match="only a leaf"):
        index.remove_leaf(a[0])


def test_a_locked_saved_state_pins_its_node_and_is_not_evicted():
    index = PrefixIndex(block_size=2)
    path, _ = index.insert([1, 2, 3], [0, 1])
    old = index.add_saved_state(path[0], 2, "s2", 4)
    new = index.add_saved_state(path[1], 3, "s3", 4)
    assert index.evictable_saved_state() is old
    index.lock([], old)
    assert index.evictable_saved_state() is new
    assert index.evictable_leaf() is path[1]
    index.lock([], new)
    assert index.evictable_saved_state() is None and index.evictable_leaf() is None
