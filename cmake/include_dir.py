"""Print the directory holding xla/ffi/api/ffi.h (jax.ffi.include_dir()).

Prefers jax.ffi.include_dir(); falls back to jaxlib's own include folder
so the build environment needs only jaxlib.
"""
import importlib.util
import os

try:
    import jax.ffi

    print(jax.ffi.include_dir())
except Exception:  # jax itself not installed in the build environment
    spec = importlib.util.find_spec("jaxlib")
    print(os.path.join(list(spec.submodule_search_locations)[0], "include"))
