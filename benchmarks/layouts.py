"""Checkpoint layouts read in place, and expert biases: what they cost next
to the plain layout, and next to transposing into it.

    python benchmarks/layouts.py [--model olmoe-1b-7b] [--tokens 1,8,512] [--dtype bf16]

For each T, the CPU handler's median time on the same weights stored as:
plain (gate, up [E, H, I], down [E, I, H]), out x in (``layout="out_in"``:
nn.Linear), fused gate||up concatenated ([E, H, 2I]; and [E, 2I, H] out x
in: transformers v5 ``gate_up_proj``), interleaved (gpt-oss, both
orientations), plain with gate/up/down biases, and "transpose+call": the
out x in weights transposed into the plain layout inside the jitted function
before the call (what a user without layout support writes: a copy of every
weight on every call).  Ratios are to the plain layout measured in the same
process, runs interleaved.  The table's header names the machine and the
instruction set of the kernels.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from bench_common import DTYPES, format_table, machine, make_layer

import jax_nbx as nbx


def layouts(ex: nbx.Experts, bias_key) -> dict[str, nbx.Experts]:
    """The same weights in every layout (copies made here, outside the timing)."""
    g, u, d = ex.gate, ex.up, ex.down
    E, H, I = g.shape
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
    concat = jnp.concatenate([g, u], -1)
    inter = jnp.stack([g, u], -1).reshape(E, H, 2 * I)
    k = jax.random.split(bias_key, 3)
    return {
        "plain": ex,
        "out_in": nbx.Experts(t(g), t(u), t(d), layout="out_in"),
        "concat": nbx.Experts.fused(concat, d),
        "concat_out_in": nbx.Experts.fused(t(concat), t(d), layout="out_in"),
        "interleaved": nbx.Experts.fused(inter, d, fusion="interleaved"),
        "interleaved_out_in": nbx.Experts.fused(t(inter), t(d), fusion="interleaved", layout="out_in"),
        "plain+bias": nbx.Experts(g, u, d, gate_bias=jax.random.normal(k[0], (E, I)),
                                  up_bias=jax.random.normal(k[1], (E, I)),
                                  down_bias=jax.random.normal(k[2], (E, H))),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="olmoe-1b-7b", choices=sorted(nbx.MODELS))
    ap.add_argument("--tokens", default="1,8,512")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    m = nbx.MODELS[args.model]
    print(f"layouts benchmark: {m.name} (E={m.E} k={m.k} H={m.H} I={m.I}), {args.dtype}, "
          f"CPU handler, ISA {nbx.cpu.isa()}")
    print(f"machine: {machine()}")
    f = jax.jit(nbx.fused_moe)
    f_transpose = jax.jit(lambda x, w, ids, ex: nbx.fused_moe(
        x, w, ids, nbx.Experts(*(jnp.swapaxes(a, 1, 2) for a in (ex.gate, ex.up, ex.down)))))
    rows = []
    x, w, ids, plain = make_layer(m, 1, DTYPES[args.dtype])
    variants = layouts(plain, jax.random.PRNGKey(1))
    jax.block_until_ready(jax.tree.leaves(variants))
    names = list(variants) + ["transpose+call"]
    for T in (int(t) for t in args.tokens.split(",")):
        x, w, ids, _ = make_layer(m, T, DTYPES[args.dtype], seed=T)
        fns = {n: (lambda ex=ex: f(x, w, ids, ex)) for n, ex in variants.items()}
        fns["transpose+call"] = lambda: f_transpose(x, w, ids, variants["out_in"])
        for fn in fns.values():
            jax.block_until_ready(fn())
        times = {n: [] for n in fns}
        for _ in range(args.repeats):  # interleaved
            for n, fn in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                times[n].append(time.perf_counter() - t0)
        med = {n: statistics.median(v) for n, v in times.items()}
        row = [str(T), f"{med['plain'] * 1e3:.2f}"] + [f"{med[n] / med['plain']:.3f}" for n in names[1:]]
        rows.append(row)
        print(row, flush=True)
    print(format_table(["T", "plain ms"] + [f"{n}/plain" for n in names[1:]], rows))


if __name__ == "__main__":
    main()
