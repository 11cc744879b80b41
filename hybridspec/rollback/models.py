"""Models and workloads for the rollback checks: a random hybrid model built
in code, a perturbed copy (a drafter that agrees partly), prompts, sampling
parameters, and scripted / broken drafters."""
from __future__ import annotations

from copy import deepcopy
from dataclasses import replace

import torch

from hybridspec.adapters.validate import expected_tensors
from hybridspec.config import AttentionConfig, GdnConfig, HybridConfig, Mamba1Config, Mamba2Config, MLPConfig
from hybridspec.engine.engine import Engine
from hybridspec.models.hybrid import HybridModel
from hybridspec.models.mtp import MTPLayer, mtp_config
from hybridspec.sampling.sampler import SamplingParams
from hybridspec.spec.drafters import NgramDrafter


# -- models --------------------------------------------------------------------------------------

def tiny_model(seed: int = 0, layer_types=("mamba2", "attention", "mamba2"), dtype=torch.float64,
               vocab_size: int = 97, device="cpu") -> HybridModel:
    """A random hybrid model built in code (no HF, no files): hidden size 32,
    a SwiGLU MLP after every mixer; `layer_types` from attention (GQA, half
    rotary), mamba2, mamba1 (Jamba-style inner norms) and gdn (gated DeltaNet,
    two key heads shared by four value heads)."""
    config = HybridConfig(
        vocab_size=vocab_size, hidden_size=32, layer_types=tuple(layer_types), ffn_types=("mlp",) * len(layer_types),
        attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, partial_rotary_factor=0.5),
        mamba2=Mamba2Config(num_heads=4, head_dim=16, d_state=8, chunk_size=8),
        mamba1=Mamba1Config(d_inner=64, d_state=8, dt_rank=4), mlp=MLPConfig(48),
        gdn=GdnConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8),
        max_position_embeddings=512, family="tiny")
    return random_model(config, seed, dtype, device)


def random_model(config: HybridConfig, seed: int = 0, dtype=torch.float64, device="cpu") -> HybridModel:
    """A HybridModel of `config` with random weights (`_random_weight`'s values)."""
    g = torch.Generator().manual_seed(seed)
    weights = {name: _random_weight(name, expected.shape, g).to(device=device, dtype=dtype)
               for name, expected in expected_tensors(config).items()}
    return HybridModel(config, weights)


