"""`EngineConfig`: an Engine's settings in one typed, frozen, checked value.

`Engine(target, draft, config)` takes one (or the same settings as keyword
arguments, turned into one); `hs.LLM` and the command line build one and pass
it. The models stay outside: the target and the draft are the Engine's own
arguments.

Every setting is checked when the config is built, a ConfigError naming the
value and the fix. Three are bounded by the target and checked against it
when an Engine is built, before any model work: `max_model_len` (the model's
position limit, `sizes`), `eos_token_ids` (its vocabulary, `eos_ids`) and
`tensor_parallel_size` (its shards, `engine.check_tensor_parallel`).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch

from hybridspec.cache.prefix_cache import PrefixCache, as_prefix_settings
from hybridspec.checkpoints.auto import resolve_policy
from hybridspec.checkpoints.policy import CheckpointPolicy, validate_gamma
from hybridspec.config import HybridConfig
from hybridspec.errors import ConfigError
from hybridspec.models.graphs import GRAPHS_ENV
from hybridspec.sampling.stopping import Decode
from hybridspec.spec.gamma import DEFAULT_MAX_DRAFT_TOKENS
from hybridspec.spec.tree import TreeShape
from hybridspec.validation import integer, token_id

DEFAULT_MAX_MODEL_LEN = 4096  # when the model allows more and the caller does not say


@dataclass(frozen=True)
class EngineSizes:
    """An EngineConfig's sizes for one model (`EngineConfig.sizes`)."""

    max_batch_size: int
    max_model_len: int  # prompt + generated tokens of one sequence
    block_size: int  # KV tokens per block
    num_blocks: int  # KV blocks in the pool


