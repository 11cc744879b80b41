"""The native kernels over several threads (`kernels/cpu/pool.c`, `cpu_native.sync_threads`):
the same bits at every thread count, in a product, the recurrences (Mamba-2, Mamba-1, gated delta),
attention over a long context, a whole forward and the engine's tokens; products from two Python threads at
once; a forked child; helpers bound to CPUs of their own (`cpu_native.pin_threads`) and let go."""
from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Callable, NamedTuple

import pytest
import torch

import hybridspec as hs
from hybridspec.errors import ConfigError
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.kernels import ops
from hybridspec.kernels.cpu import gdn as cpu_gdn
from hybridspec.kernels.cpu import mamba1 as cpu_mamba1
from hybridspec.kernels.cpu import mamba2 as cpu_mamba2
from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.kernels.cpu import rows as cpu_rows
from hybridspec.kernels.slot_plan import SlotPlan
from native_cpu import one_thread, with_threads, x86_with_compiler  # noqa: F401 (one_thread: an autouse fixture)
from native_switch import backend_of
from oracles import bamba
from test_blocks import run
from test_gdn import inputs as gdn_inputs
from test_state_kernels import inputs, lengths

pytestmark = x86_with_compiler

# at least PARALLEL_MIN_MACS = 2^16 multiply-adds at one row, so that every call splits:
# steps, tiles (from 10 rows), a panel copy (N a multiple of 1024), tail columns past a multiple of 8
SHAPES = [(256, 1160), (300, 1000), (130, 2048), (64, 4101), (512, 300)]
ROWS = (1, 3, 5, 9, 10, 16, 20, 33, 48)


def helper_threads() -> int:
    """This process's threads (the products' helpers among them)."""
    return len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("K,N", SHAPES)
def test_a_products_bits_do_not_depend_on_the_thread_count(K, N):
    g = torch.Generator().manual_seed(K + N)
    w, x = torch.randn(K, N, generator=g), torch.randn(max(ROWS), K, generator=g)
    one = {M: cpu_rows.rows_matmul(x[:M], w) for M in ROWS}
    for count in (2, 3, 5):
        for M in ROWS:
            got = with_threads(count, lambda: cpu_native.available() and cpu_rows.rows_matmul(x[:M], w))
            assert torch.equal(got, one[M]), (count, M)
    assert torch.allclose(one[48], (x.double() @ w.double()).float(), rtol=1e-4, atol=1e-4)


def test_a_long_products_bits_do_not_depend_on_the_thread_count():
    """A job of 2^28 multiply-adds and more (cpu/rows.c's LONG_JOB_MACS: a prefill's product) is
    never taken back whole from a late helper (`hs_parallel_long`); the bits stay one thread's,
    for float32 and bfloat16-compute weights alike."""
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(1024, 2112, generator=g), torch.randn(128, 1024, generator=g)  # 2^28 + 2^23 MACs
    kinds = [(w, torch.float32)] + ([(w.bfloat16(), torch.bfloat16)] if cpu_native.bf16_compute_supported() else [])
    for weight, compute in kinds:
        one = cpu_rows.rows_matmul(x, weight, compute)
        for count in (2, 3):
            got = with_threads(count, lambda: cpu_native.available() and cpu_rows.rows_matmul(x, weight, compute))
            assert torch.equal(got, one), (compute, count)


def mamba1_inputs(batch, T, d_inner, d_state, seed):
    """A Mamba-1 pool (each row's head slot and a snapshot slot per input) and the recurrence's inputs."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(batch * (T + 1), d_inner, d_state, generator=g)
    src = [b * (T + 1) for b in range(batch)]
    snap = [[b * (T + 1) + 1 + t for t in range(T)] for b in range(batch)]
    args = (torch.randn(batch, T, d_inner, generator=g), 2 * torch.rand(batch, T, d_inner, generator=g),
            -8 * torch.rand(d_inner, d_state, generator=g), torch.randn(batch, T, d_state, generator=g),
            torch.randn(batch, T, d_state, generator=g), torch.randn(d_inner, generator=g))
    return pool, src, snap, args


class Recurrence(NamedTuple):
    """A recurrence's C kernel, its `applies` and which of its inputs that takes, a case and its inputs."""
    steps: Callable
    applies: Callable
    input_at: int  # the index in `make`'s inputs of the tensor `applies` takes beside the states
    case: tuple
    make: Callable


