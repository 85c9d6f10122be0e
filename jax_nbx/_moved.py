"""Public names that moved, importable from their old places for a release
with a `DeprecationWarning`.

Modules: one table, `MOVED` (the old name is the new module itself); a finder
at the end of ``sys.meta_path`` answers only those names (no file holds them
any more), so nothing else is affected.  Names inside a module: that module's
``__getattr__ = moved_attributes(__name__, {name: new module})``.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old module name -> where it lives now
MOVED: dict[str, str] = {
    "jax_nbx.checkpoint": "jax_nbx.loaders.checkpoint",
    "jax_nbx.quant_import": "jax_nbx.loaders.quant_import",
    "jax_nbx.nn.qwen3_moe": "jax_nbx.models.qwen3_moe",
}


def moved_attributes(module: str, moved: dict[str, str]):
    """A module ``__getattr__`` that gives each name of ``moved`` from the
    module it moved to, with a `DeprecationWarning`; other names are an
    AttributeError, as without it."""
    def __getattr__(name: str):
        where = moved.get(name)
        if where is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} moved to {where}.{name}; the old name will be removed",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(where), name)

    return __getattr__


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old name will be removed)",
                      DeprecationWarning, stacklevel=2)  # past importlib's frames, which warnings skips
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        pass  # the new module, already executed


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())
