"""CUDA graphs of the few-input forwards (`hybridspec.models.graphs`).

Without a GPU the graphs' static path still runs: the Triton kernels
interpreted on CPU tensors (`HYBRIDSPEC_BACKEND=triton`, native CPU kernels
off), every forward of a shape over the same static buffers, nothing read
back to the host inside it (`no_host_reads`). So these tests catch what
would break a captured graph — a value taken from one forward's host lists,
a padding row that writes, a read-back — everywhere but in the capture
itself, which the last test (GPU only, `benches/gpu_check.sh`) runs.
"""
import contextlib
import os
import re
import warnings

import pytest
import torch

import hybridspec as hs
from hybridspec.errors import ConfigError
from hybridspec.kernels.backend import BACKEND_ENV
from hybridspec.models import graphs
from oracles import bamba, jamba, nemotron_h, qwen3_5, zamba2

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="the CPU runs of the GPU path need TRITON_INTERPRET=1")


@pytest.fixture
def gpu_path_on_cpu(monkeypatch, request):
    """The Triton kernels on CPU tensors (interpreted): the models and caches made in the test take them,
    and so does the module's `target` while the test runs."""
    monkeypatch.setenv(BACKEND_ENV, "triton")
    shared = request.getfixturevalue("target") if "target" in request.fixturenames else None
    before = shared.backend.name if shared is not None else None
    if shared is not None:
        shared.bind_backend()
    yield
    if shared is not None:
        shared.bind_backend(before)


