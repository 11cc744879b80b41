"""Reading a model directory strictly: `config.json`, then the weights —
the shards `model.safetensors.index.json` names (each one required, holding
exactly the tensors the index assigns to it), or without an index every
`*.safetensors` file (no tensor in two of them), or one `pytorch_model.bin`.
Every problem is a `ModelFilesError` that names the file."""
from __future__ import annotations

import json
import math
import mmap
import pickle
from pathlib import Path

import torch

from hybridspec.errors import ModelFilesError

INDEX = "model.safetensors.index.json"
BINARY = "pytorch_model.bin"
SHOWN = 4  # names listed in a message


def read_config(path: Path) -> dict:
    """config.json of the model directory `path`, as a dict."""
    if not path.is_dir():
        raise ModelFilesError(f"{path} is not a directory; hs.load expects a model directory holding "
                              "config.json and *.safetensors weights")
    config = read_json(path / "config.json", "the model config")
    if not isinstance(config, dict):
        raise ModelFilesError(f"{path / 'config.json'} holds a JSON {type(config).__name__}, not an object; "
                              "restore the model's config.json")
    return config


def read_json(file: Path, what: str):
    """The JSON in `file` (transformers' {"__float__": "Infinity"} read as floats)."""
    if not file.is_file():
        raise ModelFilesError(f"{file} not found: a model directory needs {file.name} ({what})")
    try:
        return json.loads(file.read_text(encoding="utf-8"), object_hook=_special_floats)
    except (OSError, UnicodeDecodeError) as error:
        raise ModelFilesError(f"{file} cannot be read ({error}); check its permissions or restore it") from None
    except ValueError as error:
        raise ModelFilesError(f"{file} is not valid JSON ({error}); the file is truncated or was edited by "
                              "hand: restore it from the model's original files") from None


def _special_floats(obj: dict):
    return float(obj["__float__"]) if set(obj) == {"__float__"} else obj


def read_weights(path: Path, device, mapped: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors by stored name, stored name -> file name). mapped (CPU
    safetensors only): each tensor a view of the file mapped copy-on-write, so
    that only the pages a later copy reads are read (a tensor-parallel rank
    copying its slices)."""
    read = _mapped_shard if mapped and torch.device(device).type == "cpu" else read_shard
    if (path / INDEX).exists():
        return _read_indexed(path, device, read)
    files = sorted(path.glob("*.safetensors"))
    if files:
        return _read_unindexed(files, device, read)
    if (path / BINARY).is_file():
        state = _read_binary(path / BINARY, device)
        return state, dict.fromkeys(state, BINARY)
    raise ModelFilesError(f"{path} holds no *.safetensors files and no {BINARY}; a model directory needs "
                          "its weights next to config.json")


def _read_indexed(path: Path, device, read) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    index_file = path / INDEX
    weight_map = _weight_map(index_file)
    named: dict[str, set[str]] = {}
    for tensor, file in weight_map.items():
        named.setdefault(file, set()).add(tensor)
    missing = sorted(f for f in named if not (path / f).is_file())
    if missing:
        tensors = sorted(t for f in missing for t in named[f])
        raise ModelFilesError(f"{path}: shard {_few(missing)} named by {INDEX} not found (it holds "
                              f"{_few(tensors)}); restore the missing shard(s) from the model's original files")
    stray = [f.name for f in sorted(path.glob("*.safetensors")) if f.name not in named]
    if stray:
        raise ModelFilesError(f"{path}: {_few(stray)} not named by {INDEX} (a stray shard); remove the stray "
                              "file(s) or restore the index that lists them")
    state, file_of = {}, {}
    for file, tensors in sorted(named.items()):
        shard = read(path / file, device)
        extra, absent = sorted(set(shard) - tensors), sorted(tensors - set(shard))
        if extra or absent:
            problems = [f"it holds {_few(extra)}, which the index does not assign to it"] if extra else []
            problems += [f"it lacks {_few(absent)}, which the index assigns to it"] if absent else []
            raise ModelFilesError(f"{path / file} disagrees with {INDEX}: " + "; ".join(problems)
                                  + "; restore the shard or the index from the model's original files")
        state.update(shard)
        file_of.update(dict.fromkeys(shard, file))
    return state, file_of


def _weight_map(index_file: Path) -> dict[str, str]:
    index = read_json(index_file, "the shard index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not (isinstance(weight_map, dict) and weight_map
            and all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())):
        raise ModelFilesError(f"{index_file} has no \"weight_map\" from tensor names to shard files; restore it "
                              "from the model's original files, or delete it to load every *.safetensors file")
    return weight_map


def _read_unindexed(files: list[Path], device, read) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    state, file_of = {}, {}
    for file in files:
        shard = read(file, device)
        twice = sorted(set(shard) & set(state))
        if twice:
            raise ModelFilesError(f"{file.parent}: {_few(twice)} in both {file_of[twice[0]]} and {file.name}; "
                                  "remove the duplicate shard (or add the model's "
                                  f"{INDEX} so it says which files belong to the model)")
        state.update(shard)
        file_of.update(dict.fromkeys(shard, file.name))
    return state, file_of


def read_shard(file: Path, device) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(str(file), device=str(device))
    except (SafetensorError, OSError) as error:
        raise ModelFilesError(f"{file} is not a readable safetensors file ({error}); it is truncated or "
                              "corrupt: restore it from the model's original files") from None


def _map(file: Path) -> mmap.mmap:
    """`file` mapped copy-on-write (the tensors are writable, the file never
    written), read at random: no read-ahead into the slices other ranks take."""
    with open(file, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return mapped


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _mapped_shard(file: Path, device) -> dict[str, torch.Tensor]:
    """read_shard's tensors as views of `file` mapped privately (pages read when
    touched); safetensors checks the file first, so a corrupt one fails as in
    read_shard. A dtype or offset the view cannot take is read whole."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(file), framework="pt") as opened:  # validates the header and the offsets
            names = list(opened.keys())
        with open(file, "rb") as f:
            header_size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_size))
    except (SafetensorError, OSError, ValueError) as error:
        raise ModelFilesError(f"{file} is not a readable safetensors file ({error}); it is truncated or "
                              "corrupt: restore it from the model's original files") from None
    storage = _map(file)
    out, whole = {}, []
    for name in names:
        info = header[name]
        dtype, (start, _) = _DTYPES.get(info["dtype"]), info["data_offsets"]
        offset = 8 + header_size + start
        if dtype is None or offset % dtype.itemsize:
            whole.append(name)
            continue
        count = math.prod(info["shape"])
        out[name] = (torch.frombuffer(storage, dtype=dtype, count=count, offset=offset).view(info["shape"])
                     if count else torch.empty(info["shape"], dtype=dtype))
    if whole:
        with safe_open(str(file), framework="pt") as opened:
            out.update({name: opened.get_tensor(name) for name in whole})
    return out


def _read_binary(file: Path, device) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location=device, weights_only=True)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as error:
        raise ModelFilesError(f"{file} is not a readable PyTorch state dict ({error}); restore it from the "
                              "model's original files") from None
    if not (isinstance(state, dict) and all(isinstance(t, torch.Tensor) for t in state.values())):
        raise ModelFilesError(f"{file} does not hold a state dict of tensors; save the model's state_dict()")
    return state


def describe_files(path: Path, files: list[str]) -> str:
    """`path` and the weight files read from it, for messages."""
    shown = ", ".join(files) if len(files) <= 2 else f"{files[0]} ... {files[-1]}, {len(files)} files"
    return f"{path} ({shown})"


def _few(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more
