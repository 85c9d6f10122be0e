"""Choose the CPU micro-kernels per family by timing them on this machine.

The default choice (`jax_nbx.cpu.default_isa`) is a fixed rule per CPU: the
widest instruction set, except where a measurement showed a narrower one
faster.  `calibrate_isa` measures instead: for each kernel family
(`jax_nbx.cpu.FAMILIES`) it runs one small representative `fused_moe` call
under each supported instruction set, rounds interleaved, and composes the
fastest per family (the default's unless another is faster by more than
``tolerance``)::

    import jax_nbx as nbx
    cal = nbx.calibrate_isa()        # seconds (a compilation per family); cached for the process
    print(cal.chosen, cal.times_ms)  # e.g. "avx2" {"packed": {"avx512": 41.2, "avx2": 33.0, ...}, ...}

Calibration trades reproducibility for speed: two processes may time the
families differently and compose different kernels, whose float32 results
differ in the last bits.  The default never changes from run to run.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from . import cpu
from .experts import Experts
from .ops import fused_moe
from .quantization import quantize

__all__ = ["Calibration", "calibrate_isa", "candidates", "choose"]

# family -> (T, E, k, H, I, weights): small enough to time in milliseconds,
# shaped so the whole call runs that family's kernels (packed: every expert
# gets T*k/E = 96 rows, more than the 6 that stream; stream/stream_f32/qstream: T = 1;
# dot: the packed shape in bfloat16 under precision="bfloat16"; qdot: T = 1, int8 experts
# under precision="int8").
PROBLEMS = {
    "packed": (192, 4, 2, 1024, 512, "f32"),
    "stream": (1, 8, 2, 2048, 1024, "bf16"),
    "stream_f32": (1, 8, 2, 2048, 1024, "f32"),
    "qstream": (1, 8, 2, 2048, 1024, "int4"),
    "dot": (192, 4, 2, 1024, 512, "bf16dot"),
    "qdot": (1, 8, 2, 2048, 1024, "int8x8"),
}


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What `calibrate_isa` measured and chose.

    ``chosen``: the composition (as `jax_nbx.cpu.isa` prints it);
    ``families``: family -> instruction set; ``default``: the fixed rule's
    choice; ``times_ms``: family -> instruction set -> the fastest round's
    milliseconds (the least disturbed by other work on the machine);
    ``rounds``, ``tolerance``: how it was measured."""
    chosen: str
    families: dict[str, str]
    default: dict[str, str]
    times_ms: dict[str, dict[str, float]]
    rounds: int
    tolerance: float


def candidates() -> list[str]:
    """The instruction sets calibration composes: every supported one but
    "generic" where another exists.  On x86 the generic kernels have no FMA, so
    a composition of generic with avx2/avx512 would make a token's result
    depend on how many rows its expert has (an expert with up to 6 rows
    streams, a larger one runs the packed kernels: each family in its own
    arithmetic); avx2 and avx512 both fuse every multiply-add."""
    isas = cpu.supported_isas()
    return [i for i in isas if i != "generic"] or isas


def choose(times: Mapping[str, float], default: str, tolerance: float) -> str:
    """The instruction set to use for one family given its times: the
    fastest, unless ``default``'s time is within ``tolerance`` (a fraction)
    of it, when the default stays (results then match the uncalibrated run)."""
    if not times:
        raise ValueError("choose: no times given")
    best = min(times, key=times.__getitem__)
    if default in times and times[default] <= times[best] * (1.0 + tolerance):
        return default
    return best


def _problem(family: str) -> Callable[[], jax.Array]:
    T, E, k, H, I, fmt = PROBLEMS[family]
    rng = np.random.default_rng(0)
    wdt = jnp.float32 if fmt == "f32" else jnp.bfloat16
    precision = {"bf16dot": "bfloat16", "int8x8": "int8"}.get(fmt)
    experts = Experts(
        gate=jnp.asarray(rng.standard_normal((E, H, I), np.float32) * H ** -0.5, wdt),
        up=jnp.asarray(rng.standard_normal((E, H, I), np.float32) * H ** -0.5, wdt),
        down=jnp.asarray(rng.standard_normal((E, I, H), np.float32) * I ** -0.5, wdt))
    if fmt == "int4":
        experts = quantize(experts, "int4", group_size=128)
    elif fmt == "int8x8":
        experts = quantize(experts, "int8")
    x = jnp.asarray(rng.standard_normal((T, H), np.float32), jnp.bfloat16 if precision else jnp.float32)
    ids = jnp.asarray((np.arange(T * k) % E).reshape(T, k), jnp.int32)  # T*k/E rows per expert
    w = jnp.full((T, k), 1.0 / k, jnp.float32)
    f = jax.jit(lambda x_, w_, i_: fused_moe(x_, w_, i_, experts, implementation="ffi", precision=precision))
    return lambda: f(x, w, ids)


def _time_ms(fn: Callable[[], jax.Array]) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return (time.perf_counter() - t0) * 1e3


_CACHE: dict[tuple, Calibration] = {}


def calibrate_isa(rounds: int = 5, tolerance: float = 0.03, apply: bool = True,
                  force: bool = False) -> Calibration:
    """Times every kernel family under every instruction set this CPU
    supports (`candidates`: generic only where nothing else runs) and
    composes the fastest per family (`choose`).

    ``rounds``: timed runs per (family, instruction set), interleaved across
    the instruction sets so that all of one round run seconds apart (plus one
    warm-up round); ``tolerance``: how much faster than the default another
    instruction set must be to replace it; ``apply``: select the result
    (`jax_nbx.cpu.set_isa`); ``force``: measure again even if this process
    already has a result for these arguments.  Returns a `Calibration`."""
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"calibrate_isa: rounds must be a positive int, got {rounds!r}")
    if not 0.0 <= float(tolerance) < 1.0:
        raise ValueError(f"calibrate_isa: tolerance must be in [0, 1), got {tolerance!r}")
    key = (rounds, float(tolerance))
    if key in _CACHE and not force:
        cal = _CACHE[key]
        if apply:
            cpu.set_isa(cal.chosen)
        return cal
    before = cpu.isa()
    default = _default_families()
    isas = candidates()
    times: dict[str, dict[str, float]] = {}
    try:
        for family in cpu.FAMILIES:
            fn = _problem(family)
            runs: dict[str, list[float]] = {i: [] for i in isas}
            for r in range(rounds + 1):  # round 0 warms up (compiles once, then every ISA once)
                for i in isas:
                    cpu.set_isa({family: i})
                    t = _time_ms(fn)
                    if r:
                        runs[i].append(t)
            times[family] = {i: min(v) for i, v in runs.items()}
    finally:
        cpu.set_isa(before)
    families = {f: choose(times[f], default[f], tolerance) for f in cpu.FAMILIES}
    cpu.set_isa(families)
    chosen = cpu.isa()
    if not apply:
        cpu.set_isa(before)
    cal = Calibration(chosen=chosen, families=families, default=default, times_ms=times,
                      rounds=rounds, tolerance=float(tolerance))
    _CACHE[key] = cal
    return cal


def _default_families() -> dict[str, str]:
    """The fixed rule's instruction set per family (`jax_nbx.cpu.default_isa`)."""
    d = cpu.default_isa()
    if "=" not in d:
        return {f: d for f in cpu.FAMILIES}
    return dict(item.split("=", 1) for item in d.split(","))
