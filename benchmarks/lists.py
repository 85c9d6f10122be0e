"""Experts as per-expert arrays (read in place through a pointer table) vs
stacked arrays, vs stacking them under jit before the call.

    python benchmarks/lists.py [--models olmoe-1b-7b,mixtral-8x7b] [--tokens 1,8] [--dtype bf16]

For each model and T: the median time of the op with stacked experts, with
the same experts as E separate arrays per projection (`Experts(gate=[...])`),
and with `jnp.stack` of those lists inside the jitted function followed by
the stacked call (what a user without lists support writes: a copy of every
weight on every call).  Ratios are to the stacked time measured in the same
process, runs interleaved.  Full model shapes (Mixtral bf16: 2.8 GB of
weights, held twice: stacked and as lists).
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
from bench_common import DTYPES, format_table, machine, make_layer

import jax_nbx as nbx


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="olmoe-1b-7b,mixtral-8x7b")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    print(machine())
    rows = []
    for name in args.models.split(","):
        m = nbx.MODELS[name]
        for T in (int(t) for t in args.tokens.split(",")):
            x, w, ids, stacked = make_layer(m, T, DTYPES[args.dtype])
            lists = nbx.Experts(*([a[e] for e in range(m.E)] for a in (stacked.gate, stacked.up, stacked.down)))
            jax.block_until_ready(lists.flat())
            f = jax.jit(nbx.fused_moe)
            f_stack = jax.jit(lambda x, w, ids, ex: nbx.fused_moe(x, w, ids, ex.stacked()))
            fns = {"stacked": lambda: f(x, w, ids, stacked), "lists": lambda: f(x, w, ids, lists),
                   "stack+call": lambda: f_stack(x, w, ids, lists)}
            times = {k: [] for k in fns}
            for fn in fns.values():
                jax.block_until_ready(fn())
            for _ in range(args.repeats):  # interleaved
                for k, fn in fns.items():
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn())
                    times[k].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append([name, str(T), args.dtype, f"{med['stacked'] * 1e3:.2f}", f"{med['lists'] * 1e3:.2f}",
                         f"{med['stack+call'] * 1e3:.2f}", f"{med['lists'] / med['stacked']:.3f}",
                         f"{med['stack+call'] / med['stacked']:.2f}"])
            print(rows[-1], flush=True)
    print(format_table(["model", "T", "dtype", "stacked ms", "lists ms", "stack+call ms",
                        "lists/stacked", "stack+call/stacked"], rows))


if __name__ == "__main__":
    main()
