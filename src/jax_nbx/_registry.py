"""Loading: the compiled module, its handlers registered with XLA, and the
environment's settings applied to it, once, here.

The lowest layer of the package: it imports nothing of jax_nbx but the
compiled module, the contract (`_abi`) and the environment (`_env`), so
every other module may import it and the state it sets up (budget,
instruction set, profiling, table capacity) does not depend on which module
was imported first.
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
_TESTING_REGISTERED = False

try:
    from . import _ffi
except ImportError as e:  # pragma: no cover - a broken install
    _ffi = None
    _IMPORT_ERROR: ImportError | None = e
else:
    _IMPORT_ERROR = None


def ffi_module():
    """The compiled module, or RuntimeError saying why it failed to import."""
    if _ffi is None:
        raise RuntimeError(f"jax_nbx's compiled module failed to import: {_IMPORT_ERROR}")
    return _ffi


def register_testing() -> None:
    """Registers the test-only targets (xla_ffi/testing/: the handlers with
    NaN-filled output twins).  Called by the test suite, never by the product."""
    global _TESTING_REGISTERED
    if not _TESTING_REGISTERED:
        for name, capsule in ffi_module().testing_handlers().items():
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        _TESTING_REGISTERED = True


def cuda_unavailable_reason() -> str:
    """Empty when this build can run the CUDA path, else why not (no CUDA
    handler compiled in, or no Triton to compile the kernels)."""
    if _ffi is None or not getattr(_ffi, "has_cuda", False):
        return "this build of jax_nbx has no CUDA handler (built without nvcc; see README)"
    if importlib.util.find_spec("triton") is None:
        return "the CUDA path needs Triton (pip install 'jax_nbx[gpu]')"
    return ""


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


def _activate_metal(which: str | None, budget: int | None) -> None:
    """The Metal device: JAX_NBX_METAL's choice (an error names it), else
    Metal itself where the build has it (quietly none when it finds no GPU).
    metal:0's budget is the device's working-set size, or JAX_NBX_BUDGET."""
    global METAL_UNAVAILABLE
    requested = which is not None
    if which is None:
        which = "apple" if _ffi.has_metal_apple else "none"
    why = _ffi.metal_activate(which)
    if why and requested:
        raise ValueError(f"JAX_NBX_METAL={which}: {why}")
    if which == "none" or why:
        METAL_UNAVAILABLE = why or ("JAX_NBX_METAL=none" if requested else
                                    "this build of jax_nbx has no Metal implementation (it is "
                                    "compiled only on Apple; JAX_NBX_METAL=sim runs the simulated device)")
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
