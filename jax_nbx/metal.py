"""The Metal device: the Apple GPU behind JAX's CPU client.

JAX on Apple silicon has no GPU backend that takes custom calls, so the
Apple path is a shim at the FFI level: JAX's CPU client owns the buffers and
runs the program, and jax_nbx's handler (registered for ``"cpu"``) hands the
MoE block to the GPU through Metal, reading the weights in place (unified
memory: host pages wrapped without a copy).  This module is the device's
view: whether one is active, which implementation, its limits.

Two implementations (xla_ffi/metal/): Metal itself, compiled only when the
package is built on Apple, and a **simulated device** (portable, strict where
Metal is silent) that the tests run on Linux.  The simulated device is used
only when asked for (``JAX_NBX_METAL=sim`` or ``use("sim")``): it is never a
user's fast path.  Every byte the Metal path allocates is counted in the
account under ``"metal:0"``, whose budget is the device's working-set size
(``recommendedMaxWorkingSetSize``; ``JAX_NBX_BUDGET`` or
``jax_nbx.memory.set_budget(..., "metal", 0)`` override it).
"""
from __future__ import annotations

from . import _registry

__all__ = ["available", "implementation", "info", "name", "working_set_size",
           "max_buffer_length", "unavailable_reason", "use"]


def info() -> dict | None:
    """The active device: implementation ("apple" or "sim"), name,
    working_set (bytes), max_buffer_length, max_wraps, live_wraps,
    device_count; None when no Metal device is active."""
    d = _registry.ffi_module().metal_info()
    return None if d is None else dict(d)


def available() -> bool:
    """Whether a Metal device (real or simulated) is active."""
    return info() is not None


def implementation() -> str | None:
    """``"apple"`` (Metal), ``"sim"`` (the simulated device) or None."""
    d = info()
    return None if d is None else d["implementation"]


def name() -> str | None:
    d = info()
    return None if d is None else d["name"]


def working_set_size() -> int | None:
    """``recommendedMaxWorkingSetSize``: metal:0's default budget."""
    d = info()
    return None if d is None else int(d["working_set"])


def max_buffer_length() -> int | None:
    """``maxBufferLength``: no buffer or no-copy wrap is longer."""
    d = info()
    return None if d is None else int(d["max_buffer_length"])


def unavailable_reason() -> str:
    """Why no Metal device is active ("" when one is)."""
    return "" if available() else (_registry.METAL_UNAVAILABLE or "no Metal device is active")


def use(which: str) -> None:
    """Activates ``"apple"``, ``"sim"`` or ``"none"`` (refused by name while
    the account holds bytes on metal:0: release pinned tables first); sets
    metal:0's budget to the device's working set."""
    why = _registry.ffi_module().metal_activate(which)
    if why:
        raise ValueError(f"jax_nbx.metal.use({which!r}): {why}")
    _registry.METAL_UNAVAILABLE = "" if which != "none" else "jax_nbx.metal.use('none')"