@contextlib.contextmanager
def no_host_reads():
    """Raise on any tensor value read back to the host (a synchronisation on a GPU, illegal in a capture)."""
    saved = {name: getattr(torch.Tensor, name)
             for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")}

    def deny(name):
        def read(*args, **kwargs):
            raise AssertionError(f"a graphed forward called Tensor.{name}: a host synchronisation")
        return read

    for name in saved:
        setattr(torch.Tensor, name, deny(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


@pytest.fixture
def guarded_forwards(monkeypatch):
    forward = graphs.ForwardGraphs._forward

    def guarded(self, *args):
        with no_host_reads():
            return forward(self, *args)
    monkeypatch.setattr(graphs.ForwardGraphs, "_forward", guarded)


def tokens(engine, prompts=PROMPTS, max_new_tokens=6):
    return [o.token_ids for o in engine.generate(prompts, hs.SamplingParams(max_new_tokens=max_new_tokens))]


@pytest.fixture(scope="module")
def target():
    return hs.from_hf(bamba(seed=11, attn_layers=(1,), num_layers=3, dtype=torch.float32))


@needs_interpreter
@pytest.mark.parametrize("make", [
    lambda: nemotron_h(seed=3, dtype=torch.float32),  # attention without rotary embeddings
    lambda: zamba2(seed=3, dtype=torch.float32, block_types=("mamba", "hybrid", "hybrid")),  # shared blocks
    lambda: jamba(seed=3, dtype=torch.float32, expert_period=100, num_experts=1),  # Mamba-1, no MoE layer
    lambda: qwen3_5(seed=3, dtype=torch.float32),  # gated DeltaNet, gated attention
], ids=["nemotron_h", "zamba2", "jamba_mamba1", "qwen3_5_gdn"])
def test_families_give_the_eager_tokens(make, gpu_path_on_cpu, guarded_forwards):
    model = hs.from_hf(make())
    kwargs = dict(draft=hs.NgramDrafter(), max_batch_size=4, max_model_len=64, block_size=4)
    engine = hs.Engine(model, cuda_graphs=True, **kwargs)
    assert tokens(engine, max_new_tokens=3) == tokens(hs.Engine(model, **kwargs), max_new_tokens=3)
    assert engine.cache.graphs.replays > 0


@needs_interpreter
def test_one_shape_replayed_over_changing_batches(target, gpu_path_on_cpu, guarded_forwards):
    """Decode steps of 3, 4 and 3 rows (other rows, another order) all run the
    4-row graph of one input: its buffers, not the first forward's lists, decide
    every later forward. Logits, K/V and every ring slot match the eager forwards."""
    caches = [hs.Engine(target, max_batch_size=4, max_model_len=64, block_size=4).cache for _ in range(2)]
    caches[1].graphs = graphs.ForwardGraphs(target, caches[1], max_batch_size=4, max_model_len=64)
    for cache in caches:  # prompts past MAX_GRAPH_INPUTS: eager
        target.prefill(cache, [0, 1, 2, 3], [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15], [16] * 11, [17, 18, 19]])
    outs = [[], []]
    for seq_ids, toks in (([1, 2, 3], [20, 21, 22]), ([0, 1, 2, 3], [23, 24, 25, 26]), ([3, 0, 2], [27, 28, 29]),
                          ([0, 1, 2, 3], [30, 31, 32, 33])):
        for cache, out in zip(caches, outs):
            out.append(target.decode(cache, seq_ids, toks))
    assert list(caches[1].graphs.forwards) == [(4, 1, False, False)] and caches[1].graphs.replays == 4
    for eager, graphed in zip(*outs):
        torch.testing.assert_close(graphed, eager, rtol=1e-6, atol=1e-6)
    eager_cache, graph_cache = caches
    assert eager_cache.computed_len == graph_cache.computed_len
    for s in (0, 1, 2, 3):
        assert eager_cache.head(s) == graph_cache.head(s)
        n = eager_cache.computed_len[s]
        for name in ("k_cache", "v_cache"):
            kv = [getattr(c.kv, name)[0].reshape(-1, *getattr(c.kv, name).shape[-2:]) for c in caches]
            slots = [p * 4 + o for p in eager_cache.kv.block_table(s) for o in range(4)][:n]
            torch.testing.assert_close(kv[1][slots], kv[0][slots], rtol=1e-6, atol=1e-6)
    for pool in ("ssm_states", "conv_states"):
        for eager, graphed in zip(getattr(eager_cache.states, pool), getattr(graph_cache.states, pool)):
            torch.testing.assert_close(graphed, eager, rtol=1e-6, atol=1e-6)


@needs_interpreter
def test_long_forwards_stay_eager_and_logged_forwards_hand_out_their_log(target, gpu_path_on_cpu,
                                                                          guarded_forwards):
    """A prefill past MAX_GRAPH_INPUTS runs eagerly; a verify forward that keeps an
    input log (a log-replaying policy) runs its own graph shape and gives the
    eager forward's log, in copies."""
    caches = [hs.Engine(target, max_batch_size=4, max_model_len=64, block_size=4).cache for _ in range(2)]
    caches[1].graphs = graphs.ForwardGraphs(target, caches[1], max_batch_size=4, max_model_len=64)
    logs = []
    for cache in caches:
        target.prefill(cache, [0, 1], [list(range(3, 3 + graphs.MAX_GRAPH_INPUTS + 1)), [5, 6]])
        snap = [[-1, -1, cache.spare_slot(s)] for s in (0, 1)]
        logs.append({})
        target.extend(cache, [0, 1], [[7, 8, 9], [10, 11, 12]], snap_slot=snap, input_log=logs[-1])
    assert caches[1].graphs.replays == 1 and list(caches[1].graphs.forwards) == [(2, 3, False, True)]
    eager, graphed = logs
    assert sorted(graphed) == sorted(eager) and graphed
    for layer in eager:
        for name in ("xs", "x", "dt", "B", "C"):
            torch.testing.assert_close(getattr(graphed[layer], name), getattr(eager[layer], name),
                                       rtol=1e-6, atol=1e-6)


@needs_interpreter
def test_a_shape_that_fails_to_capture_runs_eagerly_after_one_warning(target, gpu_path_on_cpu, monkeypatch):
    engine = hs.Engine(target, max_batch_size=2, max_model_len=64, block_size=4, cuda_graphs=True)
    eager = tokens(hs.Engine(target, max_batch_size=2, max_model_len=64, block_size=4), PROMPTS[:2])
    calls = []

    def failing(self, *key):
        calls.append(key)
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(graphs.ForwardGraphs, "_capture", failing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tokens(engine, PROMPTS[:2]) == eager
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any(re.search("capture of 2 rows x 1 inputs failed .*not permitted.*runs eagerly", m) for m in messages)
    assert engine.cache.graphs.replays == 0 and (2, 1, False, False) in calls
    assert len(calls) == len(set(calls)) == len(messages)  # each shape tried, and warned about, once


def test_engine_refuses_graphs_it_cannot_capture(monkeypatch):
    from hybridspec.rollback.models import tiny_model  # no transformers on the GPU machine
    target = tiny_model(1, dtype=torch.float32)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    with pytest.raises(ConfigError, match="needs the Triton kernels.*on cpu"):
        hs.Engine(target, cuda_graphs=True)
    with pytest.raises(ConfigError, match="cuda_graphs='yes' must be True, False or None"):
        hs.Engine(target, cuda_graphs="yes")
    monkeypatch.setenv(graphs.GRAPHS_ENV, "yes")
    with pytest.raises(ConfigError, match="HYBRIDSPEC_CUDA_GRAPHS='yes' must be 0 or 1"):
        hs.Engine(target)
    monkeypatch.setenv(graphs.GRAPHS_ENV, "1")  # where a model can be captured: not on this CPU, so eager
    assert hs.Engine(target).cache.graphs is None
    monkeypatch.setenv(BACKEND_ENV, "triton")  # chosen once: the model keeps the backend it was bound to
    with pytest.raises(ConfigError, match="needs the Triton kernels.*'auto' backend"):
        hs.Engine(target, cuda_graphs=True)


@needs_interpreter
def test_float64_attention_takes_the_reference_on_the_gpu_path(gpu_path_on_cpu):
    """The Triton attention has no float64: such a model attends with the torch
    reference (its other kernels run in float64); graphs refuse it."""
    from hybridspec.rollback.models import tiny_model
    model = tiny_model(2, dtype=torch.float64)
    kwargs = dict(draft=hs.NgramDrafter(), max_batch_size=4, max_model_len=64, block_size=4)
    gpu_path = tokens(hs.Engine(model, **kwargs), max_new_tokens=4)
    os.environ[BACKEND_ENV] = "torch"  # the fixture's monkeypatch restores it
    model.bind_backend()
    assert gpu_path == tokens(hs.Engine(model, **kwargs), max_new_tokens=4)
    os.environ[BACKEND_ENV] = "triton"
    model.bind_backend()
    with pytest.raises(ConfigError, match="torch.float64 model's attention"):
        hs.Engine(model, cuda_graphs=True)


def test_engine_refuses_graphs_of_moe_models(gpu_path_on_cpu, monkeypatch):
    pytest.importorskip("transformers")
    moe = hs.from_hf(jamba(seed=1, dtype=torch.float32))
    with pytest.raises(ConfigError, match="MoE layers"):
        hs.Engine(moe, cuda_graphs=True)
    monkeypatch.setenv(graphs.GRAPHS_ENV, "1")  # the environment's default: graphs where they can run
    assert hs.Engine(moe).cache.graphs is None


@needs_interpreter
def test_the_environment_turns_graphs_on_for_each_model_that_takes_them(gpu_path_on_cpu, monkeypatch):
    from hybridspec.rollback.models import perturbed_copy, tiny_model
    target = tiny_model(3, dtype=torch.float32)
    monkeypatch.setenv(graphs.GRAPHS_ENV, "1")
    engine = hs.Engine(target, draft=perturbed_copy(target))
    assert engine.cache.graphs is not None and engine.speculator.drafter.cache.graphs is not None
    float64_draft = tiny_model(3, dtype=torch.float64)  # attention in float64: eager
    engine = hs.Engine(tiny_model(3, dtype=torch.float64), draft=float64_draft)
    assert engine.cache.graphs is None and engine.speculator.drafter.cache.graphs is None
    assert hs.Engine(target, cuda_graphs=False).cache.graphs is None


def test_graph_batch_sizes_round_up():
    assert [graphs.graph_batch_size(n) for n in (1, 2, 3, 5, 9, 16, 17)] == [1, 2, 4, 8, 12, 16, 24]
    assert graphs.graph_batch_size(graphs.GRAPH_BATCH_SIZES[-1] + 1) is None


def test_rounds_replay_the_eager_tokens(request):
    """Captured on a GPU (benches/gpu_check.sh); elsewhere the same rounds over the static path, interpreted."""
    from hybridspec.rollback.models import perturbed_copy, tiny_model  # no transformers on the GPU machine
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the CPU runs of the GPU path need TRITON_INTERPRET=1")
        request.getfixturevalue("gpu_path_on_cpu")
        request.getfixturevalue("guarded_forwards")
    model = tiny_model(5, ("mamba2", "attention", "mamba1", "mamba2"), dtype=torch.float32, device=device)
    kwargs = dict(draft=perturbed_copy(model, seed=1), max_batch_size=4, max_model_len=64, block_size=4)
    engine = hs.Engine(model, cuda_graphs=True, **kwargs)
    new_tokens = 16 if device == "cuda" else 6
    assert tokens(engine, max_new_tokens=new_tokens) == tokens(hs.Engine(model, **kwargs), max_new_tokens=new_tokens)
    captured = [shape is not None and shape[1].graph is not None for shape in engine.cache.graphs.forwards.values()]
    assert captured and all(captured) == (device == "cuda") and any(captured) == (device == "cuda")
    target_graphs, draft_graphs = engine.cache.graphs, engine.speculator.drafter.cache.graphs
    assert target_graphs.replays > 0 and draft_graphs.replays > 0
    assert (4, 5, False, False) in target_graphs.forwards  # 3 rows padded to 4, γ + 1 = 5 verify inputs
    assert (4, 1, False, False) in draft_graphs.forwards  # drafting steps
    assert (4, 4, True, False) not in target_graphs.forwards  # the prompts' prefill (4 tokens at most) is eager
