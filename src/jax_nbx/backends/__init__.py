"""The backends of `jax_nbx.fused_moe`, behind one interface (`base.Backend`).

``implementation=`` names one of `names()`: ``"xla"`` (the pure-JAX
reference, every platform), ``"cpu"`` (the CPU handlers), ``"cuda"`` (the
CUDA handlers with Triton kernels), ``"metal"`` (the Metal handler), or
``"ffi"``: the handler of ``jax.default_backend()`` ("cuda" on a CUDA GPU,
else "cpu").  ``None`` takes the first of `DEFAULT_ORDER` that can run the
problem; when none can, or a named one cannot, the error gives every
backend's reason.
"""
from __future__ import annotations

import jax

from .base import Backend, Problem
from .cpu import CpuBackend
from .cuda import CudaBackend
from .metal import MetalBackend
from .xla import XlaBackend

__all__ = ["Backend", "Problem", "get", "names", "choose", "DEFAULT_ORDER", "IMPLEMENTATIONS"]

_BACKENDS: dict[str, Backend] = {b.name: b for b in (MetalBackend(), CudaBackend(), CpuBackend(),
                                                    XlaBackend())}
#: the order ``implementation=None`` tries them in
DEFAULT_ORDER: tuple[str, ...] = ("metal", "cuda", "cpu", "xla")
#: every value ``implementation=`` takes (None besides)
IMPLEMENTATIONS: tuple[str, ...] = ("xla", "cpu", "cuda", "metal", "ffi")


def names() -> tuple[str, ...]:
    """The backends' names."""
    return tuple(_BACKENDS)


def get(name: str) -> Backend:
    """The backend named ``name`` ("ffi": the default platform's handler)."""
    if name == "ffi":
        name = "cuda" if jax.default_backend() == "gpu" else "cpu"
    if name not in _BACKENDS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None; got {name!r}")
    return _BACKENDS[name]


def choose(implementation: str | None, problem: Problem) -> Backend:
    """The backend that runs ``problem``: the one named, or with None the
    first of `DEFAULT_ORDER` whose `why_not_by_default` is empty.  ValueError
    saying why when the named one cannot run it, or listing every backend's
    reason when none can."""
    if implementation is not None:
        if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None; "
                             f"got {implementation!r}")
        backend = get(implementation)
        why = backend.why_not(problem)
        if why:
            alias = f" (the {jax.default_backend()!r} handler)" if implementation == "ffi" else ""
            raise ValueError(f"implementation={implementation!r}{alias} cannot run this call: {why}")
        return backend
    reasons = []
    for name in DEFAULT_ORDER:
        why = _BACKENDS[name].why_not_by_default(problem)
        if not why:
            return _BACKENDS[name]
        reasons.append(f"{name}: {why}")
    raise ValueError("no jax_nbx backend can run this call:\n  " + "\n  ".join(reasons))
