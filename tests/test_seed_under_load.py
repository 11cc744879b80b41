"""Seeds hold under any load: a sampled request given a seed gets the same
tokens alone and beside many others, plain or speculative, at a fixed γ and
under adaptive γ ("auto"), with the default verify="rejection" (its rows are
verified coupled: their output is plain seeded sampling's); requests without
a seed are still verified by rejection sampling. Underneath, a sequence's
logits do not depend on the call it runs in: a prefill batch of more than
`cpu_blocks.BLOCK_ROWS` rows, one mixing longer and shorter prompts, and a
MoE's router give every sequence the bits it gets alone."""
import pytest
import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.kernels.cpu import blocks as cpu_blocks
from hybridspec.kernels.reference import MODE_COUPLED, MODE_REJECTION
from hybridspec.models.ffn import MoE
from oracles import randomize_

SEEDS = (3, 17, 40)
LOAD = 24  # other requests running beside the seeded ones


@pytest.fixture(scope="module")
def pair():
    target_dir, draft_dir = hs.embedded_paths()
    return hs.load(target_dir), hs.load(draft_dir)


def tiny_moe(seed=0):
    """A GraniteMoeHybrid with a routed MoE after every mixer, float32, packed for the CPU. Its sizes are
    multiples of the vector width, so that torch's element-wise operations treat every row alike."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    cfg = GraniteMoeHybridConfig(
        vocab_size=97, hidden_size=64, intermediate_size=32, shared_intermediate_size=32, num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"], num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, position_embedding_type="rope", mamba_n_heads=4,
        mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=8, max_position_embeddings=512, pad_token_id=0,
        eos_token_id=1, bos_token_id=2, experts_implementation="eager")
    torch.manual_seed(seed)
    return hs.from_hf(randomize_(GraniteMoeHybridForCausalLM(cfg), seed).float().eval()).pack_for_cpu()


@pytest.fixture(scope="module")
def moe():
    return tiny_moe()


def prompt(vocab, i, length):
    return [(7 * t + 13 * i + 3) % (vocab - 3) + 3 for t in range(length)]


def seeded(max_new_tokens=20):
    return [hs.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.9, seed=s, ignore_eos=True) for s in SEEDS]


def load(vocab, count=LOAD):
    """Unseeded sampled and greedy requests, prompts of 12-40 tokens and one longer than a block takes."""
    prompts = [prompt(vocab, 100 + i, 12 + (5 * i) % 29) for i in range(count - 1)]
    prompts.append(prompt(vocab, 99, cpu_blocks.BLOCK_ROWS + 30))
    params = [hs.SamplingParams(max_new_tokens=16, temperature=0.0 if i % 4 == 0 else 0.9, ignore_eos=True)
              for i in range(count)]
    return prompts, params


def alone_and_loaded(engine, vocab):
    """The seeded requests' tokens, each run alone, and all of them beside the load."""
    prompts = [prompt(vocab, i, 9 + 4 * i) for i in range(len(SEEDS))]
    alone = [engine.generate([p], [q])[0].token_ids for p, q in zip(prompts, seeded())]
    others, other_params = load(vocab)
    loaded = engine.generate(prompts + others, seeded() + other_params)[:len(SEEDS)]
    return alone, [o.token_ids for o in loaded]


@pytest.mark.parametrize("gamma", [4, "auto"])
def test_seeded_requests_match_alone_and_under_load(pair, gamma):
    target, draft = pair
    spec = hs.Engine(target, draft=draft, num_draft_tokens=gamma, max_batch_size=32)
    alone, loaded = alone_and_loaded(spec, target.vocab_size)
    assert loaded == alone
    plain = hs.Engine(target, max_batch_size=32)
    plain_alone, plain_loaded = alone_and_loaded(plain, target.vocab_size)
    assert plain_loaded == plain_alone == alone  # coupled rows give plain seeded sampling's tokens
    assert len({tuple(t) for t in alone}) == len(SEEDS)


def test_seeded_moe_requests_match_alone_and_under_load(moe):
    spec = hs.Engine(moe, draft=hs.NgramDrafter(), num_draft_tokens="auto", max_draft_tokens=4, max_batch_size=32)
    alone, loaded = alone_and_loaded(spec, moe.vocab_size)
    assert loaded == alone
    plain_alone, _ = alone_and_loaded(hs.Engine(moe, max_batch_size=32), moe.vocab_size)
    assert plain_alone == alone


