"""fused_moe(..., precision="int8") on the CPU handler: int8 and int4 experts
with x and the intermediate quantized to int8 in blocks of 32 along K and
integer sums (xla_ffi/abi.h "int8 arithmetic"; xla_ffi/cpu/kernels/kernels_qdot.h).

The float64 reference (tests/support/int8_ref.py) quantizes x exactly as the
definition says (float32 codes and scales), takes the float64 products with
the dequantized weights, and does the same to the float64 intermediate.  The
bound is float32's relative to sum |a * w| per sum, plus, for the
intermediate, one code step d of each element within float32 error of a
rounding boundary (its float32 value may round the other way).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from support.handlers import ffi_forward
from support.int8_ref import dequantized_rows, quantize_rows
from support.problems import f64, make_problem, np_glu

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU handler's precision")

BLOCK = nbx.contract.INT8_BLOCK


def _near_tie(h, dh):
    """Elements of float64 rows h [T, K] within dh (their float32 error) of a
    rounding boundary of their int8 codes, and each block's d."""
    q, d = quantize_rows(h.astype(np.float32))
    dd = np.repeat(d.astype(np.float64), BLOCK, axis=1)[:, :h.shape[1]]
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(dd > 0, h / dd, 0)
        slack = np.where(dd > 0, dh / dd, 0) + 2.0**-20 * (np.abs(r) + 1)
    near = np.abs(np.abs(r - np.floor(r)) - 0.5) <= slack
    return near, dd


def np_moe_int8(x, w, ids, q: nbx.Experts, activation="swiglu"):
    """(y, tol): the float64 reference of precision="int8" and its bound."""
    dq = nbx.dequantize(q, jnp.float32)
    G, U, D = f64(dq.gate), f64(dq.up), f64(dq.down)
    xq = dequantized_rows(np.asarray(jnp.asarray(x).astype(jnp.float32)))
    w, ids = f64(w), np.asarray(ids)
    T, H = xq.shape
    y, tol = np.zeros((T, H)), np.zeros((T, H))
    eps = 2.0**-22
    for e in range(G.shape[0]):
        t_idx, j_idx = np.nonzero(ids == e)
        if t_idx.size == 0:
            continue
        a = xq[t_idx]
        g, u = a @ G[e], a @ U[e]
        mg, mu = np.abs(a) @ np.abs(G[e]), np.abs(a) @ np.abs(U[e])
        h, hg, hu = np_glu(g, u, activation)
        hq = dequantized_rows(h.astype(np.float32))
        o = hq @ D[e]
        # the intermediate's float32 error: its sums' (eps * mg, eps * mu) through the
        # activation's slopes, and its own roundings
        dh = eps * 8 * (np.abs(hg) * mg + np.abs(hu) * mu + np.abs(h))
        near, dd = _near_tie(h, dh)
        mag = np.abs(hq) @ np.abs(D[e])
        wt = w[t_idx, j_idx][:, None]
        np.add.at(y, t_idx, wt * o)
        np.add.at(tol, t_idx, np.abs(wt) * (eps * 64 * mag + (near * dd) @ np.abs(D[e])))
    return y, tol + 1e-30


def _check(y, x, w, ids, q, activation="swiglu"):
    ref, tol = np_moe_int8(x, w, ids, q, activation)
    yd = f64(y)
    assert np.all(np.isfinite(yd))
    if y.dtype == jnp.bfloat16:
        tol = tol + np.abs(ref) * 2.0**-8
    bad = np.abs(yd - ref) > tol
    assert not bad.any(), (f"{bad.sum()} of {bad.size} outside the bound; worst "
                           f"{np.max(np.abs(yd - ref) / tol):.3g} x tol")


def _quantized(seed, T, E, k, H, I, kind, G, xd=jnp.float32, scale_dtype=jnp.float32):
    x, w, ids, ex = make_problem(seed, T, E, k, H, I, xd, jnp.float32)
    return x, w, ids, nbx.quantize(ex, kind, group_size=G, scale_dtype=scale_dtype)


def _run(x, w, ids, q, **kw):
    return nbx.fused_moe(x, w, ids, q, implementation="ffi", precision="int8", **kw)


