"""`hs.EngineConfig`: the Engine's settings in one checked, frozen value.
Its defaults are the Engine's; a bad setting is the same ConfigError the
Engine raised, before any model work; an Engine built from a config equals
one built from the same keyword settings; a config and keyword settings that
disagree are refused; the command line builds one config from its flags."""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest
import torch

import hybridspec as hs
from hybridspec.checkpoints.policy import MAX_DRAFT_TOKENS
from hybridspec.cli.args import engine_config
from hybridspec.engine import engine as engine_module
from hybridspec.errors import ConfigError
from hybridspec.rollback import perturbed_copy, tiny_model

VOCAB = 97
LIMIT = 512  # tiny_model's max_position_embeddings

# `Engine(...)`'s keyword defaults before the settings became an EngineConfig
ENGINE_DEFAULTS = dict(num_draft_tokens=4, checkpoint=None, verify="rejection", max_draft_tokens=None,
                       max_batch_size=16, max_model_len=None, block_size=16, num_blocks=None, state_dtype=None,
                       eos_token_ids=None, decode=None, tokenizer=None, prefix_cache=None, cuda_graphs=None,
                       tensor_parallel_size=None, tree=None)

# (settings, the Engine's error for them): checked by the config alone
BAD_SETTINGS = [
    (dict(verify="greedy"), "verify='greedy' must be 'rejection' or 'coupled'"),
    (dict(state_dtype=torch.int32), r"state_dtype=torch\.int32 must be a floating torch\.dtype"),
    (dict(state_dtype="float32"), "state_dtype='float32' must be a floating torch.dtype"),
    (dict(decode="text"), "decode='text' must be a function from token ids to text"),
    (dict(prefix_cache="on"), r"prefix_cache='on' must be True, False, None or hs\.PrefixCache"),
    (dict(max_batch_size=0), "max_batch_size=0 must be an integer >= 1"),
    (dict(max_batch_size=True), "max_batch_size=True must be an integer >= 1, not a bool"),
    (dict(block_size=2.5), r"block_size=2\.5 must be an integer >= 1 \(tokens per KV block"),
    (dict(num_blocks=0), "num_blocks=0 must be an integer >= 1; or None"),
    (dict(max_draft_tokens=3), "max_draft_tokens=3 is for num_draft_tokens='auto'"),
    (dict(num_draft_tokens="auto", max_draft_tokens=0), "max_draft_tokens=0 must be an integer >= 1"),
    (dict(num_draft_tokens=0), "num_draft_tokens=0 must be an integer >= 1"),
    (dict(num_draft_tokens="4"), "num_draft_tokens='4' must be an integer >= 1"),
    (dict(num_draft_tokens=MAX_DRAFT_TOKENS + 1), f"num_draft_tokens={MAX_DRAFT_TOKENS + 1} exceeds"),
    (dict(checkpoint="sometimes"), "checkpoint='sometimes' must be a CheckpointPolicy or 'auto'"),
    (dict(checkpoint=2), "checkpoint must be a CheckpointPolicy or 'auto', got int"),
    (dict(cuda_graphs="yes"), "cuda_graphs='yes' must be True, False or None"),
]
# (settings, error): bounded by the target, checked by the Engine against it
BAD_FOR_THE_MODEL = [
    (dict(max_model_len=0), rf"max_model_len=0 must be an integer >= 1 \(the model allows up to {LIMIT}\)"),
    (dict(max_model_len=LIMIT + 1), f"max_model_len={LIMIT + 1} exceeds the model's limit"),
    (dict(eos_token_ids=5), r"eos_token_ids=5 is not a collection of token ids; pass token ids in \[0, 97\)"),
    (dict(eos_token_ids="2"), "eos_token_ids='2' is not a collection of token ids"),
    (dict(eos_token_ids=(1, VOCAB)), f"eos_token_ids holds {VOCAB}, not a token id of the model"),
    (dict(eos_token_ids=[1.5]), r"eos_token_ids holds 1\.5, not a token id"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size=2 but the target is not sharded"),
]


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, ("mamba2", "attention"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed_copy(target, seed=1)


@pytest.fixture
def no_model_work(monkeypatch):
    """Makes loading or wrapping a draft, the Engine's first model work, fail the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the Engine started model work before refusing a setting")
    monkeypatch.setattr(engine_module, "as_draft", refuse)


def test_defaults_are_the_engine_defaults():
    assert dataclasses.asdict(hs.EngineConfig()) == ENGINE_DEFAULTS
    assert hs.EngineConfig().gamma_max == 4 and not hs.EngineConfig().adaptive


@pytest.mark.parametrize("settings,message", BAD_SETTINGS)
def test_a_bad_setting_is_refused_by_the_config(settings, message):
    with pytest.raises(ConfigError, match=message):
        hs.EngineConfig(**settings)
    with pytest.raises(ConfigError, match=message):
        hs.EngineConfig().replace(**settings)


@pytest.mark.parametrize("settings,message", BAD_SETTINGS + BAD_FOR_THE_MODEL)
def test_a_bad_setting_is_refused_by_the_engine_before_model_work(target, no_model_work, settings, message):
    with pytest.raises(ConfigError, match=message):
        hs.Engine(target, draft="ngram", **settings)


@pytest.mark.parametrize("settings,message", BAD_FOR_THE_MODEL)
def test_a_config_bad_for_the_model_is_refused_before_model_work(target, no_model_work, settings, message):
    config = hs.EngineConfig(**settings)  # the model's bounds are not known yet
    with pytest.raises(ConfigError, match=message):
        hs.Engine(target, draft="ngram", config=config)


def test_engine_from_config_equals_engine_from_settings(target, draft):
    settings = dict(num_draft_tokens=3, verify="coupled", max_batch_size=2, max_model_len=48, block_size=4,
                    eos_token_ids=(3,), checkpoint=hs.CheckpointPolicy(snapshot_every=2))
    from_settings = hs.Engine(target, draft=draft, **settings)
    from_config = hs.Engine(target, draft=draft, config=hs.EngineConfig(**settings))
    assert from_config.config == from_settings.config == hs.EngineConfig(**settings)
    assert from_config.cache_kwargs == from_settings.cache_kwargs
    assert from_config.eos_token_ids == from_settings.eos_token_ids == {3}
    prompts = [[5, 6, 7, 5, 6], [9, 1, 2]]
    params = [hs.SamplingParams(max_new_tokens=12, temperature=1.0, seed=7), hs.SamplingParams(max_new_tokens=10)]
    got = [o.token_ids for o in from_config.generate(prompts, params)]
    assert got == [o.token_ids for o in from_settings.generate(prompts, params)]
    assert from_config.stats.drafted_tokens > 0  # speculative rounds ran
    plain = hs.Engine(target, config=hs.EngineConfig(**settings))
    assert [o.token_ids for o in plain.generate(prompts, params)] == got  # coupled: plain decoding's tokens


def test_keyword_settings_beside_a_config_must_agree(target):
    config = hs.EngineConfig(max_batch_size=2, block_size=4)
    with pytest.raises(ConfigError, match=r"config sets max_batch_size=2 and max_batch_size=3 .*config\.replace"):
        hs.Engine(target, config=config, max_batch_size=3)
    engine = hs.Engine(target, config=config, max_batch_size=2, eos_token_ids=None)
    assert engine.config is config and engine.max_batch_size == 2
    with pytest.raises(ConfigError, match="config must be an hs.EngineConfig, got a int"):
        hs.Engine(target, None, 4)
    with pytest.raises(TypeError, match="'max_batch' is not an Engine setting"):
        hs.Engine(target, max_batch=2)


def test_config_is_frozen_and_replace_checks(target):
    config = hs.EngineConfig(num_draft_tokens="auto", max_draft_tokens=6)
    assert config.adaptive and config.gamma_max == 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch_size = 4
    assert config.replace(max_batch_size=4).max_batch_size == 4 and config.max_batch_size == 16
    with pytest.raises(ConfigError, match="max_draft_tokens=6 is for num_draft_tokens='auto'"):
        config.replace(num_draft_tokens=4)
    assert hs.EngineConfig(eos_token_ids=iter([1, 2])).eos_token_ids == (1, 2)  # an iterator is read once
    assert type(hs.EngineConfig(max_batch_size=np.int64(3)).max_batch_size) is int


def test_llm_passes_one_config():
    config = hs.EngineConfig(max_batch_size=3, num_draft_tokens=2, max_model_len=64)
    llm = hs.LLM(draft="ngram", config=config, max_batch_size=3)
    assert llm.engine.config.max_batch_size == 3 and llm.engine.config.max_model_len == 64
    assert llm.engine.config.num_draft_tokens == 2 and llm.engine.config.decode == llm.codec.decode
    with pytest.raises(ConfigError, match="config sets block_size=16 and block_size=8"):  # a default is a value
        hs.LLM(model="/no/such/checkpoint", config=config, block_size=8)
    with pytest.raises(ConfigError, match="verify='greedy'"):
        hs.LLM(model="/no/such/checkpoint", verify="greedy")  # refused before the model is loaded


def test_command_line_flags_make_one_config():
    generate = argparse.Namespace(gamma="auto", verify="coupled", cuda_graphs=False, tensor_parallel_size=1,
                                  threads=None)
    assert engine_config(generate, max_batch_size=1) == hs.EngineConfig(
        num_draft_tokens="auto", verify="coupled", tensor_parallel_size=1, max_batch_size=1)
    serve = argparse.Namespace(num_draft_tokens=3, max_draft_tokens=None, verify="rejection", max_batch_size=8,
                               max_model_len=128, prefix_cache=True, tensor_parallel_size=1, port=8000)
    assert engine_config(serve) == hs.EngineConfig(num_draft_tokens=3, max_batch_size=8, max_model_len=128,
                                                   prefix_cache=True, tensor_parallel_size=1)
    with pytest.raises(ConfigError, match="num_draft_tokens=0"):
        engine_config(argparse.Namespace(gamma=0))
