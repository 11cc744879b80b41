"""Public names renamed so that "checkpoint" means only a ring snapshot of
recurrent state (and `ParallelConfig` no longer reads as tensor parallelism):
each old name still works, warns DeprecationWarning, and is the new object."""
import pytest

import hybridspec as hs
from hybridspec.config import ParallelMixerConfig
from hybridspec.errors import ModelFilesError


@pytest.mark.parametrize("module,old,new", [(hs.errors, "CheckpointError", ModelFilesError),
                                            (hs.config, "ParallelConfig", ParallelMixerConfig)])
def test_an_old_module_name_is_the_new_object_with_a_warning(module, old, new):
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: use .*{new.__name__}"):
        assert getattr(module, old) is new
    with pytest.raises(AttributeError, match="no attribute 'Nonexistent'"):
        getattr(module, "Nonexistent")


def test_except_checkpoint_error_still_catches_a_model_files_error(tmp_path):
    with pytest.warns(DeprecationWarning):
        old = hs.errors.CheckpointError
    with pytest.raises(old, match="model directory"):
        hs.load(tmp_path / "absent")


@pytest.mark.parametrize("make,old,new,value", [
    (hs.PrefixCache, "checkpoint_every", "save_every", 8),
    (hs.SamplingParams, "cache_checkpoints", "save_states_at", (3, 5)),
    (hs.EngineStats, "prefix_checkpoint_hits", "prefix_saved_state_hits", 2),
])
def test_an_old_field_name_is_accepted_and_read_with_a_warning(make, old, new, value):
    with pytest.warns(DeprecationWarning, match=rf"{old}=\.\.\.\) is deprecated"):
        made = make(**{old: value})
    assert getattr(made, new) == value and made == make(**{new: value})
    with pytest.warns(DeprecationWarning, match=rf"\.{old} is deprecated: use .*\.{new}"):
        assert getattr(made, old) == value
    with pytest.raises(TypeError, match=f"pass only {new}="):
        make(**{old: value, new: value})
