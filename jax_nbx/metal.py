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
user's fast path, and it is test-only: it lives in the test module
``jax_nbx._ffi_testing`` (built with ``NBX_TESTING=ON``, the README's test
command), which asking for it imports; other builds refuse it, saying so.
Every byte the Metal path allocates is counted in the
account under ``"metal:0"``, whose budget is the device's working-set size
(``recommendedMaxWorkingSetSize``; ``JAX_NBX_BUDGET`` or
``jax_nbx.memory.set_budget(..., "metal", 0)`` override it).
"""
from __future__ import annotations

from . import _registry

__all__ = ["available", "implementation", "info", "name", "working_set_size",
           "max_buffer_length", "unavailable_reason", "use", "command_buffer_flops",
           "set_command_buffer_flops", "is_default"]


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
    why = _registry.metal_activate(which)
    if why:
        raise ValueError(f"jax_nbx.metal.use({which!r}): {why}")
    _registry.METAL_UNAVAILABLE = "" if which != "none" else "jax_nbx.metal.use('none')"


def command_buffer_flops() -> int:
    """The bound on one command buffer's GEMM work, in floating-point
    operations.  macOS stops a command buffer that keeps the GPU busy too long
    (the GPU watchdog), so the Metal handler dispatches a band's expert GEMMs
    in ranges of 32-row tiles, one command buffer per range, each under this
    bound (default 2**36; one row tile is never split)."""
    return int(_registry.ffi_module().metal_command_buffer_flops())


def set_command_buffer_flops(flops: int | None) -> None:
    """Sets `command_buffer_flops` (``None`` or ``<= 0``: the default).  Results
    do not depend on it: every range computes its own rows."""
    if flops is not None and (isinstance(flops, bool) or not isinstance(flops, int)):
        raise TypeError(f"flops must be an int or None; got {flops!r}")
    _registry.ffi_module().metal_set_command_buffer_flops(0 if flops is None else int(flops))


def is_default() -> bool:
    """Whether ``fused_moe(implementation=None)`` picks the Metal path: on
    macOS on Apple silicon, when Metal itself (not the simulated device) is
    active.  Elsewhere the CPU handler stays the default."""
    import platform
    import sys

    return (sys.platform == "darwin" and platform.machine() == "arm64"
            and implementation() == "apple")
