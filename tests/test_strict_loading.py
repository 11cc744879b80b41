"""Strict loading of model directories (`hs.load`, `hs.from_hf`): a broken directory or
a config that does not match its weights raises ModelFilesError naming the
directory, the file and the tensors; never a different model. The fuzz test
corrupts a saved sharded model directory at random: each corruption gives a typed
error or a model whose logits equal the original's."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.config import MLPConfig
from hybridspec.errors import ConfigError, HybridSpecError, ModelFilesError
from oracles import bamba

INDEX = "model.safetensors.index.json"
IDS = [[5, 9, 3, 7, 2, 11], [4, 4, 8]]


def logits(model) -> torch.Tensor:
    cache = HybridCache(model.config, max_seqs=2, num_blocks=16, block_size=4, ring_slots=2, dtype=model.dtype)
    return model.prefill(cache, [0, 1], IDS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A float64 Bamba (Mamba2 + attention, untied lm_head) saved in 5 shards with an index."""
    path = tmp_path_factory.mktemp("ckpt") / "orig"
    bamba(seed=0, vocab=64).save_pretrained(path, max_shard_size="40KB")
    assert len(list(path.glob("*.safetensors"))) >= 4 and (path / INDEX).is_file()
    return path


@pytest.fixture(scope="module")
def reference(saved) -> torch.Tensor:
    return logits(hs.load(saved))


def copy_of(saved: Path, tmp: Path) -> Path:
    target = tmp / "ckpt"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(saved, target)
    return target


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def shard_of(path: Path, tensor: str) -> Path:
    return path / read_json(path / INDEX)["weight_map"][tensor]


def edit_config(path: Path, **changes) -> None:
    config = read_json(path / "config.json")
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def edit_shard(path: Path, tensor: str, change) -> None:
    """Rewrite the shard holding `tensor` with change(tensors) applied (index untouched)."""
    file = shard_of(path, tensor)
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


# -- the cases of issue 9 -----------------------------------------------------------------------------------


def test_sharded_model_directory_loads_as_the_original(saved, reference, tmp_path):
    path = copy_of(saved, tmp_path)
    assert torch.equal(logits(hs.load(path)), reference)
    (path / INDEX).unlink()  # without an index every shard is read
    assert torch.equal(logits(hs.load(path)), reference)


