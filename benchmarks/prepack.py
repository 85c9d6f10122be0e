"""Prepacked experts (`jax_nbx.prepack`) against the same experts packed per
call, in one process, interleaved, with the CPU's peaks measured in the same
run (benchmarks/peaks.py: register-only FMA and VDPBF16PS loops on every core).

    python benchmarks/prepack.py                       # OLMoE and Qwen3-30B-A3B layers, T=512
    python benchmarks/prepack.py --models olmoe-1b-7b --rows f32 --tokens 64,512 --rounds 5

Rows (x and the experts of one dtype, routing of the model's router on random
logits): ``f32`` (float32 arithmetic), ``bf16`` (bfloat16 x and experts,
``precision="bfloat16"``: the dot-product kernels), ``bf16-f32`` (bfloat16 x and
experts, ``precision="float32"``: the packed words are float32, twice the
experts' bytes).  Each round times the two contenders once per row, order
alternating, after one untimed call each; medians over the rounds.  Columns:
each one's time and GFLOP/s of the routed work (``T*k*6*H*I``) over the peak
that bounds it (float32: the FMA loop; bfloat16 dot products: VDPBF16PS where
the CPU has it, else the FMA loop), ``unpacked ÷ prepacked`` (> 1: prepacked
is faster), the outputs' bit equality, and what packing took once (time, MiB).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from bench_common import format_table, machine, make_layer, time_once

import jax_nbx as nbx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peaks import peaks  # noqa: E402

ROWS = {"f32": (jnp.float32, "float32"), "bf16": (jnp.bfloat16, "bfloat16"),
        "bf16-f32": (jnp.bfloat16, "float32")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="olmoe-1b-7b,qwen3-30b-a3b")
    ap.add_argument("--rows", default="f32,bf16")
    ap.add_argument("--tokens", default="512")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    rows = args.rows.split(",")
    for r in rows:
        if r not in ROWS:
            ap.error(f"--rows: unknown row {r!r}; expected some of {sorted(ROWS)}")
    for m in args.models.split(","):
        if m not in nbx.MODELS:
            ap.error(f"--models: unknown model {m!r}; expected some of {sorted(nbx.MODELS)}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1; got {args.rounds}")
    tokens = [int(t) for t in args.tokens.split(",")]
    pk = peaks()
    print(f"# {machine()}; ISA {nbx.cpu.isa()}; dot kernels {nbx.cpu.dot_kernels()}")
    print(f"# peaks (GFLOP/s, both cores): FMA f32 {pk['fma_f32']}, VDPBF16PS {pk['vdpbf16ps']}")
    fn = jax.jit(lambda x, w, ids, ex, prec: nbx.fused_moe(x, w, ids, ex, precision=prec),
                 static_argnames="prec")
    table = []
    for name in args.models.split(","):
        model = nbx.MODELS[name]
        for T in tokens:
            for row in rows:
                dtype, prec = ROWS[row]
                x, w, ids, ex = jax.block_until_ready(make_layer(model, T, dtype))
                t0 = time.perf_counter()
                packed = jax.block_until_ready(nbx.prepack(ex, precision=prec))
                pack_s = time.perf_counter() - t0
                runs = {"unpacked": lambda: fn(x, w, ids, ex, prec), "prepacked": lambda: fn(x, w, ids, packed, prec)}
                outs = {k: jax.block_until_ready(f()) for k, f in runs.items()}
                same = bool(jnp.array_equal(outs["unpacked"], outs["prepacked"]))
                times = {k: [] for k in runs}
                for r in range(args.rounds):
                    for k in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                        times[k].append(time_once(runs[k]))
                med = {k: statistics.median(v) for k, v in times.items()}
                flops = T * model.k * 6 * model.H * model.I
                peak = pk["vdpbf16ps"] if prec == "bfloat16" and nbx.cpu.dot_kernels() == "avx512_bf16" \
                    else pk["fma_f32"]

                def rate(s: float, peak: float | None = peak) -> str:
                    g = flops / s / 1e9
                    return f"{g:.0f}" + (f" ({g / peak:.2f})" if peak else "")

                table.append([name, str(T), row, f"{med['unpacked'] * 1e3:.1f}", rate(med["unpacked"]),
                              f"{med['prepacked'] * 1e3:.1f}", rate(med["prepacked"]),
                              f"{med['unpacked'] / med['prepacked']:.2f}", "yes" if same else "NO",
                              f"{pack_s * 1e3:.0f} ms, {packed.nbytes / 2**20:.0f} MiB"])
    print(format_table(["model", "T", "row", "unpacked ms", "GFLOP/s (of peak)", "prepacked ms",
                        "GFLOP/s (of peak)", "unpacked ÷ prepacked", "same bits", "prepack once"], table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
