"""The opt-in bfloat16 compute path (`compute="bfloat16"`, `kernels/cpu/rows_bf16.c`):
the products round their activations to bfloat16 and use the CPU's BF16 dot product
(AVX512-BF16) with float32 sums. NOT bit-equal to the exact float32 path (the default);
within the path a row's bits do not depend on the other rows of its call (a decode of
one row, a verify of five, a batch) nor on the thread count, so speculative output
equals plain output and batching does not change a row. Tiny models whose float32
weights are bfloat16 values (bf16 weights loaded as float32)."""
from __future__ import annotations

import pytest
import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.errors import ConfigError
from hybridspec.kernels import backend
from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.kernels.cpu import rows as cpu_rows
from native_cpu import one_thread, with_threads  # noqa: F401 (one_thread: an autouse fixture)
from oracles import granite
from test_exact_16bit import forwards, half_valued, stored


def rounded(model) -> set[torch.dtype]:
    """The storage dtypes of the products bfloat16 compute rounds: all but the MoE routers, which stay
    exact (float32) so that routing is the exact model's."""
    dtypes = stored(model)
    assert {dtypes[name] for name in dtypes if name.endswith(".router")} <= {torch.float32}
    return {dtype for name, dtype in dtypes.items() if not name.endswith(".router")}

has_bf16 = pytest.mark.skipif(not (cpu_native.cpu_supported() and cpu_native.bf16_compute_supported()),
                              reason="the bfloat16 products need the native kernels and a CPU with AVX512-BF16")

# the fast path's logits against the exact path's, relative to the largest exact logit: measured
# 3e-3 to 5e-3 on these tiny models (bfloat16 activations carry 8 bits); twice that allowed
CLOSE_TO_EXACT = 1e-2


