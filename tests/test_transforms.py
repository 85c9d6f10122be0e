"""jit, vmap and grad through both implementations."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from conftest import TOL, make_problem, np_moe, np_moe_grads, rel_err

IMPLS = ["ffi", "xla"]


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_equals_eager(impl):
    x, w, ids, experts = make_problem(1, 33, 8, 2, 129, 65)
    f = lambda *a: nbx.fused_moe(*a, implementation=impl)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x, w, ids, experts)),
                                  np.asarray(f(x, w, ids, experts)))


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_shared_experts(impl):
    x, w, ids, experts = make_problem(2, 30, 8, 2, 65, 33)
    xb, wb, ib = x.reshape(3, 10, 65), w.reshape(3, 10, 2), ids.reshape(3, 10, 2)
    f = lambda x_, w_, i_: nbx.fused_moe(x_, w_, i_, experts, implementation=impl)  # noqa: E731
    y = jax.jit(jax.vmap(f))(xb, wb, ib)
    assert rel_err(y.reshape(30, 65), np_moe(x, w, ids, experts)) < TOL["f32"]
    # nested vmap, and x shared while the routing is batched
    y2 = jax.vmap(jax.vmap(f))(xb.reshape(3, 2, 5, 65), wb.reshape(3, 2, 5, 2), ib.reshape(3, 2, 5, 2))
    np.testing.assert_allclose(np.asarray(y2).reshape(30, 65), np.asarray(y).reshape(30, 65),
                               rtol=1e-6, atol=1e-6)
    y3 = jax.vmap(f, in_axes=(None, 0, 0))(x[:10], wb, ib)
    for b in range(3):
        assert rel_err(y3[b], np_moe(x[:10], wb[b], ib[b], experts)) < TOL["f32"]


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_batched_experts(impl):
    xs, ws, ids_, exs = zip(*(make_problem(10 + b, 9, 4, 2, 33, 17) for b in range(3)))
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *exs)
    f = lambda x_, w_, i_, e_: nbx.fused_moe(x_, w_, i_, e_, implementation=impl)  # noqa: E731
    y = jax.jit(jax.vmap(f))(jnp.stack(xs), jnp.stack(ws), jnp.stack(ids_), stacked)
    for b in range(3):
        assert rel_err(y[b], np_moe(xs[b], ws[b], ids_[b], exs[b])) < TOL["f32"]
    # x shared, experts batched
    y2 = jax.vmap(f, in_axes=(None, None, None, 0))(xs[0], ws[0], ids_[0], stacked)
    for b in range(3):
        assert rel_err(y2[b], np_moe(xs[0], ws[0], ids_[0], exs[b])) < TOL["f32"]


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_matches_float64(impl):
    x, w, ids, experts = make_problem(3, 33, 8, 2, 65, 47, routing="random")
    ct = jnp.asarray(np.random.default_rng(9).standard_normal(x.shape), jnp.float32)

    def loss(x_, w_, e_):
        return jnp.sum(nbx.fused_moe(x_, w_, ids, e_, implementation=impl) * ct)

    dx, dw, de = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, experts)
    ref = np_moe_grads(x, w, ids, experts, ct)
    got = (dx, dw, de.gate, de.up, de.down)
    for name, g, r in zip(("x", "w", "gate", "up", "down"), got, ref):
        assert g.shape == r.shape, name
        assert rel_err(g, r) < 1e-5, name


def test_grad_under_vmap():
    x, w, ids, experts = make_problem(4, 20, 8, 2, 33, 17)

    def loss(x_, w_, i_):
        return jnp.sum(nbx.fused_moe(x_, w_, i_, experts, implementation="ffi") ** 2)

    g = jax.vmap(jax.grad(loss))(x.reshape(4, 5, 33), w.reshape(4, 5, 2), ids.reshape(4, 5, 2))

    def loss_ref(x_, w_, i_):
        return jnp.sum(nbx.fused_moe(x_, w_, i_, experts, implementation="xla") ** 2)

    g_ref = jax.vmap(jax.grad(loss_ref))(x.reshape(4, 5, 33), w.reshape(4, 5, 2), ids.reshape(4, 5, 2))
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-5)
