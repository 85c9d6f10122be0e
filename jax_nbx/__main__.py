"""The main job: one MoE layer of a real model's shape through jax_nbx's
handler (on a CPU also with the experts prepacked, `jax_nbx.prepack`) and
through the pure-JAX reference, with a table of the results.

    python -m jax_nbx                       # OLMoE-1B-7B layer, T=256, float32
    python -m jax_nbx --model qwen3-30b-a3b --tokens 64 --dtype bf16
"""
from __future__ import annotations

import argparse
import functools
import sys

import jax

from . import _registry, contract
from ._bench import DTYPES, format_table, machine, make_layer, max_rel_error, median_time, np_reference
from .models import MODELS
from .ops import fused_moe
from .prepack import prepack


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
    x, w, ids, experts = make_layer(m, a.tokens, dtype)
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
        t = median_time(lambda: f(x, w, ids, ex), repeats=a.repeats, warmup=0)
        rows.append([name, f"T={a.tokens} E={m.E} k={m.k} H={m.H} I={m.I}", a.dtype,
                     f"{t * 1e3:.1f}", f"{flops / t / 1e9:.1f}", f"{err:.2e}"])
    print()
    print(format_table(["implementation", "shape", "dtype", "time ms (median)", "routed GFLOP/s",
                        f"max rel err (first {n_check} tokens vs float64)"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
