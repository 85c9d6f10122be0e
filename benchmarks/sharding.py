"""Sharded vs unsharded fused_moe on 8 host devices (CPU).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/sharding.py [--model M] [--tokens T]
        [--dtype D] [--repeats N] [--dispatch psum all_to_all] [--capacity-factor C ...]

Checks that `nbx.sharded_moe` equals the unsharded op on meshes 8x1, 4x2 and
2x4 (expert x data) with each dispatch (psum combine; all_to_all, exact, and
with each --capacity-factor given: then the error counts the dropped slots),
and times each (median of --repeats, default 5) against the unsharded op in
the same process.  The 8 host devices share this machine's cores, so the
time says what the partitioning costs, not what 8 real devices would gain.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from bench_common import DTYPES, format_table, machine, make_layer
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nbx as nbx


def median_ms(fn, repeats=5):
    jax.block_until_ready(fn())
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="granite-3.0-1b-a400m")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per row (the median is shown)")
    ap.add_argument("--dispatch", nargs="+", default=["psum", "all_to_all"], choices=["psum", "all_to_all"])
    ap.add_argument("--capacity-factor", type=float, nargs="*", default=[],
                    help="extra all_to_all rows with this capacity_factor (may drop slots)")
    args = ap.parse_args(argv)
    if len(jax.devices()) < 8:
        raise SystemExit("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    print(machine())
    m = nbx.MODELS[args.model]
    x, w, ids, ex = make_layer(m, args.tokens, DTYPES[args.dtype])
    f = jax.jit(nbx.fused_moe)
    y_ref = f(x, w, ids, ex)
    base = median_ms(lambda: f(x, w, ids, ex), args.repeats)
    rows = [["unsharded", "-", "-", f"{base:.1f}", "1.00"]]
    variants = [(d, None) for d in args.dispatch]
    if "all_to_all" in args.dispatch:
        variants += [("all_to_all", c) for c in args.capacity_factor]
    for shape in ((8, 1), (4, 2), (2, 4)):
        mesh = jax.make_mesh(shape, ("expert", "data"))
        tok, exs = NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P("expert", None, None))
        xs, ws, i_s = (jax.device_put(a, tok) for a in (x, w, ids))
        es = jax.tree.map(lambda a: jax.device_put(a, exs), ex)
        for dispatch, cf in variants:
            g = jax.jit(lambda x, w, i, e, mesh=mesh, dispatch=dispatch, cf=cf: nbx.sharded_moe(
                x, w, i, e, mesh, dispatch=dispatch, capacity_factor=cf))
            y = g(xs, ws, i_s, es)
            err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - y_ref.astype(jnp.float32)))
                        / jnp.max(jnp.abs(y_ref.astype(jnp.float32))))
            t = median_ms(lambda: g(xs, ws, i_s, es), args.repeats)
            name = dispatch if cf is None else f"{dispatch}, capacity_factor={cf:g}"
            rows.append([f"{shape[0]}x{shape[1]}", name, f"{err:.1e}", f"{t:.1f}", f"{t / base:.2f}"])
    print(f"{m.name} T={args.tokens} {args.dtype}")
    print(format_table(["mesh (expert x data)", "dispatch", "max rel err vs unsharded", "ms",
                        "time / unsharded"], rows))


if __name__ == "__main__":
    main()
