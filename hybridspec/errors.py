"""Typed errors. Every one is raised before any state changes and says what
was wrong and how to fix it."""
from hybridspec.deprecated import renamed_attributes


class HybridSpecError(Exception):
    """Base class of every error hybridspec raises on purpose."""


class ConfigError(HybridSpecError, ValueError):
    """A config, policy or engine argument is invalid."""


class UnsupportedModelError(HybridSpecError, ValueError):
    """The model architecture or the layout of its weights is not supported."""


class ModelFilesError(HybridSpecError, ValueError):
    """A model directory is unreadable or inconsistent: config.json, the shard
    index, a shard, or weights that do not match what the config implies."""


class UsageError(HybridSpecError, ValueError):
    """A command-line argument is invalid (the command exits with status 2)."""


class InvalidRequestError(HybridSpecError, ValueError):
    """A prompt or sampling parameter of a request is invalid."""


class CacheFullError(HybridSpecError, RuntimeError):
    """A batch does not fit the KV block pool or the state pool."""


class NumericalError(HybridSpecError, FloatingPointError):
    """A model produced NaN or inf logits."""


class InvariantError(HybridSpecError, AssertionError):
    """A commit broke the boundary invariant (HYBRIDSPEC_CHECK=1)."""


class PeerRankError(HybridSpecError, RuntimeError):
    """Another tensor-parallel rank's round raised: this rank reverted its round too."""


# the old name of ModelFilesError ("checkpoint" names the ring snapshots of recurrent state)
__getattr__ = renamed_attributes(globals(), {"CheckpointError": "ModelFilesError"})
