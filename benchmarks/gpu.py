"""CUDA path on a GPU: correctness against float64, then timing against XLA.

    python benchmarks/gpu.py [--check-only] [--models a,b] [--tokens 1,16,512,4096] [--out DIR]

Checks (every shape on fresh random inputs, float64 numpy reference):
odd sizes (T = 1, 33, 222; H, I not multiples of any block), bf16/f16/f32
weights, both activations, bands, the decode and prefill paths, a bad expert
id (must fail naming the slot), the pointer-table cache.

Timing: each implementation runs R times inside one jitted `lax.fori_loop`
(each iteration's output, renormalized, is the next input), so device time
and each call's host work are counted and Python dispatch is not; the median
of 5 such loops, divided by R.  Columns: ours, XLA `ragged_dot`, dense
per-expert einsum (every expert on every token, masked), routed TFLOP/s and
its fraction of the GEMM rate, and for T <= 16 time / floor.  Both anchors are
measured beside each row, in the same way as the row (a jitted loop, median of
5): the GEMM rate is XLA's own bf16 matmul (cuBLAS) of --gemm-n (8192) cubed;
the floor is the active experts' weight bytes / the bandwidth of a
device-to-device copy of --copy-mib (1024 MiB; read + write counted).
Then the quantized decode rows (bf16, int8, int4, mxfp4 experts at --quant-tokens)
and the training-step rows (forward + backward of sum(y^2) with respect to x,
the routing weights and the experts, at --train-tokens; ours vs a ragged_dot
MoE's step; 3x the routed forward FLOPs as a fraction of the GEMM rate).
Gradient checks: jax.grad through the CUDA path vs the reference's VJP in
float32 at the highest matmul precision.
A table is printed last; full logs go to --out (or $JAX_NBX_BENCH_OUT).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import format_table, make_layer, max_rel_error, np_reference

import jax_nbx as nbx
from jax_nbx.backends.cuda import calls as _cuda
from jax_nbx.models import MODELS


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------ correctness

def check_case(T, E, k, H, I, xd, wd, activation="swiglu", band=None, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, H)), xd)
    ex = nbx.Experts(gate=jnp.asarray(rng.standard_normal((E, H, I)) / np.sqrt(H), wd),
                     up=jnp.asarray(rng.standard_normal((E, H, I)) / np.sqrt(H), wd),
                     down=jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), wd))
    w, ids = nbx.route(jnp.asarray(rng.standard_normal((T, E)), jnp.float32), k)
    f = jax.jit(lambda x, w, ids, ex: nbx.fused_moe(x, w, ids, ex, activation=activation,
                                                    implementation="ffi", max_workspace_bytes=band))
    y = f(x, w, ids, ex)
    ref = np_reference(x, w, ids, ex, activation)
    err = max_rel_error(y, ref)
    finite = bool(jnp.all(jnp.isfinite(y)))
    tol = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 4e-3}[np.dtype(wd).name]
    return err, finite and err < tol, tol


GRAD_CASES = [  # T, E, k, H, I, weights dtype (x the same)
    (1, 8, 2, 257, 130, jnp.float32),
    (33, 8, 2, 129, 99, jnp.float32),
    (222, 16, 4, 256, 128, jnp.bfloat16),
    (1024, 64, 8, 2048, 1024, jnp.bfloat16),
]


def check_grad_case(T, E, k, H, I, wd, seed=0):
    """jax.grad through the CUDA path (the CUDA backward handler for dense
    experts) against the reference's VJP evaluated in float32 at the highest
    matmul precision on the same (dtype-rounded) inputs: the worst relative
    error over dx, d(topk_weights) and the three weight gradients."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, H)), wd)
    ex = nbx.Experts(gate=jnp.asarray(rng.standard_normal((E, H, I)) / np.sqrt(H), wd),
                     up=jnp.asarray(rng.standard_normal((E, H, I)) / np.sqrt(H), wd),
                     down=jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), wd))
    w, ids = nbx.route(jnp.asarray(rng.standard_normal((T, E)), jnp.float32), k)
    dy = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)

    def loss(impl, x_, w_, ex_):
        return jnp.sum(nbx.fused_moe(x_, w_, ids, ex_, implementation=impl).astype(jnp.float32) * dy)

    got = jax.jit(jax.grad(functools.partial(loss, "ffi"), argnums=(0, 1, 2)))(x, w, ex)
    up32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2)))(
            up32(x), w, jax.tree.map(up32, ex))
    errs = [max_rel_error(g, np.asarray(r, np.float64))
            for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref))]
    tol = {"float32": 1e-4, "bfloat16": 3e-2}[np.dtype(wd).name]
    finite = all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(got))
    return max(errs), finite and max(errs) < tol, tol