MAMBA2 = (cpu_mamba2.mamba2_steps, cpu_mamba2.applies, 0)
MAMBA1 = (cpu_mamba1.mamba1_steps, cpu_mamba1.applies, 0)
GDN = (cpu_gdn.gdn_steps, cpu_gdn.applies, 2)  # (q, k, v, g, beta): v
# Each recurrence short (one part per thread, hs_parallel) and long (past LONG_WORK = 2^22 state floats
# updated: a few parts per thread, more than the threads, hs_parallel_long)
RECURRENCES = {
    "mamba2 short": Recurrence(*MAMBA2, (3, 5, 8, 64, 64, 1), inputs),
    "mamba2 long": Recurrence(*MAMBA2, (2, 70, 8, 64, 64, 1), inputs),  # 16 units · 70 · 4096
    "mamba1 short": Recurrence(*MAMBA1, (2, 5, 640, 16), mamba1_inputs),
    "mamba1 long": Recurrence(*MAMBA1, (1, 520, 511, 16), mamba1_inputs),  # 256 channel pairs · 520 · 32
    "gdn short": Recurrence(*GDN, (3, 4, 4, 2, 64, 64), gdn_inputs),
    "gdn long": Recurrence(*GDN, (1, 130, 8, 2, 64, 64), gdn_inputs),  # 8 units · 130 · 4096
}


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", list(RECURRENCES))
def test_every_recurrences_bits_do_not_depend_on_the_thread_count(name, padded):
    """Units (a row's heads, or its channel pairs) split over the threads, in more parts than
    threads for a long job: outputs and every slot of the pool the same bits."""
    r = RECURRENCES[name]
    pool, src, snap, args = r.make(*r.case, seed=3)

    def recurrence():
        states = pool.clone()
        plan = SlotPlan(src, snap, lengths(r.case[0], r.case[1], padded), "cpu")
        assert r.applies(states, args[r.input_at], plan)
        return r.steps(states, plan, *args), states

    out, states = recurrence()
    for count in (2, 3, 7):
        got, got_states = with_threads(count, recurrence)
        assert torch.equal(got, out) and torch.equal(got_states, states), count


def _child_long_recurrence(queue, case):
    """In a forked child: the helpers a long Mamba-2 recurrence over 2 threads starts (its 8 parts
    claimed by the caller and one helper)."""
    pool, src, snap, args = inputs(*case, seed=3)
    before = len(os.listdir("/proc/self/task"))
    cpu_native.library().hs_set_threads(2)
    cpu_mamba2.mamba2_steps(pool, SlotPlan(src, snap, [case[1]] * case[0], "cpu"), *args)
    queue.put(len(os.listdir("/proc/self/task")) - before)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_job_of_more_parts_than_threads_starts_one_helper_per_thread_beyond_the_first():
    assert in_forked_child(_child_long_recurrence, RECURRENCES["mamba2 long"].case) == 1


def failures_in_two_python_threads(same, repeats: int) -> list[int]:
    """Python threads 0 and 1 each call `same(i)` (True when its result is right)
    `repeats` times at once; the indices of the calls that were wrong."""
    failures = []

    def work(i):
        failures.extend(i for _ in range(repeats) if not same(i))

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures


