"""Eviction never frees what a running request holds: random request streams
(prompts over a few shared prefixes, decode steps, finishes, aborts, room
requests) under tiny saved-state budgets and small block pools. After every
step each page's reference count is exactly its holders (running block tables
plus the index), every locked saved state is still stored and the saved-state
bytes stay in budget; a finishing request's state equals a from-scratch
prefill; at the end every page and saved state is cached or free."""
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.cache.prefix_cache import PrefixStore
from hybridspec.errors import CacheFullError
from oracles import bamba, jamba

FAMILIES = {"bamba": bamba, "jamba": jamba}
MAX_SEQS = 3


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def target(request):
    return hs.from_hf(FAMILIES[request.param](seed=0))


START = st.tuples(st.just("start"), st.integers(0, 2), st.integers(4, 14), st.integers(1, 9))
OPS = st.one_of(
    START, START, START,
    st.tuples(st.just("decode"), st.integers(0, MAX_SEQS - 1), st.integers(1, 5)),
    st.tuples(st.just("finish"), st.integers(0, MAX_SEQS - 1)),
    st.tuples(st.just("abort"), st.integers(0, MAX_SEQS - 1)),
    st.tuples(st.just("room"), st.integers(0, 40)),
)


def check_holders(store: PrefixStore, cache: HybridCache, running: dict[int, list[int]]) -> None:
    pool = cache.kv.pool
    holders = Counter(p for s in running for p in cache.kv.block_table(s))
    holders.update(store.cached_pages())
    assert [pool.ref_count(b) for b in range(pool.num_blocks)] == [holders[b] for b in range(pool.num_blocks)]
    assert set(pool.snapshot().free_blocks) == {b for b in range(pool.num_blocks) if holders[b] == 0}
    assert all(n.lock_count == 0 for n in store.index.nodes())  # locks live only while a prompt is restored
    assert all(c.lock_count == 0 for c in store.index.saved_states())
    assert store.saved_state_bytes == sum(c.nbytes for c in store.index.saved_states())
    assert store.saved_state_bytes <= store.settings.memory_budget_bytes


def assert_state_is_a_fresh_prefill(model, cache, seq_id, tokens):
    fresh = HybridCache(model.config, max_seqs=1, num_blocks=64, block_size=cache.block_size, dtype=model.dtype)
    model.prefill(fresh, [0], [tokens])
    for i in range(len(cache.states.ssm_states)):
        for pool_states in ("ssm_states", "conv_states"):
            got = getattr(cache.states, pool_states)[i][cache.head(seq_id)]
            want = getattr(fresh.states, pool_states)[i][fresh.head(0)]
            assert (got - want).abs().max().item() <= 1e-10
    for got, want in zip(kv_at(cache.kv, seq_id, len(tokens)), kv_at(fresh.kv, 0, len(tokens))):
        assert (got - want).abs().max().item() <= 1e-10


