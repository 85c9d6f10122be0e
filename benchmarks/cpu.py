"""CPU speed of the fused MoE block against every baseline, in one process.

    python benchmarks/cpu.py                    # default set (about 15 min on 2 cores)
    python benchmarks/cpu.py --models olmoe-1b-7b --tokens 1 512 --dtypes f32
    python benchmarks/cpu.py --full             # adds T=2048 and Mixtral prefill
    python benchmarks/cpu.py --skew --models olmoe-1b-7b --tokens 512 --dtypes f32

For each (model layer shape, T, weight dtype) it times, medians of a few runs:
ours (fused_moe, implementation="ffi"); XLA ragged_dot (slots sorted by expert,
three lax.ragged_dot); XLA dense einsum over all experts (where its [T, E, I]
intermediates fit); a numpy-BLAS loop over the active experts.  Printed with:
routed GFLOP/s / the numpy sgemm rate measured in this run (2048^3, float32);
ratios to each baseline; and for T <= 8, our time / (bytes of the active
experts' weights / the copy bandwidth measured in this run).  Baselines whose
estimated time exceeds --max-baseline-seconds are skipped ("-").  --skew adds,
per row with T >= 64, a "skewed" row where every token goes to the same k
experts (slot j to expert j), its rate compared with the balanced one.
"""
from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import DTYPES, format_table, machine, make_layer, median_time

import jax_nbx as nbx

DEFAULT_MODELS = ["olmoe-1b-7b", "qwen3-30b-a3b", "granite-3.0-1b-a400m", "deepseek-v2-lite",
                  "mixtral-8x7b"]


def progress(i: int, n: int, what: str) -> None:
    width = 30
    done = int(width * i / max(n, 1))
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {what[:60]:<60}")
    sys.stderr.flush()
    if i == n:
        sys.stderr.write("\n")


def timed(fn, repeats: int) -> float:
    """Median seconds after one warm-up run (a warm-up over 2 s cuts to one timed run)."""
    return median_time(fn, repeats=repeats, warmup=1, slow_after=2.0)


def sgemm_rate() -> float:
    a = np.random.default_rng(0).random((2048, 2048), dtype=np.float32)
    b = np.random.default_rng(1).random((2048, 2048), dtype=np.float32)
    return 2 * 2048 ** 3 / timed(lambda: a @ b, 5)


def copy_bandwidth() -> float:
    """Bytes read + written per second by numpy copying 512 MB."""
    a = np.ones(128 * 2 ** 20, np.float32)
    b = np.empty_like(a)
    return 2 * a.nbytes / timed(lambda: np.copyto(b, a), 5)