def test_products_from_two_python_threads_at_once():
    """The C calls release the GIL: a product started while another holds the
    helpers runs on its own thread; both are right."""
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(256, 1160, generator=g), torch.randn(300, 1000, generator=g)]
    xs = [torch.randn(20, 256, generator=g), torch.randn(5, 300, generator=g)]
    want = [cpu_rows.rows_matmul(x, w) for x, w in zip(xs, weights)]
    torch.set_num_threads(2)
    cpu_native.sync_threads()
    assert failures_in_two_python_threads(lambda i: torch.equal(cpu_rows.rows_matmul(xs[i], weights[i]), want[i]),
                                          50) == []


def test_mamba2_recurrences_from_two_python_threads_at_once():
    """Each Python thread keeps its own scratch head (the C call releases the GIL)."""
    cases = [inputs(2, 5, 8, 64, 64, 1, seed=s) for s in (4, 5)]

    def recurrence(i):
        pool, src, snap, args = cases[i]
        states = pool.clone()
        return cpu_mamba2.mamba2_steps(states, SlotPlan(src, snap, [5, 5], "cpu"), *args), states

    want = [recurrence(i) for i in (0, 1)]

    def same(i):
        y, states = recurrence(i)
        return torch.equal(y, want[i][0]) and torch.equal(states, want[i][1])
    assert failures_in_two_python_threads(same, 30) == []


def in_forked_child(target, *args):
    """What `target(queue, *args)` puts on its queue, run in a forked child; fails the test if the
    child has not finished within a minute (its split product awaiting helpers it does not have)."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=target, args=(queue, *args))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail(f"the forked child's split product did not finish ({target.__name__})")
    return queue.get(timeout=5)


def _child_product(queue, x, w):
    """In a forked child: the helpers a split product over 3 threads starts (2,
    reused after), and its sum. torch stays on one thread here: GNU OpenMP's
    team does not survive a fork, so the count goes to the products directly."""
    before = len(os.listdir("/proc/self/task"))
    cpu_native.library().hs_set_threads(3)
    total = float(cpu_rows.rows_matmul(x, w).sum())
    started = len(os.listdir("/proc/self/task")) - before
    cpu_rows.rows_matmul(x, w)
    queue.put((total, started, len(os.listdir("/proc/self/task")) - before))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_forked_child_makes_its_own_helpers():
    """The parent's helpers stay in the parent: a child's split product starts
    its own (and does not wait for the parent's), once."""
    x, w = torch.ones(3, 256), torch.ones(256, 1160)
    with_threads(2, lambda: cpu_native.available() and cpu_rows.rows_matmul(x, w))  # the parent's helper
    total, started, after_second = in_forked_child(_child_product, x, w)
    assert total == 3 * 1160 * 256
    assert started == 2 and after_second == started


@pytest.fixture(scope="module")
def model():
    """Products big enough to split: the LM head (128 × 1024) at every step, the Mamba input projection at 5 rows."""
    return hs.from_hf(bamba(seed=7, attn_layers=(1,), num_layers=3, dtype=torch.float32, hidden=128, vocab=1024)
                      ).pack_for_cpu()


@pytest.mark.parametrize("whole", [True, False], ids=["whole forward", "layer by layer"])
def test_a_forwards_bits_do_not_depend_on_the_thread_count(model, whole):
    with backend_of(model, "native" if whole else "native-blocks"):
        prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
        logits, cache, _ = run(model, prompts, steps=2, verify_tokens=5)
        for count in (2, 3):
            got, other, _ = with_threads(count, lambda: run(model, prompts, steps=2, verify_tokens=5))
            for a, b in zip(logits, got):
                assert torch.equal(a, b), count
            for pool_a, pool_b in zip(cache.states.ssm_states, other.states.ssm_states):
                assert torch.equal(pool_a, pool_b)


def test_attention_over_a_long_context_has_the_same_bits_at_every_thread_count():
    """Past 2^16 floats of keys (here 300 keys of 4 KV heads of 64) a row's KV
    heads split over the threads: decode and verify logits and the K/V pages the same."""
    long_model = hs.from_hf(bamba(seed=9, attn_layers=(1,), num_layers=2, dtype=torch.float32, hidden=256,
                                  heads=4, kv_heads=4, vocab=512)).pack_for_cpu()
    prompt = [(7 * i + 3) % 500 + 3 for i in range(300)]

    def decode_and_verify(count):
        cache = HybridCache(long_model.config, max_seqs=1, num_blocks=24, block_size=16, ring_slots=8,
                            dtype=long_model.dtype)
        long_model.prefill(cache, [0], [prompt], last_only=True)  # one thread, outside the counts compared
        steps = with_threads(count, lambda: [long_model.decode(cache, [0], [t]) for t in (11, 12, 13)]
                             + [long_model.extend(cache, [0], [[14, 15, 16, 17, 18]])])
        return steps, cache

    logits, cache = decode_and_verify(1)
    for count in (2, 3):
        got, other = decode_and_verify(count)
        assert all(torch.equal(a, b) for a, b in zip(logits, got)), count
        assert torch.equal(cache.kv.k_cache, other.kv.k_cache) and torch.equal(cache.kv.v_cache, other.kv.v_cache)


def test_the_engine_emits_the_same_tokens_at_every_thread_count(model):
    draft = hs.from_hf(bamba(seed=8, attn_layers=(), num_layers=1, dtype=torch.float32, hidden=128, vocab=1024)
                       ).pack_for_cpu()
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [40, 2, 33]]
    greedy = hs.SamplingParams(max_new_tokens=12, ignore_eos=True)
    sampled = hs.SamplingParams(max_new_tokens=12, temperature=0.8, seed=11, ignore_eos=True)

    def generate():
        spec = hs.Engine(model, draft=draft, num_draft_tokens=3, max_batch_size=3, max_model_len=64)
        plain = hs.Engine(model, max_batch_size=3, max_model_len=64)
        return [[o.token_ids for o in e.generate(prompts, params)] for e in (spec, plain) for params in (greedy, sampled)]

    one = generate()
    assert one[0] == one[2]  # greedy: speculative == plain
    assert with_threads(2, generate) == one


