"""The compiled module, imported before anything that needs it.

jax_nbx/ sits at the repository's top level, so python started in a source
tree imports that tree (the working directory comes first on sys.path).
Without its built module, that import fails here, saying what to do, as
numpy's and jax's do from their source directories: install in place
(``pip install -e .``) or run from elsewhere (or ``python -P``).
"""
from __future__ import annotations

import pathlib

try:
    from . import _ffi  # noqa: F401
except ImportError as e:
    root = pathlib.Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "xla_ffi").is_dir():
        raise ImportError(
            f"jax_nbx was imported from its source tree ({root / 'jax_nbx'}), where its compiled "
            "module (jax_nbx._ffi) is not built. Either install it in place, `pip install -e .` "
            "in that folder, or run Python from outside the source tree (or with `python -P`, "
            "which leaves the working directory off sys.path) so that the installed jax_nbx is "
            f"imported. ({e})") from e
    raise
