"""Seeded fuzz: random problems against the float64 reference (issue #14).

Each case draws, from its own seed, a shape (T, E, k, H, I: odd sizes and
T=1 often), an activation, the x and weight dtypes, a weight format (dense,
int8, or int4 / fp8 / mxfp4 / mxfp8 / nvfp4 in groups), stacked or per-expert layout, a routing (top-k, or
independent draws with repeats), an id dtype (signed/unsigned, 8 to 64 bit,
numpy or JAX), out-of-range ids with ``ids_outside="error"`` or ``"skip"``,
and a workspace cap that forces bands.  It checks:

* the handler writing into a NaN-poisoned output (every row written) and the
  public op against ``np_moe`` (float64, conftest.py) within the dtype's
  bound, or against the same reference on the dequantized weights;
* for ``"error"`` with a bad id: the run-time error names its position;
* for dense cases, every few cases, the gradients against ``np_moe_grads``.

``JAX_NBX_FUZZ_CASES`` / ``JAX_NBX_FUZZ_FIRST`` / ``JAX_NBX_FUZZ_SEED`` run
more cases, cases from another index, or another seed.  CI runs cases 0-19
here and .ci/sanitize cases 20-29 under ASan + UBSan (30 distinct cases per
run; a failure prints its case, whose index and seed rerun it).
"""
from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from conftest import DTYPES, TOL, make_problem, np_moe, np_moe_grads, rel_err
from support.handlers import ffi_forward as _ffi_forward

pytestmark = pytest.mark.sanitize

CASES = int(os.environ.get("JAX_NBX_FUZZ_CASES", "20"))
FIRST = int(os.environ.get("JAX_NBX_FUZZ_FIRST", "0"))
SEED = int(os.environ.get("JAX_NBX_FUZZ_SEED", "20261130"))
ID_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


def draw(i: int) -> dict:
    """Case i: every choice from one seeded generator (printed on failure)."""
    r = np.random.default_rng([SEED, i])
    fmt = r.choice(["dense"] * 3 + ["int8", "int4", "mxfp4", "fp8", "mxfp8", "nvfp4"])
    G = (int(r.choice([32, 64])) if fmt in ("int4", "fp8") else 16 if fmt == "nvfp4"
         else 32 if fmt in ("mxfp4", "mxfp8") else None)
    T = int(r.choice([1, 1, 2, 3, 33, int(r.integers(4, 90))]))
    E = int(r.integers(1, 11))
    k = int(r.integers(1, min(E, 4) + 1))
    if G:  # K of every projection a multiple of the group
        H, I = G * int(r.integers(1, 3)), G * int(r.integers(1, 4))
    else:
        H, I = int(r.integers(1, 140)), int(r.integers(1, 150))
    id_dtype = np.dtype(r.choice([d for d in ID_DTYPES if np.iinfo(d).max > E]))
    return dict(
        i=i, T=T, E=E, k=k, H=H, I=I, fmt=str(fmt), G=G,
        activation=str(r.choice(["swiglu", "geglu"])),
        xd=str(r.choice(list(DTYPES))),
        wd=str(r.choice(list(DTYPES))) if fmt == "dense" else "f32",
        lists=bool(r.random() < 0.3),
        routing=str(r.choice(["topk", "draws", "one"])),
        id_dtype=id_dtype.name, id_jax=bool(r.random() < 0.5 and id_dtype.itemsize <= 4),
        bad=int(r.integers(0, 3)) if r.random() < 0.35 else 0,
        outside=str(r.choice(["error", "skip"])),
        band_fraction=float(r.uniform(0.05, 0.9)) if r.random() < 0.4 else None,
        grads=bool(fmt == "dense" and i % 4 == 0),
        seed=int(r.integers(0, 2 ** 31)),
    )


def bad_values(dt: np.dtype, E: int, r) -> list[int]:
    """Ids outside [0, E) that dtype can hold: its extremes, E, -1, past int32."""
    info = np.iinfo(dt)
    vals = [E, int(info.max), int(r.integers(E, info.max, endpoint=True, dtype=dt))]
    if info.min < 0:
        vals += [-1, int(info.min)]
    return vals