def helper_cpus() -> list[set[int]]:
    """The CPUs each of this process's helper threads (named hs-helper) may run on, by thread id (not
    always their start order: ids wrap at the kernel's pid_max)."""
    found = []
    for task in sorted(os.listdir("/proc/self/task"), key=int):
        with open(f"/proc/self/task/{task}/comm") as f:
            if f.read().strip() != "hs-helper":
                continue
        found.append(os.sched_getaffinity(int(task)))
    return found


def bound_as_promised(helpers: list[set[int]], cpus: set[int]) -> bool:
    """As many helpers as there are CPUs other than the caller's (or all of them, if fewer) alone on
    one CPU of `cpus`, each a CPU of its own; the others keep all of `cpus`. (The pool binds helper k
    while k + 1 such CPUs are there; which thread is helper k the ids cannot tell once they wrap.)"""
    own = [h for h in helpers if len(h) == 1]
    return (len(own) == min(len(helpers), len(cpus) - 1) and all(h <= cpus for h in own)
            and len(set().union(*own)) == len(own) and all(h == cpus for h in helpers if len(h) != 1))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the threads' names in /proc")
def test_helpers_are_each_bound_to_a_cpu_of_their_own_on_request_and_let_go():
    """Bound (HYBRIDSPEC_PIN_THREADS=1), helpers started before and after take their CPUs;
    let go, all keep the process's; the bits the same either way."""
    g = torch.Generator().manual_seed(12)
    w, x = torch.randn(256, 1160, generator=g), torch.randn(3, 256, generator=g)
    want = cpu_rows.rows_matmul(x, w)
    cpus = os.sched_getaffinity(0)
    product = lambda count: with_threads(count, lambda: cpu_native.available() and cpu_rows.rows_matmul(x, w))  # noqa: E731
    assert torch.equal(product(2), want)  # a helper started free
    started = helper_cpus()
    assert started and started == [cpus] * len(started)
    try:
        assert cpu_native.pin_threads(True) is True
        assert torch.equal(product(3), want)  # one more helper, started bound
        helpers = helper_cpus()
        assert len(helpers) >= 2 and bound_as_promised(helpers, cpus), (helpers, cpus)
    finally:
        assert cpu_native.pin_threads(None) is False
    assert helper_cpus() == [cpus] * len(helpers)
    assert torch.equal(product(3), want)


