"""The Metal path against float64, the CPU path and the weight-bandwidth floor.

    python benchmarks/metal.py [--models olmoe-1b-7b] [--tokens 1,8,128] [--dtype float32,bfloat16]
                               [--scale 8]

Meant for Apple hardware (``JAX_NBX_METAL=apple``, the default where the build
has Metal).  It has NEVER run there: no Apple machine has built this package,
compiled its Metal kernels or run this script.  On Linux,
``JAX_NBX_METAL=sim`` runs it on the simulated device, where only the
correctness column means anything (the kernels run through an emulation, one
OS thread per GPU thread: times are not the GPU's).

Per model and T, first correctness (max |y - ref| / max |ref| against the
float64 reference), then the median time of ``implementation="metal"`` and of
``"ffi"`` (the CPU handler), measured interleaved in this process, the
ratio cpu / metal, and the weight-bandwidth floor (bytes of the experts the
tokens touch / ``--bandwidth`` GB/s: 100 for an M-series Pro-class chip).
``--dtype``: the experts' dtypes (x is float32; 16-bit weights run the _f16 /
_bf16 kernels, and the floor counts their bytes).  ``--scale`` divides H and I
(and E) so that a simulated run stays short.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import format_table, machine, make_layer, max_rel_error, median_time, np_reference

import jax_nbx as nbx


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="olmoe-1b-7b")
    ap.add_argument("--tokens", default="1,8,128")
    ap.add_argument("--dtype", default="float32", help="weights' dtypes, comma-separated")
    ap.add_argument("--scale", type=int, default=1, help="divide E, H and I by this (simulated runs)")
    ap.add_argument("--bandwidth", type=float, default=100.0, help="GB/s for the floor")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    info = nbx.metal.info()
    if info is None:
        raise SystemExit(f"no Metal device: {nbx.metal.unavailable_reason()}")
    print(machine())
    print(f"Metal device: {info['name']} ({info['implementation']}), working set "
          f"{nbx.memory.format_bytes(info['working_set'])}")
    print(f"command buffers bounded at {nbx.metal.command_buffer_flops():.3g} GEMM flops each")
    if info["implementation"] == "sim":
        print("simulated device: times are the emulation's, not a GPU's; correctness only")
    metal = jax.jit(lambda x, w, i, e: nbx.fused_moe(x, w, i, e, implementation="metal"))
    cpu = jax.jit(lambda x, w, i, e: nbx.fused_moe(x, w, i, e, implementation="ffi"))
    rows = []
    for name in args.models.split(","):
        m = nbx.MODELS[name]
        if args.scale > 1:
            m = m._replace(E=max(m.k, m.E // args.scale), H=max(8, m.H // args.scale),
                           I=max(8, m.I // args.scale))
        for T, dt in ((int(t), d) for t in args.tokens.split(",") for d in args.dtype.split(",")):
            x, w, ids, ex = make_layer(m, T, jnp.float32, seed=T)
            ex = jax.tree.map(lambda a: a.astype(dt), ex)  # noqa: B023
            err = max_rel_error(metal(x, w, ids, ex), np_reference(x, w, ids, ex))
            t_metal = median_time(lambda: metal(x, w, ids, ex), args.repeats)  # noqa: B023
            t_cpu = median_time(lambda: cpu(x, w, ids, ex), args.repeats)  # noqa: B023
            used = len(np.unique(np.asarray(ids)))
            floor = used * 3 * m.H * m.I * jnp.dtype(dt).itemsize / (args.bandwidth * 1e9)
            rows.append([name, f"E={m.E} H={m.H} I={m.I}", T, dt, f"{err:.1e}", f"{t_metal * 1e3:.2f}",
                         f"{t_cpu * 1e3:.2f}", f"{t_cpu / t_metal:.2f}", f"{floor * 1e3:.3f}",
                         f"{floor / t_metal:.2f}"])
    print(format_table(["model", "shape", "T", "weights", "rel err", "metal ms", "cpu ms", "cpu/metal",
                        "floor ms", "floor/metal"], rows))


if __name__ == "__main__":
    main()
