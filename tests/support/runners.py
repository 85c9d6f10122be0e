"""The backends the shared behaviour suite (tests/suite/) runs against.

Each `Runner` is one way `fused_moe` can run here: the "xla" reference, the
CPU handler on each instruction set the CPU has, the Metal handler on the
simulated device, the CUDA programs under Triton's interpreter, and CUDA on a
GPU when there is one.  A runner says why it cannot run in this process
(`unavailable`), what it takes (`takes`: the suite skips a feature a backend
does not have, naming it), its tolerance, and sets itself up around a test
(`setting`: the instruction set, the Metal device, the interpreter backend).
``pytest --backends=cpu,metal-sim`` restricts the suite (a runner's own id
names it alone, other prefixes match: "cpu" is every cpu-* runner, "cuda" only
the GPU's); .ci/sanitize and .ci/arm64 use it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import platform

import jax.numpy as jnp
import numpy as np

import jax_nbx as nbx
from jax_nbx.backends.cuda.plan import kernels_formats

# features a backend may lack
QUANT = "quantized experts"
LAYOUTS = "checkpoint layouts and biases"
BANDS = "bands planned against a workspace budget"
FUSED_BACKWARD = "a fused backward"
LORA = "LoRA adapters"
ALL = frozenset({QUANT, LAYOUTS, BANDS, FUSED_BACKWARD, LORA})

# max |y - ref| / max |ref| by x's dtype: float32 accumulation; 16-bit x adds
# the output's rounding
TOL = {np.dtype("float32"): 1e-5, np.dtype(jnp.bfloat16): 1e-2, np.dtype("float16"): 2e-3}
# CUDA's tensor cores round x and the intermediate to 16-bit weights' dtype
TENSOR_CORE_TOL = {np.dtype("float32"): 1e-5, np.dtype(jnp.bfloat16): 1.5e-2, np.dtype("float16"): 3e-3}


@dataclasses.dataclass(frozen=True)
class Runner:
    id: str
    implementation: str
    isa: str | None = None
    metal: bool = False
    takes: frozenset = ALL
    tensor_cores: bool = False
    sweeps: bool = False  # runs the suite's `sweep` parametrizations (conftest.py)
    # quantized formats it lacks (its backend refuses them by name: tests/library/test_backends.py)
    lacks_formats: frozenset = frozenset()

    def unavailable(self) -> str:
        """Why this runner cannot run here ("" when it can)."""
        if self.isa is not None and self.isa not in nbx.cpu.supported_isas():
            machine = platform.machine()
            if self.isa in ("avx512", "avx2") and machine not in ("x86_64", "AMD64"):
                return f"{self.isa} is an x86-64 instruction set; this is {machine}"
            return f"this CPU lacks {self.isa} (supports {nbx.cpu.supported_isas()})"
        if self.metal:
            from support import ffi_testing

            return ffi_testing.metal_sim_unavailable()
        if self.implementation == "cuda-interpret" and importlib.util.find_spec("triton") is None:
            return "the CUDA programs run under Triton's interpreter: Triton is not installed"
        if self.implementation == "cuda" and not nbx._registry.has_handler("gpu"):
            return "no CUDA GPU with jax_nbx's CUDA handler here"
        return ""

    @contextlib.contextmanager
    def setting(self):
        """The runner's state around one test: instruction set, Metal device."""
        if self.isa is not None:
            before = nbx.cpu.isa()
            nbx.cpu.set_isa(self.isa)
            try:
                yield self
            finally:
                nbx.cpu.set_isa(before)
        elif self.metal:
            from support import ffi_testing

            with ffi_testing.metal_sim():
                yield self
        else:
            if self.implementation == "cuda-interpret":
                from support import cuda_interpret

                cuda_interpret.register()
            yield self

    def tol(self, x_dtype, w_dtype=None) -> float:
        t = TOL[np.dtype(x_dtype)]
        if self.tensor_cores and w_dtype is not None:
            t = max(t, TENSOR_CORE_TOL[np.dtype(w_dtype)])
        return t

    def require(self, feature: str) -> None:
        """Skips the test when this backend does not take ``feature``."""
        import pytest

        if feature not in self.takes:
            pytest.skip(f"{self.id} does not take {feature}")

    def require_format(self, fmt: str) -> None:
        """Skips the test when this backend has no kernels for the weight format ``fmt``."""
        import pytest

        if fmt != "dense":
            self.require(QUANT)
        if fmt in self.lacks_formats:
            pytest.skip(f"{self.id} has no kernels for {fmt} experts")

    def __call__(self, x, w, ids, experts, **kw):
        return nbx.fused_moe(x, w, ids, experts, implementation=self.implementation, **kw)


# the formats the Triton kernels have no `_wtile` branch for (backends/cuda/plan.py)
_NO_TILE_DEQUANT = frozenset(nbx.formats.names()) - frozenset(kernels_formats().values())  # none today

RUNNERS = (
    Runner("xla", "xla", takes=ALL - {BANDS, FUSED_BACKWARD}),
    Runner("cpu-avx512", "cpu", isa="avx512", sweeps=True),
    Runner("cpu-avx2", "cpu", isa="avx2", sweeps=True),
    Runner("cpu-generic", "cpu", isa="generic", sweeps=True),
    Runner("metal-sim", "metal", metal=True, takes=frozenset({QUANT, BANDS, LORA})),
    Runner("cuda-interpret", "cuda-interpret", tensor_cores=True, lacks_formats=_NO_TILE_DEQUANT),
    # (no sweeps: on a lent GPU the whole check has minutes; its core cases cover each behaviour)
    Runner("cuda", "cuda", tensor_cores=True, lacks_formats=_NO_TILE_DEQUANT),
)


def selected(option: str | None) -> tuple[Runner, ...]:
    """The runners ``--backends`` names (comma-separated id prefixes; None: all)."""
    if not option:
        return RUNNERS
    wanted = [p.strip() for p in option.split(",") if p.strip()]
    ids = {r.id for r in RUNNERS}

    def matches(r: Runner, p: str) -> bool:  # a runner's own id names it alone ("cuda" is not "cuda-interpret")
        return r.id == p if p in ids else r.id.startswith(p)

    unknown = [p for p in wanted if not any(matches(r, p) for r in RUNNERS)]
    if unknown:
        raise ValueError(f"--backends: {unknown} match no runner of {[r.id for r in RUNNERS]}")
    return tuple(r for r in RUNNERS if any(matches(r, p) for p in wanted))
