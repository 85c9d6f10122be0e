"""Registration of the compiled handlers with XLA."""
from __future__ import annotations

import os
from typing import Callable

import jax

FORWARD_TARGET = "nbx_fused_moe_fwd"
FORWARD_INTO_TARGET = "nbx_fused_moe_fwd_into"  # tests: output aliased to a poisoned input
FORWARD_LISTS_TARGET = "nbx_fused_moe_fwd_lists"  # experts as per-expert buffers
FORWARD_LISTS_INTO_TARGET = "nbx_fused_moe_fwd_lists_into"
FORWARD_QUANT_TARGET = "nbx_fused_moe_fwd_quant"  # int8 / int4 experts
BACKWARD_TARGET = "nbx_fused_moe_bwd"  # dx, d(topk_weights), d(experts); stacked or lists
FORWARD_QUANT_INTO_TARGET = "nbx_fused_moe_fwd_quant_into"  # tests: output aliased to a poisoned input
CUDA_FORWARD_TARGET = "nbx_fused_moe_fwd_cuda"
CUDA_FORWARD_TABLES_TARGET = "nbx_fused_moe_fwd_cuda_tables"  # lists and/or quantized experts

_PLATFORMS: list[str] = []

try:
    from . import _ffi
except ImportError as e:  # pragma: no cover - a broken install
    _ffi = None
    _IMPORT_ERROR: ImportError | None = e
else:
    _IMPORT_ERROR = None
    for _name, _capsule in _ffi.cpu_handlers().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
    _PLATFORMS.append("cpu")
    if getattr(_ffi, "has_cuda", False):  # built with nvcc: register for CUDA too
        for _name, _capsule in _ffi.cuda_handlers().items():
            jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def ffi_module():
    """The compiled module, or RuntimeError saying why it failed to import."""
    if _ffi is None:
        raise RuntimeError(f"jax_nbx's compiled module failed to import: {_IMPORT_ERROR}")
    return _ffi


def apply_env(var: str, setter: Callable[[str], object]) -> bool:
    """Calls setter(value) when the environment variable is set; a bad value
    raises ValueError naming the variable.  Returns whether it was set."""
    value = os.environ.get(var)
    if not value:
        return False
    try:
        setter(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{var}={value!r}: {e}") from None
    return True


def platforms() -> list[str]:
    """Platforms with a registered jax_nbx handler ("gpu" when the CUDA path can run)."""
    return list(_PLATFORMS) + (["gpu"] if has_handler("gpu") else [])


def has_handler(platform: str) -> bool:
    """Whether `fused_moe` has a handler for a JAX backend ("cpu", "gpu")."""
    if platform == "gpu":
        from . import _cuda

        return platform_is_cuda() and not _cuda.available()
    return platform in _PLATFORMS


def platform_is_cuda() -> bool:
    try:
        return any(d.platform == "gpu" and "cuda" in d.client.platform_version.lower()
                   for d in jax.devices("gpu")[:1])
    except RuntimeError:
        return False
