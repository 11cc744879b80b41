"""The few-row CPU matmul kernel (`kernels/cpu/rows.c`): values against a
float64 product, a row's bits independent of the other rows of the call, when
`linear` takes it; and the loader of the native kernels (`cpu_native`): the
environment switch, the torch paths when they cannot be built or run, a
read-only cache."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import hybridspec as hs
from hybridspec.errors import ConfigError
from hybridspec.kernels import backend as backends
from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.kernels.cpu import rows as cpu_rows
from hybridspec.models import common
from native_cpu import both_vector_paths, one_thread, x86_with_compiler  # noqa: F401 (fixtures; one_thread autouse)
from oracles import bamba

SHAPES = [(1, 1), (3, 7), (5, 13), (64, 8), (129, 257), (256, 1160), (7, 4101), (2, 9000)]


@x86_with_compiler
def test_kernel_is_built_and_runs_here():
    assert cpu_native.available()
    assert cpu_native.build().is_file()


@x86_with_compiler
@pytest.mark.parametrize("K,N", SHAPES)
def test_values_match_a_float64_product(K, N):
    g = torch.Generator().manual_seed(K * 1000 + N)
    w = torch.randn(K, N, generator=g)
    for M in range(1, cpu_rows.MAX_ROWS + 1):
        x = torch.randn(M, K, generator=g)
        got = cpu_rows.rows_matmul(x, w).double()
        want = x.double() @ w.double()
        bound = 1e-6 * (x.double().abs() @ w.double().abs()) + 1e-30  # float32 rounding over K terms
        assert ((got - want).abs() <= bound * max(K, 1)).all(), (M, K, N)


@x86_with_compiler
@pytest.mark.parametrize("K,N", SHAPES[2:])
def test_a_rows_bits_do_not_depend_on_the_other_rows(K, N):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(K, N, generator=g)
    x = torch.randn(cpu_rows.MAX_ROWS, K, generator=g)
    alone = [cpu_rows.rows_matmul(x[m:m + 1], w)[0] for m in range(len(x))]
    for M in range(2, len(x) + 1):
        for start in (0, len(x) - M):
            out = cpu_rows.rows_matmul(x[start:start + M], w)
            for m in range(M):
                assert torch.equal(out[m], alone[start + m]), (M, start, m)


@x86_with_compiler
@pytest.mark.parametrize("K,N", SHAPES + [(24, 24), (33, 40)])
def test_the_avx512_and_avx2_paths_give_the_same_bits(both_vector_paths, K, N):
    """16-column vectors, the 8 columns they leave and the last few: the same chains."""
    g = torch.Generator().manual_seed(K + N)
    w = torch.randn(K, N, generator=g)
    x = torch.randn(48, K, generator=g)
    for M in (1, 2, 3, 4, 5, 7, 16, 21, 48):
        avx2, avx512 = both_vector_paths(lambda: cpu_rows.rows_matmul(x[:M], w))
        assert torch.equal(avx2, avx512), (M, K, N)


@x86_with_compiler
def test_a_model_gives_the_same_logits_on_either_vector_path(both_vector_paths):
    """Prefill, decode steps and a verify of a float32 model: the same bits."""
    from hybridspec.cache.hybrid_cache import HybridCache
    model = hs.from_hf(bamba(seed=3, dtype=torch.float32)).pack_for_cpu()

    def forwards():
        cache = HybridCache(model.config, max_seqs=2, num_blocks=16, block_size=8, ring_slots=8, dtype=model.dtype)
        out = [model.prefill(cache, [0, 1], [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]], last_only=True)]
        out += [model.decode(cache, [0, 1], [20 + t, 30 + t]) for t in range(3)]
        out.append(model.extend(cache, [0, 1], [[40, 41, 42, 43, 44], [50, 51, 52, 53, 54]]))
        return out
    avx2, avx512 = both_vector_paths(forwards)
    for a, b in zip(avx2, avx512, strict=True):
        assert torch.equal(a, b)


def test_a_vector_path_it_does_not_know_is_refused():
    with pytest.raises(ValueError, match="avx9"):
        cpu_rows.vector_path("avx9")


@x86_with_compiler
@pytest.mark.parametrize("K,N", [(5, 13), (129, 257), (300, 1160), (7, 4101), (600, 1000), (70, 1024), (130, 2048),
                                 (520, 1024)])
def test_the_register_tiles_give_a_rows_bits_alone(K, N):
    """From `TILE_MIN_ROWS` (5; 10 for weights that fit in L2) rows (up to
    `cpu_blocks.BLOCK_ROWS`) the tiles run: blocks of weight rows, panels of
    columns, groups of rows, each sum the same chain as one row's. In L2:
    blocks of 64, the next one prefetched (K = 300: a short last block). Past
    L2 (600 × 1000, 520 × 1024): blocks of 16 below 24 rows, each row's next
    panel prefetched below 40 rows, short last blocks either way. The tiles
    read the weight in place, or from a copy of each panel where N is a
    multiple of 1024 (the last three shapes)."""
    g = torch.Generator().manual_seed(K * 7 + N)
    w = torch.randn(K, N, generator=g)
    x = torch.randn(48, K, generator=g)
    alone = torch.stack([cpu_rows.rows_matmul(x[m:m + 1], w)[0] for m in range(len(x))])
    for M in (4, 5, 6, 9, 10, 11, 16, 23, 24, 31, 33, 39, 40, 48):
        assert torch.equal(cpu_rows.rows_matmul(x[:M], w), alone[:M]), M
        assert torch.equal(cpu_rows.rows_matmul(x[48 - M:], w), alone[48 - M:]), M


@x86_with_compiler
def test_strided_rows_and_one_row_views():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 300, generator=g)
    w = torch.randn(256, 40, generator=g)
    x = base[:, 10:266]  # row stride 300
    assert cpu_rows.applies(x, w)
    assert torch.allclose(cpu_rows.rows_matmul(x, w), x @ w, rtol=1e-5, atol=1e-5)
    col = torch.randn(256, 1, generator=g).t()  # one row, row stride 1
    assert cpu_rows.applies(col, w)
    assert torch.allclose(cpu_rows.rows_matmul(col, w), col @ w, rtol=1e-5, atol=1e-5)


@x86_with_compiler
def test_linear_takes_the_kernel_only_where_it_applies(monkeypatch):
    calls = []
    real = cpu_rows.rows_matmul
    monkeypatch.setattr(cpu_rows, "rows_matmul", lambda x, w: calls.append(x.shape) or real(x, w))
    linear = backends.select("cpu", torch.float32, "auto").linear  # the native backend's
    g = torch.Generator().manual_seed(2)
    packed = torch.randn(24, 16, generator=g).t().contiguous().t()  # [out, in], input-major
    plain = torch.randn(24, 16, generator=g)                       # [out, in] as HF keeps it
    x = torch.randn(2, 3, 16, generator=g)
    assert torch.allclose(linear(x, packed), x @ packed.t(), rtol=1e-5, atol=1e-5)
    assert calls == [(6, 16)]
    linear(x, plain)                                          # weight not input-major
    linear(torch.randn(cpu_rows.MAX_ROWS + 1, 16), packed)   # more than MAX_ROWS rows
    linear(x.double(), packed.double())                      # float64
    backends.select("cpu", torch.float32, "torch").linear(x, packed)  # the torch backend's
    assert calls == [(6, 16)]
    torch.set_num_threads(2)  # more threads: the kernel still (its columns split over them)
    linear(x, packed)
    torch.set_num_threads(1)
    assert calls == [(6, 16), (6, 16)]


def test_the_environment_switch(monkeypatch):
    def native() -> bool:
        return backends.select("cpu", torch.float32).whole_forward
    monkeypatch.setenv(backends.BACKEND_ENV, "torch")
    assert not native()
    monkeypatch.setenv(backends.BACKEND_ENV, "fast")
    with pytest.raises(ConfigError, match="HYBRIDSPEC_BACKEND='fast' must be one of"):
        native()
    with backends.using("auto"):  # the override wins over the environment
        assert native()
    with pytest.raises(ConfigError, match="use_backend='fast'"):
        backends.use_backend("fast")
    monkeypatch.setenv(backends.BACKEND_ENV, "auto")
    assert native()


def test_no_compiler_falls_back_to_the_torch_paths_with_one_warning(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_native.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(cpu_native.CpuKernelsUnavailable):
        cpu_native.build()
    monkeypatch.setattr(cpu_native, "_library", None)
    with pytest.warns(RuntimeWarning, match="the torch paths run instead"):
        assert not cpu_native.available()
    assert not cpu_native.available()  # decided once: no second warning, no second build
    x, w = torch.randn(3, 8), torch.randn(8, 5)
    linear = backends.select("cpu", torch.float32).linear  # the torch backend's: the kernels cannot run
    assert torch.equal(linear(x, w.t()), torch.mm(x, w))  # an input-major weight, torch.mm all the same


@x86_with_compiler
def test_float32_model_greedy_tokens_with_and_without_the_kernel(monkeypatch):
    """A packed float32 model through the kernel gives the tokens torch.mm gives,
    plain and speculative, alone and in a batch."""
    model = hs.from_hf(bamba(seed=5, dtype=torch.float32)).pack_for_cpu()
    draft = hs.from_hf(bamba(seed=6, num_layers=1, attn_layers=(), dtype=torch.float32)).pack_for_cpu()
    prompts = [[5, 17, 3, 42, 8, 11, 2], [9, 4, 4, 60], [33, 1, 70, 12, 12, 5]]
    params = hs.SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)

    def tokens(**kwargs):
        engine = hs.Engine(model, max_batch_size=3, max_model_len=32, **kwargs)
        batched = [o.token_ids for o in engine.generate(prompts, params)]
        alone = [engine.generate([p], params)[0].token_ids for p in prompts]
        assert batched == alone
        return batched

    calls = []
    real = cpu_rows.rows_matmul
    monkeypatch.setattr(cpu_rows, "rows_matmul", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    for m in (model, draft):  # every product through `linear` (no whole blocks or forwards)
        m.bind_backend("native-ops")
    with_kernel = tokens(), tokens(draft=draft, num_draft_tokens=3)
    assert 1 in calls and 4 in calls  # decode rows and a verify of γ + 1 = 4 inputs took the kernel
    for m in (model, draft):
        m.bind_backend("torch")
    assert with_kernel == (tokens(), tokens(draft=draft, num_draft_tokens=3))
    assert with_kernel[0] == with_kernel[1]


@x86_with_compiler
def test_a_read_only_cache_builds_in_the_temporary_directory(monkeypatch, tmp_path, capsys):
    built_here = cpu_native.build()  # the library this process runs: its "build" below is a copy of it
    capsys.readouterr()
    monkeypatch.setattr(cpu_native, "compile_library", lambda compiler, sources, target: shutil.copy(built_here, target))
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv(cpu_native.CACHE_ENV, str(blocked))  # cache_dir() lies under a file: mkdir fails
    monkeypatch.setattr(cpu_native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    built = cpu_native.build()
    assert built.is_file() and built.parent == tmp_path / "tmp" / f"hybridspec-kernels-{os.getuid()}"
    # a build says so on stderr, naming where it is cached; a cache hit says nothing
    announced = f"hybridspec: building the native CPU kernels (once, cached in {built.parent})...\n"
    assert capsys.readouterr().err == announced
    assert cpu_native.build() == built  # found again, not rebuilt
    assert capsys.readouterr().err == ""


def test_an_unsupported_cpu_takes_the_torch_paths_quietly(monkeypatch, recwarn):
    monkeypatch.setattr(cpu_native, "_library", None)
    monkeypatch.setattr(cpu_native.platform, "machine", lambda: "aarch64")
    assert not cpu_native.available()
    assert not [w for w in recwarn if "native CPU kernels" in str(w.message)]
    with pytest.raises(cpu_native.CpuKernelsUnavailable, match="aarch64"):
        cpu_native.build()


@x86_with_compiler
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K,N", [(3, 7), (5, 13), (64, 8), (129, 257), (300, 1160), (600, 1000), (130, 2048),
                                 (520, 2048), (1100, 1000), (7, 4101)])
def test_a_16bit_weight_gives_the_bits_of_its_float32_copy(both_vector_paths, K, N, half):
    """A weight whose values are bfloat16 (float16) values, stored so: every
    path (the steps below 5 rows, the tiles in L2 and streamed from memory,
    each row group widening what it loads or, from three groups, one widened
    float32 copy of each panel's block; the panel copy where rows lie a
    multiple of 4 KiB apart — N = 2048 in bfloat16 — the 8-column AVX2
    vector and the columns past it) widens each
    weight as it loads it and gives the float32 copy's bits, on either vector
    path and split over two threads. (N = 2048 lies 4 KiB apart in either
    16-bit type.)"""
    g = torch.Generator().manual_seed(K * 3 + N)
    w32 = torch.randn(K, N, generator=g).to(half).float()
    w16 = w32.to(half)
    x = torch.randn(48, K, generator=g)
    rows = (1, 2, 4, 5, 9, 10, 23, 24, 39, 40, 48)
    for path_outputs in both_vector_paths(lambda: [(cpu_rows.rows_matmul(x[:M], w32), cpu_rows.rows_matmul(x[:M], w16))
                                                   for M in rows]):
        for M, (want, got) in zip(rows, path_outputs):
            assert torch.equal(got, want), (M, K, N)
    torch.set_num_threads(2)
    assert torch.equal(cpu_rows.rows_matmul(x[:40], w16), cpu_rows.rows_matmul(x[:40], w32))


@x86_with_compiler
def test_linear_takes_a_bfloat16_weight_and_torch_widens_it():
    """`linear` with a bfloat16 weight (pack_for_cpu's exact copies): the kernel
    up to MAX_ROWS rows, torch's product of a widened copy past them; both
    the float32 weight's results."""
    g = torch.Generator().manual_seed(4)
    w32 = torch.randn(24, 16, generator=g).to(torch.bfloat16).float().t().contiguous().t()
    w16 = w32.to(torch.bfloat16).t().contiguous().t()
    assert cpu_rows.applies(torch.randn(3, 16), common.transposed(w16))
    for rows in (3, cpu_rows.MAX_ROWS + 5):
        x = torch.randn(rows, 16, generator=g)
        linear = backends.select("cpu", torch.float32, "auto").linear
        assert torch.equal(linear(x, w16), linear(x, w32)), rows
