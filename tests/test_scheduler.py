"""Continuous batching (`hybridspec.engine.scheduler` inside `Engine`): any number of
prompts give the outputs of one-by-one runs, pools too small for two requests
complete them all, forced preemption changes no token and leaks no page or
ring, `abort` leaves the others exact, and the incremental API (`add_request`,
`step`, `abort`, `stream`) reports what each round committed."""
import random

import pytest

import hybridspec as hs
from hybridspec.errors import InvalidRequestError
from hybridspec.rollback import perturbed_copy
from hybridspec.rollback.observer import _state_problems
from oracles import bamba, jamba

BLOCK = 4


@pytest.fixture(scope="module")
def models():
    target = hs.from_hf(bamba(seed=0))
    return target, perturbed_copy(target, seed=2)


def prompts_and_params(vocab: int, count: int, seed: int, sampled: bool = False):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 9))] for _ in range(count)]
    params = [hs.SamplingParams(max_new_tokens=rng.randint(3, 10), ignore_eos=True,
                                temperature=0.9 if sampled and i % 3 else 0.0, seed=seed * 100 + i)
              for i in range(count)]
    return prompts, params


def alone(target, prompts, params, **engine_kwargs):
    """Each request by itself on a fresh engine: the reference outputs."""
    return [hs.Engine(target, block_size=BLOCK, **engine_kwargs).generate([p], [q])[0].token_ids
            for p, q in zip(prompts, params)]


def assert_empty(engine):
    """No page, ring or drafter sequence is left behind."""
    assert engine.cache.computed_len == {} and not engine.has_unfinished_requests()
    if engine.cache.kv is not None:
        assert engine.cache.kv.num_free_blocks == engine.cache.kv.num_blocks
    assert engine.cache.states.num_free_rings == engine.cache.states.max_seqs
    drafter = engine.speculator.drafter if engine.speculator is not None else None
    if drafter is not None and drafter.cache is not None:
        assert drafter.cache.computed_len == {}
        assert drafter.cache.kv is None or drafter.cache.kv.num_free_blocks == drafter.cache.kv.num_blocks


@pytest.mark.parametrize("kind", ["plain", "greedy spec", "coupled spec"])
def test_fifty_prompts_at_concurrency_four_equal_one_by_one(models, kind):
    target, draft = models
    prompts, params = prompts_and_params(target.vocab_size, 50, seed=1, sampled=kind != "greedy spec")
    expected = alone(target, prompts, params)  # plain: greedy and seeded sampling
    kwargs = {} if kind == "plain" else dict(draft=draft, num_draft_tokens=3,
                                             verify="coupled" if kind == "coupled spec" else "rejection")
    engine = hs.Engine(target, max_batch_size=4, block_size=BLOCK, **kwargs)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert engine.stats.sequences == 50 and engine.stats.emitted_tokens == sum(map(len, expected))
    assert_empty(engine)


