"""Whole blocks in C (`kernels/cpu/blocks.c`) and whole forwards
(`kernels/cpu/forward.c`): the MLP, Mamba-2 and attention blocks of float32
Bamba models against the module path (logits, state slots, conv windows, K/V
pages, input logs), the whole forward against the blocks layer by layer (bit
for bit), a row's bits alone and in a batch, a verify input's bits against a
decode step's, and when each runs."""
from __future__ import annotations

import collections

import pytest
import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.kernels.cpu import blocks as cpu_blocks
from hybridspec.kernels.cpu import forward as cpu_forward
from hybridspec.models.greedy_chain import GreedyChain
from native_cpu import both_vector_paths, one_thread, x86_with_compiler  # noqa: F401 (fixtures)
from native_switch import backend_of
from oracles import bamba

pytestmark = x86_with_compiler


@pytest.fixture(scope="module")
def model():
    return hs.from_hf(bamba(seed=5, attn_layers=(1,), num_layers=3, dtype=torch.float32, kv_heads=2)).pack_for_cpu()


def new_cache(model, max_seqs=3, block_size=8):
    return HybridCache(model.config, max_seqs=max_seqs, num_blocks=64 // block_size * max_seqs,
                       block_size=block_size, ring_slots=8, dtype=model.dtype)


@pytest.fixture
def blocks_off():
    """Bind models to the native ops without the blocks (the modules, with the other
    native kernels, run): `blocks_off(*models)`; each bound to the default again after."""
    bound = []

    def off(*models):
        for m in models:
            m.bind_backend("native-ops")
            bound.append(m)
    yield off
    for m in bound:
        m.bind_backend()


@pytest.fixture
def layer_by_layer(model):
    """The whole-forward path off: the layers run one by one (the blocks where they apply)."""
    with backend_of(model, "native-blocks"):
        yield


@pytest.fixture(params=["whole forward", "layer by layer"])
def either_path(request, model):
    with backend_of(model, "native" if request.param == "whole forward" else "native-blocks"):
        yield request.param


@pytest.fixture
def counted(monkeypatch):
    """Counts of the block and whole-forward calls that ran (not None) and that fell back (None)."""
    counts = collections.Counter()
    for module, name in ((cpu_blocks, "mixer_block"), (cpu_blocks, "mlp_block"), (cpu_forward, "forward")):
        original = getattr(module, name)

        def wrapper(*args, _original=original, _name=name):
            out = _original(*args)
            counts[_name if out is not None else _name + " fell back"] += 1
            return out
        monkeypatch.setattr(module, name, wrapper)
    return counts


def run(model, prompts, steps, verify_tokens, block_size=8):
    """Prefill, a few batched decode steps, then one snapshotted verify forward
    of `verify_tokens` inputs per row with an input log; returns (logits, cache, log)."""
    cache = new_cache(model, max_seqs=max(3, len(prompts)), block_size=block_size)
    ids = list(range(len(prompts)))
    logits = [model.prefill(cache, ids, prompts, last_only=True)]
    for step in range(steps):
        logits.append(model.decode(cache, ids, [(7 * step + p[0]) % 90 + 3 for p in prompts]))
    heads = [cache.head(s) for s in ids]
    ring = [cache.states.ring_slots(s) for s in ids]
    snap = torch.tensor([[r[(r.index(h) + 1 + t) % len(r)] for t in range(verify_tokens)] for r, h in zip(ring, heads)])
    log = {}
    logits.append(model.extend(cache, ids, [[p[0], 12, 13, 14, 15][:verify_tokens] for p in prompts], snap_slot=snap,
                               input_log=log))
    return logits, cache, log


