import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hybridspec.cache import PagedKVCache
from hybridspec.cache.block_pool import consecutive_runs
from hybridspec.errors import CacheFullError

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 1, 2


def make_cache(num_blocks=8, block_size=4):
    return PagedKVCache(NUM_LAYERS, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu")


def token_kv(values: list[list[float]], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V `[batch, T_max, 1, 2]` whose entries name the token (value) and the layer; rows padded with NaN."""
    t_max = max((len(r) for r in values), default=0)
    k = torch.full((len(values), t_max, NUM_KV_HEADS, HEAD_DIM), float("nan"))
    for row, vals in enumerate(values):
        k[row, : len(vals), :, 0] = torch.tensor(vals)[:, None]
        k[row, : len(vals), :, 1] = layer
    return k, -k


def write_all_layers(cache, meta, values):
    for layer in range(NUM_LAYERS):
        cache.write(layer, meta, *token_kv(values, layer))


def stored_values(cache, seq_id, layer=0) -> list[float]:
    """Token values held at positions 0..kv_len-1, read straight from the pages."""
    pos = torch.arange(cache.kv_len(seq_id))
    pages = torch.tensor(cache.block_table(seq_id), dtype=torch.long)[pos // cache.block_size]
    return cache.k_cache[layer, pages, pos % cache.block_size, 0, 0].tolist()


def append(cache, seq_id, values):
    meta = cache.prepare_write([seq_id], [len(values)])
    write_all_layers(cache, meta, [values])
    cache.commit(seq_id, cache.kv_len(seq_id) + len(values))


# ---- unit tests ---------------------------------------------------------------


def test_prepare_write_meta():
    cache = make_cache(num_blocks=8, block_size=4)
    cache.add_sequence(0)
    cache.add_sequence(1)
    append(cache, 0, [1.0] * 6)  # pages p0, p1; kv_len 6
    t0 = cache.block_table(0)
    meta = cache.prepare_write([0, 1], [3, 1])
    t0, t1 = cache.block_table(0), cache.block_table(1)
    assert len(t0) == 3 and len(t1) == 1  # positions 6..8 reach a third page
    assert meta.seq_ids == (0, 1)
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.tolist() == [
        [t0[1] * 4 + 2, t0[1] * 4 + 3, t0[2] * 4 + 0],
        [t1[0] * 4 + 0, -1, -1],
    ]
    assert meta.block_tables.dtype == torch.int64 and meta.block_tables.tolist() == [t0, t1 + [-1, -1]]
    assert meta.context_lens.tolist() == [9, 1] and meta.query_lens.tolist() == [3, 1]
    assert meta.page_runs == (tuple(consecutive_runs(t0)), tuple(consecutive_runs(t1)))
    assert cache.kv_len(0) == 6 and cache.kv_len(1) == 0  # prepare_write does not advance kv_len


def test_sequences_growing_side_by_side_keep_one_run_of_pages_each():
    cache = make_cache(num_blocks=16, block_size=2)
    for s in (0, 1):
        cache.add_sequence(s)
    append(cache, 0, [1.0] * 3)
    append(cache, 1, [2.0] * 3)
    for _ in range(6):  # decode steps, each sequence crossing page boundaries
        for s in (0, 1):
            append(cache, s, [3.0])
    meta = cache.prepare_write([0, 1], [1, 1])
    assert [len(runs) for runs in meta.page_runs] == [1, 1]
    cache.truncate(0, 2)  # a rollback frees pages; growing again takes them back
    append(cache, 0, [4.0] * 5)
    assert len(consecutive_runs(cache.block_table(0))) == 1


def test_write_then_gather_round_trip_zero_padded():
    cache = make_cache(block_size=3)
    for s in (0, 1):
        cache.add_sequence(s)
    meta = cache.prepare_write([0, 1], [5, 2])
    write_all_layers(cache, meta, [[1, 2, 3, 4, 5], [6, 7]])
    for layer in range(NUM_LAYERS):
        k, v = cache.gather(layer, meta)
        assert k.shape == (2, 5, NUM_KV_HEADS, HEAD_DIM)
        assert k[0, :, 0, 0].tolist() == [1, 2, 3, 4, 5] and k[1, :, 0, 0].tolist() == [6, 7, 0, 0, 0]
        assert torch.all(k[0, :, 0, 1] == layer) and torch.all(k[1, 2:] == 0)
        torch.testing.assert_close(v, -k)


def test_commit_frees_pages_past_the_boundary():
    cache = make_cache(num_blocks=8, block_size=2)
    cache.add_sequence(0)
    append(cache, 0, [1.0, 2.0, 3.0])  # 2 pages
    meta = cache.prepare_write([0], [5])  # positions 3..7 -> 4 pages
    write_all_layers(cache, meta, [[4.0, 5.0, 6.0, 7.0, 8.0]])
    assert len(cache.block_table(0)) == 4 and cache.num_free_blocks == 4
    cache.commit(0, 5)  # keep inputs up to position 4
    assert cache.kv_len(0) == 5 and len(cache.block_table(0)) == 3 and cache.num_free_blocks == 5
    assert stored_values(cache, 0) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match=r"must lie in \[kv_len=5, 5\]"):
        cache.commit(0, 6)
    with pytest.raises(ValueError, match="truncate"):
        cache.commit(0, 4)


def test_failed_forward_leaves_kv_len_and_reuses_reserved_pages():
    cache = make_cache(num_blocks=4, block_size=2)
    cache.add_sequence(0)
    append(cache, 0, [1.0])
    cache.prepare_write([0], [3])  # forward raises: no write, no commit
    assert cache.kv_len(0) == 1 and cache.num_free_blocks == 2
    table = cache.block_table(0)
    cache.prepare_write([0], [3])  # the retry takes no new page
    assert cache.block_table(0) == table and cache.num_free_blocks == 2
    cache.prepare_write([0], [1])  # a shorter retry returns the page it no longer needs
    assert cache.block_table(0) == table[:1] and cache.num_free_blocks == 3
    cache.prepare_write([0], [3])
    cache.truncate(0, 1)  # abandoning the forward returns the reserved page
    assert cache.block_table(0) == table[:1] and cache.num_free_blocks == 3


@pytest.mark.parametrize("new_len, pages_left", [(10, 3), (9, 3), (8, 2), (1, 1), (0, 0)])
def test_truncate_frees_pages_wholly_past(new_len, pages_left):
    cache = make_cache(num_blocks=4, block_size=4)
    cache.add_sequence(0)
    append(cache, 0, [float(i) for i in range(10)])
    table = cache.block_table(0)
    cache.truncate(0, new_len)
    assert cache.kv_len(0) == new_len
    assert cache.block_table(0) == table[:pages_left]
    assert cache.num_free_blocks == 4 - pages_left
    assert stored_values(cache, 0) == [float(i) for i in range(new_len)]


def test_truncate_out_of_range():
    cache = make_cache()
    cache.add_sequence(0)
    append(cache, 0, [1.0, 2.0])
    with pytest.raises(ValueError, match=r"\[0, kv_len=2\]"):
        cache.truncate(0, 3)


def test_fork_shares_pages_and_copy_on_write_isolates():
    cache = make_cache(num_blocks=8, block_size=4)
    cache.add_sequence(0)
    append(cache, 0, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])  # one full page, one half page
    cache.fork(0, 1)
    shared = cache.block_table(0)
    assert cache.block_table(1) == shared and cache.kv_len(1) == 6
    assert [cache.pool.ref_count(b) for b in shared] == [2, 2] and cache.num_free_blocks == 6
    append(cache, 1, [70.0])  # writes into the shared half page: copied first
    t1 = cache.block_table(1)
    assert t1[0] == shared[0] and t1[1] != shared[1]
    assert [cache.pool.ref_count(b) for b in shared] == [2, 1] and cache.pool.ref_count(t1[1]) == 1
    assert stored_values(cache, 0) == [1, 2, 3, 4, 5, 6]
    assert stored_values(cache, 1) == [1, 2, 3, 4, 5, 6, 70]
    for layer in range(NUM_LAYERS):  # the copy covers every layer, K and V
        assert cache.k_cache[layer, t1[1], 1, 0, 1].item() == layer
        assert cache.v_cache[layer, t1[1], 1, 0, 0].item() == -6.0
    append(cache, 0, [80.0])  # sole holder now: writes in place
    assert cache.block_table(0) == shared
    assert stored_values(cache, 0) == [1, 2, 3, 4, 5, 6, 80]


def test_fork_leaves_reserved_pages_private():
    cache = make_cache(num_blocks=6, block_size=2)
    cache.add_sequence(0)
    append(cache, 0, [1.0, 2.0])
    cache.prepare_write([0], [3])  # reserves two more pages
    cache.fork(0, 1)
    assert cache.block_table(1) == cache.block_table(0)[:1]


def test_admission_counts_copies_exactly():
    # Two holders of a shared page both write it in one batch: one copy, not two.
    cache = make_cache(num_blocks=3, block_size=4)
    cache.add_sequence(0)
    append(cache, 0, [1.0, 2.0])
    cache.fork(0, 1)
    assert cache.num_free_blocks == 2
    assert cache.blocks_needed(0, 3) == 1 and cache.blocks_needed(1, 3) == 1
    cache.check_admission({0: 3, 1: 3})
    meta = cache.prepare_write([0, 1], [1, 1])
    write_all_layers(cache, meta, [[30.0], [31.0]])
    cache.commit(0, 3)
    cache.commit(1, 3)
    assert cache.num_free_blocks == 1
    assert stored_values(cache, 0) == [1, 2, 30] and stored_values(cache, 1) == [1, 2, 31]
    # Now three sequences would need: 1 copy for the fork of 0 plus 1 new page each for 0 and 2.
    cache.fork(0, 2)
    with pytest.raises(CacheFullError, match=r"needs 3 free KV pages \(2 new, 1 copy-on-write\) but only 1 of 3"):
        cache.check_admission({0: 5, 2: 5})


def test_full_cache_rejects_the_batch_unchanged():
    cache = make_cache(num_blocks=4, block_size=2)
    for s in (0, 1):
        cache.add_sequence(s)
    append(cache, 0, [1.0, 2.0, 3.0])
    before, k_before = cache.snapshot_bookkeeping(), cache.k_cache.clone()
    # 0 grows from 3 to 5 tokens (one new page), 1 from 0 to 3 (two pages): 3 > 2 free.
    with pytest.raises(CacheFullError, match=r"needs 3 free KV pages \(3 new, 0 copy-on-write\) but only 2 of 4.*"
                       "raise num_blocks or run a smaller batch"):
        cache.prepare_write([0, 1], [2, 3])
    assert cache.snapshot_bookkeeping() == before
    assert torch.equal(cache.k_cache, k_before)


def test_free_sequence_returns_every_page():
    cache = make_cache(num_blocks=5, block_size=2)
    cache.add_sequence(0)
    append(cache, 0, [1.0] * 5)
    cache.fork(0, 1)
    cache.free_sequence(0)
    assert cache.num_free_blocks == 2 and not cache.has_sequence(0)
    cache.free_sequence(1)
    assert cache.num_free_blocks == 5
    assert cache.snapshot_bookkeeping().pool.ref_counts == (0,) * 5


def test_misuse_is_rejected():
    cache = make_cache()
    cache.add_sequence(0)
    with pytest.raises(ValueError, match="already in the KV cache"):
        cache.add_sequence(0)
    for call in (lambda: cache.kv_len(3), lambda: cache.free_sequence(3), lambda: cache.fork(3, 4),
                 lambda: cache.prepare_write([0, 3], [1, 1]), lambda: cache.truncate(3, 0)):
        with pytest.raises(KeyError, match="add_sequence"):
            call()
    cache.add_sequence(1)
    with pytest.raises(ValueError, match="already exists"):
        cache.fork(0, 1)
    with pytest.raises(ValueError, match="repeat"):
        cache.prepare_write([0, 0], [1, 1])
    with pytest.raises(ValueError, match="negative"):
        cache.prepare_write([0], [-1])
    with pytest.raises(ValueError, match="one per sequence"):
        cache.prepare_write([0, 1], [1])
    meta = cache.prepare_write([0], [2])
    with pytest.raises(ValueError, match=r"expected \(1, 2, 1, 2\)"):
        cache.write(0, meta, torch.zeros(1, 3, 1, 2), torch.zeros(1, 3, 1, 2))
    with pytest.raises(ValueError, match="dtype"):
        cache.write(0, meta, torch.zeros(1, 2, 1, 2, dtype=torch.float64), torch.zeros(1, 2, 1, 2))


def test_bytes_per_block():
    cache = PagedKVCache(3, 4, 16, 2, 8, torch.bfloat16, "cpu")
    assert cache.bytes_per_block == 2 * 3 * 16 * 2 * 8 * 2


# ---- property test ------------------------------------------------------------

NUM_SEQ_IDS = 6


class PagedKVMachine(RuleBasedStateMachine):
    """Random add / forward (commit or failed) / truncate / fork / free against a model of each sequence's tokens."""

    def __init__(self):
        super().__init__()
        self.cache = None
        self.tokens: dict[int, list[float]] = {}  # seq_id -> value of each valid position
        self.next_value = 1.0

    @initialize(num_blocks=st.integers(3, 10), block_size=st.integers(1, 4), data=st.data())
    def start(self, num_blocks, block_size, data):
        self.cache = make_cache(num_blocks, block_size)
        self.cache.add_sequence(0)
        prompt = self.fresh_values(data.draw(st.integers(1, num_blocks * block_size)))
        append(self.cache, 0, prompt)
        self.tokens[0] = prompt

    def fresh_values(self, n):
        values = [self.next_value + i for i in range(n)]
        self.next_value += n
        return values

    @rule(seq_id=st.integers(0, NUM_SEQ_IDS - 1))
    def add(self, seq_id):
        if seq_id in self.tokens:
            with pytest.raises(ValueError):
                self.cache.add_sequence(seq_id)
            return
        self.cache.add_sequence(seq_id)
        self.tokens[seq_id] = []

    @rule(data=st.data())
    def forward(self, data):
        seq_ids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, unique=True))
        num_new = [data.draw(st.sampled_from([1, 2, 3, 4, 5, 6, 0])) for _ in seq_ids]
        succeeds = data.draw(st.booleans())
        before, contents = self.cache.snapshot_bookkeeping(), self.cache.k_cache.clone()
        num_taken, num_trimmed = self.pages_taken(before, seq_ids, num_new)
        try:
            meta = self.cache.prepare_write(seq_ids, num_new)
        except CacheFullError:
            assert num_taken > len(before.pool.free_blocks)  # rejected only when it does not fit
            assert self.cache.snapshot_bookkeeping() == before
            assert torch.equal(self.cache.k_cache, contents)
            return
        assert len(before.pool.free_blocks) - self.cache.num_free_blocks == num_taken - num_trimmed
        tables = [[p for p in row if p >= 0] for row in meta.block_tables.tolist()]
        assert meta.page_runs == tuple(tuple(consecutive_runs(t)) for t in tables)
        values = [self.fresh_values(n) for n in num_new]
        write_all_layers(self.cache, meta, values)
        if not succeeds:  # the forward raised after writing: nothing is committed
            return
        for seq_id, vals in zip(seq_ids, values):
            kept = data.draw(st.sampled_from(range(len(vals), -1, -1)))  # accepted prefix, all first
            self.cache.commit(seq_id, len(self.tokens[seq_id]) + kept)
            self.tokens[seq_id] += vals[:kept]

    def pages_taken(self, state, seq_ids, num_new) -> tuple[int, int]:
        """(pages a batch takes, reserved pages it gives back), by replaying copy-on-write holder by holder."""
        bs, ref_counts = self.cache.block_size, list(state.pool.ref_counts)
        taken = trimmed = 0
        for seq_id, n in zip(seq_ids, num_new):
            table, kv_len = state.block_tables[seq_id], len(self.tokens[seq_id])
            end_page = -(-(kv_len + n) // bs)
            for block in (table[p] for p in range(kv_len // bs, min(end_page, len(table))) if n > 0):
                if ref_counts[block] > 1:  # shared: this holder takes a private copy
                    ref_counts[block] -= 1
                    taken += 1
            taken += max(0, end_page - len(table))
            trimmed += max(0, len(table) - end_page)
        return taken, trimmed

    @rule(data=st.data())
    def truncate(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        new_len = data.draw(st.integers(0, len(self.tokens[seq_id])))
        self.cache.truncate(seq_id, new_len)
        del self.tokens[seq_id][new_len:]

    @rule(data=st.data())
    def fork(self, data):
        unused = sorted(set(range(NUM_SEQ_IDS)) - set(self.tokens))
        if not unused:
            return
        src, dst = data.draw(st.sampled_from(sorted(self.tokens))), data.draw(st.sampled_from(unused))
        self.cache.fork(src, dst)
        self.tokens[dst] = list(self.tokens[src])

    @rule(data=st.data())
    def free(self, data):
        if len(self.tokens) == 1:  # keep one sequence to act on; teardown frees the rest
            return
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.free_sequence(seq_id)
        del self.tokens[seq_id]

    @invariant()
    def page_counts_are_exact(self):
        state = self.cache.snapshot_bookkeeping()
        holders = [0] * self.cache.num_blocks
        for table in state.block_tables.values():
            for block in table:
                holders[block] += 1
        assert list(state.pool.ref_counts) == holders
        free = state.pool.free_blocks
        assert len(set(free)) == len(free) == self.cache.num_free_blocks
        assert set(free) == {b for b, n in enumerate(holders) if n == 0}
        assert len(free) + sum(n > 0 for n in holders) == self.cache.num_blocks
        for seq_id, table in state.block_tables.items():
            assert len(table) == -(-state.reserved_lens[seq_id] // self.cache.block_size)

    @invariant()
    def every_sequence_holds_its_own_tokens(self):
        for seq_id, tokens in self.tokens.items():
            assert self.cache.kv_len(seq_id) == len(tokens)
            for layer in range(NUM_LAYERS):
                assert stored_values(self.cache, seq_id, layer) == tokens

    def teardown(self):
        for seq_id in list(self.tokens):
            self.cache.free_sequence(seq_id)
        assert self.cache.num_free_blocks == self.cache.num_blocks
        assert self.cache.snapshot_bookkeeping().pool.ref_counts == (0,) * self.cache.num_blocks


PagedKVMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_paged_kv_bookkeeping = PagedKVMachine.TestCase


def test_blocks_needed_of_one_sequence_is_the_batch_count_of_it_alone():
    """The one-sequence fast path against the general count, over forks
    (shared pages, copy-on-write) and lengths inside, at and past each table."""
    cache = make_cache(num_blocks=16, block_size=2)
    cache.add_sequence(0)
    append(cache, 0, [1.0, 2.0, 3.0])
    cache.fork(0, 1)
    cache.fork(0, 2)
    append(cache, 2, [4.0])
    for seq_id in (0, 1, 2):
        for new_len in range(cache.kv_len(seq_id), 12):
            assert cache.blocks_needed(seq_id, new_len) == cache._count_blocks_needed({seq_id: new_len})[0]
    with pytest.raises(ValueError, match="truncate"):
        cache.blocks_needed(0, 1)
    # the scheduler's sum over a batch: each sequence alone, lengths below kv_len counting as kv_len
    for lengths in ([(0, 3), (1, 5), (2, 9)], [(0, 1), (2, 4)], [(1, 12), (0, 7), (2, 2)], []):
        assert cache.blocks_needed_each(lengths) == sum(
            cache.blocks_needed(s, max(n, cache.kv_len(s))) for s, n in lengths)