def test_unseeded_rows_verify_by_rejection(pair, monkeypatch):
    """In one batch the seeded sampled rows verify coupled and the unseeded ones by rejection sampling."""
    target, draft = pair
    engine = hs.Engine(target, draft=draft, num_draft_tokens=3, max_batch_size=16)
    rejection = target.backend.rejection
    modes = []  # (mode, seed) of every verified row
    inner = rejection.fn

    def recording(p, q, draft_tokens, num_draft, mode, seeds, positions):
        modes.extend(zip(mode.tolist(), seeds.tolist()))
        return inner(p, q, draft_tokens, num_draft, mode, seeds, positions)

    monkeypatch.setattr(rejection, "fn", recording)
    prompts = [prompt(target.vocab_size, i, 10 + i) for i in range(8)]
    params = [hs.SamplingParams(max_new_tokens=12, temperature=0.9, ignore_eos=True, seed=SEEDS[i] if i < 3 else None)
              for i in range(8)]
    engine.generate(prompts, params)
    seeded_modes = {m for m, s in modes if s in SEEDS}
    unseeded_modes = {m for m, s in modes if s not in SEEDS}
    assert seeded_modes == {MODE_COUPLED} and unseeded_modes == {MODE_REJECTION}
    coupled = hs.Engine(target, draft=draft, num_draft_tokens=3, max_batch_size=16, verify="coupled")
    modes.clear()
    coupled.generate(prompts, params)
    assert {m for m, _ in modes} == {MODE_COUPLED}


def new_cache(model, n):
    return HybridCache(model.config, max_seqs=n, num_blocks=64 * n, block_size=16, ring_slots=2, dtype=model.dtype)


def test_prefill_rows_do_not_depend_on_the_batch(pair):
    """More rows than a block takes (8 prompts of 20-27 tokens), more than one native call takes (split by
    sequences), and prompts longer and shorter than a block takes in one call: each sequence's logits,
    and the decode step after, are the ones it gets alone."""
    target, _ = pair
    limit = cpu_blocks.BLOCK_ROWS
    many = [limit - b % 7 for b in range(cpu_blocks.CALL_ROWS // limit + 3)]
    for lengths in ([20 + b for b in range(8)], many, [20, limit + 34, 33, limit + 1, 5, limit]):
        prompts = [prompt(target.vocab_size, b, n) for b, n in enumerate(lengths)]
        assert len(prompts) * max(lengths) > limit
        alone, steps = [], []
        for p in prompts:
            cache = new_cache(target, 1)
            alone.append(target.prefill(cache, [0], [p]))
            steps.append(target.decode(cache, [0], [7]))
        cache = new_cache(target, len(prompts))
        together = target.prefill(cache, list(range(len(prompts))), prompts)
        step = target.decode(cache, list(range(len(prompts))), [7] * len(prompts))
        for b, p in enumerate(prompts):
            assert torch.equal(together[b, :len(p)], alone[b][0]), (lengths, b)
            assert torch.equal(step[b], steps[b][0]), (lengths, b)


def test_moe_rows_do_not_depend_on_the_batch(moe):
    """The router's product (and so each token's routing) and a decode step's logits are a row's own."""
    ffn = next(layer.ffn for layer in moe.layers if isinstance(layer.ffn, MoE))
    x = torch.randn(150, moe.config.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, ids = ffn.route(x)
    for k in (1, 3, 40):
        w, i = ffn.route(x[:k])
        assert torch.equal(w, weights[:k]) and torch.equal(i, ids[:k])
    steps = []
    for n in (1, 5, 20):
        cache = new_cache(moe, n)
        moe.prefill(cache, list(range(n)), [prompt(moe.vocab_size, b, 6 + b) for b in range(n)], last_only=True)
        steps.append(moe.decode(cache, list(range(n)), [5 + b for b in range(n)])[0])
    assert all(torch.equal(s, steps[0]) for s in steps[1:])


def test_a_split_forward_fails_whole(pair, monkeypatch):
    """A forward run as several (shorter and longer sequences) that fails in a later part leaves every
    sequence where it was; run again, each sequence gets the logits it gets alone."""
    target, _ = pair
    lengths = [10, cpu_blocks.BLOCK_ROWS + 5, 7]
    starts = [prompt(target.vocab_size, 50 + b, 4) for b in range(len(lengths))]
    more = [prompt(target.vocab_size, 60 + b, n) for b, n in enumerate(lengths)]
    cache = new_cache(target, len(lengths))
    ids = list(range(len(lengths)))
    target.prefill(cache, ids, starts, last_only=True)
    before = [cache.computed_len[s] for s in ids]
    calls = []

    def fail_second(forwards=1):
        calls.append(forwards)
        if len(calls) == 2:
            raise RuntimeError("injected")

    monkeypatch.setattr(target, "forward_done", fail_second)
    with pytest.raises(RuntimeError, match="injected"):
        target.extend(cache, ids, more)
    monkeypatch.undo()
    assert [cache.computed_len[s] for s in ids] == before
    together = target.extend(cache, ids, more)
    for b in ids:
        alone = new_cache(target, 1)
        target.prefill(alone, [0], [starts[b]], last_only=True)
        assert torch.equal(together[b, :lengths[b]], target.extend(alone, [0], [more[b]])[0])