def _deferred_check(x, ex):
    """A call with topk_ids[2, 1] = 9 (E = 4) under JAX_NBX_CUDA_CHECK_IDS=deferred
    must return; the next call must fail naming it: (status, message)."""
    try:
        ids = jnp.zeros((5, 2), jnp.int32).at[2, 1].set(9)
        ww = jnp.ones((5, 2), jnp.float32)
        f = jax.jit(lambda a, b, c: nbx.fused_moe(a, b, c, ex, implementation="ffi"))
        f(x, ww, ids).block_until_ready()
        time.sleep(0.1)  # the asynchronous copy lands
    except Exception as e:  # what the handler was given, for the diagnosis (seen on an H200, 2026-12-04)
        try:
            attr = re.findall(r"check_ids = (\d+)", f.lower(x, ww, ids).as_text())
        except Exception as le:  # noqa: BLE001 (a diagnosis, never a second failure)
            attr = f"(lowering failed: {le})"
        return (f"FAIL (the bad call itself failed; JAX_NBX_CUDA_CHECK_IDS read as "
                f"{_cuda.check_ids_mode()!r}, the custom call's check_ids {attr})"), str(e).splitlines()[0][:120]
    try:
        f(x, ww, jnp.zeros((5, 2), jnp.int32)).block_until_ready()
        return "FAIL (no error at the next call)", ""
    except Exception as e:
        msg = str(e).splitlines()[0][:120]
        return ("PASS" if "topk_ids[2, 1] = 9" in str(e) and "earlier call" in str(e) else "FAIL"), msg


CHECK_CASES = [
    # T, E, k, H, I, x dtype, w dtype, activation, band cap
    (1, 8, 2, 4096, 1408, jnp.bfloat16, jnp.bfloat16, "swiglu", None),
    (33, 8, 2, 129, 99, jnp.float32, jnp.float32, "swiglu", None),
    (222, 16, 4, 257, 130, jnp.bfloat16, jnp.bfloat16, "geglu", None),
    (222, 16, 4, 256, 128, jnp.float32, jnp.bfloat16, "swiglu", None),
    (222, 16, 4, 256, 128, jnp.float16, jnp.float16, "swiglu", None),
    (1024, 64, 8, 2048, 1024, jnp.bfloat16, jnp.bfloat16, "swiglu", None),
    (1024, 64, 8, 2048, 1024, jnp.bfloat16, jnp.bfloat16, "swiglu", "40MB"),
    (3, 64, 8, 2048, 1024, jnp.bfloat16, jnp.bfloat16, "swiglu", None),
    (600, 128, 8, 2048, 768, jnp.bfloat16, jnp.bfloat16, "swiglu", None),
]