def run_case(c: dict) -> None:
    r = np.random.default_rng(c["seed"])
    T, E, k, H, I = c["T"], c["E"], c["k"], c["H"], c["I"]
    x, w, ids, ex = make_problem(c["seed"], T, E, k, H, I, DTYPES[c["xd"]], DTYPES[c["wd"]],
                                 routing=c["routing"])
    ids = np.asarray(ids).astype(c["id_dtype"])
    bad_slots = []
    for _ in range(c["bad"]):
        t, j = int(r.integers(0, T)), int(r.integers(0, k))
        vals = bad_values(ids.dtype, E, r)
        ids[t, j] = vals[int(r.integers(len(vals)))]
        bad_slots.append((t, j))
    ids_in = jnp.asarray(ids) if c["id_jax"] else ids
    weights = ex
    if c["lists"]:
        weights = nbx.Experts(*([a[e] for e in range(E)] for a in (ex.gate, ex.up, ex.down)))
    ref_ex = ex
    if c["fmt"] != "dense":
        weights = nbx.quantize(weights, c["fmt"], group_size=c["G"])
        ref_ex = nbx.dequantize(weights, jnp.float32)
        ref_ex = ref_ex.stacked() if c["lists"] else ref_ex
    ids64 = ids.astype(np.int64)
    ok = (ids64 >= 0) & (ids64 < E)
    ref = np_moe(x, w, ids64, ref_ex, c["activation"])  # slots outside [0, E) contribute nothing
    tol = max(TOL[c["xd"]], TOL[c["wd"]])
    # the arithmetic precision=None takes (bf16 x: the dot kernels where the CPU has the instruction)
    dot = nbx.ops.resolve(x, w, ids_in, weights, implementation="ffi", ids_outside="skip")[1].bf16_dot
    cap = None
    if c["band_fraction"] is not None:
        need = functools.partial(nbx.memory.fused_moe_workspace_bytes, bf16_dot=dot)
        cap = need(0, k, E, H, I) + int((need(T, k, E, H, I) - need(0, k, E, H, I)) * c["band_fraction"])
        # one token of each handler fits (the backward plans against the same cap)
        cap = max(cap, need(1, k, E, H, I), nbx.memory.fused_moe_backward_workspace_bytes(1, k, E, H, I))
    kw = dict(activation=c["activation"], implementation="ffi", max_workspace_bytes=cap,
              ids_outside=c["outside"])
    if bad_slots and c["outside"] == "error":
        t, j = min(bad_slots)  # the handler names the first bad slot in row-major order
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=rf"INVALID_ARGUMENT: topk_ids\[{t}, {j}\] = -?\d+ is outside \[0, {E}\)"):
            nbx.fused_moe(x, w, ids_in, weights, **kw)
        return
    # the handler into a NaN-poisoned output, on the ids the op hands it
    ids32 = np.clip(ids64, -1, E).astype(np.int32)
    band = nbx.planning.plan_band_tokens(T, k, E, H, I, cap, bf16_dot=dot)
    yp = _ffi_forward(x, w, jnp.asarray(ids32), *weights.flat(), activation=c["activation"],
                      band_tokens=band, lists=c["lists"], skip_outside=True, poison=True, bf16_dot=dot)
    assert bool(jnp.all(jnp.isfinite(yp.astype(jnp.float32)))), "unwritten (poisoned) rows"
    assert rel_err(yp, ref) < tol
    y = nbx.fused_moe(x, w, ids_in, weights, **kw)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, ref) < tol
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(yp.astype(jnp.float32)))
    if c["grads"]:
        ct = jnp.asarray(r.standard_normal((T, H)), jnp.float32)

        def loss(x_, w_, e_):
            return jnp.sum(nbx.fused_moe(x_, w_, ids_in, e_, **kw).astype(jnp.float32) * ct)

        dx, dw, de = jax.grad(loss, argnums=(0, 1, 2))(x, w, weights)
        gref = np_moe_grads(x, w, np.where(ok, ids64, -1), ex, ct.astype(x.dtype), c["activation"])
        de = de.stacked() if c["lists"] else de
        for got, want in zip((dx, dw, de.gate, de.up, de.down), gref):
            assert rel_err(got, want) < 4 * tol


def test_fuzz_against_float64():
    start, failures = time.perf_counter(), []
    for i in range(FIRST, FIRST + CASES):
        c = draw(i)
        try:
            run_case(c)
        except Exception as e:  # noqa: BLE001 - collected, reported with the case
            failures.append(f"case {c}: {type(e).__name__}: {str(e)[:300]}")
        assert nbx.memory.stats()["cpu:0"]["live"] == 0, f"bytes leaked after case {c}"
    print(f"fuzz: cases {FIRST}-{FIRST + CASES - 1} (seed {SEED}) in {time.perf_counter() - start:.1f} s")
    assert not failures, f"{len(failures)} of {CASES} cases failed (JAX_NBX_FUZZ_SEED={SEED}):\n" + \
        "\n".join(failures[:5])
