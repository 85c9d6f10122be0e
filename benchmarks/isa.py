"""Every CPU kernel family under every supported instruction set, side by side,
with the anchors measured beside each row (issue #19's benchmark method).

    python benchmarks/isa.py                                  # OLMoE and Qwen3, the default rows
    python benchmarks/isa.py --models olmoe-1b-7b --rows prefill-f32,decode-int4 --rounds 5
    python benchmarks/isa.py --json isa.json
    python benchmarks/isa.py --rows prefill-f32,prefill-bf16,prefill-bf16dot   # bf16 dot products
    python benchmarks/isa.py --rows decode-bf16,decode-bf16dot,decode8-bf16,decode8-bf16dot
    python benchmarks/isa.py --rows decode-int8x8,decode-int4x8,decode8-int8x8,decode8-int4x8  # int8 arithmetic

A row is one (model layer, T, weight format): prefill T=512 with float32 and
bfloat16 weights; decode T=1 and T=8 with float32, bfloat16, int8 and int4
(group 128) weights; x float32 (bf16 for the quantized rows, as
benchmarks/quant.py); and prefill T=512 with bfloat16 x and weights under
``precision="bfloat16"`` (and decode T=1 / T=8 under it; the dot-product kernels: VDPBF16PS where the CPU
has avx512_bf16, issue #19's target >= 1.3 x the sgemm rate; else the fma
kernels, the same arithmetic on float32 FMAs; an ISA whose dot kernels would
be the emulation -- the generic table -- is not timed on that row; the ISA
column names the dot kernels, and a T=16 layer's bits are compared with the
emulation's); and decode T=1 / T=8 with int8 and int4 experts under
``precision="int8"`` (the ``x8`` rows: x quantized to int8, integer sums).
Each round runs, for that row, numpy's sgemm (1024^3, float32), and the op
once with each ISA for the row's kernel family (`jax_nbx.cpu.set_isa`; the
other families as chosen; until 2026-12-05 every family took the ISA, so a
decode row also changed the packed family's blocking, which lays out the
gathered rows), each call right after a numpy
copy of 256 MB, which leaves the weights cold (as in a model, where the
other layers' weights pass between two calls of one layer), the ISAs' order
rotating from round to round -- so every ratio compares times taken seconds
apart; the medians over the rounds are printed.  (Until 2026-12-05 the copy
ran once per round, before the first ISA: a later ISA found the weights of
a small layer, such as int4 Qwen3 at T=1 (21 MB), still in a 32 MB L3.)

* prefill: GFLOP/s of the routed work and its ratio to the sgemm rate of the
  same rounds (issue #19's target: >= 0.85), and the time over the roofline
  max(FLOPs / sgemm rate, active weight bytes / copy read rate), naming the
  bound: few rows per expert (Qwen3: 32 at T=512) read every weight for few
  FLOPs, and the read rate bounds it, not the sgemm rate;
* decode: time / the weight-bandwidth floor (active experts' weight bytes /
  the copy's read rate in the same rounds; target <= 1.3 for bf16), and the
  "idle" time: a trivial jitted op (``x * 2 + 1`` on 1024 floats) timed right
  after its own copy in the same rounds, what any call pays after the copy
  left this process's other threads idle (on the 2-core VMs here 0.25-0.45
  ms against 0.01 ms back to back: waking an idle vCPU, not the weights);
  ``net`` is (time - idle) / floor;
* ``÷ best``: each ISA's time over the fastest ISA's on that row; the ISA
  jax_nbx chooses by itself for the row's kernel family (prefill: packed;
  decode: stream for bf16 weights, stream_f32 for float32, quantized decode:
  qstream; precision="bfloat16": dot; precision="int8": qdot;
  `jax_nbx.cpu.isa_families`) is
  marked ``*`` (target: never above 1.03).  ``--calibrate`` first runs
  `jax_nbx.calibrate_isa` and marks its choice instead.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import format_table, machine, make_layer, time_once

import jax_nbx as nbx

ROWS = {  # name -> (T, weights, x dtype, precision)
    "prefill-f32": (512, "f32", jnp.float32, None),
    "prefill-bf16": (512, "bf16", jnp.float32, None),
    "prefill-bf16dot": (512, "bf16", jnp.bfloat16, "bfloat16"),
    "decode-f32": (1, "f32", jnp.float32, None),
    "decode-bf16": (1, "bf16", jnp.float32, None),
    "decode-int8": (1, "int8", jnp.bfloat16, None),
    "decode-int4": (1, "int4", jnp.bfloat16, None),
    "decode8-bf16": (8, "bf16", jnp.float32, None),
    "decode8-int4": (8, "int4", jnp.bfloat16, None),
    "decode-bf16dot": (1, "bf16", jnp.bfloat16, "bfloat16"),
    "decode8-bf16dot": (8, "bf16", jnp.bfloat16, "bfloat16"),
    "decode-int8x8": (1, "int8", jnp.bfloat16, "int8"),
    "decode-int4x8": (1, "int4", jnp.bfloat16, "int8"),
    "decode8-int8x8": (8, "int8", jnp.bfloat16, "int8"),
    "decode8-int4x8": (8, "int4", jnp.bfloat16, "int8"),
}
DEFAULT_ROWS = [r for r, v in ROWS.items() if v[3] is None]  # (the other precisions' rows: by name)


def _family(T, fmt, prec) -> str:
    """The kernel family a row runs (every expert streams at T <= 8 here;
    precision="bfloat16" runs on the dot family's blocking, streamed or not;
    precision="int8" on the qdot family's kernels)."""
    if prec == "bfloat16":
        return "dot"
    if prec == "int8":
        return "qdot"
    if T > 8:
        return "packed"
    return "qstream" if fmt in ("int8", "int4") else "stream_f32" if fmt == "f32" else "stream"


def _experts(m, fmt, T):
    x, w, ids, ex = make_layer(m, T, jnp.bfloat16 if fmt != "f32" else jnp.float32)
    if fmt == "int8":
        ex = nbx.quantize(ex, "int8", scale_dtype=jnp.bfloat16)
    elif fmt == "int4":
        ex = nbx.quantize(ex, "int4", group_size=128, scale_dtype=jnp.bfloat16)
    return x, w, ids, jax.block_until_ready(ex)


def _weight_bytes(m, fmt, ids) -> float:
    per = {"f32": 4.0, "bf16": 2.0, "int8": 1.0 + 2.0 / m.H, "int4": 0.5 + 4.0 / 128}[fmt]
    active = len(np.unique(np.asarray(ids)))
    return active * 3 * m.H * m.I * per


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="olmoe-1b-7b,qwen3-30b-a3b")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated of {', '.join(ROWS)}")
    ap.add_argument("--isas", default=None, help="comma-separated (default: every ISA this CPU supports)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--calibrate", action="store_true", help="mark jax_nbx.calibrate_isa's choice")
    a = ap.parse_args(argv)
    rows_wanted = a.rows.split(",")
    for r in rows_wanted:
        if r not in ROWS:
            ap.error(f"--rows: unknown row {r!r} (known: {', '.join(ROWS)})")
    calibration = nbx.calibrate_isa() if a.calibrate else None
    chosen = nbx.cpu.isa()
    families = nbx.cpu.isa_families()
    isas = a.isas.split(",") if a.isas else nbx.cpu.supported_isas()
    for i in isas:
        if i not in nbx.cpu.supported_isas():
            ap.error(f"--isas: {i!r} is not supported here (supported: {nbx.cpu.supported_isas()})")
    print(f"{machine()}; ISA chosen: {chosen}{' (calibrated)' if calibration else ''}; "
          f"measured side by side: {', '.join(isas)}; bf16 dot kernels: {nbx.cpu.dot_kernels()}", flush=True)

    rng = np.random.default_rng(0)
    A = rng.random((1024, 1024), dtype=np.float32)
    B = rng.random((1024, 1024), dtype=np.float32)
    src = np.ones(64 * 2 ** 20, np.float32)
    dst = np.empty_like(src)
    trivial = jax.jit(lambda v: v * 2 + 1)  # the decode rows' "idle" anchor
    small = jnp.ones(1024, jnp.float32)
    # (None rows: "float32" explicitly, whatever the default picks for bf16 x on this CPU)
    jitted = {p: jax.jit(lambda *a, p=p: nbx.fused_moe(*a, precision=p or "float32"))
              for p in (None, "bfloat16", "int8")}
    table, results = [], []
    try:
        for name in a.models.split(","):
            m = nbx.MODELS[name]
            for row in rows_wanted:
                T, fmt, xdt, precision = ROWS[row]
                x, w, ids, ex = _experts(m, fmt, T)
                x = x.astype(xdt)
                f = jitted[precision]
                fn = lambda: f(x, w, ids, ex)  # noqa: E731
                row_isas = isas
                dot = {}  # ISA -> its dot kernels (precision="bfloat16" rows)
                if precision == "bfloat16":  # not where the emulation would run (far slower)
                    row_isas = []
                    for i in isas:
                        nbx.cpu.set_isa(i)
                        if nbx.cpu.dot_kernels() != "emulated":
                            row_isas.append(i)
                            dot[i] = nbx.cpu.dot_kernels()
                    nbx.cpu.set_isa(chosen)
                    for i in row_isas:  # the kernels' bits against the emulation's, on a small layer
                        nbx.cpu.set_isa(i)
                        xs, ws_, is_, es = make_layer(m, 16, jnp.bfloat16)
                        y_native = f(xs, ws_, is_, es)
                        nbx.cpu.set_dot_kernels("emulated")
                        try:
                            emul = jax.jit(lambda *a: nbx.fused_moe(*a, precision="bfloat16"))
                            y_emul = emul(xs, ws_, is_, es)
                        finally:
                            nbx.cpu.set_dot_kernels("auto")
                            nbx.cpu.set_isa(chosen)
                        differ = int(jnp.sum(y_native != y_emul))
                        print(f"{name} T=16 precision=bfloat16 under {i}: {dot[i]} vs emulated: "
                              f"{'identical bits' if differ == 0 else f'{differ} of {y_native.size} differ'}",
                              flush=True)
                    if not row_isas:
                        print(f"{name} {row}: not timed (no ISA here has dot kernels other than the "
                              f"emulation)", flush=True)
                        continue
                family = _family(T, fmt, precision)
                times = {i: [] for i in row_isas}
                sg, bw, idle = [], [], []
                for r in range(a.rounds + 1):  # round 0 warms up
                    t_sg = time_once(lambda: A @ B)
                    per, t_cp = {}, []
                    # each call after the copy (its weights cold, as in a model's decode, where
                    # the other layers' weights pass between two calls of one layer), the ISAs'
                    # order rotating from round to round
                    for j in range(len(row_isas)):
                        i = row_isas[(r + j) % len(row_isas)]
                        nbx.cpu.set_isa({**families, family: i})  # only the row's family changes
                        t_cp.append(time_once(lambda: np.copyto(dst, src)))
                        per[i] = time_once(fn)
                    if T <= 8:  # what a trivial jitted call pays after the same copy
                        trivial(small).block_until_ready()  # (compiled, its threads just ran)
                        np.copyto(dst, src)
                        t_idle = time_once(lambda: trivial(small))
                        if r:
                            idle.append(t_idle)
                    if r:
                        sg.append(2 * 1024 ** 3 / t_sg)
                        bw.extend(src.nbytes / t for t in t_cp)  # the copy's read rate
                        for i in row_isas:
                            times[i].append(per[i])
                    sys.stderr.write(f"\r{name} {row} round {r}/{a.rounds}   ")
                sys.stderr.write("\n")
                med = {i: statistics.median(v) for i, v in times.items()}
                rate, read_bw = statistics.median(sg), statistics.median(bw)
                best = min(med.values())
                flops = m.routed_flops(T)
                floor = _weight_bytes(m, fmt, ids) / read_bw
                t_idle = statistics.median(idle) if idle else 0.0
                for i in row_isas:
                    t = med[i]
                    # prefill: also t over the roofline max(flops / sgemm rate, weight bytes / read
                    # rate): with few rows per expert the weights' traffic, not the FLOPs, bounds it
                    roof = max(flops / rate, floor)
                    anchor = (f"{flops / t / 1e9:.1f} GF/s, {flops / t / rate:.2f} x sgemm, "
                              f"{t / roof:.2f} x roofline ({'flops' if flops / rate >= floor else 'bytes'})"
                              if T > 8 else f"{t / floor:.2f} x bw floor (idle {t_idle * 1e3:.2f} ms, "
                              f"net {(t - t_idle) / floor:.2f})")
                    mark = "*" if i == families[family] else ""
                    label = i + mark + (f" ({dot[i]})" if i in dot else "")
                    table.append([name, row, label, f"{t * 1e3:.2f}", anchor,
                                  f"{t / best:.2f}"])
                results.append({"model": name, "row": row, "family": family, "T": T, "weights": fmt,
                                "x": str(np.dtype(xdt)),
                                "precision": precision or "float32", "dot_kernels": dot,
                                "median_ms": {i: v * 1e3 for i, v in med.items()},
                                "all_ms": {i: [t * 1e3 for t in v] for i, v in times.items()},
                                "sgemm_gflops_median": rate / 1e9, "copy_read_gbs_median": read_bw / 1e9,
                                "weight_floor_ms": floor * 1e3, "idle_ms": t_idle * 1e3, "flops": flops})
                print(table[-len(row_isas):], flush=True)
    finally:
        nbx.cpu.set_isa(chosen)
    print(format_table(["model", "row", "ISA", "ms", "vs anchors (same rounds)", "÷ best"], table))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"machine": machine(), "isa_chosen": chosen, "isa_families": families,
                       "dot_kernels": nbx.cpu.dot_kernels(),
                       "calibration": calibration and calibration.times_ms, "isas": isas, "rounds": a.rounds,
                       "rows": results}, fh, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