def run_checks(rows):
    ok_all = True
    for i, (T, E, k, H, I, xd, wd, act, band) in enumerate(CHECK_CASES):
        t0 = time.perf_counter()
        try:
            err, ok, tol = check_case(T, E, k, H, I, xd, wd, act, band, seed=i)
            status = "PASS" if ok else "FAIL"
        except Exception as e:  # report and go on
            err, ok, tol, status = float("nan"), False, 0, f"ERROR {type(e).__name__}: {e}"[:160]
            traceback.print_exc()
        ok_all &= ok
        rows.append([f"T={T} E={E} k={k} H={H} I={I} x={np.dtype(xd).name} w={np.dtype(wd).name} "
                     f"{act} band={band}", f"{err:.2e}", f"{tol:.0e}", status])
        log(rows[-1], f"{time.perf_counter() - t0:.1f}s")
    # a bad expert id must fail and name the slot
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16)
    ex = nbx.Experts(*(jnp.asarray(rng.standard_normal(s) * 0.1, jnp.bfloat16)
                       for s in ((4, 64, 32), (4, 64, 32), (4, 32, 64))))
    for T_, note in ((5, "decode"), (64, "prefill")):
        xx = jnp.tile(x, (T_ // 5 + 1, 1))[:T_]
        ids = jnp.zeros((T_, 2), jnp.int32).at[T_ // 2, 1].set(9)
        ww = jnp.ones((T_, 2), jnp.float32)
        try:
            y = nbx.fused_moe(xx, ww, ids, ex, implementation="ffi")
            y.block_until_ready()
            status, msg = "FAIL (no error)", ""
        except Exception as e:
            msg = str(e).splitlines()[0][:120]
            status = "PASS" if f"topk_ids[{T_ // 2}, 1] = 9" in str(e) else "FAIL"
        ok_all &= status == "PASS"
        rows.append([f"bad id, {note} path (T={T_})", "-", "-", f"{status}: {msg}"])
        log(rows[-1])
    # JAX_NBX_CUDA_CHECK_IDS=deferred: the bad call returns; the next call on the device fails naming it
    with _env("JAX_NBX_CUDA_CHECK_IDS", "deferred"):
        status, msg = _deferred_check(x, ex)
    ok_all &= status == "PASS"
    rows.append(["bad id, deferred check (T=5)", "-", "-", f"{status}: {msg}"])
    log(rows[-1])
    for i, (T, E, k, H, I, wd) in enumerate(GRAD_CASES):
        t0 = time.perf_counter()
        try:
            err, ok, tol = check_grad_case(T, E, k, H, I, wd, seed=100 + i)
            status = "PASS" if ok else "FAIL"
        except Exception as e:
            err, ok, tol, status = float("nan"), False, 0, f"ERROR {type(e).__name__}: {e}"[:160]
            traceback.print_exc()
        ok_all &= ok
        rows.append([f"grad T={T} E={E} k={k} H={H} I={I} w={np.dtype(wd).name}", f"{err:.2e}", f"{tol:.0e}",
                     status])
        log(rows[-1], f"{time.perf_counter() - t0:.1f}s")
    rows.append(["pointer tables", "-", "-", json.dumps(nbx.tables.stats("cuda"))])
    rows.append(["account", "-", "-", json.dumps({k: {kk: v[kk] for kk in ("live", "peak", "budget")}
                                                  for k, v in nbx.memory.stats().items()})])
    return ok_all


# ------------------------------------------------------------------ baselines

def ragged_moe(x, w, ids, ex):
    """MoE through jax.lax.ragged_dot: slots sorted by expert, three grouped matmuls."""
    T, k = ids.shape
    E = ex.gate.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat)
    tok = order // k
    gs = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = x[tok]
    g = jax.lax.ragged_dot(xs, ex.gate, gs, preferred_element_type=jnp.float32)
    u = jax.lax.ragged_dot(xs, ex.up, gs, preferred_element_type=jnp.float32)
    a = (jax.nn.silu(g) * u).astype(x.dtype)
    o = jax.lax.ragged_dot(a, ex.down, gs, preferred_element_type=jnp.float32)
    o = o * w.reshape(-1)[order][:, None]
    return jnp.zeros((T, x.shape[1]), jnp.float32).at[tok].add(o).astype(x.dtype)


def dense_moe(x, w, ids, ex):
    """Every expert on every token (einsum), masked by the routing."""
    E = ex.gate.shape[0]
    comb = jnp.zeros((x.shape[0], E), jnp.float32).at[jnp.arange(x.shape[0])[:, None], ids].add(w)
    g = jnp.einsum("th,ehi->tei", x, ex.gate, preferred_element_type=jnp.float32)
    u = jnp.einsum("th,ehi->tei", x, ex.up, preferred_element_type=jnp.float32)
    a = (jax.nn.silu(g) * u).astype(x.dtype)
    o = jnp.einsum("tei,eih->teh", a, ex.down, preferred_element_type=jnp.float32)
    return jnp.einsum("teh,te->th", o, comb).astype(x.dtype)


def ours(x, w, ids, ex):
    return nbx.fused_moe(x, w, ids, ex, implementation="ffi")


@contextlib.contextmanager
def _env(name, value):
    """``name=value`` in the environment for the block (read at trace time),
    then what it was."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def ours_deferred(x, w, ids, ex):
    """Ours with the expert-id check deferred to the next call (no stream
    synchronization: JAX_NBX_CUDA_CHECK_IDS=deferred, read at trace time)."""
    with _env("JAX_NBX_CUDA_CHECK_IDS", "deferred"):
        return ours(x, w, ids, ex)


def ours_graph(x, w, ids, ex):
    """Ours with the deferred id check and the launches as one CUDA graph
    (JAX_NBX_CUDA_GRAPHS=1; both read at trace time)."""
    with _env("JAX_NBX_CUDA_CHECK_IDS", "deferred"), _env("JAX_NBX_CUDA_GRAPHS", "1"):
        return ours(x, w, ids, ex)


def ours_prefill(x, w, ids, ex):
    """Ours forced onto the prefill path (ordering + tensor-core GEMMs) at any T."""
    with _env("JAX_NBX_CUDA_DECODE_SLOTS", "0"):
        return ours(x, w, ids, ex)


def _median_loop_time(run, arg, reps):
    jax.block_until_ready(run(arg))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(run(arg))
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def _renorm(y, dtype):
    """The timing loops' step between iterations: y scaled to unit RMS (in
    float32), cast to the loop's dtype -- the next iteration's input."""
    y = y.astype(jnp.float32)
    return (y * jax.lax.rsqrt(jnp.mean(y * y) + 1e-6)).astype(dtype)


def loop_time(fn, x, w, ids, ex, reps):
    @jax.jit
    def run(x, w, ids, ex):
        return jax.lax.fori_loop(0, reps, lambda _, xc: _renorm(fn(xc, w, ids, ex), x.dtype), x)

    return _median_loop_time(lambda x: run(x, w, ids, ex), x, reps)


@functools.partial(jax.jit, static_argnums=1)
def _norm_loop(x, reps):
    return jax.lax.fori_loop(0, reps, lambda _, xc: _renorm(xc, x.dtype), x)


def norm_time(x, reps):
    """The loop's own renormalization, subtracted from every row (compiled once
    per shape, dtype and reps)."""
    return _median_loop_time(lambda x: _norm_loop(x, reps), x, reps)


@functools.cache
def _gemm_loop(n, reps, dtype):
    """The GEMM anchor's operands and jitted loop, built once per (n, reps, dtype)."""
    dtype = jnp.dtype(dtype)
    key_a, key_b = jax.random.split(jax.random.key(1))
    a = jax.random.normal(key_a, (n, n), jnp.float32).astype(dtype)
    b = (jax.random.normal(key_b, (n, n), jnp.float32) / np.sqrt(n)).astype(dtype)

    def step(_, xc):
        return _renorm(jnp.dot(xc, b, preferred_element_type=jnp.float32), dtype)

    return jax.jit(lambda a: jax.lax.fori_loop(0, reps, step, a)), a


