"""Quantized experts vs bf16 experts on the CPU handler, every supported ISA side by side.

    python benchmarks/quant.py [--models olmoe-1b-7b,qwen3-30b-a3b] [--tokens 1,8,256]
                               [--formats int8,int4,mxfp4,fp8,mxfp8,nvfp4,int8/x8,int4/x8]
                               [--isas avx512,avx2,chosen] [--json out.json]

For each model and T: median time of the op with bf16 weights and with each
quantized format -- int8 (bf16 scales), int4 (group 128, bf16 scales), mxfp4
(E2M1, E8M0 scales per 32), fp8 (E4M3, bf16 scales per 128 rows), mxfp8 (E4M3,
E8M0 per 32), nvfp4 (E2M1, E4M3 per 16) -- under each instruction set the CPU
supports (`jax_nbx.cpu.set_isa`) -- and "int8/x8", "int4/x8": int8 and int4
under precision="int8" (x quantized to int8, integer sums) -- all in one process and interleaved (each
round runs every ISA and format once), and the speed ratios bf16 time /
quantized time (higher is better for the quantized experts; issue #19's goals:
decode int4 >= 2.5, int8 >= 1.6; issue #32's: mxfp4 and nvfp4 >= 3, fp8 >=
1.8, prefill any <= 1.1x bf16's time).  "÷ best ISA" is each ISA's time over
the fastest ISA's, per format; the ISA jax_nbx chooses by itself is marked *; "chosen" measures the
composition in use (`jax_nbx.cpu.isa`, e.g. the default's per-family choice).
x is bf16.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
from bench_common import format_table, machine, make_layer

import jax_nbx as nbx

# each format as `jax_nbx.quantize` makes it here: (kind, group_size, scale dtype)
QUANT = {"int8": ("int8", None, jnp.bfloat16), "int4": ("int4", 128, jnp.bfloat16), "mxfp4": ("mxfp4", None, None),
         "fp8": ("fp8", 128, jnp.bfloat16), "mxfp8": ("mxfp8", None, None), "nvfp4": ("nvfp4", None, None)}
# the same experts under precision="int8" (x quantized to int8, integer sums)
PRECISION = {"int8/x8": "int8", "int4/x8": "int8"}
QUANT.update({k: QUANT[k.split("/")[0]] for k in PRECISION})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="olmoe-1b-7b,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,8,256")
    ap.add_argument("--formats", default="int8,int4,mxfp4,fp8,mxfp8,nvfp4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--isas", default=None, help="comma-separated, 'chosen' for the composition in use "
                    "(default: every ISA this CPU supports)")
    ap.add_argument("--json", default=None, help="also write the medians and every timing here")
    args = ap.parse_args(argv)
    chosen = nbx.cpu.isa()
    isas = args.isas.split(",") if args.isas else nbx.cpu.supported_isas()
    FORMATS = ("bf16",) + tuple(args.formats.split(","))
    for k in FORMATS[1:]:
        if k not in QUANT:
            ap.error(f"--formats: {k!r} is not one of {tuple(QUANT)}")
    isas = list(dict.fromkeys(chosen if i == "chosen" else i for i in isas))  # (no ISA twice)
    for i in isas:
        if i != chosen and i not in nbx.cpu.supported_isas():
            ap.error(f"--isas: {i!r} is not supported here (supported: {nbx.cpu.supported_isas()})")
    print(f"{machine()}; ISA chosen: {chosen}; measured: {', '.join(isas)}")
    rows, results = [], []
    f = jax.jit(nbx.fused_moe, static_argnames=("precision",))
    try:
        for name in args.models.split(","):
            m = nbx.MODELS[name]
            x0, w0, ids0, ex = make_layer(m, 1, jnp.bfloat16)
            made = {}  # one quantized copy per format, whatever the precision
            for k in FORMATS[1:]:
                if QUANT[k] not in made:
                    made[QUANT[k]] = nbx.quantize(ex, QUANT[k][0], group_size=QUANT[k][1],
                                                  scale_dtype=QUANT[k][2] or jnp.float32)
            qs = {k: made[QUANT[k]] for k in FORMATS[1:]}
            jax.block_until_ready(qs)
            for T in (int(t) for t in args.tokens.split(",")):
                x, w, ids, _ = make_layer(m, T, jnp.bfloat16, seed=T)
                fns = {"bf16": lambda: f(x, w, ids, ex)}
                for k, q in qs.items():
                    p = PRECISION.get(k)
                    fns[k] = lambda q=q, p=p: f(x, w, ids, q, precision=p)
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
                    row = [name, str(T), ("chosen" if "=" in i else i) + ("*" if i == chosen else "")]
                    row += [f"{med[(i, k)]:.2f}" for k in FORMATS]
                    row += [f"{med[(i, 'bf16')] / med[(i, q)]:.2f}" for q in FORMATS[1:]]
                    row += [" ".join(f"{med[(i, k)] / best[k]:.2f}" for k in FORMATS)]
                    rows.append(row)
                    print(row, flush=True)
                results.append({"model": name, "T": T, "median_ms": {f"{i}/{k}": v for (i, k), v in med.items()},
                                "all_ms": {f"{i}/{k}": [t * 1e3 for t in v] for (i, k), v in times.items()}})
    finally:
        nbx.cpu.set_isa(chosen)
    print(format_table(["model", "T", "ISA"] + [f"{k} ms" for k in FORMATS]
                       + [f"{k} speed / bf16" for k in FORMATS[1:]] + [f"÷ best ISA ({' '.join(FORMATS)})"], rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine(), "isa_chosen": chosen, "isas": isas, "rows": results}, fh, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