def moe_ragged_dot(x, w, ids, experts, E):
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k].astype(jnp.float32)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    g = jax.lax.ragged_dot(xs, f32(experts.gate), sizes)
    u = jax.lax.ragged_dot(xs, f32(experts.up), sizes)
    o = jax.lax.ragged_dot(jax.nn.silu(g) * u, f32(experts.down), sizes)
    o = o * w.reshape(-1)[order][:, None]
    return jnp.zeros((T, x.shape[1]), jnp.float32).at[order // k].add(o).astype(x.dtype)


def moe_dense(x, w, ids, experts, E):
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    xf = f32(x)
    g = jnp.einsum("th,ehi->tei", xf, f32(experts.gate))
    u = jnp.einsum("th,ehi->tei", xf, f32(experts.up))
    o = jnp.einsum("tei,eih->teh", jax.nn.silu(g) * u, f32(experts.down))
    comb = jnp.zeros((x.shape[0], E), jnp.float32).at[jnp.arange(x.shape[0])[:, None], ids].add(w)
    return jnp.einsum("teh,te->th", o, comb).astype(x.dtype)


def numpy_loop(x, w, ids, gate, up, down):
    """Per active expert: gather rows, three BLAS sgemms, scatter-add."""
    y = np.zeros(x.shape, np.float32)
    for e in np.unique(ids):
        t_idx, j_idx = np.nonzero(ids == e)
        a = x[t_idx]
        g = a @ gate[e].astype(np.float32, copy=False)
        h = g / (1 + np.exp(-g)) * (a @ up[e].astype(np.float32, copy=False))
        np.add.at(y, t_idx, w[t_idx, j_idx][:, None] * (h @ down[e].astype(np.float32, copy=False)))
    return y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=sorted(nbx.MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 512])
    p.add_argument("--dtypes", nargs="+", default=["f32", "bf16"], choices=["f32", "bf16", "f16"])
    p.add_argument("--full", action="store_true", help="add T=2048 (and Mixtral prefill)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-baseline-seconds", type=float, default=20.0)
    p.add_argument("--skew", action="store_true",
                   help="also time routing where every token goes to the same k experts")
    a = p.parse_args()
    tokens = sorted(set(a.tokens + ([2048] if a.full else [])))

    print(f"machine: {machine()}; CPU kernels: {nbx.cpu.isa()} (supported: {nbx.cpu.supported_isas()})")
    rate, bw = sgemm_rate(), copy_bandwidth()
    print(f"numpy sgemm 2048^3: {rate / 1e9:.1f} GFLOP/s; numpy copy bandwidth: {bw / 1e9:.1f} GB/s "
          f"(read + write)")
    jobs = [(m, T, d) for m in a.models for d in a.dtypes for T in tokens
            if not (m == "mixtral-8x7b" and T > 64 and not a.full)]
    rows = []
    for i, (name, T, dname) in enumerate(jobs):
        progress(i, len(jobs), f"{name} T={T} {dname}")
        m = nbx.MODELS[name]
        x, w, ids, experts = make_layer(m, T, DTYPES[dname])
        x = x.astype(jnp.float32)  # activations f32; weights in dname
        flops = m.routed_flops(T)
        ours = timed(functools.partial(jax.jit(nbx.fused_moe), x, w, ids, experts), a.repeats)
        est_dense = flops * m.E / m.k / (0.5 * rate)  # both XLA baselines do the all-experts work here
        rd = dn = None
        if est_dense <= a.max_baseline_seconds:
            rd = timed(functools.partial(jax.jit(moe_ragged_dot, static_argnums=4), x, w, ids,
                                         experts, m.E), a.repeats)
            if T * m.E * m.I * 4 * 3 <= 2 * 2 ** 30:
                dn = timed(functools.partial(jax.jit(moe_dense, static_argnums=4), x, w, ids,
                                             experts, m.E), a.repeats)
        xn, wn, idn = np.asarray(x), np.asarray(w), np.asarray(ids)
        gn, un, dnp = (np.asarray(experts.gate), np.asarray(experts.up), np.asarray(experts.down))
        npl = timed(functools.partial(numpy_loop, xn, wn, idn, gn, un, dnp), a.repeats)
        active = len(np.unique(idn))
        wbytes = active * 3 * m.H * m.I * np.dtype(experts.gate.dtype).itemsize
        floor = wbytes / (bw / 2)  # weights read once at the copy's read rate
        ratio = lambda t: "-" if t is None else f"{t / ours:.1f}x"  # noqa: E731
        rows.append([name, str(T), dname, f"{ours * 1e3:.1f}", f"{flops / ours / 1e9:.1f}",
                     f"{flops / ours / rate:.2f}", ratio(rd), ratio(dn), ratio(npl),
                     f"{ours / floor:.2f}" if T <= 8 else ""])
        if a.skew and T >= 64:
            skew_ids = jnp.broadcast_to(jnp.arange(m.k, dtype=jnp.int32), ids.shape)
            sk = timed(functools.partial(jax.jit(nbx.fused_moe), x, w, skew_ids, experts), a.repeats)
            rows.append([name, str(T), dname + " skewed", f"{sk * 1e3:.1f}", f"{flops / sk / 1e9:.1f}",
                         f"{flops / sk / rate:.2f}", "", "", "", f"{ours / sk:.2f} x balanced rate"])
        del x, w, ids, experts, gn, un, dnp
    progress(len(jobs), len(jobs), "done")
    print()
    print(format_table(["model", "T", "weights", "ours ms", "GFLOP/s", "/ sgemm", "ragged_dot / ours",
                        "dense / ours", "numpy loop / ours", "T<=8: / bw floor"], rows))


if __name__ == "__main__":
    main()