def product(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    return cpu_rows.rows_matmul(x, w_t, torch.bfloat16)


# K odd (a padded last pair), N past a multiple of 64 (masked panels), rows through the steps
# (up to 24), the tiles and more than one chunk of 96 rows
SHAPES = [(1, 64), (7, 70), (64, 130), (257, 1000), (1024, 2048), (33, 4101)]
ROWS = (1, 2, 4, 5, 9, 24, 25, 40, 97, 200)


@has_bf16
@pytest.mark.parametrize("K,N", SHAPES)
def test_the_product_is_the_rounded_activations_times_the_weights(K, N):
    """Against torch: x rounded to bfloat16, times the weights, in float64 (the kernel's
    float32 sums run in another order: within a few float32 ulps of the sum of |terms|)."""
    g = torch.Generator().manual_seed(K + N)
    x, w_t = torch.randn(max(ROWS), K, generator=g), torch.randn(K, N, generator=g).bfloat16()
    got = product(x, w_t)
    xb, wf = x.bfloat16().double(), w_t.double()
    want, scale = xb @ wf, xb.abs() @ wf.abs()
    assert (got.double() - want).abs().le(1e-6 * scale + 1e-30).all()
    assert torch.allclose(got, x.bfloat16().float() @ w_t.float(), rtol=1e-4, atol=1e-4 * scale.max().item())


@has_bf16
@pytest.mark.parametrize("K,N", SHAPES)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_nor_the_threads(K, N):
    g = torch.Generator().manual_seed(K * N)
    x, w_t = torch.randn(max(ROWS), K, generator=g), torch.randn(K, N, generator=g).bfloat16()
    alone = torch.cat([product(x[m:m + 1], w_t) for m in range(max(ROWS))])
    for M in ROWS:
        assert torch.equal(product(x[:M], w_t), alone[:M]), M
        assert torch.equal(with_threads(2, lambda: cpu_native.available() and product(x[:M], w_t)), alone[:M]), M


@has_bf16
def test_an_odd_row_stride_and_a_one_row_view_are_taken():
    g = torch.Generator().manual_seed(5)
    wide, w_t = torch.randn(6, 300, generator=g), torch.randn(257, 129, generator=g).bfloat16()
    x = wide[:, 1:258]  # rows 300 floats apart
    assert cpu_rows.applies_bf16(x, w_t)
    assert torch.equal(product(x, w_t), product(x.contiguous(), w_t))


@has_bf16
def test_the_op_multiplies_the_same_rounded_values_where_the_kernel_declines():
    """Under autograd torch runs the product: the same rounded activations, its own sums."""
    from hybridspec.kernels import ops
    g = torch.Generator().manual_seed(9)
    x, weight = torch.randn(3, 130, generator=g), torch.randn(70, 130, generator=g).bfloat16()
    weight = weight.t().contiguous().t()  # input-major, as pack_for_cpu stores it
    kernel = ops.NATIVE_BF16_LINEAR(x, weight)
    torched = ops.NATIVE_BF16_LINEAR(x.clone().requires_grad_(), weight)
    assert torched.requires_grad
    assert torch.allclose(torched.detach(), kernel, rtol=1e-5, atol=1e-5)
    assert torch.allclose(kernel, x.bfloat16().float() @ weight.float().t(), rtol=1e-5, atol=1e-5)


# -- the models -----------------------------------------------------------------------------------

def pair(seed: int = 2, **shape):
    """The exact model and the fast one (set_compute) of one bf16-valued float32 Granite-4.0-H-shaped model."""
    hf = half_valued(granite(seed=seed, **shape))
    return hs.from_hf(hf).pack_for_cpu(), hs.from_hf(hf).pack_for_cpu().set_compute("bfloat16")


@has_bf16
def test_the_fast_model_multiplies_in_bfloat16_and_is_close_to_the_exact_one():
    exact, fast = pair()
    assert fast.compute is torch.bfloat16 and fast.backend.compute is torch.bfloat16
    assert exact.compute is torch.float32 and exact.backend.compute is torch.float32
    assert rounded(fast) == {torch.bfloat16} and fast.dtype is torch.float32
    for want, got in zip(forwards(exact), forwards(fast), strict=True):
        assert not torch.equal(got, want)  # not the float32 bits: labelled, never claimed
        assert (got - want).abs().max() <= CLOSE_TO_EXACT * want.abs().max()


@has_bf16
def test_the_whole_forward_the_blocks_and_the_modules_give_the_same_bits():
    """The fast path's kernels are the same products wherever they are called."""
    from native_switch import backend_of
    _, fast = pair()
    outputs = {}
    for name in ("native", "native-blocks", "native-ops"):
        with backend_of(fast, name):
            assert fast.backend.compute is torch.bfloat16
            outputs[name] = forwards(fast)
    for name in ("native-blocks", "native-ops"):
        for want, got in zip(outputs["native"], outputs[name], strict=True):
            assert torch.equal(got, want), name


def rows_alone_and_together(model, prompts, steps: list[list[int]]):
    """Each row's prefill and decode logits, run alone and in one batch."""
    def run(rows):
        cache = HybridCache(model.config, max_seqs=len(rows), num_blocks=64, block_size=8, ring_slots=8,
                            dtype=model.dtype)
        ids = list(range(len(rows)))
        out = [model.prefill(cache, ids, [prompts[r] for r in rows], last_only=True)[:, 0]]
        out += [model.decode(cache, ids, [step[r] for r in rows]) for step in steps]
        return torch.stack(out, 1)  # [rows, steps + 1, vocab]
    return torch.cat([run([r]) for r in range(len(prompts))]), run(list(range(len(prompts))))


@has_bf16
def test_one_row_and_a_batch_give_the_same_bits():
    _, fast = pair()
    prompts = [[5, 9, 14, 3, 22], [7, 8, 30], [1, 2, 3, 4, 5, 6, 7, 8, 9], [40]]
    alone, together = rows_alone_and_together(fast, prompts, [[11, 12, 13, 14], [21, 22, 23, 24]])
    assert torch.equal(alone, together)


@has_bf16
def test_a_verify_forward_gives_the_decode_steps_bits():
    """Five inputs in one forward (a verify) against five one-input forwards (decode steps)."""
    _, fast = pair()
    tokens = [[20, 21, 22, 23, 24], [30, 31, 32, 33, 34]]

    def cache_after_prompts():
        cache = HybridCache(fast.config, max_seqs=2, num_blocks=64, block_size=8, ring_slots=8, dtype=fast.dtype)
        fast.prefill(cache, [0, 1], [[5, 9, 14], [7, 8, 30, 2]], last_only=True)
        return cache
    verify = fast.extend(cache_after_prompts(), [0, 1], tokens)
    cache = cache_after_prompts()
    steps = torch.stack([fast.decode(cache, [0, 1], [t[i] for t in tokens]) for i in range(5)], 1)
    assert torch.equal(verify, steps)


@has_bf16
def test_two_threads_give_one_threads_bits():
    _, fast = pair()
    one = forwards(fast)
    two = with_threads(2, lambda: forwards(fast))
    for want, got in zip(one, two, strict=True):
        assert torch.equal(got, want)


@has_bf16
@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_speculative_output_is_plain_output(mode):
    """Within the fast path: a bf16-compute model drafter (γ = 3) and prompt lookup against plain decoding."""
    _, target = pair(seed=6)
    draft = hs.from_hf(half_valued(granite(seed=7, layer_types=("mamba",)))).pack_for_cpu().set_compute("bfloat16")
    params = (hs.SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True) if mode == "greedy"
              else hs.SamplingParams(max_new_tokens=12, temperature=0.9, seed=11, ignore_eos=True))
    prompts = [[5, 9, 14, 3, 22, 5, 9, 14], [7, 8, 30], [3, 3, 3, 3]]
    verify = "coupled" if mode == "coupled" else "rejection"
    plain = [o.token_ids for o in hs.Engine(target, max_batch_size=3).generate(prompts, params)]
    for drafter in (draft, "ngram"):
        engine = hs.Engine(target, draft=drafter, num_draft_tokens=3, max_batch_size=3, verify=verify)
        assert [o.token_ids for o in engine.generate(prompts, params)] == plain
    assert [o.token_ids for o in hs.Engine(target, max_batch_size=1).generate(prompts, params)] == plain