@dataclass(frozen=True)
class EngineConfig:
    """The settings of an `Engine` (its docstring describes each); the
    defaults are the Engine's. `replace(**changes)` gives a checked copy.

    Integer sizes are kept as ints (a numpy integer becomes one) and
    `eos_token_ids` as a tuple; the other settings as given.
    """

    num_draft_tokens: int | Literal["auto"] = 4
    checkpoint: CheckpointPolicy | Literal["auto"] | None = None
    verify: Literal["rejection", "coupled"] = "rejection"
    max_draft_tokens: int | None = None
    max_batch_size: int = 16
    max_model_len: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    state_dtype: torch.dtype | None = None
    eos_token_ids: Iterable[int] | None = None
    decode: Decode | None = None
    tokenizer: object | None = None
    prefix_cache: bool | PrefixCache | None = None
    cuda_graphs: bool | None = None
    tensor_parallel_size: int | None = None
    tree: TreeShape | str | None = None  # "auto": chosen per round (`spec.tree_auto`)

    def __post_init__(self):
        if self.verify not in ("rejection", "coupled"):
            raise ConfigError(f"verify={self.verify!r} must be 'rejection' or 'coupled'")
        dtype = self.state_dtype
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ConfigError(f"state_dtype={dtype!r} must be a floating torch.dtype (e.g. torch.float32) "
                              "or None for the default")
        if self.decode is not None and not callable(self.decode):
            raise ConfigError(f"decode={self.decode!r} must be a function from token ids to text, e.g. tokenizer.decode")
        as_prefix_settings(self.prefix_cache)
        if self.tree is not None and self.tree != "auto" and not isinstance(self.tree, TreeShape):
            raise ConfigError(f"tree={self.tree!r} must be None (chains of drafts), a TreeShape, e.g. "
                              "hs.TreeShape((2,)): two candidates at the first depth, or 'auto' (chain or tree "
                              "chosen per round)")
        if self.tree == "auto" and not self.adaptive:
            raise ConfigError(f"tree='auto' chooses chain or tree from the round costs num_draft_tokens='auto' "
                              f"measures; pass num_draft_tokens='auto' (not {self.num_draft_tokens!r}), or a "
                              "TreeShape for a fixed tree")
        self._set("max_batch_size", integer("max_batch_size", self.max_batch_size, 1, ConfigError))
        self._set("block_size", integer("block_size", self.block_size, 1, ConfigError,
                                        " (tokens per KV block; 16 is typical)"))
        if self.num_blocks is not None:
            self._set("num_blocks", integer("num_blocks", self.num_blocks, 1, ConfigError,
                                            "; or None for one full-length sequence per row"))
        self._check_gamma()
        resolve_policy(self.checkpoint)
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ConfigError(f"cuda_graphs={self.cuda_graphs!r} must be True, False or None (the environment's "
                              f"{GRAPHS_ENV})")
        eos = self.eos_token_ids
        if eos is not None and not isinstance(eos, (str, bytes)) and hasattr(eos, "__iter__"):
            self._set("eos_token_ids", tuple(eos))  # read once: an iterator would be spent; ids checked by `eos_ids`

    def _check_gamma(self) -> None:
        if self.max_draft_tokens is not None and not self.adaptive:
            raise ConfigError(f"max_draft_tokens={self.max_draft_tokens!r} is for num_draft_tokens='auto'; with a "
                              f"fixed num_draft_tokens={self.num_draft_tokens!r} leave it out")
        gamma = self.gamma_max
        if self.adaptive and (not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1):
            raise ConfigError(f"max_draft_tokens={self.max_draft_tokens!r} must be an integer >= 1 (8 is typical)")
        validate_gamma(gamma)

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # normalising a frozen instance while it is built

    @property
    def adaptive(self) -> bool:
        """Whether γ is chosen per round (num_draft_tokens="auto")."""
        return self.num_draft_tokens == "auto"

    @property
    def gamma_max(self) -> int:
        """The most drafts a round verifies: num_draft_tokens, or with "auto"
        max_draft_tokens (default DEFAULT_MAX_DRAFT_TOKENS)."""
        if not self.adaptive:
            return self.num_draft_tokens
        return DEFAULT_MAX_DRAFT_TOKENS if self.max_draft_tokens is None else self.max_draft_tokens

    def replace(self, **changes) -> EngineConfig:
        """A copy with `changes`, checked as a new config is."""
        unknown = [name for name in changes if name not in SETTINGS]
        if unknown:
            raise TypeError(f"{unknown[0]!r} is not an Engine setting; the settings are {', '.join(SETTINGS)}")
        return dataclasses.replace(self, **changes)

    def agreeing(self, settings: dict) -> EngineConfig:
        """This config, where keyword `settings` passed beside it agree with it;
        a ConfigError names the first that does not."""
        merged = self.replace(**settings)
        for name in settings:
            if getattr(merged, name) != getattr(self, name):
                raise ConfigError(f"config sets {name}={getattr(self, name)!r} and {name}={settings[name]!r} was "
                                  f"passed beside it; pass one of them (config.replace({name}=...) for a changed "
                                  "copy)")
        return self

    def sizes(self, model: HybridConfig) -> EngineSizes:
        """The sizes for `model`: max_model_len defaults to the model's limit
        (at most DEFAULT_MAX_MODEL_LEN) and may not exceed it, num_blocks
        defaults to max_model_len tokens for every sequence of a batch."""
        limit = model.max_position_embeddings
        if self.max_model_len is None:
            length = min(limit, DEFAULT_MAX_MODEL_LEN)
        else:
            length = integer("max_model_len", self.max_model_len, 1, ConfigError, f" (the model allows up to {limit})")
            if length > limit:
                raise ConfigError(f"max_model_len={length} exceeds the model's limit max_position_embeddings={limit}; "
                                  f"pass max_model_len <= {limit}")
        blocks = self.max_batch_size * math.ceil(length / self.block_size) if self.num_blocks is None \
            else self.num_blocks
        return EngineSizes(self.max_batch_size, length, self.block_size, blocks)

    def eos_ids(self, model: HybridConfig) -> frozenset[int]:
        """The EOS ids for `model`: `eos_token_ids` checked against its vocabulary,
        or its config's `eos_token_id` (none if it has none)."""
        eos = self.eos_token_ids
        if eos is None:
            return frozenset() if model.eos_token_id is None else frozenset((model.eos_token_id,))
        fix = f"; pass token ids in [0, {model.vocab_size}) such as (2,), or None for the model config's"
        if not isinstance(eos, tuple):
            raise ConfigError(f"eos_token_ids={eos!r} is not a collection of token ids{fix}")
        ids = [token_id(t) for t in eos]
        bad = [t for t, i in zip(eos, ids) if i is None or not 0 <= i < model.vocab_size]
        if bad:
            raise ConfigError(f"eos_token_ids holds {bad[0]!r}, not a token id of the model{fix}")
        return frozenset(ids)


SETTINGS = tuple(f.name for f in dataclasses.fields(EngineConfig))


def engine_config(config: EngineConfig | None, settings: dict) -> EngineConfig:
    """The config of an `Engine(config=..., **settings)` (or `LLM`) call: `config`
    with the keyword settings, which must agree with it, or the settings alone."""
    if config is None:
        return EngineConfig().replace(**settings)
    if not isinstance(config, EngineConfig):
        raise ConfigError(f"config must be an hs.EngineConfig, got a {type(config).__name__}; pass settings such "
                          "as max_batch_size=32 as keyword arguments instead")
    return config.agreeing(settings)
