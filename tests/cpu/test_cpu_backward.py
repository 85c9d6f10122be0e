"""The CPU backward handler (`nbx_fused_moe_bwd`): gradients of x, the routed
weights and every expert projection against a float64 reference, on every
instruction set, odd shapes, 16-bit dtypes, bands, lists, skipped slots, and
under jit / vmap; result buffers poisoned so that anything left unwritten shows."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nbx as nbx
from jax_nbx.planning import plan_band_tokens

from conftest import TOL, make_problem, np_moe_grads, rel_err
from support.handlers import ffi_backward as _ffi_backward

pytestmark = pytest.mark.sanitize

NAMES = ("x", "w", "gate", "up", "down")


def _grads(x, w, ids, ex, ct, activation="swiglu", impl="ffi", **kw):
    def loss(x_, w_, e_):
        y = nbx.fused_moe(x_, w_, ids, e_, activation=activation, implementation=impl, **kw)
        return jnp.sum(y.astype(jnp.float32) * ct)

    dx, dw, de = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, ex)
    return dx, dw, de


def _check(got, ref, tol):
    dx, dw, de = got
    for name, g, r in zip(NAMES, (dx, dw, de.gate, de.up, de.down), ref):
        assert g.shape == r.shape, name
        assert np.all(np.isfinite(np.asarray(jnp.asarray(g).astype(jnp.float32)))), name
        err = rel_err(g, r)
        assert err < tol, f"d{name}: {err:.2e}"


def _ct(shape, seed=7):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("T,E,k,H,I,routing,activation", [
    pytest.param(1, 4, 2, 16, 8, "topk", "swiglu", marks=pytest.mark.arm64),
    pytest.param(33, 8, 2, 65, 99, "random", "geglu", marks=pytest.mark.arm64),  # repeated ids in a token
    (222, 6, 3, 129, 33, "topk", "swiglu"),
    (40, 1, 1, 17, 257, "topk", "geglu"),      # one expert; I over two column tiles
    (50, 5, 3, 300, 20, "one", "swiglu"),      # every slot to one expert; H over two tiles
])
def test_backward_matches_float64(isa, T, E, k, H, I, routing, activation):
    x, w, ids, ex = make_problem(T + E, T, E, k, H, I, routing=routing)
    ct = _ct(x.shape)
    ref = np_moe_grads(x, w, ids, ex, ct, activation)
    _check(_grads(x, w, ids, ex, ct, activation), ref, TOL["f32"])


@pytest.mark.parametrize("T,E,k,H,I", [(1, 4, 2, 16, 8), (33, 8, 2, 65, 99)])
@pytest.mark.parametrize("activation", ["geglu_erf", nbx.Activation("swiglu_clamped", alpha=1.702, limit=0.8)], ids=str)
def test_backward_of_the_model_activations(isa, T, E, k, H, I, activation):
    """The exact-GELU GeGLU and gpt-oss's clamped SwiGLU (limit 0.8: the clamps
    bite; no gradient through a clamped gate or up) in the fused backward."""
    x, w, ids, ex = make_problem(T + 3 * E, T, E, k, H, I, routing="random")
    ct = _ct(x.shape)
    ref = np_moe_grads(x, w, ids, ex, ct, activation)
    _check(_grads(x, w, ids, ex, ct, activation), ref, TOL["f32"])
    _check(_grads(x, w, ids, ex, ct, activation, impl="xla"), ref, TOL["f32"])  # the reference's VJP too


@pytest.mark.parametrize("xd,wd", [("bf16", "bf16"), pytest.param("f32", "bf16", marks=pytest.mark.arm64),
                                   ("f16", "f16"), ("bf16", "f32")])
def test_backward_16bit(xd, wd):
    dt = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
    x, w, ids, ex = make_problem(5, 37, 8, 2, 72, 40, dt[xd], dt[wd])
    ct = _ct(x.shape)
    dx, dw, de = _grads(x, w, ids, ex, ct)
    assert dx.dtype == x.dtype and de.gate.dtype == ex.gate.dtype and dw.dtype == jnp.float32
    # the reference on the same (rounded) inputs, cotangent rounded as the op's output is
    ref = np_moe_grads(x, w, ids, ex, ct.astype(x.dtype))
    tol = max(TOL[xd], TOL[wd])
    _check((dx, dw, de), ref, tol)


def test_backward_writes_every_output():
    """Called directly with NaN-filled result buffers: nothing stays NaN."""
    x, w, ids, ex = make_problem(8, 45, 6, 2, 33, 70)
    ids = ids.at[4].set(-1).at[7, 1].set(6)  # token 4 all elsewhere; one slot elsewhere
    dy = _ct(x.shape)
    for lists in (False, True):
        weights = ex.flat() if not lists else (*[ex.gate[e] for e in range(6)],
                                               *[ex.up[e] for e in range(6)],
                                               *[ex.down[e] for e in range(6)])
        dx, dw, dws = _ffi_backward(dy, x, w, ids, *weights, activation="swiglu",
                                    band_tokens=0, lists=lists, skip_outside=True, poison=True)
        for a in (dx, dw, *dws):
            assert not np.any(np.isnan(np.asarray(a)))
        assert np.all(np.asarray(dx[4]) == 0) and np.all(np.asarray(dw[4]) == 0)
        assert float(dw[7, 1]) == 0.0
        ok = (np.asarray(ids) >= 0) & (np.asarray(ids) < 6)
        ref = np_moe_grads(x, w * ok, np.where(ok, np.asarray(ids), -1), ex, dy)
        assert rel_err(dx, ref[0]) < TOL["f32"]
        assert rel_err(dw, ref[1] * ok) < TOL["f32"]
        got = (jnp.stack(dws[0:6]), jnp.stack(dws[6:12]), jnp.stack(dws[12:18])) if lists else dws
        for g, r in zip(got, ref[2:]):
            assert rel_err(g, r) < TOL["f32"]


def test_bands_bit_identical():
    # A budget that holds a forward band of 300 tokens and a backward band of
    # 300; T large enough that the backward really is banded under it (the
    # forward's per-worker scratch grows with the number of cores, so on a
    # many-core machine T grows too).
    cap = max(nbx.memory.fused_moe_backward_workspace_bytes(300, 2, 8, 64, 48),
              nbx.memory.fused_moe_workspace_bytes(300, 2, 8, 64, 48))
    T = 1000
    while nbx.memory.fused_moe_backward_workspace_bytes(T, 2, 8, 64, 48) <= 2 * cap:
        T *= 2
    x, w, ids, ex = make_problem(9, T, 8, 2, 64, 48)
    assert plan_band_tokens(T, 2, 8, 64, 48, cap, backward=True) < T  # really banded
    ct = _ct(x.shape)
    one = _grads(x, w, ids, ex, ct)
    banded = _grads(x, w, ids, ex, ct, max_workspace_bytes=cap)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(banded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_lists_get_list_gradients_equal_to_stacked():
    x, w, ids, ex = make_problem(10, 30, 5, 2, 40, 24)
    lists = nbx.Experts(*([a[e] for e in range(5)] for a in (ex.gate, ex.up, ex.down)))
    ct = _ct(x.shape)
    s = _grads(x, w, ids, ex, ct)
    dl = _grads(x, w, ids, lists, ct)
    assert isinstance(dl[2].gate, list) and len(dl[2].gate) == 5
    np.testing.assert_array_equal(np.asarray(s[0]), np.asarray(dl[0]))
    np.testing.assert_array_equal(np.asarray(s[1]), np.asarray(dl[1]))
    for n in ("gate", "up", "down"):
        np.testing.assert_array_equal(np.asarray(getattr(s[2], n)),
                                      np.asarray(jnp.stack(getattr(dl[2], n))))


def test_ids_outside_skip_gradients():
    x, w, ids, ex = make_problem(11, 25, 6, 2, 33, 20)
    ids = ids - 2  # a third of the slots belong to experts held elsewhere
    ct = _ct(x.shape)
    got = _grads(x, w, ids, ex, ct, ids_outside="skip")
    ok = (np.asarray(ids) >= 0) & (np.asarray(ids) < 6)
    ref = list(np_moe_grads(x, w, np.where(ok, np.asarray(ids), -1), ex, ct))
    _check(got, ref, TOL["f32"])


def test_backward_refuses_bad_ids():
    x, w, ids, ex = make_problem(12, 6, 4, 2, 16, 8)
    bad = ids.at[5, 1].set(4)
    with pytest.raises(Exception, match=r"topk_ids\[5, 1\] = 4 is outside \[0, 4\)"):
        jax.block_until_ready(_ffi_backward(x, x, w, bad, *ex.flat(), activation="swiglu",
                                            band_tokens=0))


def test_backward_budget_too_small_raises_with_advice():
    x, w, ids, ex = make_problem(13, 8, 4, 2, 64, 64)
    with pytest.raises(nbx.DeviceOOMError, match="backward"):
        plan_band_tokens(8, 2, 4, 64, 64, 1000, backward=True)


def test_nan_input_propagates_without_harm():
    x, w, ids, ex = make_problem(14, 9, 4, 2, 16, 8)
    x = x.at[3, 2].set(jnp.nan)
    dx, dw, de = _grads(x, w, ids, ex, _ct(x.shape))
    assert np.all(np.isnan(np.asarray(dw[3])))  # the NaN token's slots
    assert np.all(np.isfinite(np.asarray(dw[np.arange(9) != 3])))


def test_check_grads_numerically():
    x, w, ids, ex = make_problem(15, 6, 3, 2, 8, 5)

    def f(x_, w_, g_, u_, d_):
        return nbx.fused_moe(x_, w_, ids, nbx.Experts(g_, u_, d_), implementation="ffi")

    check_grads(f, (x, w, ex.gate, ex.up, ex.down), order=1, modes=["rev"], atol=2e-2, rtol=2e-2)


def test_grad_of_vmap_and_vmap_of_grad():
    x, w, ids, ex = make_problem(16, 20, 8, 2, 33, 17)
    xb, wb, ib = x.reshape(4, 5, 33), w.reshape(4, 5, 2), ids.reshape(4, 5, 2)

    def loss(impl):
        def f(x_, e_):
            y = jax.vmap(lambda a, b, c: nbx.fused_moe(a, b, c, e_, implementation=impl))(x_, wb, ib)
            return jnp.sum(jnp.sin(y))
        return f

    g = jax.jit(jax.grad(loss("ffi"), argnums=(0, 1)))(xb, ex)
    r = jax.grad(loss("xla"), argnums=(0, 1))(xb, ex)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(r)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)

    def per_example(x_, w_, i_):
        return jax.grad(lambda e_: jnp.sum(nbx.fused_moe(x_, w_, i_, e_) ** 2))(ex)

    ge = jax.vmap(per_example)(xb, wb, ib)
    for b in range(4):
        ref = np_moe_grads(xb[b], wb[b], ib[b], ex, 2 * nbx.moe_reference(xb[b], wb[b], ib[b], ex))
        for n, r in zip(("gate", "up", "down"), ref[2:]):
            assert rel_err(getattr(ge, n)[b], r) < 1e-5