def _child_on_one_cpu(queue, x, w):
    """In a forked child confined to one CPU, helpers bound: the helpers its split product starts, their CPUs."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    cpu_native.pin_threads(True)
    cpu_native.library().hs_set_threads(2)
    cpu_rows.rows_matmul(x, w)
    queue.put((os.sched_getaffinity(0), helper_cpus()))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the threads' names in /proc")
def test_a_helper_with_no_cpu_of_its_own_keeps_the_process_cpus():
    """Confined to one CPU, the only one is the caller's: the helper keeps it rather than a CPU outside."""
    x, w = torch.ones(3, 256), torch.ones(256, 1160)
    cpu_native.available()
    cpus, helpers = in_forked_child(_child_on_one_cpu, x, w)
    assert len(cpus) == 1 and helpers == [cpus]


@pytest.mark.parametrize("value", ["yes", "2", ""])
def test_a_bad_pinning_choice_is_refused_naming_the_fix(monkeypatch, value):
    cpu_native.available()
    monkeypatch.setenv(cpu_native.PIN_ENV, value)
    with pytest.raises(ConfigError, match="HYBRIDSPEC_PIN_THREADS=.*must be '1'"):
        cpu_native.pin_threads(None)
    with pytest.raises(ConfigError, match="takes True, False or None"):
        cpu_native.pin_threads(1)
    monkeypatch.setenv(cpu_native.PIN_ENV, "1")
    assert cpu_native.pin_threads(None) is True
    monkeypatch.delenv(cpu_native.PIN_ENV)
    assert cpu_native.pin_threads(None) is False


def test_a_long_prefills_bits_do_not_depend_on_the_thread_count(model):
    """Past MAX_ROWS rows the products of weights in panels stay the kernel's at every count
    (torch's own operations on one thread beside them, `cpu_native.torch_on_one_thread`)."""
    prompts = [[(5 * i + b) % 1000 + 3 for i in range(70)] for b in (0, 1)]  # 140 rows
    logits, cache, _ = run(model, prompts, steps=1, verify_tokens=5)
    for count in (2, 3):
        got, other, _ = with_threads(count, lambda: run(model, prompts, steps=1, verify_tokens=5))
        assert all(torch.equal(a, b) for a, b in zip(logits, got)), count
        assert all(torch.equal(a, b) for a, b in zip(cache.states.ssm_states, other.states.ssm_states))


def test_a_native_forward_runs_torch_on_one_thread_but_attention(model, monkeypatch):
    """Two threads: a layer's torch operations see one, attention (and the kernels) two; the torch
    backend's layers see two; afterwards torch has its two again."""
    seen = {}
    attention = ops.PagedAttention.__call__

    def recorded(self, *args):
        seen["attention"] = torch.get_num_threads()
        return attention(self, *args)
    monkeypatch.setattr(ops.PagedAttention, "__call__", recorded)
    hook = model.layers[0].register_forward_hook(lambda *_: seen.__setitem__("layer", torch.get_num_threads()))
    prompts = [[(5 * i + 7) % 1000 + 3 for i in range(40)]]
    try:
        for backend, layer in (("native-ops", 1), ("torch", 2)):  # native-ops: attention through the op
            with backend_of(model, backend):
                seen.clear()
                with_threads(2, lambda: [run(model, prompts, steps=0, verify_tokens=3),
                                         seen.__setitem__("after", torch.get_num_threads()),
                                         seen.__setitem__("kernels", cpu_native.sync_threads())])
                assert seen == {"layer": layer, "attention": 2, "after": 2, "kernels": 2}, backend
    finally:
        hook.remove()


