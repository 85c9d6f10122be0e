"""Public modules that moved, importable from their old names for a release
with a `DeprecationWarning` (the old name is the new module itself).

One table, `MOVED`; a finder at the end of ``sys.meta_path`` answers only
those names (no file holds them any more), so nothing else is affected.
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
