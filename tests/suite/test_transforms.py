"""jit, vmap and grad through every backend: jit equals eager bit for bit;
vmap folds a batch with shared experts into the tokens and runs experts that
differ per element one call each; gradients of x, topk_weights and every
weight against float64 (frozen quantized experts: x and topk_weights only),
in every layout, and grad composed with vmap."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from support.layouts import canonical, np_block, routing, stored
from support.problems import as_lists, dense, make_problem, np_moe, np_moe_grads, rel_err
from support.runners import LAYOUTS


@pytest.mark.sanitize
def test_jit_equals_eager(backend):
    x, w, ids, ex = make_problem(1, 33, 8, 2, 65, 33)
    np.testing.assert_array_equal(np.asarray(jax.jit(backend.__call__)(x, w, ids, ex)),
                                  np.asarray(backend(x, w, ids, ex)))


@pytest.mark.sanitize
@pytest.mark.arm64
def test_vmap_with_shared_experts(backend):
    x, w, ids, ex = make_problem(2, 30, 8, 2, 33, 20)
    xb, wb, ib = x.reshape(3, 10, 33), w.reshape(3, 10, 2), ids.reshape(3, 10, 2)

    def f(x_, w_, i_):
        return backend(x_, w_, i_, ex)

    y = jax.jit(jax.vmap(f))(xb, wb, ib)
    assert rel_err(y.reshape(30, 33), np_moe(x, w, ids, ex)) < backend.tol(x.dtype)
    # an empty batch
    y0 = jax.vmap(f)(jnp.zeros((0, 10, 33)), jnp.zeros((0, 10, 2)), jnp.zeros((0, 10, 2), jnp.int32))
    assert y0.shape == (0, 10, 33)
    # per-expert lists shared across the batch
    yl = jax.vmap(lambda x_: backend(x_, wb[0], ib[0], as_lists(ex)))(jnp.stack([xb[0], -xb[0]]))
    assert rel_err(yl[1], np_moe(-xb[0], wb[0], ib[0], ex)) < backend.tol(x.dtype)


@pytest.mark.sweep
def test_vmap_nested_and_with_x_shared(backend):
    """vmap of vmap folds both batch axes; x shared while the routing is batched."""
    x, w, ids, ex = make_problem(2, 30, 8, 2, 33, 20)
    xb, wb, ib = x.reshape(3, 10, 33), w.reshape(3, 10, 2), ids.reshape(3, 10, 2)

    def f(x_, w_, i_):
        return backend(x_, w_, i_, ex)

    y2 = jax.vmap(jax.vmap(f))(xb.reshape(3, 2, 5, 33), wb.reshape(3, 2, 5, 2), ib.reshape(3, 2, 5, 2))
    assert rel_err(np.asarray(y2).reshape(30, 33), np_moe(x, w, ids, ex)) < backend.tol(x.dtype)
    y3 = jax.vmap(f, in_axes=(None, 0, 0))(x[:10], wb, ib)
    for b in range(3):
        assert rel_err(y3[b], np_moe(x[:10], wb[b], ib[b], ex)) < backend.tol(x.dtype)


def test_vmap_with_experts_per_element(backend):
    xs, ws, ids_, exs = zip(*(make_problem(10 + b, 9, 4, 2, 33, 17) for b in range(3)))
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *exs)
    y = jax.jit(jax.vmap(backend.__call__))(jnp.stack(xs), jnp.stack(ws), jnp.stack(ids_), stacked)
    for b in range(3):
        assert rel_err(y[b], np_moe(xs[b], ws[b], ids_[b], exs[b])) < backend.tol(jnp.float32)
    y2 = jax.vmap(backend.__call__, in_axes=(None, None, None, 0))(xs[0], ws[0], ids_[0], stacked)
    for b in range(3):
        assert rel_err(y2[b], np_moe(xs[0], ws[0], ids_[0], exs[b])) < backend.tol(jnp.float32)


GRAD_TOL = 1e-5


@pytest.mark.parametrize("lists", [pytest.param(False, marks=(pytest.mark.sanitize, pytest.mark.arm64)),
                                   pytest.param(True, marks=pytest.mark.sanitize)], ids=["stacked", "lists"])
@pytest.mark.parametrize("activation", ["swiglu", pytest.param("geglu", marks=pytest.mark.sweep), "swiglu_clamped"])
def test_gradients_match_float64(backend, activation, lists):
    x, w, ids, ex = make_problem(3, 33, 8, 2, 33, 20, routing="random")
    ct = jnp.asarray(np.random.default_rng(9).standard_normal(x.shape), jnp.float32)
    e_in = as_lists(ex) if lists else ex

    def loss(x_, w_, e_):
        return jnp.sum(backend(x_, w_, ids, e_, activation=activation) * ct)

    dx, dw, de = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, e_in)
    if lists:
        assert isinstance(de.down, list) and len(de.down) == 8
        de = nbx.Experts(*(jnp.stack(getattr(de, n)) for n in ("gate", "up", "down")))
    ref = np_moe_grads(x, w, ids, ex, ct, activation)
    for name, g, r in zip(("x", "w", "gate", "up", "down"), (dx, dw, de.gate, de.up, de.down), ref):
        assert g.shape == r.shape, name
        assert rel_err(g, r) < GRAD_TOL, name


@pytest.mark.parametrize("fmt", [pytest.param(f, marks=pytest.mark.sanitize) for f in ("int8", "int4", "mxfp4")]
                         + [pytest.param(f, marks=pytest.mark.sweep) for f in ("fp8", "mxfp8", "nvfp4")])
def test_quantized_experts_are_frozen(backend, fmt):
    """Gradients flow to x and topk_weights; quantized weights get none."""
    backend.require_format(fmt)
    x, w, ids, ex = make_problem(5, 9, 4, 2, 64, 32)
    q = nbx.quantize(ex, fmt, group_size=16 if fmt == "nvfp4" else 32 if nbx.formats.get(fmt).grouped else None)
    ct = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape), jnp.float32)
    dx, dw = jax.grad(lambda x_, w_: jnp.sum(backend(x_, w_, ids, q) * ct), argnums=(0, 1))(x, w)
    ref = np_moe_grads(x, w, ids, dense(q), ct)
    assert rel_err(dx, ref[0]) < GRAD_TOL and rel_err(dw, ref[1]) < GRAD_TOL
    dq = jax.grad(lambda q_: jnp.sum(backend(x, w, ids, q_) * ct), allow_int=True)(q)
    assert all(not np.any(np.asarray(leaf, np.float64)) for leaf in jax.tree.leaves(dq)
               if np.asarray(leaf).dtype != jax.dtypes.float0)


@pytest.mark.sanitize
@pytest.mark.parametrize("name", ["out_in", "interleaved", "concat_out_in"])
def test_gradients_in_a_layout_with_biases(backend, name):
    backend.require(LAYOUTS)
    rng = np.random.default_rng(17)
    E, K, H, I = 5, 2, 33, 20
    G, U, D, bg, bu, bd = canonical(rng, E, H, I, True)
    x = jnp.asarray(rng.standard_normal((9, H)), jnp.float32)
    w, ids = routing(rng, 9, E, K)
    ct = jnp.asarray(rng.standard_normal((9, H)), jnp.float32)
    ex = stored(name, G, U, D, bg, bu, bd)
    dx, dw, de = jax.grad(lambda x_, w_, e_: jnp.sum(backend(x_, w_, ids, e_) * ct), argnums=(0, 1, 2))(x, w, ex)
    _, ref = np_block(x, w, ids, G, U, D, bg, bu, bd, ct=ct)
    assert rel_err(dx, ref[0]) < GRAD_TOL and rel_err(dw, ref[1]) < GRAD_TOL
    # the experts' gradients, mapped to the canonical layout as the weights are
    # (a permutation: the same map carries weights and gradients)
    dG = stored(name, *(np.asarray(a) for a in ref[2:5]), *(np.asarray(a) for a in ref[5:8]))
    for got, want in zip(jax.tree.leaves(de), jax.tree.leaves(dG)):
        assert rel_err(got, np.asarray(want, np.float64)) < GRAD_TOL


@pytest.mark.sweep
def test_grad_of_vmap_and_vmap_of_grad(backend):
    x, w, ids, ex = make_problem(4, 20, 8, 2, 33, 17)

    def loss(x_, w_, i_):
        return jnp.sum(backend(x_, w_, i_, ex) ** 2)

    xb, wb, ib = x.reshape(4, 5, 33), w.reshape(4, 5, 2), ids.reshape(4, 5, 2)
    g = jax.vmap(jax.grad(loss))(xb, wb, ib)
    g2 = jax.grad(lambda xb_: jnp.sum(jax.vmap(loss)(xb_, wb, ib)))(xb)
    ref = np.stack([np_moe_grads(xb[b], wb[b], ib[b], ex, 2 * np_moe(xb[b], wb[b], ib[b], ex))[0]
                    for b in range(4)])
    assert rel_err(g, ref) < GRAD_TOL and rel_err(g2, ref) < GRAD_TOL
