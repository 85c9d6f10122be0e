"""Experts given as per-expert arrays: read in place through a pointer table,
identical to stacked experts; validation names the expert that differs."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from conftest import DTYPES, TOL, make_problem, np_moe, rel_err
from support.handlers import ffi_forward as _ffi_forward


def as_lists(ex: nbx.Experts) -> nbx.Experts:
    E = ex.num_experts
    return nbx.Experts(*([a[e] for e in range(E)] for a in (ex.gate, ex.up, ex.down)))


CASES = [(1, 4, 2, 33, 20), (33, 5, 3, 129, 99), (222, 8, 2, 64, 130), (64, 1, 1, 16, 8)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-E{}-k{}-H{}-I{}".format(*c))
@pytest.mark.parametrize("wd", ["f32", "bf16"])
def test_lists_equal_stacked_bitwise(case, wd):
    T, E, k, H, I = case
    x, w, ids, ex = make_problem(sum(case), T, E, k, H, I, jnp.float32, DTYPES[wd])
    lists = as_lists(ex)
    assert lists.is_list and lists.num_experts == E and (lists.hidden, lists.intermediate) == (H, I)
    y_stacked = jax.jit(nbx.fused_moe)(x, w, ids, ex)
    y_lists = jax.jit(nbx.fused_moe)(x, w, ids, lists)
    np.testing.assert_array_equal(np.asarray(y_stacked), np.asarray(y_lists))
    assert rel_err(y_lists, np_moe(x, w, ids, ex)) < TOL["f32"]


def test_lists_poisoned_output_fully_written():
    x, w, ids, ex = make_problem(1, 40, 6, 2, 65, 33, jnp.bfloat16, jnp.bfloat16)
    f = jax.jit(functools.partial(_ffi_forward, activation="swiglu", band_tokens=16, poison=True,
                                  lists=True))
    y = f(x, w, ids, *as_lists(ex).flat())
    assert bool(jnp.all(jnp.isfinite(y)))
    assert rel_err(y, np_moe(x, w, ids, ex)) < TOL["bf16"]


def test_lists_bad_id_is_reported():
    x, w, ids, ex = make_problem(2, 8, 4, 2, 16, 8)
    ids = ids.at[3, 1].set(7)
    with pytest.raises(Exception, match=r"topk_ids\[3, 1\] = 7 is outside \[0, 4\)"):
        nbx.fused_moe(x, w, ids, as_lists(ex), implementation="ffi")


def test_lists_xla_reference_and_grads_are_lists():
    x, w, ids, ex = make_problem(3, 12, 4, 2, 16, 8)
    lists = as_lists(ex)
    y = nbx.fused_moe(x, w, ids, lists, implementation="xla")
    assert rel_err(y, np_moe(x, w, ids, ex)) < TOL["f32"]

    def loss(e):
        return jnp.sum(nbx.fused_moe(x, w, ids, e) ** 2)

    g_lists = jax.grad(loss)(lists)
    g_stacked = jax.grad(loss)(ex)
    assert isinstance(g_lists.down, list) and len(g_lists.down) == 4
    for e in range(4):
        np.testing.assert_allclose(np.asarray(g_lists.down[e]), np.asarray(g_stacked.down[e]), rtol=1e-5, atol=1e-6)


def test_lists_vmap_shared_experts():
    x, w, ids, ex = make_problem(4, 10, 4, 2, 16, 8)
    lists = as_lists(ex)
    xb = jnp.stack([x, -x])
    yb = jax.vmap(lambda x: nbx.fused_moe(x, w, ids, lists))(xb)
    assert rel_err(yb[1], np_moe(-x, w, ids, ex)) < TOL["f32"]


def test_lists_validation_names_the_expert():
    x, w, ids, ex = make_problem(5, 4, 6, 2, 128, 64)
    lists = as_lists(ex)
    bad = nbx.Experts(lists.gate, lists.up, lists.down[:5] + [jnp.zeros((64, 129))])
    with pytest.raises(ValueError, match=r"down expert 5 has shape \(64, 129\), expert 0 \(64, 128\)"):
        nbx.fused_moe(x, w, ids, bad)
    bad = nbx.Experts(lists.gate[:2] + [lists.gate[2].astype(jnp.bfloat16)] + lists.gate[3:], lists.up, lists.down)
    with pytest.raises(TypeError, match=r"gate expert 2 has dtype bfloat16, expert 0 float32"):
        nbx.fused_moe(x, w, ids, bad)
    with pytest.raises(TypeError, match="all be stacked arrays or all lists"):
        nbx.fused_moe(x, w, ids, nbx.Experts(lists.gate, ex.up, ex.down))
    with pytest.raises(ValueError, match="experts.up has 5 experts; experts.gate has 6"):
        nbx.fused_moe(x, w, ids, nbx.Experts(lists.gate, lists.up[:5], lists.down))
    with pytest.raises(ValueError, match="empty list"):
        nbx.fused_moe(x, w, ids, nbx.Experts([], [], []))
