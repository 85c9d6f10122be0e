"""The CPU handler's micro-kernels: which instruction set runs them.

The wheel carries one build of the micro-kernels per instruction set
("avx512", "avx2", "generic" on x86-64; "generic" = NEON on arm64) and picks
the best the CPU supports when first used.  ``JAX_NBX_ISA=avx2`` (applied
when the package loads, `jax_nbx._registry`) or `set_isa` force one, for
tests and benchmarks.
"""
from __future__ import annotations

import os

from . import _registry

__all__ = ["isa", "supported_isas", "set_isa", "planned_workers"]


_ffi = _registry.ffi_module


def isa() -> str:
    """The instruction set in use: "avx512", "avx2" or "generic"."""
    return _ffi().cpu_isa()


def supported_isas() -> list[str]:
    """Instruction sets this CPU can run, best first."""
    return _ffi().cpu_supported_isas().split(",")


def set_isa(name: str) -> None:
    """Forces the micro-kernels' instruction set (ValueError for an unknown
    name or one this CPU lacks).  Takes effect for calls that start after it."""
    _ffi().set_cpu_isa(str(name))



def planned_workers() -> int:
    """Workers the CPU handler may use (XLA's pool threads plus the caller);
    the workspace plan counts one worker's scratch per worker."""
    return (os.cpu_count() or 1) + 1