def test_missing_lm_head_shard_is_an_error_not_tied_embeddings(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    shard = shard_of(path, "lm_head.weight")
    shard.unlink()
    with pytest.raises(ModelFilesError, match=f"{shard.name} named by {INDEX} not found.*lm_head.weight"):
        hs.load(path)
    (path / INDEX).unlink()
    with pytest.raises(ModelFilesError, match=r"missing: .*lm_head\.weight.*tie_word_embeddings"):
        hs.load(path)


def test_missing_ordinary_shard_names_file_and_tensors(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    shard = shard_of(path, "model.layers.0.input_layernorm.weight")
    shard.unlink()
    with pytest.raises(ModelFilesError, match=f"{shard.name}.*model.layers.0.input_layernorm.weight"):
        hs.load(path)


@pytest.mark.parametrize("changes,fragment", [
    (dict(vocab_size=100), r"embed_tokens\.weight \(model\.embed_tokens\.weight in model-\d+-of-\d+\.safetensors\) "
                           r"is \[64, 32\], expected \[100, 32\]"),
    (dict(mamba_n_heads=8), r"layers\.0\.mixer\.A_log .* is \[4\], expected \[8\]"),
    (dict(num_hidden_layers=2), r"unused: layers\.2\."),
    (dict(num_hidden_layers=4), r"missing: layers\.3\."),
    (dict(mamba_proj_bias=True), r"missing: layers\.0\.mixer\.in_proj\.bias"),
    (dict(tie_word_embeddings=True), r"unused: lm_head\.weight.*ties the embeddings"),
    (dict(attn_layer_indices=[2]), r"missing: layers\.1\.mixer\.in_proj\.weight"),
])
def test_config_that_does_not_match_the_weights(saved, tmp_path, changes, fragment):
    path = copy_of(saved, tmp_path)
    edit_config(path, **changes)
    with pytest.raises(ModelFilesError, match=fragment) as error:
        hs.load(path)
    assert str(path) in str(error.value)


@pytest.mark.parametrize("edit,fragment", [
    (lambda p: (p / "config.json").write_text((p / "config.json").read_text()[:80]), "config.json is not valid JSON"),
    (lambda p: edit_config(p, num_hidden_layers=None), "config.json has no 'num_hidden_layers' field"),
    (lambda p: edit_config(p, hidden_size="32"), "config.json holds a field of the wrong type"),
    (lambda p: edit_config(p, mamba_conv_bias="yes"), "conv_bias='yes' must be true or false"),
    (lambda p: (p / "config.json").unlink(), "config.json not found"),
    (lambda p: (p / "config.json").write_text("[1, 2]"), "holds a JSON list"),
    (lambda p: (p / INDEX).write_text("{\"weight_map\": "), f"{INDEX} is not valid JSON"),
    (lambda p: (p / INDEX).write_text("{\"weight_map\": []}"), "has no \"weight_map\""),
])
def test_malformed_files_name_the_file(saved, tmp_path, edit, fragment):
    path = copy_of(saved, tmp_path)
    edit(path)
    with pytest.raises(ModelFilesError, match=fragment):
        hs.load(path)


def test_truncated_shard_names_the_file(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    shard = shard_of(path, "lm_head.weight")
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ModelFilesError, match=f"{shard.name} is not a readable safetensors file"):
        hs.load(path)


def test_extra_or_unknown_tensors_are_refused(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    shard = shard_of(path, "lm_head.weight")
    name = "model.layers.0.mamba.in_proj.bias"  # a bias the config (mamba_proj_bias false) does not allow
    edit_shard(path, "lm_head.weight", lambda t: t.update({name: torch.zeros(3)}))
    with pytest.raises(ModelFilesError, match=f"holds {name}, which the index does not assign"):
        hs.load(path)
    (path / INDEX).unlink()
    with pytest.raises(ModelFilesError, match=r"unused: layers\.0\.mixer\.in_proj\.bias"):
        hs.load(path)
    tensors = load_file(str(shard))
    del tensors[name]
    tensors["model.extra.weight"] = torch.zeros(2)  # a name no renaming rule knows
    save_file(tensors, str(shard))
    with pytest.raises(ModelFilesError, match=rf"unused: model\.extra\.weight \(in {shard.name}\)"):
        hs.load(path)


def test_duplicate_shard_without_index(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    (path / INDEX).unlink()
    shard = _shards(path)[1]
    shutil.copy(shard, path / "copy.safetensors")
    with pytest.raises(ModelFilesError, match=f"in both copy.safetensors and {shard.name}"):
        hs.load(path)


def test_stray_shard_with_index(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    shutil.copy(_shards(path)[1], path / "copy.safetensors")
    with pytest.raises(ModelFilesError, match=f"copy.safetensors not named by {INDEX}"):
        hs.load(path)


def test_not_a_directory(saved, tmp_path):
    with pytest.raises(ModelFilesError, match="is not a directory"):
        hs.load(tmp_path / "nope")
    shutil.copy(saved / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelFilesError, match="holds no \\*.safetensors files"):
        hs.load(tmp_path)


def test_from_hf_runs_the_same_checks():
    m = bamba(seed=0, vocab=64)
    m.config.vocab_size = 100
    with pytest.raises(ModelFilesError, match=r"BambaForCausalLM \(from_hf\).*embed_tokens\.weight "
                                              r"\(model\.embed_tokens\.weight\) is \[64, 32\], expected \[100, 32\]"):
        hs.from_hf(m)
    m.config.vocab_size, m.config.mamba_proj_bias = 64, True
    with pytest.raises(ModelFilesError, match=r"missing: layers\.0\.mixer\.in_proj\.bias"):
        hs.from_hf(m)


def test_config_fields_are_type_checked():
    with pytest.raises(ConfigError, match="MLPConfig.intermediate_size=48.0 must be an integer"):
        MLPConfig(48.0)
    with pytest.raises(ConfigError, match="MLPConfig.gated=1 must be true or false"):
        MLPConfig(48, gated=1)


# -- fuzz: random corruptions of a saved model directory -------------------------------------------------------

CONFIG_FIELDS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "attn_layer_indices", "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups",
                 "mamba_expand", "mamba_d_conv", "intermediate_size", "tie_word_embeddings", "mamba_conv_bias",
                 "mamba_proj_bias", "attention_bias", "mlp_bias", "architectures", "model_type"]
FIELD_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 130), st.floats(-1, 100, allow_nan=False),
                         st.text(max_size=4), st.lists(st.integers(-1, 4), max_size=3))


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


@st.composite
def corruptions(draw):
    """(description, function(path) that corrupts the model directory at path)."""
    kind = draw(st.sampled_from(["delete shard", "truncate shard", "rename shard", "truncate config", "edit config",
                                 "drop tensor", "add tensor", "reshape tensor", "corrupt index", "drop index"]))
    pick = draw(st.integers(0, 10 ** 6))
    fraction = draw(st.floats(0.0, 0.999))
    update_index = draw(st.booleans())
    field, value = draw(st.sampled_from(CONFIG_FIELDS)), draw(FIELD_VALUES)

    def corrupt(path: Path) -> None:
        shards = _shards(path)
        shard = shards[pick % len(shards)]
        weight_map = read_json(path / INDEX)["weight_map"]
        tensor = sorted(weight_map)[pick % len(weight_map)]
        if kind == "delete shard":
            shard.unlink()
        elif kind == "truncate shard":
            shard.write_bytes(shard.read_bytes()[:int(fraction * shard.stat().st_size)])
        elif kind == "rename shard":
            shard.rename(path / ("renamed.safetensors" if update_index else "renamed.bin"))
        elif kind == "truncate config":
            text = (path / "config.json").read_text()
            (path / "config.json").write_text(text[:int(fraction * len(text))])
        elif kind == "edit config":
            edit_config(path, **{field: value})
        elif kind in ("drop tensor", "add tensor", "reshape tensor"):
            _edit_tensor(path, kind, tensor, update_index, fraction)
        elif kind == "corrupt index":
            _corrupt_index(path, weight_map, tensor, pick, fraction)
        else:
            (path / INDEX).unlink()

    return f"{kind} (pick {pick}, fraction {fraction:.3f}, index {update_index}, {field}={value!r})", corrupt


def _edit_tensor(path: Path, kind: str, tensor: str, update_index: bool, fraction: float) -> None:
    index = read_json(path / INDEX)
    if kind == "drop tensor":
        edit_shard(path, tensor, lambda t: t.pop(tensor))
        if update_index:
            del index["weight_map"][tensor]
    elif kind == "add tensor":
        name = tensor.replace("weight", "bias") if fraction < 0.5 else tensor + "_extra"
        edit_shard(path, tensor, lambda t: t.setdefault(name, torch.zeros(3)))
        if update_index:
            index["weight_map"].setdefault(name, index["weight_map"][tensor])
    else:  # a vector loses entries, a matrix is flattened (same numel, another shape)
        def reshape(tensors):
            t = tensors[tensor]
            tensors[tensor] = t.flatten() if t.ndim >= 2 else t[:max(1, int(fraction * t.numel()))]
        edit_shard(path, tensor, reshape)
    (path / INDEX).write_text(json.dumps(index))


def _corrupt_index(path: Path, weight_map: dict, tensor: str, pick: int, fraction: float) -> None:
    choice = pick % 4
    if choice == 0:
        text = (path / INDEX).read_text()
        (path / INDEX).write_text(text[:int(fraction * len(text))])
        return
    if choice == 1:
        del weight_map[tensor]
    elif choice == 2:
        files = sorted(set(weight_map.values()))
        weight_map[tensor] = files[(files.index(weight_map[tensor]) + 1) % len(files)]
    else:
        weight_map["model.layers.9.extra.weight"] = weight_map[tensor]
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(corruption=corruptions())
def test_corrupted_model_directory_is_an_error_or_the_same_model(saved, reference, tmp_path, corruption):
    description, corrupt = corruption
    path = copy_of(saved, tmp_path)
    corrupt(path)
    try:
        model = hs.load(path)
    except HybridSpecError as error:
        assert str(error).strip(), description
        return
    assert torch.equal(logits(model), reference), f"{description} loaded as another model"