# int8: any H and I (odd, not a multiple of any block); int4: multiples of the group
CASES = [(1, 8, 2, 129, 67, "int8", None), (33, 5, 3, 64, 96, "int4", 32), (222, 16, 4, 67, 45, "int8", None),
         (33, 6, 2, 128, 64, "int4", 64)]


@pytest.mark.parametrize("T,E,k,H,I,kind,G", CASES)
def test_matches_float64(T, E, k, H, I, kind, G):
    x, w, ids, q = _quantized(T + H + I, T, E, k, H, I, kind, G)
    _check(_run(x, w, ids, q), x, w, ids, q)


def test_bf16_x_bf16_scales_and_activation():
    x, w, ids, q = _quantized(5, 9, 8, 2, 64, 96, "int4", 32, jnp.bfloat16, jnp.bfloat16)
    _check(_run(x, w, ids, q, activation="geglu"), x, w, ids, q, "geglu")


@pytest.mark.parametrize("kind,G", [("int8", None), ("int4", 32)])
def test_every_row_written_and_same_bits_everywhere(kind, G):
    """Poisoned output; one band and bands of 7 tokens, decode token by token
    and every ISA this CPU runs give the same bits."""
    x, w, ids, q = _quantized(11, 61, 6, 3, 96, 64, kind, G)
    run = lambda band: ffi_forward(x, w, ids, *q.flat(), band_tokens=band, poison=True,  # noqa: E731
                                   int8_dot=True)
    y0 = run(0)
    assert bool(jnp.all(jnp.isfinite(y0)))
    assert bool(jnp.all(y0 == run(7)))
    one = jnp.concatenate([_run(x[t:t + 1], w[t:t + 1], ids[t:t + 1], q) for t in range(0, 61, 6)])
    assert bool(jnp.all(one == y0[::6]))
    chosen = nbx.cpu.isa()
    try:
        for isa in nbx.cpu.supported_isas():
            nbx.cpu.set_isa(isa)
            assert bool(jnp.all(_run(x, w, ids, q) == y0)), isa
    finally:
        nbx.cpu.set_isa(chosen)
    _check(y0, x, w, ids, q)


def test_nan_in_x_makes_its_row_nan():
    x, w, ids, q = _quantized(3, 4, 4, 2, 64, 32, "int4", 32)
    x = x.at[2, 40].set(jnp.nan)
    y = np.asarray(_run(x, w, ids, q))
    assert np.isnan(y[2]).all() and np.isfinite(np.delete(y, 2, axis=0)).all()


def test_close_to_float32_and_grad():
    x, w, ids, q = _quantized(7, 16, 8, 2, 64, 64, "int8", None)
    y8, y32 = _run(x, w, ids, q), nbx.fused_moe(x, w, ids, q, implementation="ffi")
    assert float(jnp.max(jnp.abs(y8 - y32))) < 0.05 * float(jnp.max(jnp.abs(y32)))
    g8 = jax.grad(lambda x_: jnp.sum(_run(x_, w, ids, q)))(x)
    g32 = jax.grad(lambda x_: jnp.sum(nbx.fused_moe(x_, w, ids, q, implementation="ffi")))(x)
    assert bool(jnp.all(g8 == g32))  # the float32 arithmetic's gradients


def test_errors_name_the_argument():
    x, w, ids, ex = make_problem(1, 4, 4, 2, 64, 32, jnp.float32, jnp.float32)
    with pytest.raises(ValueError, match="precision='int8' takes int8 or int4 experts; these are dense float32"):
        _run(x, w, ids, ex)
    with pytest.raises(ValueError, match="precision='int8' takes int8 or int4 experts; these are mxfp4"):
        _run(x, w, ids, nbx.quantize(ex, "mxfp4"))
    q = nbx.quantize(ex, "int4", group_size=32)
    with pytest.raises(ValueError, match="precision='int8' runs on the CPU handler only"):
        nbx.fused_moe(x, w, ids, q, implementation="xla", precision="int8")
    with pytest.raises(ValueError, match="precision must be None, 'float32', 'bfloat16' or 'int8'; got 'int4'"):
        nbx.fused_moe(x, w, ids, q, precision="int4")
    with pytest.raises(Exception, match="precision='int8' takes int8 or int4 experts; these are dense"):
        jax.block_until_ready(ffi_forward(x, w, ids, *ex.flat(), int8_dot=True))