def test_blocks_match_the_module_path(model, blocks_off, layer_by_layer, counted):
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    fused = run(model, prompts, steps=3, verify_tokens=5)  # 2 · 5 rows: two row blocks of the product kernel
    # three layers, three steps and the verify; in the padded prefill the two Mamba blocks decline
    assert counted["mlp_block"] == 3 * 5 and counted["mixer_block"] == 1 + 3 * 4
    assert counted["mixer_block fell back"] == 2
    blocks_off(model)
    plain = run(model, prompts, steps=3, verify_tokens=5)
    for a, b in zip(fused[0], plain[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    (_, cache_a, log_a), (_, cache_b, log_b) = fused, plain
    for name in ("ssm_states", "conv_states"):
        for a, b in zip(getattr(cache_a.states, name), getattr(cache_b.states, name)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache_a.kv.k_cache, cache_b.kv.k_cache, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache_a.kv.v_cache, cache_b.kv.v_cache, rtol=1e-5, atol=1e-5)
    assert cache_a.bookkeeping() == cache_b.bookkeeping()
    assert log_a.keys() == log_b.keys() and log_a
    for layer in log_a:
        for field in ("xs", "x", "dt", "B", "C"):
            torch.testing.assert_close(getattr(log_a[layer], field), getattr(log_b[layer], field), rtol=1e-5,
                                       atol=1e-5)


def test_attention_heads_of_76_columns_match_the_module_path(blocks_off):
    """head_dim 76: a block of 64 value columns in registers, one of 8, a tail of 4."""
    wide = hs.from_hf(bamba(seed=6, dtype=torch.float32, kv_heads=1, hidden=152, heads=2)).pack_for_cpu()
    assert wide.config.attention.head_dim == 76
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [10, 11, 12]]
    fused = run(wide, prompts, steps=3, verify_tokens=5)
    blocks_off(wide)
    plain = run(wide, prompts, steps=3, verify_tokens=5)
    for a, b in zip(fused[0], plain[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_attention_over_pages_of_12_keys_matches_the_module_path(model, blocks_off):
    """Pages of 12 keys (the scores go eight keys at a time, so groups end at
    page boundaries) and contexts over four pages: decode steps, then a verify."""
    prompts = [[(3 * i + 5) % 90 + 3 for i in range(37)], [(7 * i + 1) % 90 + 3 for i in range(29)]]
    fused = run(model, prompts, steps=4, verify_tokens=5, block_size=12)
    blocks_off(model)
    plain = run(model, prompts, steps=4, verify_tokens=5, block_size=12)
    for a, b in zip(fused[0], plain[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hidden,heads,kv_heads", [(256, 4, 1), (256, 4, 2), (192, 6, 2), (160, 4, 2), (256, 8, 1)])
def test_grouped_attention_gives_the_same_bits_on_either_vector_path(both_vector_paths, blocks_off, hidden, heads,
                                                                     kv_heads):
    """On AVX-512 two query heads of a KV head share each key load and the
    values go sixteen columns per vector; every lane runs the AVX2 path's
    chain, so the logits are the same bits. Groups of 4, 2, 3 (a head left
    over), 2 and 8 (values four heads at a time); head_dim 64, 64, 32, 40 (its
    values on the AVX2 loop) and 32; pages of 12 keys (scores end in groups of
    fewer than eight keys), decode steps and a verify. The module path agrees
    within float32 rounding."""
    m = hs.from_hf(bamba(seed=7, dtype=torch.float32, kv_heads=kv_heads, hidden=hidden, heads=heads)).pack_for_cpu()
    prompts = [[(3 * i + 5) % 90 + 3 for i in range(37)], [(7 * i + 1) % 90 + 3 for i in range(29)]]
    avx2, avx512 = both_vector_paths(lambda: run(m, prompts, steps=3, verify_tokens=5, block_size=12)[0])
    for a, b in zip(avx2, avx512, strict=True):
        assert torch.equal(a, b)
    blocks_off(m)
    for a, b in zip(avx512, run(m, prompts, steps=3, verify_tokens=5, block_size=12)[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_whole_forward_gives_the_bits_of_the_blocks_layer_by_layer(model, counted):
    """Same logits, states, conv windows, K/V and logged inputs, bit for bit."""
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]  # unpadded, so the prefill runs whole too
    whole = run(model, prompts, steps=3, verify_tokens=5)
    assert counted["forward"] == 5 and not counted["forward fell back"]
    with backend_of(model, "native-blocks"):
        layers = run(model, prompts, steps=3, verify_tokens=5)
    assert counted["mixer_block"] == counted["mlp_block"] == 5 * 3  # three layers, five forwards
    for a, b in zip(whole[0], layers[0]):
        assert torch.equal(a, b)
    (_, cache_a, log_a), (_, cache_b, log_b) = whole, layers
    for a, b in zip((*cache_a.states.ssm_states, *cache_a.states.conv_states, cache_a.kv.k_cache, cache_a.kv.v_cache),
                    (*cache_b.states.ssm_states, *cache_b.states.conv_states, cache_b.kv.k_cache, cache_b.kv.v_cache)):
        assert torch.equal(a, b)
    assert cache_a.bookkeeping() == cache_b.bookkeeping()
    assert log_a.keys() == log_b.keys() and log_a
    for layer in log_a:
        for field in ("xs", "x", "dt", "B", "C"):
            assert torch.equal(getattr(log_a[layer], field), getattr(log_b[layer], field))


def test_whole_forward_of_block_rows_kept_and_a_bad_token(model, counted):
    """`cpu_blocks.BLOCK_ROWS` kept rows (every logit of a prefill that long): the
    layers and the head in C, the same bits as layer by layer (where `linear`
    takes the same kernel); a token outside the vocabulary raises before
    anything is written."""
    prompt = [(3 + i) % 90 + 3 for i in range(cpu_blocks.BLOCK_ROWS)]
    whole = new_cache(model, 2)  # room for BLOCK_ROWS positions
    logits = model.prefill(whole, [0], [prompt])  # every input's logits: BLOCK_ROWS rows kept
    assert counted["forward"] == 1
    with backend_of(model, "native-blocks"):
        layers = new_cache(model, 2)
        assert torch.equal(logits, model.prefill(layers, [0], [prompt]))
    before = whole.bookkeeping()
    states = [s.clone() for s in whole.states.ssm_states]
    with pytest.raises(IndexError, match="300"):
        model.decode(whole, [0], [300])
    assert whole.bookkeeping() == before
    assert all(torch.equal(a, b) for a, b in zip(states, whole.states.ssm_states))


def test_a_row_has_the_same_bits_alone_and_in_a_batch(model, either_path):
    """Five rows: the batch's verify has 25 rows, in the products' register tiles
    and, layer by layer, with `linear`'s LM head in the same kernel as alone."""
    prompts = [[5, 6, 7], [10, 11, 12], [20, 21, 22], [30, 31, 32], [40, 41, 42]]
    batched = run(model, prompts, steps=2, verify_tokens=5)[0]
    for b, prompt in enumerate(prompts):
        alone = run(model, [prompt], steps=2, verify_tokens=5)[0]
        for step in range(len(alone)):  # prefill, decode steps, verify
            assert torch.equal(alone[step][0], batched[step][b])


@pytest.mark.parametrize("block_size,prompt_len", [(8, 9), (12, 30)])
def test_a_verify_input_gets_the_bits_of_a_decode_step(model, either_path, block_size, prompt_len):
    """Greedy speculative decoding in float32 emits what plain decoding emits
    because each verify input's logits are the decode step's, bit for bit
    (also where the verify's keys cross pages of 12)."""
    prompt, tokens = [(5 + i) % 90 + 3 for i in range(prompt_len)], [31, 32, 33, 34, 35]
    decoded, verified = new_cache(model, 1, block_size), new_cache(model, 1, block_size)
    model.prefill(decoded, [0], [prompt], last_only=True)
    model.prefill(verified, [0], [prompt], last_only=True)
    steps = torch.stack([model.decode(decoded, [0], [t])[0] for t in tokens])  # [5, vocab]
    at_once = model.extend(verified, [0], [tokens])[0]  # [5, vocab]
    assert torch.equal(steps, at_once)
    ssm_decoded = decoded.states.ssm_states[0][decoded.head(0)]
    assert torch.equal(ssm_decoded, verified.states.ssm_states[0][verified.head(0)])


def test_the_engine_emits_the_same_tokens_with_and_without_blocks(model, blocks_off, counted):
    draft = hs.from_hf(bamba(seed=6, attn_layers=(1,), num_layers=2, dtype=torch.float32, kv_heads=2)).pack_for_cpu()
    prompts, params = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], hs.SamplingParams(max_new_tokens=12)

    def generate():
        spec = hs.Engine(model, draft=draft, num_draft_tokens=3, max_batch_size=2, max_model_len=64)
        plain = hs.Engine(model, max_batch_size=2, max_model_len=64)
        return [[o.token_ids for o in e.generate(prompts, params)] for e in (spec, plain)]
    with_blocks = generate()
    assert counted["forward"] > 0
    assert with_blocks[0] == with_blocks[1]  # speculative == plain
    blocks_off(model, draft)
    assert generate() == with_blocks


@pytest.mark.parametrize("last_only", [False, True])
def test_a_padded_batch_runs_whole_with_each_rows_bits(model, counted, last_only):
    """Rows of 3 and 1 inputs (a verify where one row has fewer drafts) in one
    whole forward, padded: each row's logits, final state and conv window,
    and the next step's logits (its K/V), bit for bit those of the row alone."""
    prompts, inputs = [[5, 6, 7, 8], [9, 10, 11]], [[20, 21, 22], [30]]

    def run(rows):
        cache = new_cache(model, len(rows))
        ids = list(range(len(rows)))
        model.prefill(cache, ids, [prompts[b] for b in rows], last_only=True)
        logits = model.extend(cache, ids, [inputs[b] for b in rows], last_only=last_only)
        states = [(cache.states.ssm_states[0][cache.head(s)].clone(), cache.states.conv_states[0][cache.head(s)].clone())
                  for s in ids]
        after = model.decode(cache, ids, [40] * len(rows))
        return logits, states, after
    counted.clear()
    together = run([0, 1])
    assert counted["forward"] == 3 and not counted["forward fell back"]  # the padded extend among them
    for b in (0, 1):
        alone = run([b])
        n = 1 if last_only else len(inputs[b])
        assert torch.equal(together[0][b, :n], alone[0][0, :n])
        assert all(torch.equal(x, y) for x, y in zip(together[1][b], alone[1][0]))
        assert torch.equal(together[2][b], alone[2][0])


def test_when_the_blocks_fall_back(model, counted):
    cache = new_cache(model)
    model.prefill(cache, [0, 1], [[5, 6, 7], [8, 9]], last_only=True)
    counted.clear()
    model.extend(cache, [0, 1], [[3, 4], [5]], last_only=True)  # a padded batch: the whole forward takes it
    assert counted["forward"] == 1 and not counted["forward fell back"]
    counted.clear()
    with backend_of(model, "native-blocks"):  # layer by layer, the Mamba block needs all inputs of every row
        model.extend(cache, [0, 1], [[3, 4], [5]], last_only=True)
    assert counted["mixer_block fell back"] == 2 and counted["mixer_block"] == 1  # Mamba fell back, attention ran
    counted.clear()
    with backend_of(model, "torch"):
        model.decode(cache, [0, 1], [3, 4])
    assert counted["mixer_block"] == counted["mlp_block"] == 0
    counted.clear()
    model.extend(cache, [0], [[3] * (cpu_blocks.BLOCK_ROWS + 1)], last_only=True)  # too many rows: the modules run
    assert counted["mixer_block"] == counted["mlp_block"] == counted["forward"] == 0
    m64 = hs.from_hf(bamba(seed=5, dtype=torch.float64))
    cache64 = HybridCache(m64.config, max_seqs=1, num_blocks=4, block_size=8, ring_slots=4, dtype=m64.dtype)
    counted.clear()
    m64.prefill(cache64, [0], [[5, 6]], last_only=True)
    assert counted["mixer_block"] == counted["mlp_block"] == counted["forward"] == 0


def test_packing_after_a_forward_lets_the_blocks_run(counted):
    m = hs.from_hf(bamba(seed=5, attn_layers=(1,), num_layers=2, dtype=torch.float32, kv_heads=2))
    cache = new_cache(m, 1)
    m.prefill(cache, [0], [[5, 6]], last_only=True)
    assert counted["mlp_block"] == 0 and counted["forward fell back"] == 1  # HF's [out, in] weights: the modules run
    m.pack_for_cpu()
    counted.clear()
    m.decode(cache, [0], [7])
    assert counted["forward"] == 1
    with backend_of(m, "native-blocks"):
        m.decode(cache, [0], [7])
    assert counted["mlp_block"] == counted["mixer_block"] == 2


def test_decode_greedy_gives_the_bits_of_decode_steps(model):
    """`GreedyChain.decode`: the argmax chain of step-by-step decoding,
    the same logits, states, conv windows, K/V and bookkeeping, bit for bit."""
    prompts, steps = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], 4
    stepped, chained = new_cache(model, 2), new_cache(model, 2)
    for cache in (stepped, chained):
        model.prefill(cache, [0, 1], [p[:4] for p in prompts], last_only=True)
    tokens, logits, heads = [[3, 4]], [], []
    for _ in range(steps):
        logits.append(model.decode(stepped, [0, 1], tokens[-1]))
        heads.append([stepped.head(0), stepped.head(1)])
        tokens.append(logits[-1].argmax(dim=-1).tolist())
    drafts, chain_logits, chain_heads = model.greedy_chain.decode(chained, [0, 1], [3, 4], steps)
    assert drafts == [list(t) for t in zip(*tokens[1:])]
    assert torch.equal(chain_logits, torch.stack(logits, 1))
    assert chain_heads == [list(h) for h in zip(*heads)]
    for a, b in zip((*stepped.states.ssm_states, *stepped.states.conv_states, stepped.kv.k_cache, stepped.kv.v_cache),
                    (*chained.states.ssm_states, *chained.states.conv_states, chained.kv.k_cache, chained.kv.v_cache)):
        assert torch.equal(a, b)
    assert stepped.bookkeeping() == chained.bookkeeping()
    with backend_of(model, "native-blocks"):
        before = chained.bookkeeping()
        assert model.greedy_chain is None  # no chain without the whole forward: nothing changes
        assert chained.bookkeeping() == before
    with pytest.raises(IndexError, match="300"):
        model.greedy_chain.decode(chained, [0, 1], [3, 300], steps)
    assert chained.bookkeeping() == before


@pytest.mark.parametrize("catch_up", [1, 2])
def test_extend_greedy_gives_the_bits_of_a_catch_up_and_decode_greedy(model, catch_up):
    """`GreedyChain.extend`: `extend(last_only=True)` then `decode_greedy`
    from its argmax, in one call: the same tokens, logits, ring heads, states,
    conv windows, K/V and bookkeeping, bit for bit."""
    prompts, steps = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], 3
    inputs = [[20, 21][:catch_up], [30, 31][:catch_up]]
    apart, merged = new_cache(model, 2), new_cache(model, 2)
    for cache in (apart, merged):
        model.prefill(cache, [0, 1], prompts, last_only=True)
    first_logits = model.extend(apart, [0, 1], inputs, last_only=True)[:, 0]
    first_heads = [apart.head(0), apart.head(1)]
    first = first_logits.argmax(dim=-1).tolist()
    drafts, step_logits, heads = model.greedy_chain.decode(apart, [0, 1], first, steps)
    got_first, got_drafts, got_logits, got_heads = model.greedy_chain.extend(merged, [0, 1], inputs, steps)
    assert (got_first, got_drafts) == (first, drafts)
    assert torch.equal(got_logits, torch.cat([first_logits[:, None], step_logits], 1))
    assert got_heads == [[h] + rest for h, rest in zip(first_heads, heads)]
    for a, b in zip((*apart.states.ssm_states, *apart.states.conv_states, apart.kv.k_cache, apart.kv.v_cache),
                    (*merged.states.ssm_states, *merged.states.conv_states, merged.kv.k_cache, merged.kv.v_cache)):
        assert torch.equal(a, b)
    assert apart.bookkeeping() == merged.bookkeeping()


def test_extend_greedy_declines_or_fails_changing_nothing(model):
    cache = new_cache(model, 2)
    model.prefill(cache, [0, 1], [[5, 6, 7, 8], [9, 10, 11]], last_only=True)
    before = cache.bookkeeping()
    states = [t.clone() for t in cache.states.ssm_states]
    assert model.greedy_chain.extend(cache, [0, 1], [[20], [30, 31]], 3) is None  # catch-ups of two lengths
    assert model.greedy_chain.extend(cache, [0, 1], [[20], [30]], 8) is None  # a chain longer than the ring
    with backend_of(model, "native-blocks"):
        assert model.greedy_chain is None
    with pytest.raises(IndexError, match="300"):
        model.greedy_chain.extend(cache, [0, 1], [[20], [300]], 3)
    assert cache.bookkeeping() == before
    assert all(torch.equal(a, b) for a, b in zip(states, cache.states.ssm_states))


def test_catch_ups_of_two_lengths_still_draft_in_one_call(model, monkeypatch):
    """A round after one row accepted every draft (its catch-up two tokens) and
    another did not (one): the row two behind absorbs its first token in a
    forward of its own, so the catch-up and drafts of every round after the
    prompts run in one `extend_greedy` call, and the tokens are plain decoding's."""
    import copy
    from hybridspec.spec import drafters
    draft = copy.deepcopy(model)  # the target with a nudged final norm: most drafts accepted, not all
    with torch.no_grad():
        draft.final_norm.weight.mul_(1 + 0.3 * torch.randn(draft.final_norm.weight.shape,
                                                          generator=torch.Generator().manual_seed(1)))
    prompts, params = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20, 21, 22]], hs.SamplingParams(max_new_tokens=40)
    gaps, calls = [], collections.Counter()
    real_absorb, real_extend = drafters.ModelDrafter._absorb_backlog, GreedyChain.extend

    def absorb(self, ids, committed):
        gaps.append({len(c) - self.cache.computed_len[s] for s, c in zip(ids, committed)})
        return real_absorb(self, ids, committed)

    def extend_greedy(self, *args, **kwargs):
        out = real_extend(self, *args, **kwargs)
        calls["ran" if out is not None else "declined"] += 1
        return out
    monkeypatch.setattr(drafters.ModelDrafter, "_absorb_backlog", absorb)
    monkeypatch.setattr(GreedyChain, "extend", extend_greedy)
    engine = hs.Engine(model, draft=draft, num_draft_tokens=4, max_batch_size=3, max_model_len=64)
    spec = [o.token_ids for o in engine.generate(prompts, params)]
    assert {1, 2} in gaps  # the case this is about occurred
    assert calls["ran"] > 0 and calls["declined"] == 0
    plain = hs.Engine(model, max_batch_size=3, max_model_len=64)
    assert spec == [o.token_ids for o in plain.generate(prompts, params)]


def test_a_greedy_model_drafter_drafts_in_one_call(model, monkeypatch):
    """The greedy drafter's catch-up and steps in one `extend_greedy` call (or
    its steps in one `decode_greedy` call after a catch-up of its own) give the
    tokens of its step-by-step loop."""
    draft = hs.from_hf(bamba(seed=6, attn_layers=(1,), num_layers=2, dtype=torch.float32, kv_heads=2)).pack_for_cpu()
    prompts, params = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], hs.SamplingParams(max_new_tokens=12)
    calls = collections.Counter()
    real_extend, real_decode = GreedyChain.extend, GreedyChain.decode

    def counted(name, real):
        def wrapper(self, *args, **kwargs):
            out = real(self, *args, **kwargs)
            calls[name if out is not None else name + " declined"] += 1
            return out
        return wrapper

    def generate():
        engine = hs.Engine(model, draft=draft, num_draft_tokens=4, max_batch_size=2, max_model_len=64)
        return [o.token_ids for o in engine.generate(prompts, params)], engine.stats.drafted_tokens
    monkeypatch.setattr(GreedyChain, "extend", counted("extend_greedy", real_extend))
    monkeypatch.setattr(GreedyChain, "decode", counted("decode_greedy", real_decode))
    fast = generate()
    assert calls["extend_greedy"] > 0 and calls["decode_greedy declined"] == 0
    monkeypatch.setattr(GreedyChain, "extend", lambda self, *a, **k: None)  # catch-up, then decode_greedy
    assert generate() == fast
    monkeypatch.setattr(GreedyChain, "decode", lambda self, *a, **k: None)  # the step-by-step loop
    assert generate() == fast