# -- asking for it ----------------------------------------------------------------------------------

@has_bf16
def test_load_and_llm_take_compute(tmp_path):
    granite(seed=8, layer_types=("mamba", "attention"), vocab=256).to(torch.bfloat16).save_pretrained(tmp_path)
    model = hs.load(tmp_path, compute="bfloat16")
    assert model.dtype is torch.float32 and model.backend.compute is torch.bfloat16
    assert rounded(model) == {torch.bfloat16}
    assert hs.load(tmp_path).backend.compute is torch.float32  # the exact path stays the default
    llm = hs.LLM(model, draft=None, compute="bfloat16")
    assert llm.target.backend.compute is torch.bfloat16
    exact = hs.load(tmp_path, dtype=torch.float32)
    assert hs.LLM(exact, draft=None).target.backend.compute is torch.float32
    assert model.set_compute("float32").backend.compute is torch.float32  # and back


@has_bf16
def test_the_generate_cli_takes_compute(tmp_path, capsys):
    import json
    from hybridspec.cli.main import main
    granite(seed=8, layer_types=("mamba", "attention"), vocab=256).to(torch.bfloat16).save_pretrained(tmp_path)
    argv = ["generate", "abcabc", "--model", str(tmp_path), "--draft", "ngram", "-n", "5", "--json"]
    assert main([*argv, "--compute", "bfloat16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["token_ids"]) == 5


@pytest.mark.parametrize("value", ["bf16", "float16", torch.float64, 16])
def test_an_unknown_compute_is_a_config_error_naming_it(value):
    with pytest.raises(ConfigError, match="compute=.*must be one of"):
        backend.check_compute(value)


def test_without_avx512_bf16_it_is_a_config_error_before_anything_changes(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_native, "bf16_compute_supported", lambda: False)
    model = hs.from_hf(half_valued(granite(seed=3))).pack_for_cpu()
    before = {name: (p.dtype, p.data_ptr()) for name, p in model.named_parameters()}
    with pytest.raises(ConfigError, match="AVX512-BF16.*leave compute unset"):
        model.set_compute("bfloat16")
    assert model.compute is torch.float32 and model.backend.compute is torch.float32
    assert {name: (p.dtype, p.data_ptr()) for name, p in model.named_parameters()} == before
    with pytest.raises(ConfigError, match="AVX512-BF16"):  # before the (missing) model directory is read
        hs.load(tmp_path / "absent", compute="bfloat16")


def test_a_gpu_or_a_float64_model_is_a_config_error():
    with pytest.raises(ConfigError, match="runs on CPU for a float32 model"):
        backend.check_compute("bfloat16", "cuda")
    with pytest.raises(ConfigError, match="runs on CPU for a float32 model"):
        backend.check_compute("bfloat16", "cpu", torch.float64)
    assert backend.check_compute(None) is torch.float32 and backend.check_compute("float32", "cuda") is torch.float32


@has_bf16
def test_the_llamacpp_bench_times_the_fast_path(tmp_path, monkeypatch):
    """benches/llamacpp.py --weights bf16-compute: the bf16 copy under compute="bfloat16" (tiny model;
    the llama.cpp side skipped without a converter), its logits near HF's but not at float32's 1e-6."""
    import json
    from test_benches_quick import BENCHES, bench_main
    monkeypatch.syspath_prepend(str(BENCHES))
    out = tmp_path / "llamacpp.json"
    assert bench_main("llamacpp")(["--quick", "--weights", "bf16-compute", "--thread-counts", "1", "--out",
                                   str(out)]) == 0
    payload = json.loads(out.read_text())
    assert [c["weights"] for c in payload["checks"]] == ["bf16-compute"]
    assert 1e-6 < payload["checks"][0]["ours_vs_hf"] < 0.5
    assert {(r["weights"], r["threads"]) for r in payload["rows"]} == {("bf16-compute", 1)}
