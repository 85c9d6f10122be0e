"""The backends of `jax_nbx.fused_moe`, behind one interface (`base.Backend`).

``implementation=`` names one of `names()`: ``"xla"`` (the pure-JAX
reference, every platform), ``"cpu"`` (the CPU handlers), ``"cuda"`` (the
CUDA handlers with Triton kernels), ``"metal"`` (the Metal handler), or
``"ffi"``: the handler of ``jax.default_backend()`` ("cuda" on a CUDA GPU,
else "cpu").  ``None`` takes the first of `DEFAULT_ORDER` that can run the
problem; when none can, or a named one cannot, the error gives every
backend's reason.  The backend chosen is readied for its first call
(`Backend.initialise`: the Metal kernels' library compiled); when that fails,
a named backend is an error, and ``None`` warns and goes on to the next.
"""
from __future__ import annotations

import warnings

import jax

from .. import formats
from .base import Backend, Problem
from .cpu import CpuBackend
from .cuda import CudaBackend
from .metal import MetalBackend
from .xla import XlaBackend

__all__ = ["Backend", "Problem", "get", "names", "choose", "register", "DEFAULT_ORDER", "IMPLEMENTATIONS"]

_BACKENDS: dict[str, Backend] = {b.name: b for b in (MetalBackend(), CudaBackend(), CpuBackend(),
                                                    XlaBackend())}
#: the order ``implementation=None`` tries them in
DEFAULT_ORDER: tuple[str, ...] = ("metal", "cuda", "cpu", "xla")
#: the built-in values ``implementation=`` takes (None besides; registered backends too)
IMPLEMENTATIONS: tuple[str, ...] = ("xla", "cpu", "cuda", "metal", "ffi")


def register(backend: Backend) -> None:
    """Adds a backend of one's own (tests: the CUDA programs under Triton's
    interpreter) under ``backend.name``; ``implementation=`` then takes that
    name, and ``None`` tries it after `DEFAULT_ORDER` (before none: its
    `Backend.why_not_by_default` decides).  ValueError for a taken name."""
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a jax_nbx.backends.Backend; got {type(backend).__name__}")
    if backend.name in _BACKENDS or backend.name == "ffi":
        raise ValueError(f"a backend named {backend.name!r} exists")
    _BACKENDS[backend.name] = backend


def names() -> tuple[str, ...]:
    """The backends' names."""
    return tuple(_BACKENDS)


def get(name: str) -> Backend:
    """The backend named ``name`` ("ffi": the default platform's handler)."""
    if name == "ffi":
        name = "cuda" if jax.default_backend() == "gpu" else "cpu"
    if name not in _BACKENDS:
        raise ValueError(f"implementation must be one of {names() + ('ffi',)} or None; got {name!r}")
    return _BACKENDS[name]


def _why_not_format(backend: Backend, problem: Problem) -> str:
    """Why the backend's kernels cannot read the experts' format ("" when they can)."""
    if problem.quant is None or backend.kernels is None:
        return ""
    fmt = formats.get(problem.quant[0])
    if backend.kernels in fmt.kernels:
        return ""
    takers = ", ".join(repr(n) for n, b in _BACKENDS.items() if b.kernels is None or b.kernels in fmt.kernels)
    return (f"its kernels do not read {fmt.name} experts ({fmt.name}'s spec names kernels for "
            f"{sorted(fmt.kernels) or 'no backend'}; {takers} run them)")


def _why_not_shared(backend: Backend, problem: Problem) -> str:
    """The registry's checks before a backend's own: the experts' format, then
    the adapters and prepacked experts against what the backend takes."""
    why = _why_not_format(backend, problem)
    if why:
        return why
    if problem.lora is not None and not backend.takes_lora:
        takers = ", ".join(repr(n) for n, b in _BACKENDS.items() if b.takes_lora)
        return f"LoRA adapters (lora=) run on {takers} only so far (docs/lora.md)"
    if problem.expert_store and not backend.takes_mapped:
        takers = ", ".join(repr(n) for n, b in _BACKENDS.items() if b.takes_mapped)
        return f"mapped experts (jax_nbx.loaders.map_moe) run on {takers} only"
    if problem.prepacked and not backend.takes_prepacked:
        takers = ", ".join(repr(n) for n, b in _BACKENDS.items() if b.takes_prepacked)
        return f"prepacked experts (jax_nbx.prepack) run on {takers} only"
    return ""


def choose(implementation: str | None, problem: Problem) -> Backend:
    """The backend that runs ``problem``: the one named, or with None the
    first of `DEFAULT_ORDER` whose `why_not_by_default` is empty and that
    initialises (`Backend.initialise`; one that fails is skipped with a
    RuntimeWarning saying why).  ValueError saying why when the named one
    cannot run it (RuntimeError when it fails to initialise), or listing
    every backend's reason when none can."""
    if implementation is not None:
        if not isinstance(implementation, str):
            raise ValueError(f"implementation must be one of {names() + ('ffi',)} or None; "
                             f"got {implementation!r}")
        backend = get(implementation)
        why = _why_not_shared(backend, problem) or backend.why_not(problem)
        alias = f" (the {jax.default_backend()!r} handler)" if implementation == "ffi" else ""
        if why:
            raise ValueError(f"implementation={implementation!r}{alias} cannot run this call: {why}")
        failed = backend.initialise()
        if failed:
            raise RuntimeError(f"implementation={implementation!r}{alias} failed to initialise: {failed}")
        return backend
    reasons = []
    for name in DEFAULT_ORDER + tuple(n for n in _BACKENDS if n not in DEFAULT_ORDER):
        backend = _BACKENDS[name]
        why = _why_not_shared(backend, problem) or backend.why_not_by_default(problem)
        if not why:
            failed = backend.initialise()
            if not failed:
                return backend
            warnings.warn(f"jax_nbx: the {name!r} backend failed to initialise, so implementation=None goes on "
                          f"to the next backend: {failed}", RuntimeWarning, stacklevel=2)
            why = f"failed to initialise: {failed}"
        reasons.append(f"{name}: {why}")
    raise ValueError("no jax_nbx backend can run this call:\n  " + "\n  ".join(reasons))
