"""Quantized experts vs bf16 experts on the CPU handler.

    python benchmarks/quant.py [--models olmoe-1b-7b,qwen3-30b-a3b] [--tokens 1,8,256]

For each model and T: median time (interleaved runs in one process) of the op
with bf16 weights, int8 weights and int4 weights (group 128, bf16 scales), and
the speed ratios bf16 time / quantized time (higher is better for the
quantized experts; the issue's goals: decode int4 >= 2.5, int8 >= 1.6;
prefill int4 >= 0.8).  x is bf16.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import jax_nbx as nbx
from jax_nbx._bench import format_table, machine, make_layer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="olmoe-1b-7b,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,8,256")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print(machine())
    rows = []
    f = jax.jit(nbx.fused_moe)
    for name in args.models.split(","):
        m = nbx.MODELS[name]
        x0, w0, ids0, ex = make_layer(m, 1, jnp.bfloat16)
        q8 = nbx.quantize(ex, "int8", scale_dtype=jnp.bfloat16)
        q4 = nbx.quantize(ex, "int4", group_size=128, scale_dtype=jnp.bfloat16)
        jax.block_until_ready((q8, q4))
        for T in (int(t) for t in args.tokens.split(",")):
            x, w, ids, _ = make_layer(m, T, jnp.bfloat16, seed=T)
            fns = {"bf16": lambda: f(x, w, ids, ex), "int8": lambda: f(x, w, ids, q8),
                   "int4": lambda: f(x, w, ids, q4)}
            for fn in fns.values():
                jax.block_until_ready(fn())
            times = {k: [] for k in fns}
            for _ in range(args.repeats):
                for k, fn in fns.items():
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn())
                    times[k].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            rows.append([name, str(T), f"{med['bf16']:.2f}", f"{med['int8']:.2f}", f"{med['int4']:.2f}",
                         f"{med['bf16'] / med['int8']:.2f}", f"{med['bf16'] / med['int4']:.2f}"])
            print(rows[-1], flush=True)
    print(format_table(["model", "T", "bf16 ms", "int8 ms", "int4 g128 ms", "int8 speed / bf16",
                        "int4 speed / bf16"], rows))


if __name__ == "__main__":
    main()
