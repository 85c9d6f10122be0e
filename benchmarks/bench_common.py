"""Helpers shared by the scripts in benchmarks/ (run as `python benchmarks/X.py`,
so this directory is on sys.path): a layer of a real model's shape, timing,
a float64 numpy reference and the machine's description.

The layer is the product's `ModelShape.random_layer`; the reference, the
table and the machine line are the main job's (`python -m jax_nbx`), so the
benchmarks and the main job print and check alike.  (The tests keep their
own, independent reference.)"""
from __future__ import annotations

import statistics
from collections.abc import Callable

import jax.numpy as jnp

from jax_nbx.__main__ import DTYPES, format_table, machine, max_rel_error, np_reference, time_once
from jax_nbx.models import ModelShape

__all__ = ["DTYPES", "format_table", "machine", "make_layer", "max_rel_error", "median_time", "np_reference",
           "time_once"]


def make_layer(model: ModelShape, T: int, dtype=jnp.float32, seed: int = 0):
    """Random x [T, H], router output (w, ids) [T, k] and Experts of the model's
    layer shape (`ModelShape.random_layer`)."""
    return model.random_layer(T, dtype, seed)


def median_time(fn: Callable[[], object], repeats: int = 3, warmup: int = 1,
                slow_after: float | None = None) -> float:
    """Median wall time (s) of fn(), blocking on its result; warmup runs first.
    With ``slow_after``, a warm-up slower than that many seconds cuts the
    timed runs to one."""
    for _ in range(warmup):
        if time_once(fn) > (float("inf") if slow_after is None else slow_after):
            repeats = 1
    return statistics.median(time_once(fn) for _ in range(repeats))
