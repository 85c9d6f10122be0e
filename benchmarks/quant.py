"""Quantized experts vs bf16 experts on the CPU handler, every supported ISA side by side.

    python benchmarks/quant.py [--models olmoe-1b-7b,qwen3-30b-a3b] [--tokens 1,8,256]
                               [--isas avx512,avx2] [--json out.json]

For each model and T: median time of the op with bf16 weights, int8 weights
int4 weights (group 128, bf16 scales) and mxfp4 weights (E2M1, E8M0 scales per
32) under each instruction set the CPU
supports (`jax_nbx.cpu.set_isa`), all in one process and interleaved (each
round runs every ISA and format once), and the speed ratios bf16 time /
quantized time (higher is better for the quantized experts; issue #19's goals:
decode int4 >= 2.5, int8 >= 1.6).  "÷ best ISA" is each ISA's time over the
fastest ISA's, per format; the ISA jax_nbx chooses by itself is marked * (issue
#19: its ratios never above 1.03).  x is bf16.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

import jax_nbx as nbx
from jax_nbx._bench import format_table, machine, make_layer

FORMATS = ("bf16", "int8", "int4", "mxfp4")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="olmoe-1b-7b,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,8,256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--isas", default=None, help="comma-separated (default: every ISA this CPU supports)")
    ap.add_argument("--json", default=None, help="also write the medians and every timing here")
    args = ap.parse_args(argv)
    chosen = nbx.cpu.isa()
    isas = args.isas.split(",") if args.isas else nbx.cpu.supported_isas()
    for i in isas:
        if i not in nbx.cpu.supported_isas():
            ap.error(f"--isas: {i!r} is not supported here (supported: {nbx.cpu.supported_isas()})")
    print(f"{machine()}; ISA chosen: {chosen}; measured: {', '.join(isas)}")
    rows, results = [], []
    f = jax.jit(nbx.fused_moe)
    try:
        for name in args.models.split(","):
            m = nbx.MODELS[name]
            x0, w0, ids0, ex = make_layer(m, 1, jnp.bfloat16)
            q8 = nbx.quantize(ex, "int8", scale_dtype=jnp.bfloat16)
            q4 = nbx.quantize(ex, "int4", group_size=128, scale_dtype=jnp.bfloat16)
            qm = nbx.quantize(ex, "mxfp4")
            jax.block_until_ready((q8, q4, qm))
            for T in (int(t) for t in args.tokens.split(",")):
                x, w, ids, _ = make_layer(m, T, jnp.bfloat16, seed=T)
                fns = {"bf16": lambda: f(x, w, ids, ex), "int8": lambda: f(x, w, ids, q8),
                       "int4": lambda: f(x, w, ids, q4), "mxfp4": lambda: f(x, w, ids, qm)}
                times = {(i, k): [] for i in isas for k in fns}
                for r in range(args.repeats + 1):  # round 0 warms up (compiles, first touches)
                    for i in isas:
                        nbx.cpu.set_isa(i)
                        for k, fn in fns.items():
                            t0 = time.perf_counter()
                            jax.block_until_ready(fn())
                            if r:
                                times[(i, k)].append(time.perf_counter() - t0)
                med = {key: statistics.median(v) * 1e3 for key, v in times.items()}
                best = {k: min(med[(i, k)] for i in isas) for k in fns}
                for i in isas:
                    row = [name, str(T), i + ("*" if i == chosen else "")]
                    row += [f"{med[(i, k)]:.2f}" for k in FORMATS]
                    row += [f"{med[(i, 'bf16')] / med[(i, q)]:.2f}" for q in FORMATS[1:]]
                    row += [" ".join(f"{med[(i, k)] / best[k]:.2f}" for k in FORMATS)]
                    rows.append(row)
                    print(row, flush=True)
                results.append({"model": name, "T": T, "median_ms": {f"{i}/{k}": v for (i, k), v in med.items()},
                                "all_ms": {f"{i}/{k}": [t * 1e3 for t in v] for (i, k), v in times.items()}})
    finally:
        nbx.cpu.set_isa(chosen)
    print(format_table(["model", "T", "ISA", "bf16 ms", "int8 ms", "int4 g128 ms", "mxfp4 ms", "int8 speed / bf16",
                        "int4 speed / bf16", "mxfp4 speed / bf16", "÷ best ISA (bf16 int8 int4 mxfp4)"], rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine(), "isa_chosen": chosen, "isas": isas, "rows": results}, fh, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
