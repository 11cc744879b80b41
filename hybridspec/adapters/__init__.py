"""Adapters: build a `HybridModel` from an HF transformers model object
(`from_hf`, sharing its parameters) or from a local model directory
(`load`: config.json + safetensors in HF layout or in mamba_ssm's
`MambaLMHeadModel` layout)."""
from __future__ import annotations

import importlib
from pathlib import Path

import torch

from hybridspec.config import HybridConfig
from hybridspec.errors import ConfigError, ModelFilesError, UnsupportedModelError
from hybridspec.kernels import backend as backends
from hybridspec.kernels import huge_pages
from hybridspec.models.hybrid import HybridModel
from hybridspec.models import quantizing
from hybridspec.models.packing import HALF_DTYPES, storable_16bit
from hybridspec.adapters.model_files import describe_files, read_config, read_weights
from hybridspec.adapters.common import MTP_UNUSED, LoadReport, set_aside, unmatched  # noqa: F401 (LoadReport: HybridModel.load_report's type)
from hybridspec.adapters.validate import check_weights

# HF architecture name -> adapter module (config_from_dict, weights_from_state)
HF_ADAPTERS = {
    "BambaForCausalLM": "bamba",
    "JambaForCausalLM": "jamba",
    "NemotronHForCausalLM": "nemotron_h",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "FalconH1ForCausalLM": "falcon_h1",
    "Zamba2ForCausalLM": "zamba2",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # the released models: the text model runs
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
}
MODEL_TYPES = {"bamba": "BambaForCausalLM", "jamba": "JambaForCausalLM", "nemotron_h": "NemotronHForCausalLM",
               "granitemoehybrid": "GraniteMoeHybridForCausalLM", "falcon_h1": "FalconH1ForCausalLM",
               "zamba2": "Zamba2ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
               "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
               "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
SUPPORTED = sorted(HF_ADAPTERS) + ["mamba_ssm MambaLMHeadModel (hybrid Mamba2 + MHA)"]


def _adapter(architecture: str):
    if architecture not in HF_ADAPTERS:
        raise UnsupportedModelError(f"architecture {architecture!r} is not supported; supported: "
                                    + ", ".join(SUPPORTED))
    return _adapter_module(HF_ADAPTERS[architecture])


def _adapter_module(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def from_hf(model, tensor_parallel_size: int = 1) -> HybridModel:
    """A HybridModel from a loaded HF model (`BambaForCausalLM`, `JambaForCausalLM`,
    `NemotronHForCausalLM`, `GraniteMoeHybridForCausalLM`, `FalconH1ForCausalLM`, `Zamba2ForCausalLM`,
    `Qwen3NextForCausalLM`, `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM` or their multimodal
    `…ForConditionalGeneration`, whose text model runs), sharing its parameters
    (no copy: same dtype and device; the Qwen adapters' zero-centred norms, fused
    GDN projections and stacked experts are copies).
    tensor_parallel_size: > 1, this process's shard of the model over a
    torch.distributed group of that many ranks (`hybridspec.tp`; the sharded
    tensors are copies).
    Raises UnsupportedModelError for other architectures and ModelFilesError
    when a tensor is missing or has the wrong shape for the config."""
    architecture = type(model).__name__
    adapter = _adapter(architecture)
    source = f"{architecture} (from_hf)"
    cfg = model.config.to_dict()
    config = _config(adapter.config_from_dict, cfg, f"{source} config")
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    state, report = set_aside(state, getattr(adapter, "UNUSED", []) + MTP_UNUSED, source)
    weights = _checked(config, _to_canonical(adapter, cfg), state, adapter.RULES, source, {})
    return _build(config, weights, tensor_parallel_size, report)


def load(path: str | Path, dtype: torch.dtype | None = None, device="cpu", pack: bool | None = None,
         tensor_parallel_size: int = 1, compute: str | torch.dtype | None = None,
         quantize: str | None = None) -> HybridModel:
    """Load a model directory: config.json + safetensors shards (with
    model.safetensors.index.json when sharded) or pytorch_model.bin, in HF
    layout or mamba_ssm's layout, from local files only.

    path: the directory. dtype: cast floating weights to it (default None:
    as stored). device: where the tensors are read to (default "cpu").
    pack: lay linear weights out for CPU decoding (`HybridModel.pack_for_cpu`,
    which also keeps float32 weights whose values are all bfloat16 or float16
    values in that type, exactly: load bf16 or fp16 weights with
    dtype=torch.float32 on CPU; default None: on CPU). tensor_parallel_size:
    > 1, this process's shard over a torch.distributed group of that many
    ranks (`hybridspec.tp`). compute: what the products multiply in
    (`HybridModel.set_compute`): None or "float32" (default, exact), or
    "bfloat16", the opt-in fast path on CPUs with AVX512-BF16 (a float32 model
    whose products round their activations to bfloat16: close to float32, not
    its bits; dtype None then means float32); a ConfigError before anything is
    read where it cannot run. quantize: "q8_0", "q4_0" or "q4_k" quantizes the
    decoder layers' linear weights into that GGUF block format and the LM head into
    Q8_0 (`HybridModel.quantize`; float32 on CPU, dtype None then means float32); a
    ConfigError before anything is read for another value or a model it cannot take.
    Loading is strict: a missing or unreadable file, or weights that differ
    from what config.json implies, raise ModelFilesError (see
    `model_files`, `validate`); tensors the adapter knows to be present
    and unused (Qwen3-Next's and Qwen3.5's `mtp.*`) are left out and named in
    the model's `load_report`.
    A GGUF file (a path ending in .gguf, or a file with GGUF's magic) loads through
    `adapters.gguf` (llama.cpp's layout; its Q8_0 / Q4_0 / Q4_K / Q6_K weights stay quantized).
    The memory the load's temporaries were freed into goes back to the OS at the end."""
    model = _load(path, dtype, device, pack, tensor_parallel_size, compute, quantize)
    huge_pages.return_freed_memory()  # the reader's and the loader's copies, gone with their frames
    return model


def _load(path, dtype, device, pack, tensor_parallel_size, compute, quantize) -> HybridModel:
    """`load` itself (whose temporaries are freed when it returns)."""
    compute = HybridModel.compute_for(compute, device, dtype)
    from hybridspec.adapters.gguf import is_gguf
    if is_gguf(path):
        from hybridspec.adapters.gguf.loader import load_gguf
        return load_gguf(path, dtype, device, pack, tensor_parallel_size, compute, quantize)
    if compute is torch.bfloat16 and dtype is None:
        dtype = torch.float32
    if quantize is not None:
        quantizing.check(quantize, device, dtype, tensor_parallel_size != 1, compute)
        dtype = torch.float32
    path = Path(path)
    cfg = read_config(path)
    config_file = str(path / "config.json")
    unused_patterns = []
    if "d_model" in cfg and "n_layer" in cfg:
        from hybridspec.adapters import mamba_ssm
        config = _config(mamba_ssm.config_from_dict, cfg, config_file)
        to_canonical, rules = (lambda state: mamba_ssm.weights_from_state(state, cfg)), mamba_ssm.RULES
    else:
        model_type = str(cfg.get("model_type", "<missing>"))
        architectures = cfg.get("architectures") or [MODEL_TYPES.get(model_type, model_type)]
        adapter = _adapter(str(architectures[0] if isinstance(architectures, list) else architectures))
        config = _config(adapter.config_from_dict, cfg, config_file)
        to_canonical, rules = _to_canonical(adapter, cfg), adapter.RULES
        unused_patterns = getattr(adapter, "UNUSED", [])
    mapped = tensor_parallel_size > 1  # a rank reads only its slices' pages of the files
    state, file_of = read_weights(path, device, mapped=mapped)
    source = describe_files(path, sorted(set(file_of.values())))
    state, report = set_aside(state, unused_patterns + MTP_UNUSED, source)
    weights = _checked(config, to_canonical, state, rules, source, file_of)
    if pack is None:
        pack = backends.packs_for_cpu(device)
    del state  # the model holds what it uses: packing frees each original as it copies it
    # cast after sharding: a rank casts (and so reads) only its slices
    model = _build(config, weights, tensor_parallel_size, report,
                   lambda w: _owned(_cast(w, dtype, pack)) if mapped else _cast(w, dtype, pack))
    del weights
    return _finish(model, path, quantize, pack, compute)


def _finish(model: HybridModel, path: Path, quantize: str | None, pack: bool, compute: torch.dtype) -> HybridModel:
    """What every load does last: where it came from (draft="mtp" reads beside it), quantizing (before
    packing: quantized weights are not packed again), packing for the CPU, the products' compute."""
    model.source_dir = path
    if quantize is not None:
        model.quantize(quantize)
    if pack:
        model.pack_for_cpu()
    if compute is not torch.float32:
        model.set_compute(compute)
    return model


def _build(config: HybridConfig, weights: dict[str, torch.Tensor], tensor_parallel_size: int,
           report, prepare=None) -> HybridModel:
    """The HybridModel of `weights`, or this rank's shard of it (`hybridspec.tp`),
    with its load report; `prepare` (if given) maps the (shard's) weights first."""
    prepare = prepare or (lambda w: w)
    if tensor_parallel_size == 1:
        model = HybridModel(config, prepare(weights))
    else:
        from hybridspec.tp import TensorParallel, shard_weights
        tp = TensorParallel.of(tensor_parallel_size)
        config, weights = shard_weights(config, weights, tp.rank, tp.size)
        model = HybridModel(config, prepare(weights)).shard_over(tp)
    model.load_report = report
    return model


def _cast(weights: dict[str, torch.Tensor], dtype: torch.dtype | None, pack: bool) -> dict[str, torch.Tensor]:
    """Floating weights in `dtype` (None: as they are). Packed for float32 compute, a 16-bit
    product weight or embedding is kept as it is (what pack_for_cpu stores, exactly): no
    float32 copy of the whole model on the way."""
    if dtype is None:
        return weights
    keep = pack and dtype is torch.float32
    return {k: (v.to(dtype) if v.is_floating_point() and not k.endswith("inv_freq")
                and not (keep and v.dtype in HALF_DTYPES and storable_16bit(k)) else v)
            for k, v in weights.items()}


def _owned(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor in storage of its own: a replicated tensor still viewing a mapped
    weight file (`read_weights(mapped=True)`) is copied, so the model holds no mapping."""
    return {k: v.clone() if v.untyped_storage().nbytes() != v.nbytes else v for k, v in weights.items()}


def _to_canonical(adapter, cfg: dict):
    """The adapter's stored-names -> canonical-names function; Zamba2's also
    reads the config (which layers run which shared block)."""
    if getattr(adapter, "WEIGHTS_NEED_CONFIG", False):
        return lambda state: adapter.weights_from_state(state, cfg)
    return adapter.weights_from_state


def _config(config_from_dict, cfg: dict, source: str) -> HybridConfig:
    """config_from_dict(cfg), its failures on missing or malformed fields as ModelFilesError naming `source`."""
    try:
        return config_from_dict(cfg)
    except KeyError as error:
        raise ModelFilesError(f"{source} has no {error.args[0]!r} field, which this model family requires; "
                              "restore it from the model's original files") from None
    except ConfigError as error:
        raise ModelFilesError(f"{source}: {error}; fix the field in the config") from None
    except UnsupportedModelError:
        raise
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as error:
        raise ModelFilesError(f"{source} holds a field of the wrong type or value ({type(error).__name__}: "
                              f"{error}); compare it with the model's original config") from None


def _checked(config: HybridConfig, to_canonical, state: dict[str, torch.Tensor], rules, source: str,
             file_of: dict[str, str]) -> dict[str, torch.Tensor]:
    """The canonical weights of `state`, checked against `config` (validate.check_weights)."""
    try:
        weights = to_canonical(state)
    except ModelFilesError as error:
        raise ModelFilesError(f"{source}: {error}") from None
    origin = {id(t): name for name, t in state.items()}

    def describe(name: str) -> str:
        tensor = weights[name]
        original = origin.get(id(tensor)) or origin.get(id(tensor._base))
        file = file_of.get(original)
        where = " ".join(filter(None, (original if original != name else None, file and f"in {file}")))
        return f"{name} ({where})" if where else name

    unknown = [f"{n} (in {file_of[n]})" if n in file_of else n for n in unmatched(state, rules)]
    return check_weights(config, weights, unknown, source, describe)