def kv_at(kv, seq_id, n):
    """K and V [layers, n, kv_heads, head_dim] of positions < n, read through the block table."""
    table, positions = torch.tensor(kv.block_table(seq_id)), torch.arange(n)
    pages, offsets = table[positions // kv.block_size], positions % kv.block_size
    return kv.k_cache[:, pages, offsets], kv.v_cache[:, pages, offsets]


@settings(max_examples=25, deadline=None, derandomize=True, database=None, phases=[Phase.generate, Phase.shrink],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=st.lists(OPS, min_size=3, max_size=16), block_size=st.sampled_from([2, 4]),
       num_blocks=st.integers(10, 40), budget_slots=st.integers(0, 3),
       every=st.one_of(st.none(), st.integers(2, 6)), seed=st.integers(0, 1000))
def test_random_streams_never_free_what_a_request_holds(target, ops, block_size, num_blocks, budget_slots, every,
                                                        seed):
    cache = HybridCache(target.config, max_seqs=MAX_SEQS, num_blocks=num_blocks, block_size=block_size,
                        dtype=target.dtype)
    budget = budget_slots * cache.states.bytes_per_slot
    store = PrefixStore(target, cache, hs.PrefixCache(memory_budget_bytes=budget, save_every=every))
    g = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (9, 6, 13)]
    running: dict[int, list[int]] = {}  # seq -> tokens absorbed
    next_id = 0
    for op in ops:
        ids = sorted(running)
        if op[0] == "start" and len(running) < MAX_SEQS:
            _, family, cut, own = op
            prompt = prefixes[family][:cut] + torch.randint(3, 97, (own,), generator=g).tolist()
            store.make_room(-(-len(prompt) // block_size) + 2)
            try:
                store.prefill([next_id], [prompt])
                running[next_id] = prompt
            except CacheFullError:
                assert not cache.has_sequence(next_id)
            next_id += 1
        elif op[0] == "decode" and ids:
            s = ids[op[1] % len(ids)]
            for _ in range(op[2]):
                token = int(torch.randint(3, 97, (1,), generator=g))
                try:
                    target.decode(cache, [s], [token])
                except CacheFullError:
                    break
                running[s].append(token)
        elif op[0] in ("finish", "abort") and ids:
            s = ids[op[1] % len(ids)]
            tokens = running.pop(s)
            if op[0] == "finish":
                assert_state_is_a_fresh_prefill(target, cache, s, tokens)
            store.release([s], [tokens + [5] if op[0] == "finish" else None])  # + the pending token
            cache.free_sequences([s])
        elif op[0] == "room":
            store.make_room(op[1])
        check_holders(store, cache, running)
    for s, tokens in list(running.items()):
        store.release([s], [tokens + [5]])
        cache.free_sequences([s])
    check_holders(store, cache, {})
    assert all(cache.kv.pool.ref_count(p) == 1 for p in store.cached_pages())
    assert all(n.lock_count == 0 for n in store.index.nodes())
    assert all(c.lock_count == 0 for c in store.index.saved_states())
    store.clear()
    assert cache.kv.pool.num_free == num_blocks and store.saved_state_bytes == 0 and store.index.nodes() == []


REFERENCE: dict = {}


def alone(model, prompt: list[int], max_new: int) -> list[int]:
    """Greedy output of `prompt` by itself with the cache off (memoised across examples)."""
    key = (id(model), tuple(prompt), max_new)
    if key not in REFERENCE:
        params = hs.SamplingParams(max_new_tokens=max_new, ignore_eos=True)
        REFERENCE[key] = hs.Engine(model, block_size=4).generate([prompt], params)[0].token_ids
    return REFERENCE[key]


@settings(max_examples=12, deadline=None, derandomize=True, database=None, phases=[Phase.generate, Phase.shrink],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(requests=st.lists(st.tuples(st.integers(0, 2), st.integers(3, 14), st.integers(1, 5), st.integers(2, 9),
                                   st.one_of(st.none(), st.integers(0, 4))), min_size=2, max_size=7),
       max_running=st.integers(1, 3), spare_pages=st.integers(0, 6), budget_slots=st.integers(0, 3),
       every=st.one_of(st.none(), st.integers(2, 5)), spec=st.booleans())
def test_engine_streams_equal_cache_off_outputs(target, requests, max_running, spare_pages, budget_slots, every,
                                                spec):
    """Requests over shared prefixes through the Engine's scheduler (admission, preemption,
    reclaim) with random aborts (after k steps): every request not aborted gives its
    cache-off output, an aborted one a prefix of it; afterwards only cached pages remain."""
    g = torch.Generator().manual_seed(len(requests))
    prefixes = [torch.randint(3, 97, (14,), generator=g).tolist() for _ in range(3)]
    prompts = [prefixes[f][:cut] + torch.randint(3, 97, (own,), generator=g).tolist()
               for f, cut, own, _, _ in requests]
    pages = max(-(-(len(p) + r[3]) // 4) for p, r in zip(prompts, requests)) + spare_pages
    slot_bytes = HybridCache(target.config, max_seqs=1, num_blocks=1, block_size=4, dtype=target.dtype).states \
        .bytes_per_slot
    settings_ = hs.PrefixCache(memory_budget_bytes=budget_slots * slot_bytes, save_every=every)
    engine = hs.Engine(target, draft=target if spec else None, num_draft_tokens=2, max_batch_size=max_running,
                       block_size=4, num_blocks=pages, prefix_cache=settings_)
    engine.check_invariants = True
    ids = [engine.add_request(p, hs.SamplingParams(max_new_tokens=r[3], ignore_eos=True))
           for p, r in zip(prompts, requests)]
    got = {i: [] for i in ids}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.token_ids
        step += 1
        for i, r in zip(ids, requests):
            if r[4] == step:
                engine.abort(i)
    for i, p, r in zip(ids, prompts, requests):
        want = alone(target, p, r[3])
        assert got[i] == want if r[4] is None else got[i] == want[:len(got[i])]
    stores = [engine.prefix] + ([engine.speculator.drafter.prefix] if spec else [])
    for store in stores:
        pool = store.cache.kv.pool
        used = set(range(pool.num_blocks)) - set(pool.snapshot().free_blocks)
        assert sorted(store.cached_pages()) == sorted(used) and all(pool.ref_count(p) == 1 for p in used)
        assert store.saved_state_bytes <= store.settings.memory_budget_bytes
        assert all(n.lock_count == 0 for n in store.index.nodes())