def gemm_rate(n=8192, reps=5, dtype="bfloat16"):
    """XLA's own n x n x n matmul rate in FLOP/s on the default device: a jitted
    loop of `reps` dependent products (each renormalized into the next), median
    of 5, the renormalization's own time subtracted."""
    run, a = _gemm_loop(n, reps, dtype)
    t = _median_loop_time(run, a, reps)
    return 2.0 * n ** 3 / max(t - norm_time(a, reps), 1e-9)


@functools.cache
def _copy_loop(mib, reps):
    x = jnp.zeros((mib * 2 ** 20 // 4,), jnp.float32)
    return jax.jit(lambda x: jax.lax.fori_loop(0, reps, lambda _, xc: xc + 1.0, x)), x


def copy_bandwidth(mib=1024, reps=10):
    """Bytes per second of a device-to-device copy (read + write counted) on the
    default device: a jitted loop of `reps` passes, each adding 1 to the
    previous one's output (one read and one write of every byte, which XLA
    cannot elide), median of 5."""
    run, x = _copy_loop(mib, reps)
    return 2.0 * x.size * 4 / _median_loop_time(run, x, reps)


BENCH_VARIANTS = (("ours", ours), ("deferred", ours_deferred), ("graph", ours_graph),
                  ("prefill", ours_prefill), ("ragged", ragged_moe), ("dense", dense_moe))


def variant_runs(label: str, m, T: int) -> bool:
    """Whether a timing row times this variant: the dense einsum only where it fits, the
    decode-path variants (deferred check, graph, forced prefill path) at T <= 16."""
    if label == "dense":
        return T * m.E * m.I * 2 * 3 <= 8e9
    return label not in ("prefill", "deferred", "graph") or T <= 16


def run_bench(models, tokens, rows, budget_s, gemm_n=8192, copy_mib=1024):
    t_start = time.perf_counter()
    for name in models:
        m = MODELS[name]
        for T in tokens:
            if time.perf_counter() - t_start > budget_s:
                log("time budget spent; skipping", name, T)
                continue
            x, w, ids, ex = make_layer(m, T, jnp.bfloat16, seed=T)
            reps = 50 if T <= 16 else (20 if T <= 512 else 5)
            base = norm_time(x, reps)
            res = {}
            for label, fn in BENCH_VARIANTS:
                if not variant_runs(label, m, T):
                    res[label] = float("nan")
                    continue
                try:
                    res[label] = max(loop_time(fn, x, w, ids, ex, reps) - base, 1e-9)
                except Exception as e:
                    log("failed", label, name, T, type(e).__name__, str(e)[:200])
                    res[label] = float("nan")
            gemm = gemm_rate(gemm_n)      # the anchors beside the row
            bw = copy_bandwidth(copy_mib)
            flops = m.routed_flops(T)
            tf = flops / res["ours"] / 1e12
            active = len(np.unique(np.asarray(ids)))
            floor = active * 3 * m.H * m.I * 2 / bw
            row = [name, str(T), f"{res['ours'] * 1e3:.3f}", f"{res['deferred'] * 1e3:.3f}",
                   f"{res['graph'] * 1e3:.3f}", f"{res['prefill'] * 1e3:.3f}",
                   f"{res['ragged'] * 1e3:.3f}",
                   f"{res['dense'] * 1e3:.3f}", f"{res['ragged'] / res['ours']:.2f}",
                   f"{res['dense'] / res['ours']:.2f}", f"{tf:.1f}", f"{gemm / 1e12:.0f}", f"{tf * 1e12 / gemm:.3f}",
                   f"{bw / 1e12:.2f}", f"{res['ours'] / floor:.2f}" if T <= 16 else "-",
                   f"{res['deferred'] / floor:.2f}" if T <= 16 else "-",
                   f"{res['graph'] / floor:.2f}" if T <= 16 else "-"]
            rows.append(row)
            log(row)


def train_time(fn, x, w, ids, ex, reps):
    """One training step of the layer: loss = sum(fn(...)^2), its gradient with
    respect to x, the routing weights and every expert weight.  The loop feeds
    the renormalized dx (plus the sum of every gradient, so that none is dead
    code) into the next step; median of 5 loops / reps."""
    def step(xc):
        def loss(x_, w_, e_):
            return jnp.sum(jnp.square(fn(x_, w_, ids, e_).astype(jnp.float32)))
        dx, dw, de = jax.grad(loss, argnums=(0, 1, 2))(xc, w, ex)
        keep = jnp.sum(dw) + sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(de))
        return _renorm(dx.astype(jnp.float32) + 1e-30 * keep, x.dtype)

    @jax.jit
    def run(x):
        return jax.lax.fori_loop(0, reps, lambda _, xc: step(xc), x)

    return _median_loop_time(run, x, reps)


def run_train(models, tokens, rows, budget_s, gemm_n=8192):
    """Training-step rows (bf16 forward + backward): ours (the CUDA backward
    for dense experts) vs a ragged_dot MoE's step, and 3x the routed forward
    FLOPs over the time as a fraction of the GEMM rate."""
    t_start = time.perf_counter()
    for name in models:
        m = MODELS[name]
        for T in tokens:
            if time.perf_counter() - t_start > budget_s:
                log("training budget spent; skipping", name, T)
                continue
            x, w, ids, ex = make_layer(m, T, jnp.bfloat16, seed=T)
            reps = 3
            base = norm_time(x, reps)
            res = {}
            for label, fn in (("ours", ours), ("ragged", ragged_moe)):
                try:
                    res[label] = max(train_time(fn, x, w, ids, ex, reps) - base, 1e-9)
                except Exception as e:
                    log("failed train", label, name, T, type(e).__name__, str(e)[:200])
                    res[label] = float("nan")
            gemm = gemm_rate(gemm_n)
            tf = 3 * m.routed_flops(T) / res["ours"] / 1e12
            rows.append([name, str(T), f"{res['ours'] * 1e3:.2f}", f"{res['ragged'] * 1e3:.2f}",
                         f"{res['ragged'] / res['ours']:.2f}", f"{tf:.1f}", f"{gemm / 1e12:.0f}",
                         f"{tf * 1e12 / gemm:.3f}"])
            log(rows[-1])


QUANT_FORMATS = ("bf16", "int8", "int4", "mxfp4")


def quantized(ex, fmt: str):
    """The quantized decode rows' experts: bf16 as they are; int8, int4 (group 128) with bf16
    scales; mxfp4 (group 32, E8M0 scales)."""
    if fmt == "bf16":
        return ex
    return nbx.quantize(ex, fmt, scale_dtype=jnp.bfloat16, **({"group_size": 128} if fmt == "int4" else {}))


def run_quant_decode(models, tokens, rows, copy_mib=1024):
    """Decode with bf16, int8, int4 and mxfp4 experts: ms per call and each format's
    speed relative to bf16 (issue #56's target: int4 and mxfp4 >= 2x)."""
    for name in models:
        m = MODELS[name]
        for T in tokens:
            x, w, ids, ex = make_layer(m, T, jnp.bfloat16, seed=T)
            reps = 50
            base = norm_time(x, reps)
            res = {}
            for fmt in QUANT_FORMATS:
                e = quantized(ex, fmt)
                try:
                    res[fmt] = max(loop_time(ours, x, w, ids, e, reps) - base, 1e-9)
                except Exception as err:
                    log("failed quant", fmt, name, T, type(err).__name__, str(err)[:200])
                    res[fmt] = float("nan")
            bw = copy_bandwidth(copy_mib)
            active = len(np.unique(np.asarray(ids)))
            floor = active * 3 * m.H * m.I * 2 / bw
            rows.append([name, str(T)] + [f"{res[f] * 1e3:.3f}" for f in QUANT_FORMATS]
                        + [f"{res['bf16'] / res[f]:.2f}" for f in QUANT_FORMATS[1:]] + [f"{res['bf16'] / floor:.2f}"])
            log(rows[-1])


def _tables(check_rows, bench_rows, quant_rows, train_rows, with_checks=True) -> str:
    text = "" if not with_checks else "\n== correctness (max |y-ref| / max |ref| vs float64)\n" + format_table(
        ["case", "err", "tol", "status"], check_rows)
    if bench_rows:
        text += ("\n== timing, bf16, median of 5 jitted loops (ms per layer call)\n" + format_table(
            ["model", "T", "ours ms", "deferred check ms", "graph+deferred ms", "prefill path ms",
             "ragged_dot ms", "dense ms", "ragged/ours", "dense/ours", "TFLOP/s", "GEMM TFLOP/s", "of GEMM",
             "copy TB/s", "t/bw floor", "deferred t/bw floor", "graph t/bw floor"], bench_rows))
    if quant_rows:
        text += ("\n== quantized decode (ms per layer call; speed relative to bf16)\n" + format_table(
            ["model", "T", *(f"{f} ms" for f in QUANT_FORMATS), *(f"{f} speed" for f in QUANT_FORMATS[1:]),
             "bf16 t/bw floor"],
            quant_rows))
    if train_rows:
        text += ("\n== training step, bf16 (forward + backward of sum(y^2); ms per step)\n" + format_table(
            ["model", "T", "ours ms", "ragged_dot ms", "ragged/ours", "TFLOP/s (3x fwd)", "GEMM TFLOP/s", "of GEMM"],
            train_rows))
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--skip-checks", action="store_true", help="time only (e.g. after tuning)")
    ap.add_argument("--models", default="mixtral-8x7b,olmoe-1b-7b,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,16,512,4096")
    ap.add_argument("--bench-seconds", type=float, default=240.0)
    ap.add_argument("--deadline-seconds", type=float, default=float("inf"),
                    help="from start: no timing section starts after it (the checks always run); "
                         "the tables are written after every section")
    ap.add_argument("--out", default=os.environ.get("JAX_NBX_BENCH_OUT"))
    ap.add_argument("--gemm-n", type=int, default=8192, help="the GEMM anchor's n (n x n x n bf16)")
    ap.add_argument("--copy-mib", type=int, default=1024, help="the copy anchor's size in MiB")
    ap.add_argument("--train-tokens", default="4096", help="training-step rows' T ('' for none)")
    ap.add_argument("--quant-tokens", default="1", help="quantized decode rows' T ('' for none)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    left = lambda: args.deadline_seconds - (time.perf_counter() - start)  # noqa: E731
    dev = jax.devices()[0]
    log(f"device: {dev.device_kind}, jax {jax.__version__}, backend {jax.default_backend()}, "
        f"nbx platforms {nbx._registry.platforms()}, cuda path: {_cuda.unavailable_reason() or 'available'}")
    rows: dict[str, list] = {"check": [], "bench": [], "quant": [], "train": []}

    def write() -> str:
        text = _tables(rows["check"], rows["bench"], rows["quant"], rows["train"], not args.skip_checks)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "gpu_table.md"), "w") as f:
                f.write(f"device {dev.device_kind}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}\n{text}\n")
        return text

    ok = True if args.skip_checks else run_checks(rows["check"])
    write()
    models = args.models.split(",")
    ints = lambda s_: [int(t) for t in s_.split(",") if t]  # noqa: E731
    if not args.check_only:
        # each section gets what is left, the timing rows at most --bench-seconds
        log(f"== timing ({left():.0f} s left)")
        if left() > 30:
            run_bench(models, ints(args.tokens), rows["bench"], min(args.bench_seconds, left() - 30),
                      args.gemm_n, args.copy_mib)
            write()
        log(f"== quantized decode ({left():.0f} s left)")
        if left() > 20:
            run_quant_decode(models, ints(args.quant_tokens), rows["quant"], args.copy_mib)
            write()
        log(f"== training step ({left():.0f} s left)")
        if left() > 20:
            run_train(models, ints(args.train_tokens), rows["train"], left() - 20, args.gemm_n)
        else:
            log("deadline: quantized decode / training rows skipped")
    print(write(), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
