"""Old public names kept working for a while after a rename: using one warns
(DeprecationWarning) and reaches the new object itself, so `except OldName`,
`isinstance(x, OldName)` and `Params(old_field=...)` behave as the new names do."""
from __future__ import annotations

import functools
import warnings


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=3)


def renamed_attributes(module_globals: dict, old_to_new: dict[str, str]):
    """A module `__getattr__` serving each old name of `old_to_new` as the
    module's object under the new name, with a warning."""
    module = module_globals["__name__"]

    def __getattr__(name: str):
        if name not in old_to_new:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        _warn(f"{module}.{name}", f"{module}.{old_to_new[name]}")
        return module_globals[old_to_new[name]]

    return __getattr__


def renamed_fields(old_to_new: dict[str, str]):
    """Class decorator for a dataclass whose fields were renamed: the old names
    are still accepted as keyword arguments and read as attributes, with a warning."""
    def decorate(cls):
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{cls.__name__}() got both {old}= and {new}=; pass only {new}=")
                    _warn(f"{cls.__name__}({old}=...)", f"{cls.__name__}({new}=...)")
                    kwargs[new] = kwargs.pop(old)
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        for old, new in old_to_new.items():
            setattr(cls, old, property(functools.partial(_read_renamed, cls.__name__, old, new),
                                       doc=f"Deprecated name of `{new}`."))
        return cls

    return decorate


def _read_renamed(class_name: str, old: str, new: str, obj):
    _warn(f"{class_name}.{old}", f"{class_name}.{new}")
    return getattr(obj, new)
