"""Shared by the main job (`python -m jax_nbx`) and benchmarks/: building a
layer of a real model's shape, timing, a float64 numpy reference and the
machine's description.  (The tests keep their own, independent reference.)"""
from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .experts import Experts
from .models import ModelShape
from .routing import route

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def machine() -> str:
    """CPU model, core count and jax version, for the header of a table."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, jax {jax.__version__}, backend {jax.default_backend()}"


def make_layer(model: ModelShape, T: int, dtype=jnp.float32, seed: int = 0):
    """Random x [T, H], router output (w, ids) [T, k] and Experts of the model's
    layer shape, scaled so activations stay O(1)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    E, H, I = model.E, model.H, model.I
    x = jax.random.normal(keys[0], (T, H), jnp.float32).astype(dtype)
    experts = Experts(
        gate=(jax.random.normal(keys[1], (E, H, I), jnp.float32) * H ** -0.5).astype(dtype),
        up=(jax.random.normal(keys[2], (E, H, I), jnp.float32) * H ** -0.5).astype(dtype),
        down=(jax.random.normal(keys[3], (E, I, H), jnp.float32) * I ** -0.5).astype(dtype),
    )
    w, ids = route(jax.random.normal(keys[4], (T, E), jnp.float32), model.k, normalize=model.normalize)
    return x, w, ids, experts


def time_once(fn: Callable[[], object]) -> float:
    """Wall time (s) of one call of fn(), blocking on its result."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def median_time(fn: Callable[[], object], repeats: int = 3, warmup: int = 1,
                slow_after: float | None = None) -> float:
    """Median wall time (s) of fn(), blocking on its result; warmup runs first.
    With ``slow_after``, a warm-up slower than that many seconds cuts the
    timed runs to one."""
    for _ in range(warmup):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        if slow_after is not None and time.perf_counter() - t0 > slow_after:
            repeats = 1
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32), dtype=np.float64)


def np_reference(x, w, ids, experts: Experts, activation: str = "swiglu") -> np.ndarray:
    """float64 MoE forward of x [T, H] (one used expert at a time)."""
    x, w, ids = _f64(x), _f64(w), np.asarray(ids)
    y = np.zeros(x.shape)
    for e in np.unique(ids):
        t_idx, j_idx = np.nonzero(ids == e)
        a = x[t_idx]
        g, u = a @ _f64(experts.gate[e]), a @ _f64(experts.up[e])
        if activation == "swiglu":
            act = g / (1.0 + np.exp(-g))
        else:
            act = 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))
        np.add.at(y, t_idx, w[t_idx, j_idx][:, None] * ((act * u) @ _f64(experts.down[e])))
    return y


def max_rel_error(y, ref: np.ndarray) -> float:
    """max |y - ref| / max |ref|."""
    y = _f64(y)
    return float(np.max(np.abs(y - ref)) / max(np.max(np.abs(ref)), 1e-30))


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])