def test_an_engine_step_runs_torch_on_one_thread_beside_the_kernels(model, monkeypatch):
    """Two threads: inside a speculative engine's step (its round's sampling and acceptance) torch
    sees one thread and the kernels keep two, a sort of the vocabulary gets torch's two back, and
    after the step torch has its two again; the tokens are those of one thread."""
    seen = []
    softmax, sort = torch.softmax, torch.sort  # both called by the step's sampling, the sort under top-p

    def recorded(*args, **kwargs):
        seen.append(("step", torch.get_num_threads(), cpu_native.sync_threads()))
        return softmax(*args, **kwargs)

    def sorting(*args, **kwargs):
        seen.append(("sort", torch.get_num_threads()))
        return sort(*args, **kwargs)
    monkeypatch.setattr(torch, "softmax", recorded)
    monkeypatch.setattr(torch, "sort", sorting)
    prompts = [[(5 * i + 7) % 1000 + 3 for i in range(20)]]
    params = hs.SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.8, seed=3, ignore_eos=True)

    def generate():
        engine = hs.Engine(model, draft=model, num_draft_tokens=2, max_batch_size=1, max_model_len=64)
        return [o.token_ids for o in engine.generate(prompts, params)], torch.get_num_threads()
    tokens, after = with_threads(2, generate)
    assert after == 2 and ("step", 1, 2) in seen and ("sort", 2) in seen
    assert {entry for entry in seen if entry[0] == "step"} == {("step", 1, 2)}
    monkeypatch.setattr(torch, "softmax", softmax)
    monkeypatch.setattr(torch, "sort", sort)
    assert with_threads(1, generate)[0] == tokens


def test_torch_on_one_thread_holds_the_kernels_count_and_gives_it_back():
    assert cpu_native.available()

    def inside():
        with cpu_native.torch_on_one_thread():
            counts = [torch.get_num_threads(), cpu_native.sync_threads()]
            with cpu_native.torch_on_one_thread():  # nested: the outer one holds
                counts.append(torch.get_num_threads())
            with cpu_native.torch_threads():
                counts.append(torch.get_num_threads())
            counts.append(torch.get_num_threads())
            raise KeyError(counts)
    with pytest.raises(KeyError) as raised:
        with_threads(3, inside)
    assert raised.value.args[0] == [1, 3, 1, 3, 1]
    assert with_threads(3, lambda: (torch.get_num_threads(), cpu_native.sync_threads())) == (3, 3)
    with cpu_native.torch_on_one_thread(), cpu_native.torch_threads():  # one thread: nothing to hold
        assert torch.get_num_threads() == 1


def test_a_long_prompts_prefill_bits_do_not_depend_on_the_prompts_beside_it(model):
    """Forwards past MAX_ROWS rows run layer by layer: a 100-token prompt's logits alone and beside
    a 37-token one (padded) are the same bits, at one and two threads. torch's softplus and sigmoid
    round a tensor's tail differently from its body, so Δ comes from `ops.NativePointwise`."""
    a, b = [(3 * i + 1) % 1000 + 3 for i in range(100)], [(11 * i + 5) % 1000 + 3 for i in range(37)]

    def prefill(prompts):
        cache = HybridCache(model.config, max_seqs=2, num_blocks=40, block_size=8, ring_slots=8, dtype=model.dtype)
        return model.prefill(cache, list(range(len(prompts))), prompts)  # [batch, T, vocab]

    for count in (1, 2):
        alone, beside = with_threads(count, lambda: (prefill([a]), prefill([a, b])))
        assert torch.equal(alone[0], beside[0]), count
