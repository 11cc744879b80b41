"""Round costs kept on disk between start-ups: an engine with
`num_draft_tokens="auto"` that finds the costs its start-up would measure
(`hybridspec.engine.startup_costs`) takes them from a file instead, one file
per key (`cost_key`: the models' weights and shapes, the drafter, the
checkpoint policy, γ_max, the state dtype, the kernels' backend and compute,
the device, the machine, torch's version and threads, and the measuring
code), under `$HYBRIDSPEC_CACHE_DIR/costs` (the folder the
native kernels' builds share; default `~/.cache/hybridspec`). A file holds
the largest batch it was timed at; an engine of a larger `max_batch_size`
times its own and replaces it. Writes are atomic (a temporary file
renamed); a missing, corrupt or unreadable file, or one that cannot be
written, is passed over: the engine measures, as without a cache.
`HYBRIDSPEC_COST_CACHE=0` turns the cache off (the tests do: timings are
measured fresh there). A costs file answers only what start-up would time;
what the machine's load does to them the controller learns online
(`hybridspec.spec.gamma`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import platform
import tempfile
from pathlib import Path

import torch

from hybridspec.costs.checkpoint_costs import CheckpointCosts
from hybridspec.costs.round_costs import RoundCosts
from hybridspec.kernels import backend as backends

SWITCH_ENV = "HYBRIDSPEC_COST_CACHE"  # "0": neither read nor write costs files
FORMAT = 1  # the files' layout; a file of another is passed over
MEASURING_CODE = ("startup_costs.py", "../costs/round_costs.py", "../costs/round_terms.py")  # what a file's numbers mean
SAMPLED_WEIGHTS = 64  # values per weight tensor that enter a model's fingerprint

log = logging.getLogger(__name__)


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "1") not in ("", "0")


def cache_dir() -> Path:
    return backends.cache_root() / "costs"


def cost_key(target, draft_model, drafter, policy, gamma_max: int, state_dtype) -> dict:
    """Everything the measured costs depend on but the batch sizes, as JSON-able values."""
    return {
        "format": FORMAT,
        "code": _code_digest(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": [platform.machine(), _cpu_name(), os.cpu_count()],
        "device": backends.device_name(target.device),
        "target": model_fingerprint(target),
        "draft": None if draft_model is None else model_fingerprint(draft_model),
        "drafter": type(drafter).__qualname__,
        "policy": repr(policy),
        "gamma_max": gamma_max,
        "state_dtype": str(state_dtype),
    }


def model_fingerprint(model) -> str:
    """A digest of a model's config, dtype, backend and compute, and its
    weights' names, shapes and an evenly spaced sample of their values
    (reading every weight would cost what a large model's load does)."""
    digest = hashlib.sha256(f"{model.config!r} {model.dtype} {model.backend.name} {model.compute}".encode())
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLED_WEIGHTS)][:SAMPLED_WEIGHTS]
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(sample.to("cpu", torch.float64).numpy().tobytes())
    return digest.hexdigest()


def path_of(key: dict) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / f"round-costs-{name}.json"


def load(key: dict, top_batch: int) -> tuple[RoundCosts, CheckpointCosts | None] | None:
    """The stored costs of `key` (without a replay price) and the replay's
    checkpoint costs, where a file holds them up to `top_batch` rows; None
    otherwise, or where the file cannot be read or is not one of ours."""
    if not enabled():
        return None
    path = path_of(key)
    try:
        stored = json.loads(path.read_text())
        if stored["key"] != key:  # a digest collision or a hand-edited file
            return None
        costs = RoundCosts(**_tuples(stored["costs"]))
        replay = None if stored["replay"] is None else CheckpointCosts(**_tuples(stored["replay"]))
    except FileNotFoundError:
        return None
    except Exception as error:  # noqa: BLE001  (whatever a bad file raises: it is passed over, never fatal)
        log.warning("ignoring the round costs file %s (%s: %s); measuring instead", path, type(error).__name__, error)
        return None
    return (costs, replay) if costs.batches[-1] >= top_batch else None


def store(key: dict, costs: RoundCosts, replay: CheckpointCosts | None) -> None:
    """Write `costs` (its replay price left out) and `replay` for `key`,
    atomically; a folder that cannot be written is passed over."""
    if not enabled():
        return
    path = path_of(key)
    fields = {f.name: getattr(costs, f.name) for f in dataclasses.fields(costs) if f.name != "replay"}
    text = json.dumps({"key": key, "costs": fields, "replay": None if replay is None else dataclasses.asdict(replay)})
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(handle, "w") as f:
            f.write(text)
        os.replace(temporary, path)  # readers see the old file or the whole new one
    except OSError as error:
        log.warning("could not keep the round costs in %s (%s); the next start measures them again", path, error)
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)

def _tuples(fields: dict) -> dict:
    """JSON lists back into the tuples the cost tables are made of."""
    def of(value):
        return tuple(of(v) for v in value) if isinstance(value, list) else value
    return {name: of(value) for name, value in fields.items()}


def _code_digest() -> str:
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in MEASURING_CODE:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


def _cpu_name() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()