def _random_weight(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Non-trivial values: decays exp(A_log) in (e^-1, e), softplus(dt bias) steps
    in (0.13, 0.69), norms near 1, projections ~ N(0, 0.25 / fan_in)."""
    if name.endswith("A_log"):
        return torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1
    if name.endswith(("dt_bias", "dt_proj.bias")):
        return torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 2
    if "norm" in name:
        return 1 + 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)
    return torch.randn(shape, generator=g, dtype=torch.float64) * 0.5 / shape[-1] ** 0.5


def random_mtp(target: HybridModel, seed: int = 0) -> MTPLayer:
    """A random MTP layer over `target` (its embedding and LM head): fc, norms and
    one decoder layer of the target's attention kind, `_random_weight`'s values."""
    g = torch.Generator().manual_seed(seed)
    hidden = target.config.hidden_size
    shapes = {name: tuple(t.shape) for name, t in expected_tensors(mtp_config(target.config)).items()
              if name.startswith("layers.0.")}
    shapes |= {"fc.weight": (hidden, 2 * hidden), "pre_fc_norm_embedding.weight": (hidden,),
               "pre_fc_norm_hidden.weight": (hidden,), "norm.weight": (hidden,)}
    weights = {name: _random_weight(name, shape, g).to(device=target.device, dtype=target.dtype)
               for name, shape in shapes.items()}
    return MTPLayer(target, weights).to(target.device)


def perturbed_copy(model: HybridModel, scale: float = 0.03, seed: int = 0) -> HybridModel:
    """A copy of `model` with every weight w replaced by w·(1 + scale·ε),
    ε ~ N(0, 1): a drafter that agrees with the target often, not always."""
    copy = deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():  # a tied weight is listed once
            p.mul_(1 + scale * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.device, p.dtype))
    return copy


def params_fingerprint(models) -> list[tuple[float, float]]:
    """(sum, sum of |w|) of every weight: equal before and after means untouched."""
    return [(p.double().sum().item(), p.double().abs().sum().item()) for m in models for p in m.parameters()]


# -- workloads -----------------------------------------------------------------------------------

def workload(vocab_size: int, seed: int = 0, max_new_tokens=(24, 13, 19),
             prompt_lens=(6, 3, 9, 5)) -> tuple[list[list[int]], list[SamplingParams]]:
    """A ragged greedy batch: one prompt per entry of `max_new_tokens` (lengths
    cycling through `prompt_lens`), each a repeated random motif so that prompt
    lookup finds matches; the limits end rounds at different points (EOS is
    ignored, so every request runs to its limit)."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(len(max_new_tokens)):
        motif = torch.randint(3, vocab_size, (3,), generator=g).tolist()
        prompts.append((motif * 4)[:prompt_lens[i % len(prompt_lens)]])
    return prompts, [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in max_new_tokens]


def branching_prompts(target: HybridModel, params: list[SamplingParams], seed: int, branches: int = 3,
                      tries: int = 8) -> list[list[int]]:
    """One prompt per entry of `params`, a random tail after a head in which the first
    token plain decoding emits (t1, under that entry's sampling) already occurs
    followed by `branches` different tokens: prompt lookup and suffix decoding find
    several continuations of t1 in the first round, so they draft trees. Found by a
    fixed-point search over the head (t1 rarely depends on it), `tries` forwards at
    most; a prompt that found none keeps its last head (its rounds may be chains)."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    tails = [torch.randint(3, vocab, (5,), generator=g).tolist() for _ in params]
    others = [torch.randint(3, vocab, (branches,), generator=g).tolist() for _ in params]
    first = [tail[-1] for tail in tails]  # the guesses of t1
    one = [replace(p, max_new_tokens=1) for p in params]

    def prompt(i: int) -> list[int]:
        return [t for x in others[i] for t in (first[i], x)] + tails[i]

    unsettled = list(range(len(params)))
    for _ in range(tries):
        if not unsettled:
            break
        emitted = [o.token_ids[0] for o in plain_outputs(target, [prompt(i) for i in unsettled],
                                                          [one[i] for i in unsettled])]
        moved = [i for i, t1 in zip(unsettled, emitted) if t1 != first[i]]
        for i, t1 in zip(unsettled, emitted):
            first[i] = t1
        unsettled = moved
    return [prompt(i) for i in range(len(params))]


def sampled_params(seed: int, max_new_tokens=(20, 14, 17, 11)) -> list[SamplingParams]:
    """Seeded sampled requests (temperature 0.8-1.0, with and without top-k,
    top-p, min-p) and one greedy request, mixed in one batch; EOS is ignored."""
    kinds = [dict(temperature=0.9), dict(temperature=1.0, top_k=20), dict(temperature=0.8, top_p=0.9, min_p=0.05),
             dict(temperature=0.0)]
    return [SamplingParams(max_new_tokens=m, seed=seed + i, ignore_eos=True, **kinds[i % len(kinds)])
            for i, m in enumerate(max_new_tokens)]


def plain_outputs(target: HybridModel, prompts, params) -> list:
    """What plain decoding (`Engine(target)`) emits: the reference of every parity check."""
    return Engine(target).generate(prompts, params)


class ScriptedDrafter(NgramDrafter):
    """Proposes a known continuation (the target's own plain output) with
    scripted acceptance: each proposal is the next `a` true tokens and then one
    wrong token, `a` cycling through `schedule` (a >= γ: all true; a < 0: no
    proposal). Under greedy or coupled verification this fixes every round's
    acceptance length."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], schedule: list[int], vocab_size: int):
        super().__init__()
        self.known = [(list(p), list(o)) for p, o in zip(prompts, outputs)]
        self.schedule, self.vocab_size, self.calls = list(schedule), vocab_size, 0

    def lookup(self, context: list[int], gamma: int) -> list[int]:
        a = self.schedule[self.calls % len(self.schedule)]
        self.calls += 1
        for prompt, output in self.known:
            done = len(context) - len(prompt)
            if done >= 0 and context[:len(prompt)] == prompt and context[len(prompt):] == output[:done]:
                truth = output[done:done + gamma]
                if a < 0 or not truth:
                    return []
                wrong = [(truth[a] + 1) % self.vocab_size] if a < len(truth) else []
                return truth[:a] + wrong
        return []


# -- watching rounds -----------------------------------------------------------------------------


class OutOfVocabDrafter(NgramDrafter):
    """Proposes one token id outside the vocabulary (a broken drafter)."""

    def __init__(self, bad_token: int):
        super().__init__()
        self.bad_token = bad_token

    def lookup(self, context: list[int], gamma: int) -> list[int]:
        return [self.bad_token]


