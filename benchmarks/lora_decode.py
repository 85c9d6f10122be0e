"""Serving with LoRA adapters: the forward with adapters against the same call
without them and against the adapters merged into dense experts.

    python benchmarks/lora_decode.py [--models olmoe-1b-7b] [--tokens 1,8,64] \
        [--bases f32,bf16,int4] [--rank 16] [--repeats 15]

For each model, base and T: the median time of ``fused_moe(..., lora=)``
(rank R on gate, up and down, float32 adapters; the CPU handler's row band),
of the same call without adapters (the handler's forward: streamed weights
for experts with few rows), and of the call on ``merge_lora``'s dense experts
(the serving alternative; for an int4 base the merged experts are bf16). All
three run interleaved, round by round, with a 256 MB copy before each call
so every call reads its weights from memory, not cache. Ratios are to the
call without adapters in the same rounds. ``--isa`` selects the kernels
(``jax_nbx.set_isa``); the header prints the ones that ran.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import format_table, machine, make_layer

import jax_nbx as nbx

BASES = {"f32": (jnp.float32, None), "bf16": (jnp.bfloat16, None), "int4": (jnp.bfloat16, "int4")}


def row(m, T: int, base: str, rank: int, repeats: int, evict: np.ndarray) -> list[str]:
    """One row: (model, T, base) timed with adapters, without, and merged."""
    dt, fmt = BASES[base]
    x, w, ids, ex = make_layer(m, T, dt)
    init = nbx.LoRA.init(jax.random.key(1), m.E, m.H, m.I, rank, alpha=2 * rank)
    # B = 0 from init would make the merge trivial: give B values too
    lora = nbx.LoRA(*((A, B + 0.01) for A, B in (init.gate, init.up, init.down)), scale=init.scale("gate"))
    merged = nbx.merge_lora(ex, lora)
    base_ex = ex if fmt is None else nbx.quantize(ex, fmt, group_size=128)
    f = jax.jit(nbx.fused_moe)
    f_lora = jax.jit(lambda x, w, ids, e, lo: nbx.fused_moe(x, w, ids, e, lora=lo))
    fns = {"lora": lambda: f_lora(x, w, ids, base_ex, lora), "base": lambda: f(x, w, ids, base_ex),
           "merged": lambda: f(x, w, ids, merged)}
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            evict[::16] += 1.0  # touches every page: the weights leave the cache
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = [statistics.median(a / b for a, b in zip(times[k], times["base"])) for k in ("lora", "merged")]
    return [m.name, str(T), base, f"{med['lora'] * 1e3:.2f}", f"{med['base'] * 1e3:.2f}",
            f"{med['merged'] * 1e3:.2f}", f"{ratio[0]:.2f}", f"{ratio[1]:.2f}"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="olmoe-1b-7b")
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--bases", default="f32,bf16,int4")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--isa", default=None, help="kernels for every family or a composition")
    args = ap.parse_args(argv)
    if args.isa:
        nbx.cpu.set_isa(args.isa)
    print(machine(), "| kernels:", nbx.cpu.isa(), "| rank", args.rank, "on gate, up, down")
    evict = np.zeros(64 << 20, np.float32)
    rows = []
    for name in args.models.split(","):
        for base in args.bases.split(","):
            for T in (int(t) for t in args.tokens.split(",")):
                rows.append(row(nbx.MODELS[name], T, base, args.rank, args.repeats, evict))
                print(rows[-1], flush=True)
    print(format_table(["model", "T", "base", "lora ms", "no adapters ms", "merged ms",
                        "lora ÷ no adapters", "merged ÷ no adapters"], rows))


if __name__ == "__main__":
    main()
