"""The prefix cache under continuous batching (`hybridspec.engine.scheduler`): queued
requests hit the ones before them, cached pages give way to admission and to
the next round before anyone is preempted, a preempted request resumes from
its own cached tokens, and aborts leave the others exact; every output equals
the cache-off output and, at the end, every page is cached (one holder) or free."""
import random

import pytest

import hybridspec as hs
from hybridspec.rollback import perturbed_copy
from oracles import bamba

BLOCK = 4


@pytest.fixture(scope="module")
def models():
    target = hs.from_hf(bamba(seed=0))
    return target, perturbed_copy(target, seed=2)


def shared_prompts(count: int, seed: int, shared_len: int = 13):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 97) for _ in range(shared_len)]
    return [shared[:rng.randint(0, shared_len)] + [rng.randrange(3, 97) for _ in range(rng.randint(1, 6))]
            for _ in range(count)]


def assert_only_cached_pages_left(engine):
    stores = [engine.prefix] + ([engine.speculator.drafter.prefix] if engine.speculator is not None else [])
    assert engine.cache.computed_len == {} and not engine.has_unfinished_requests()
    for store in stores:
        pool = store.cache.kv.pool
        used = set(range(pool.num_blocks)) - set(pool.snapshot().free_blocks)
        assert sorted(store.cached_pages()) == sorted(used) and all(pool.ref_count(p) == 1 for p in used)
        assert all(n.lock_count == 0 for n in store.index.nodes())
        store.clear()
        assert pool.num_free == pool.num_blocks


@pytest.mark.parametrize("verify", ["greedy", "coupled"])
def test_queued_requests_hit_the_ones_before_them(models, verify):
    target, draft = models
    prompts = shared_prompts(12, seed=1)
    params = [hs.SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.0 if verify == "greedy" else 0.9,
                                seed=i) for i in range(12)]
    want = [o.token_ids for o in hs.Engine(target, max_batch_size=3, block_size=BLOCK).generate(prompts, params)]
    engine = hs.Engine(target, draft=draft, num_draft_tokens=3, max_batch_size=3, block_size=BLOCK,
                       verify="coupled" if verify == "coupled" else "rejection", prefix_cache=True)
    engine.check_invariants = True
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    assert engine.stats.prefix_hit_tokens > 0 and engine.stats.prefix_saved_state_hits > 0
    assert_only_cached_pages_left(engine)


def test_cached_pages_give_way_to_admission_and_rounds(models):
    """A pool of room for about two requests: distinct prompts one call after another
    only run because the cached pages of the earlier ones are evicted."""
    target, _ = models
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 97) for _ in range(9)] for _ in range(6)]
    params = hs.SamplingParams(max_new_tokens=8, ignore_eos=True)
    want = [hs.Engine(target, block_size=BLOCK).generate([p], params)[0].token_ids for p in prompts]
    engine = hs.Engine(target, block_size=BLOCK, num_blocks=10, prefix_cache=True)
    assert [engine.generate([p], params)[0].token_ids for p in prompts] == want
    assert engine.total_stats.prefix_evictions > 0 and engine.total_stats.preemptions == 0
    assert_only_cached_pages_left(engine)


@pytest.mark.parametrize("verify", ["rejection", "coupled"])
def test_preempted_requests_resume_from_their_own_cached_tokens(models, verify):
    target, draft = models
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 97) for _ in range(rng.randint(2, 8))] for _ in range(4)]
    params = [hs.SamplingParams(max_new_tokens=14, ignore_eos=True, temperature=0.0 if verify == "rejection" else 0.8,
                                seed=i) for i in range(4)]
    want = [hs.Engine(target, block_size=BLOCK).generate([p], [q])[0].token_ids for p, q in zip(prompts, params)]
    pages = -(-max(len(p) + 14 for p in prompts) // BLOCK) + 2
    engine = hs.Engine(target, draft=draft, num_draft_tokens=3, verify=verify, max_batch_size=4, block_size=BLOCK,
                       num_blocks=pages, prefix_cache=True)
    engine.check_invariants = True
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    assert engine.stats.preemptions > 0 and engine.stats.prefix_hit_tokens > 0
    assert_only_cached_pages_left(engine)


def test_abort_leaves_the_others_exact(models):
    target, draft = models
    prompts = shared_prompts(3, seed=4)
    params = [hs.SamplingParams(max_new_tokens=12, ignore_eos=True) for _ in prompts]
    want = [hs.Engine(target, block_size=BLOCK).generate([p], [q])[0].token_ids for p, q in zip(prompts, params)]
    engine = hs.Engine(target, draft=draft, num_draft_tokens=3, block_size=BLOCK, prefix_cache=True)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    got = {i: [] for i in ids}
    for out in engine.step() + engine.step():
        got[out.request_id] += out.token_ids
    engine.abort(ids[1])
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.token_ids
    assert got[ids[0]] == want[0] and got[ids[2]] == want[2]
    assert got[ids[1]] == want[1][:len(got[ids[1]])] and len(got[ids[1]]) < 12
    assert_only_cached_pages_left(engine)
