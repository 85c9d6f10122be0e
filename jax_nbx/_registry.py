"""Loading: the compiled module, its handlers registered with XLA, and the
environment's settings applied to it, once, here.

The lowest layer of the package: it imports nothing of jax_nbx but the
compiled module, the contract (`_abi`) and the environment (`_env`) (and,
asked for the simulated Metal device by name, the test module that registers
it: `metal_activate`), so every other module may import it and the state it
sets up (budget, instruction set, profiling, table capacity) does not depend
on which module was imported first.
"""
from __future__ import annotations

import importlib.util

import jax

from . import _env, contract

# Target names (the contract's; kept here for callers of the old names).
FORWARD_TARGET = contract.TARGET_FORWARD
BACKWARD_TARGET = contract.TARGET_BACKWARD
CUDA_FORWARD_TARGET = contract.TARGET_CUDA_FORWARD
CUDA_FORWARD_TABLES_TARGET = contract.TARGET_CUDA_FORWARD_TABLES

_PLATFORMS: list[str] = []

try:
    from . import _ffi
except ImportError as e:  # pragma: no cover - a broken install (a source tree is named by __init__)
    _ffi = None  # a broken install: ffi_module() says why
    _IMPORT_ERROR: ImportError | None = e
else:
    _IMPORT_ERROR = None


def ffi_module():
    """The compiled module, or RuntimeError saying why it failed to import."""
    if _ffi is None:
        raise RuntimeError(f"jax_nbx's compiled module failed to import: {_IMPORT_ERROR}")
    return _ffi


def cuda_unavailable_reason() -> str:
    """Empty when this build can run the CUDA path, else why not (no CUDA
    handler compiled in -- built without nvcc, with NBX_CUDA=OFF, or its
    sources failed to compile: the module's ``cuda_not_built``, written by
    the build -- or no Triton to compile the kernels)."""
    if _ffi is None:
        return f"jax_nbx's compiled module failed to import: {_IMPORT_ERROR}"
    if not _ffi.has_cuda:
        return _not_built("cuda", "CUDA handler")
    if importlib.util.find_spec("triton") is None:
        return "the CUDA path needs Triton (pip install 'jax_nbx[gpu]')"
    return ""


def _not_built(backend: str, what: str) -> str:
    """Why this build has no such optional backend: the build's own words
    (``<backend>_not_built``, written by cmake/optional_backend.cmake: built
    with NBX_<BACKEND>=OFF, no compiler, not this platform, or its sources
    failed to compile, with the compiler's first error)."""
    # (a module built before the build wrote them -- an editable install not yet rebuilt -- has none)
    return getattr(_ffi, f"{backend}_not_built", "") or f"this build of jax_nbx has no {what}"


def platform_is_cuda() -> bool:
    """Whether JAX's GPU backend is a CUDA one."""
    try:
        return any(d.platform == "gpu" and "cuda" in d.client.platform_version.lower()
                   for d in jax.devices("gpu")[:1])
    except RuntimeError:
        return False


def has_handler(platform: str) -> bool:
    """Whether `fused_moe` has a handler for a JAX backend ("cpu", "gpu")."""
    if platform == "gpu":
        return platform_is_cuda() and not cuda_unavailable_reason()
    return platform in _PLATFORMS


def platforms() -> list[str]:
    """Platforms with a registered jax_nbx handler ("gpu" when the CUDA path can run)."""
    return list(_PLATFORMS) + (["gpu"] if has_handler("gpu") else [])


def _apply_environment() -> None:
    """The settings of `_env`'s variables, applied once at load: the CPU
    budget (JAX_NBX_BUDGET, else half the available memory), the
    instruction set, stage profiling, the pointer-table capacity."""
    budget = _env.budget()
    _ffi.set_budget("cpu", 0, budget if budget is not None else _env.available_memory() // 2)
    _env.parse("JAX_NBX_ISA", _ffi.set_cpu_isa)
    _ffi.set_profile(_env.profile())
    capacity = _env.table_cache()
    if capacity is not None and getattr(_ffi, "has_cuda", False):
        _ffi.cuda_table_set_capacity(capacity)
    if capacity is not None:
        _ffi.metal_table_set_capacity(capacity)
    _activate_metal(_env.metal(), budget)


METAL_UNAVAILABLE = ""  # why no Metal device is active ("" when one is)

# Metal devices that are not the product's, by name: the module that registers
# each in the core's Metal runtime when it is imported.  The simulated device is
# test-only (jax_nbx._ffi_testing, built with NBX_TESTING=ON): asking for it by
# name (JAX_NBX_METAL=sim, metal.use("sim")) imports that module where it is
# installed; `import jax_nbx` alone never does.  Where it is not, the runtime's
# refusal says how to build it.
_DEVICE_MODULES = {"sim": "jax_nbx._ffi_testing"}


def metal_activate(which: str) -> str:
    """Activates the Metal device `which` ("apple", "none" or a registered
    name); returns "" or why not."""
    module = _DEVICE_MODULES.get(which)
    if module is not None:
        try:
            importlib.import_module(module)  # registers the device (once: an import)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
    return ffi_module().metal_activate(which)


def _activate_metal(which: str | None, budget: int | None) -> None:
    """The Metal device: JAX_NBX_METAL's choice (an error names it), else
    Metal itself where the build has it (quietly none when it finds no GPU).
    metal:0's budget is the device's working-set size, or JAX_NBX_BUDGET."""
    global METAL_UNAVAILABLE
    requested = which is not None
    if which is None:
        which = "apple" if _ffi.has_metal_apple else "none"
    why = metal_activate(which)
    if why and requested:
        raise ValueError(f"JAX_NBX_METAL={which}: {why}")
    if which == "none" or why:
        METAL_UNAVAILABLE = why or ("JAX_NBX_METAL=none" if requested else
                                    f"{_not_built('metal', 'Metal implementation')} (JAX_NBX_METAL=sim "
                                    "runs the simulated device of a test build, NBX_TESTING=ON)")
        return
    METAL_UNAVAILABLE = ""
    if budget is not None:
        _ffi.set_budget("metal", 0, budget)


if _ffi is not None:
    for _name, _capsule in _ffi.cpu_handlers().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
    _PLATFORMS.append("cpu")
    if getattr(_ffi, "has_cuda", False):  # built with nvcc: register for CUDA too
        for _name, _capsule in _ffi.cuda_handlers().items():
            jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")
    _apply_environment()
