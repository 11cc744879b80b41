"""The target's hidden states (`cache/hidden_states.py`) and the MTP drafter
(`draft="mtp"`): hidden states equal HF's at every point on every path, a
drafter never reads a rejected position's, and speculative output equals plain
output with the MTP layer on Bamba, Qwen3-Next, Qwen3.5 and Qwen3.5-MoE
targets, under the prefix cache, preemption and the invariant checks."""
import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hybridspec as hs
from hybridspec.cache.hidden_states import HiddenStates
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.errors import ConfigError, ModelFilesError
from oracles import bamba, float64_oracle, qwen3_5, qwen3_5_moe, qwen3_next

FAMILIES = {"bamba": bamba, "qwen3_next": qwen3_next, "qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5_moe}
SHIPPED = Path(hs.embedded_paths()[0]).parent / "mtp"


def attention_layer(m) -> int:
    cfg = m.config
    if getattr(cfg, "layer_types", None):
        return list(cfg.layer_types).index("full_attention")
    return list(cfg.attn_layer_indices)[0]


def save_with_mtp(m, path: Path, seed: int = 0, scale: float = 0.3) -> Path:
    """save_pretrained, plus an MTP layer as Qwen3-Next's checkpoints carry one: a copy of the target's first
    attention layer, perturbed, and random fc and norms."""
    m.save_pretrained(path)
    state = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    hidden, prefix = m.config.hidden_size, f"model.layers.{attention_layer(m)}."
    noisy = lambda t: t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype)
    state |= {"mtp.layers.0." + name[len(prefix):]: noisy(t) for name, t in state.items() if name.startswith(prefix)}
    state["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g, dtype=m.dtype) * scale / hidden ** 0.5
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        state[f"mtp.{name}.weight"] = noisy(torch.zeros(hidden, dtype=m.dtype) if "qwen" in m.config.model_type
                                            else torch.ones(hidden, dtype=m.dtype))
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (target loaded from a directory with MTP weights, the HF model)."""
    out = {}
    for name, make in FAMILIES.items():
        m = make(seed=3)
        path = save_with_mtp(m, tmp_path_factory.mktemp(name))
        out[name] = (hs.load(path), m)
    return out


def make_cache(model, points=None) -> HybridCache:
    cache = HybridCache(model.config, max_seqs=4, num_blocks=64, block_size=4, ring_slots=3, dtype=model.dtype)
    if points is not None:
        cache.hidden = HiddenStates(points, model.config.num_layers)
    return cache


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_states_are_hf_layer_inputs_at_every_point(family, saved):
    """Point i is the input of layer i (HF's hidden_states[i]); the last point is the stream before the final
    norm (HF's last entry is after it). Prefill then decode steps: every position's row, in order."""
    target, m = saved[family]
    L = target.config.num_layers
    cache = make_cache(target, points=range(L + 1))
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1)).tolist()
    target.prefill(cache, [0, 1], [t[:6] for t in ids])
    for k in range(6, 9):
        target.decode(cache, [0, 1], [t[k] for t in ids])
    with torch.no_grad(), float64_oracle():
        ref = m(torch.tensor(ids), output_hidden_states=True).hidden_states
    for b in (0, 1):
        first, rows = cache.hidden.take(b)
        assert first == 0 and rows.shape == (9, L + 1, target.config.hidden_size)
        for point in range(L):
            assert (rows[:, point] - ref[point][b]).abs().max().item() <= 1e-10
        assert (target.final_norm(rows[:, L]) - ref[L][b]).abs().max().item() <= 1e-10
        assert cache.hidden.take(b)[1] is None  # taken once


def test_the_native_whole_forward_keeps_the_layer_loops_hidden_states():
    """The embedded float32 target on the native kernels: the whole forward in C (few inputs) and the layer
    loop (torch backend) give the same hidden states within float32 rounding."""
    target_dir, _ = hs.embedded_paths()
    native, torch_path = hs.load(target_dir), hs.load(target_dir)
    torch_path.bind_backend("torch")
    tokens = [list(b"def f(x):\n"), list(b"import os")]
    rows = []
    for model in (native, torch_path):
        cache = make_cache(model, points=(1, 3, 6))
        model.prefill(cache, [0, 1], tokens)
        model.decode(cache, [0, 1], [32, 10])
        rows.append([cache.hidden.take(b)[1] for b in (0, 1)])
    for a, b in zip(*rows):
        assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-4 * (1 + b.abs().max().item())


def test_a_verify_forward_keeps_only_what_the_commit_accepts():
    """Rows a forward wrote are pending: a commit keeps those below the boundary, a rewind drops what is past
    it, an aborted forward leaves nothing, and a prefix-restored gap restarts the record after it."""
    store = HiddenStates((2,), 2)
    values = torch.arange(2 * 4 * 1 * 3, dtype=torch.float32).view(2, 4, 1, 3)
    store.put([7, 8], [5, 0], [4, 2], values)
    assert store.take(7) == (0, None)  # nothing is readable before a commit
    store.commit(7, 7)  # the verify's inputs 0, 1 accepted (positions 5, 6)
    store.commit(8, 2)
    first, rows = store.take(7)
    assert first == 5 and torch.equal(rows, values[0, :2])
    assert torch.equal(store.take(8)[1], values[1, :2])
    store.put([7], [7], [3], values[:1])
    store.rewind(7, 7)  # the round failed: back to its start
    store.commit(7, 9)
    assert store.take(7) == (7, None)
    store.put([7], [9], [1], values[:1])  # a gap: positions 7, 8 restored without a forward
    store.commit(7, 10)
    first, rows = store.take(7)
    assert first == 9 and torch.equal(rows, values[0, :1])
    with pytest.raises(ConfigError, match="points"):
        HiddenStates((3,), 2)


def run(target, prompts, params, draft=None, **kwargs):
    engine = hs.Engine(target, draft=draft, **kwargs)
    if draft is not None:
        engine.check_invariants = engine.speculator.check = True
    return [o.token_ids for o in engine.generate(prompts, params)], engine


def prompts_of(seed: int, count: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(3, 97, (5,), generator=g).tolist()
    return [motif * (1 + i % 2) + torch.randint(3, 97, (2 + i,), generator=g).tolist() for i in range(count)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("verify", ["greedy", "coupled"])
def test_speculative_output_is_plain_output(family, verify, saved):
    """γ = 3 at concurrency 3 of 4 requests, the prefix cache on (the second call's prompts hit the first's
    pages: positions the MTP layer never sees), invariants checked after every commit."""
    target, _ = saved[family]
    if verify == "greedy":
        params = [hs.SamplingParams(max_new_tokens=10, ignore_eos=True)] * 4
    else:
        params = [hs.SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.9, seed=i) for i in range(4)]
    kwargs = dict(max_batch_size=3, block_size=4, prefix_cache=True)
    spec = hs.Engine(target, draft="mtp", num_draft_tokens=3, verify="coupled" if verify == "coupled" else "rejection",
                     **kwargs)
    spec.check_invariants = spec.speculator.check = True
    plain = hs.Engine(target, **kwargs)
    prompts = prompts_of(5)
    for _ in range(2):
        assert [o.token_ids for o in spec.generate(prompts, params)] == \
               [o.token_ids for o in plain.generate(prompts, params)]
    assert spec.total_stats.drafted_tokens > 0 and spec.total_stats.prefix_hit_tokens > 0
    drafter = spec.speculator.drafter
    assert not drafter.pending and not drafter.offset and drafter.cache.computed_len == {}


def test_preemption_changes_no_token(saved):
    """A pool too small for every sequence's growth: preempted rows are forgotten by the MTP layer and
    rebuilt when they resume; greedy and coupled rows keep plain output."""
    target, _ = saved["bamba"]
    prompts = prompts_of(7)
    params = [hs.SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i)
              for i in range(4)]
    pages = -(-max(len(p) + 12 for p in prompts) // 4) + 2
    outs, engine = run(target, prompts, params, draft="mtp", num_draft_tokens=3, verify="coupled",
                       max_batch_size=4, block_size=4, num_blocks=pages)
    assert engine.stats.preemptions > 0 and engine.stats.drafted_tokens > 0
    assert outs == [hs.Engine(target, block_size=4).generate([p], [q])[0].token_ids for p, q in zip(prompts, params)]


def test_missing_or_mismatched_mtp_weights_are_refused(saved, tmp_path):
    m = bamba(seed=4)
    m.save_pretrained(tmp_path / "plain")
    with pytest.raises(ConfigError, match="holds none"):
        hs.Engine(hs.load(tmp_path / "plain"), draft="mtp")
    with pytest.raises(ConfigError, match="not loaded from a directory"):
        hs.Engine(hs.from_hf(m), draft="mtp")
    path = save_with_mtp(m, tmp_path / "bad")
    state = load_file(str(path / "model.safetensors"))
    state["mtp.fc.weight"] = state["mtp.fc.weight"][:, :-1].contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFilesError, match="mtp.fc.weight"):
        hs.Engine(hs.load(path), draft="mtp")
    del state["mtp.layers.0.self_attn.q_proj.weight"]
    state["mtp.fc.weight"] = torch.zeros(32, 64, dtype=torch.float64)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFilesError, match="q_proj|missing"):
        hs.Engine(hs.load(path), draft="mtp")


def load_trainer():
    script = Path(__file__).resolve().parent.parent / "tools" / "train_mtp.py"
    spec = importlib.util.spec_from_file_location("train_mtp", script)
    module = importlib.util.module_from_spec(spec)
    import sys
    sys.path.insert(0, str(script.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(script.parent))
    return module


@pytest.mark.skipif(not (SHIPPED / "model.safetensors").is_file(), reason="no trained MTP layer shipped")
def test_the_shipped_layer_computes_what_it_was_trained_as():
    """The embedded MTP layer run by hybridspec (`MTPLayer`) against the module `tools/train_mtp.py` trained,
    HF's Bamba decoder layer inside: the same logits on a byte window, in float64."""
    from transformers import AutoModelForCausalLM
    from hybridspec.adapters.mtp import load_mtp
    target_dir, _ = hs.embedded_paths()
    target = hs.load(target_dir, dtype=torch.float64)
    layer = load_mtp(target, SHIPPED)
    trainer = load_trainer()
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    reference = trainer.TrainableMTP(hf).double()
    reference.load_state_dict({k[len("mtp."):]: v for k, v in load_file(str(SHIPPED / "model.safetensors")).items()},
                              strict=False)
    window = list(b"def total(items):\n    return sum(items)\n")
    hidden = torch.randn(1, len(window) - 1, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, _ = reference(torch.tensor([window[1:]]), hidden)
    cache = layer.new_cache(max_seqs=1, block_size=16, num_blocks=8)
    cache.add_sequences([0])
    logits = torch.stack([layer.extend(cache, [0], [[t]], [hidden[0, i:i + 1]])[0][0]
                          for i, t in enumerate(window[1:])])
    assert (logits - ref[0]).abs().max().item() <= 1e-5  # the rotary angles of both come from float32 inverse frequencies


@pytest.mark.skipif(not (SHIPPED / "model.safetensors").is_file(), reason="no trained MTP layer shipped")
def test_the_embedded_default_drafts_with_its_mtp_layer():
    """`hs.LLM(draft="mtp")` on the embedded default finds the shipped layer, accepts drafts and keeps plain
    output."""
    llm = hs.LLM(draft="mtp", num_draft_tokens=3)
    plain = hs.LLM()
    prompts = ["def fibonacci(n):\n    ", "class Stack:\n    def push(self"]
    params = hs.SamplingParams(max_new_tokens=32)
    assert [o.text for o in llm.generate(prompts, params)] == [o.text for o in plain.generate(prompts, params)]
    stats = llm.engine.stats
    assert stats.accepted_tokens > 0.3 * stats.drafted_tokens


@pytest.mark.skipif(not (SHIPPED / "model.safetensors").is_file(), reason="no trained MTP layer shipped")
def test_the_mtp_step_in_one_c_call_is_the_module_path_bit_for_bit():
    """On a float32 CPU target the input stage, the layer, the norm and the LM head run as one whole forward
    (`MTPInput`); the logits and the normed output o are the module-by-module path's bits."""
    from hybridspec.adapters.mtp import load_mtp
    from hybridspec.kernels.cpu.forward import NO_WHOLE_FORWARD
    target = hs.load(hs.embedded_paths()[0])
    window = list(b"def total(items):\n    return sum(items)\n")
    hidden = torch.randn(len(window) - 1, 256, generator=torch.Generator().manual_seed(0))
    runs = []
    for whole in (True, False):
        layer = load_mtp(target)
        if not whole:
            layer.whole = NO_WHOLE_FORWARD
        cache = layer.new_cache(max_seqs=2, block_size=16, num_blocks=8)
        cache.add_sequences([0, 1])
        out = [layer.extend(cache, [0, 1], [window[1:6], window[1:4]], [hidden[:5], hidden[:3]])]
        out += [layer.extend(cache, [0, 1], [[t], [t]], [hidden[i:i + 1]] * 2) for i, t in enumerate(window[6:14])]
        runs.append(out)
    for (logits_a, o_a), (logits_b, o_b) in zip(*runs):
        assert torch.equal(logits_a, logits_b) and torch.equal(o_a, o_b)