def test_pool_too_small_for_two_requests_still_completes_them_all(models):
    target, draft = models
    prompts, params = prompts_and_params(target.vocab_size, 6, seed=2)
    longest = max(len(p) + q.max_new_tokens for p, q in zip(prompts, params))
    pages = -(-longest // BLOCK)  # one request at its longest: never two at once
    engine = hs.Engine(target, draft=draft, num_draft_tokens=3, max_batch_size=4, block_size=BLOCK, num_blocks=pages)
    assert [o.token_ids for o in engine.generate(prompts, params)] == alone(target, prompts, params)
    assert_empty(engine)


@pytest.mark.parametrize("verify", ["rejection", "coupled"])
def test_forced_preemption_changes_no_token_and_leaks_nothing(models, verify):
    """Four requests admitted into a pool that holds their prompts but not
    their growth: the newest are preempted and recomputed, repeatedly."""
    target, draft = models
    prompts, _ = prompts_and_params(target.vocab_size, 4, seed=3)
    params = [hs.SamplingParams(max_new_tokens=14, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i)
              for i in range(4)]
    pages = -(-max(len(p) + 14 for p in prompts) // BLOCK) + 2
    engine = hs.Engine(target, draft=draft, num_draft_tokens=3, verify=verify, max_batch_size=4, block_size=BLOCK,
                       num_blocks=pages)
    engine.check_invariants = True
    outs = engine.generate(prompts, params)
    if verify == "coupled":  # coupled output is plain output, greedy or sampled
        assert [o.token_ids for o in outs] == alone(target, prompts, params)
    else:  # rejection: greedy rows are plain output; sampled rows are the spec engine's alone
        spec_alone = alone(target, prompts, params, draft=draft, num_draft_tokens=3)
        assert [o.token_ids for o in outs] == spec_alone
    assert engine.stats.preemptions > 0
    assert all(len(o.token_ids) == 14 for o in outs)
    assert_empty(engine)


def test_plain_engine_preempts_too(models):
    target, _ = models
    prompts, _ = prompts_and_params(target.vocab_size, 5, seed=4)
    params = hs.SamplingParams(max_new_tokens=12, ignore_eos=True)
    pages = -(-max(len(p) + 12 for p in prompts) // BLOCK) + 1
    engine = hs.Engine(target, max_batch_size=5, block_size=BLOCK, num_blocks=pages)
    assert [o.token_ids for o in engine.generate(prompts, params)] == alone(target, prompts, [params] * 5)
    assert engine.stats.preemptions > 0
    assert_empty(engine)


def test_abort_mid_generation_leaves_the_others_exact(models):
    """Abort one of three running requests between rounds: its pages and ring
    are freed at once; the others' every layer equals a from-scratch prefill
    of their committed tokens after every step, and their outputs are unchanged."""
    target, draft = models
    prompts, params = prompts_and_params(target.vocab_size, 3, seed=5)
    params = [hs.SamplingParams(max_new_tokens=12, ignore_eos=True) for _ in prompts]
    expected = alone(target, prompts, params)
    engine = hs.Engine(target, draft=draft, num_draft_tokens=3, max_batch_size=4, block_size=BLOCK)
    engine.check_invariants = True
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    got = {i: [] for i in ids}
    for out in engine.step() + engine.step():
        got[out.request_id] += out.token_ids
    pages_before = engine.cache.kv.num_free_blocks
    engine.abort(ids[1])
    assert engine.cache.kv.num_free_blocks > pages_before and not engine.cache.has_sequence(1)
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.token_ids
        for r in engine.scheduler.running:
            committed = r.output.prompt_token_ids + r.output.token_ids
            assert not _state_problems(target, engine.cache, r.seq_id, committed[:-1], "target")
            assert not _state_problems(draft, engine.speculator.drafter.cache, r.seq_id,
                                       committed[:engine.speculator.drafter.cache.computed_len[r.seq_id]], "drafter")
    assert got[ids[0]] == expected[0] and got[ids[2]] == expected[2]
    assert got[ids[1]] == expected[1][:len(got[ids[1]])] and len(got[ids[1]]) < 12
    assert_empty(engine)


def test_step_reports_each_round_and_finishes_once(models):
    target, draft = models
    engine = hs.Engine(target, draft=draft, num_draft_tokens=3, max_batch_size=2, block_size=BLOCK)
    first = engine.add_request([5, 6, 7], hs.SamplingParams(max_new_tokens=9, ignore_eos=True))
    second = engine.add_request([8], hs.SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=1.0, seed=3,
                                                       n=2))
    finished, tokens = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault((out.request_id, out.sample_index), []).extend(out.token_ids)
            if out.finished:
                finished.append((out.request_id, out.sample_index))
    assert sorted(finished) == [(first, 0), (second, 0), (second, 1)]
    assert len(tokens[first, 0]) == 9 and len(tokens[second, 0]) == len(tokens[second, 1]) == 4
    assert engine.total_stats.emitted_tokens == 17
    assert_empty(engine)


def test_stream_yields_tokens_as_they_commit_and_closing_aborts(models):
    target, draft = models
    prompts, params = prompts_and_params(target.vocab_size, 5, seed=6)
    expected = alone(target, prompts, params)
    engine = hs.Engine(target, draft=draft, num_draft_tokens=3, max_batch_size=2, block_size=BLOCK)
    got = [[] for _ in prompts]
    for out in engine.stream(prompts, params):
        got[out.request_id] += out.token_ids
    assert got == expected
    stream = engine.stream(prompts, params)
    next(stream)
    stream.close()  # leaving early aborts the rest
    assert_empty(engine)


def test_a_request_that_never_fits_is_refused_and_disturbs_nothing(models):
    target, _ = models
    engine = hs.Engine(target, max_batch_size=2, block_size=BLOCK, num_blocks=4)
    keep = engine.add_request([1, 2, 3], hs.SamplingParams(max_new_tokens=6, ignore_eos=True))
    out = [t for o in engine.step() for t in o.token_ids]  # the prefill's token and one decode step's
    assert len(out) == 2
    before = engine.cache.bookkeeping()
    with pytest.raises(InvalidRequestError, match="need 5 KV pages of 4 tokens but the whole pool holds 4"):
        engine.add_request(list(range(12)), hs.SamplingParams(max_new_tokens=6))
    assert engine.cache.bookkeeping() == before
    while engine.has_unfinished_requests():
        out += [t for o in engine.step() if o.request_id == keep for t in o.token_ids]
    assert len(out) == 6


def test_jamba_moe_under_preemption(models):
    """Another family (attention + Mamba + MoE) through the same scheduler."""
    target = hs.from_hf(jamba(seed=1))
    prompts, _ = prompts_and_params(target.vocab_size, 4, seed=7)
    params = hs.SamplingParams(max_new_tokens=10, ignore_eos=True)
    pages = -(-max(len(p) + 10 for p in prompts) // BLOCK) + 1
    engine = hs.Engine(target, draft=hs.NgramDrafter(), num_draft_tokens=3, max_batch_size=4, block_size=BLOCK,
                       num_blocks=pages)
    assert [o.token_ids for o in engine.generate(prompts, params)] == alone(target, prompts, [params] * 4)
    assert engine.stats.preemptions > 0
    assert_empty(engine)


def test_first_tokens_are_handed_out_before_the_round_and_not_repeated(models):
    """`step(first_tokens=)`: each admitted request's first token reaches the
    callback after its prefill, before the step's round; the step's return then
    holds only what the round added, and a request that ended with its first
    token is reported once. Together they are what `step()` returns alone."""
    target, draft = models
    prompts, params = prompts_and_params(target.vocab_size, 5, seed=3)
    params[1] = hs.SamplingParams(max_new_tokens=1, ignore_eos=True)  # ends with its prefill's token

    def run(with_callback: bool):
        engine = hs.Engine(target, draft=draft, num_draft_tokens=3, max_batch_size=3, block_size=BLOCK)
        for p, q in zip(prompts, params):
            engine.add_request(p, q)
        reports, early = [], []

        def first_tokens(outputs):
            assert all(len(o.token_ids) == 1 for o in outputs)  # the prefill's token: no round ran yet
            early.extend(outputs)
            reports.extend(outputs)
        while engine.has_unfinished_requests():
            reports += engine.step(first_tokens if with_callback else None)
        assert_empty(engine)
        return reports, early

    plain, _ = run(False)
    split, early = run(True)
    assert {o.request_id for o in early} == set(range(len(prompts)))
    assert sum(o.finished for o in split) == sum(o.finished for o in plain) == len(prompts)  # one final report each
    tokens = {}
    for reports in (plain, split):
        got = tokens.setdefault(id(reports), {})
        for o in reports:
            got.setdefault(o.request_id, []).extend(o.token_ids)
    assert tokens[id(plain)] == tokens[id(split)]
