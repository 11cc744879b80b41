"""hybridspec: lossless speculative decoding for hybrid Mamba/attention models.

    import hybridspec as hs
    llm = hs.LLM()                                      # the embedded byte-level pair; hs.LLM("model/dir")
    print(llm.generate(["def add(a, b):"], hs.SamplingParams(max_new_tokens=32))[0].text)

    target = hs.from_hf(hf_model)                       # or hs.load("model/dir")
    engine = hs.Engine(target, draft=hs.from_hf(hf_draft), num_draft_tokens=4)
    outs = engine.generate([[1, 2, 3]], hs.SamplingParams(max_new_tokens=32))   # token ids in and out

The names below load on first use, so `import hybridspec` (and the command
line's `--help`) does not import torch until something needs it.
"""
from importlib import import_module

__version__ = "0.1.0"

_HOMES = {
    "AutoCheckpointPolicy": "hybridspec.checkpoints.auto",
    "CheckpointPolicy": "hybridspec.checkpoints.policy",
    "Completion": "hybridspec.llm",
    "Drafter": "hybridspec.spec.drafters",
    "Engine": "hybridspec.engine.engine",
    "EngineConfig": "hybridspec.engine.config",
    "EngineStats": "hybridspec.engine.stats",
    "HybridConfig": "hybridspec.config",
    "HybridModel": "hybridspec.models.hybrid",
    "LLM": "hybridspec.llm",
    "NgramDrafter": "hybridspec.spec.drafters",
    "Output": "hybridspec.engine.engine",
    "PrefixCache": "hybridspec.cache.prefix_cache",
    "Proposal": "hybridspec.spec.drafters",
    "SamplingParams": "hybridspec.sampling.sampler",
    "StatelessDrafter": "hybridspec.spec.drafters",
    "StructuredOutput": "hybridspec.sampling.structured",
    "SuffixDrafter": "hybridspec.spec.drafters",
    "TokenLogprob": "hybridspec.sampling.logprobs",
    "TreeShape": "hybridspec.spec.tree",
    "derived_seed": "hybridspec.sampling.sampler",
    "embedded_paths": "hybridspec.adapters.embedded",
    "from_hf": "hybridspec.adapters",
    "load": "hybridspec.adapters",
    "serve": "hybridspec.serve",  # an OpenAI-compatible server ([serve] extra)
}
_MODULES = ("errors", "sim")

__all__ = sorted([*_HOMES, *_MODULES])


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(import_module(_HOMES[name]), name)
    elif name in _MODULES:
        value = import_module(f"hybridspec.{name}")
    else:
        raise AttributeError(f"module 'hybridspec' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
