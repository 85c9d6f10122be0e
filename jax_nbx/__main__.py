"""The main job: one MoE layer of a real model's shape through jax_nbx's
handler (on a CPU also with the experts prepacked, `jax_nbx.prepack`) and
through the pure-JAX reference, with a table of the results.

    python -m jax_nbx                       # OLMoE-1B-7B layer, T=256, float32
    python -m jax_nbx --model qwen3-30b-a3b --tokens 64 --dtype bf16
"""
from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import _registry, contract
from .experts import Experts
from .models import MODELS
from .ops import fused_moe
from .prepack import prepack

# The helpers below are the main job's; benchmarks/bench_common.py reuses them.
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


def time_once(fn: Callable[[], object]) -> float:
    """Wall time (s) of one call of fn(), blocking on its result."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_nbx", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="olmoe-1b-7b", choices=sorted(MODELS),
                   help="layer shape (E, k, H, I) of this model (default: %(default)s)")
    p.add_argument("--tokens", "-T", type=int, default=256, help="tokens T (default: %(default)s)")
    p.add_argument("--dtype", default="f32", choices=sorted(DTYPES),
                   help="dtype of x and the expert weights (default: %(default)s)")
    p.add_argument("--activation", default="swiglu", choices=list(contract.ACTIVATIONS))
    p.add_argument("--repeats", type=int, default=3, help="timed runs per implementation (median)")
    p.add_argument("--check-tokens", type=int, default=64,
                   help="tokens checked against the float64 numpy reference (default: %(default)s)")
    a = p.parse_args(argv)
    if a.tokens < 1:
        p.error(f"--tokens must be >= 1; got {a.tokens}")
    if a.repeats < 1:
        p.error(f"--repeats must be >= 1; got {a.repeats}")

    m = MODELS[a.model]
    dtype = DTYPES[a.dtype]
    print(f"jax_nbx main job: {m.name} layer (E={m.E} k={m.k} H={m.H} I={m.I}), T={a.tokens}, "
          f"{a.dtype}, {a.activation}")
    print(f"machine: {machine()}")
    x, w, ids, experts = m.random_layer(a.tokens, dtype)
    n_check = min(a.tokens, a.check_tokens)
    ref = np_reference(x[:n_check], w[:n_check], ids[:n_check], experts, a.activation)

    impls = ["ffi", "xla"] if _registry.has_handler(jax.default_backend()) else ["xla"]
    runs = [(impl, impl, experts) for impl in impls]
    if "ffi" in impls and jax.default_backend() == "cpu":  # the same experts packed once (nbx.prepack)
        runs.insert(1, ("ffi, prepacked", "ffi", prepack(experts)))
    flops = m.routed_flops(a.tokens)
    rows = []
    for name, impl, ex in runs:
        f = jax.jit(functools.partial(fused_moe, activation=a.activation, implementation=impl))
        y = f(x, w, ids, ex)
        err = max_rel_error(y[:n_check], ref)
        t = statistics.median(time_once(lambda: f(x, w, ids, ex)) for _ in range(a.repeats))
        rows.append([name, f"T={a.tokens} E={m.E} k={m.k} H={m.H} I={m.I}", a.dtype,
                     f"{t * 1e3:.1f}", f"{flops / t / 1e9:.1f}", f"{err:.2e}"])
    print()
    print(format_table(["implementation", "shape", "dtype", "time ms (median)", "routed GFLOP/s",
                        f"max rel err (first {n_check} tokens vs float64)"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
