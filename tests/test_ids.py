"""Expert ids of every integer dtype keep their value or stay out of range:
never wrapped into a valid expert (issue #14, items 1 and 2), and an empty
vmap batch works (item 5)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from conftest import TOL, make_problem, np_moe, rel_err

T, E, K, H, I = 6, 8, 2, 33, 20


@pytest.fixture(scope="module")
def prob():
    return make_problem(14, T, E, K, H, I)


@pytest.mark.parametrize("impl", ["ffi", "xla"])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16,
                                   np.int64])
def test_every_integer_dtype_runs_the_same_experts(prob, dtype, impl):
    """Valid ids of any integer dtype, numpy or JAX, give the int32 result
    (unsigned 32/64-bit ids used to become expert E: all zeros)."""
    x, w, ids, ex = prob
    want = np_moe(x, w, ids, ex)
    host = np.asarray(ids).astype(dtype)
    for given in (host, jnp.asarray(host)):
        y = nbx.fused_moe(x, w, given, ex, implementation=impl)
        assert rel_err(y, want) < TOL["f32"], (dtype, type(given))


@pytest.mark.parametrize("dtype,value", [(np.uint32, 2**32 - 1), (np.uint32, 2**31 + 1),
                                         (np.uint64, 2**63 + 3), (np.int64, 2**32 + 1),
                                         (np.int64, -(2**40))])
def test_wide_ids_out_of_range_are_refused_not_wrapped(prob, dtype, value):
    """A host id past int32 (x64 off: JAX alone would wrap 2**32 + 1 to 1) is
    refused by its position; the "xla" path drops the slot, as for any bad id."""
    x, w, ids, ex = prob
    bad = np.asarray(ids).astype(dtype)
    bad[3, 1] = value
    # (ValueError: after a call of these shapes has once succeeded, JAX raises the
    # handler's error as ValueError; issue #14 item 6, open)
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError),
                       match=r"INVALID_ARGUMENT: topk_ids\[3, 1\] = -?\d+ is outside \[0, 8\)"):
        nbx.fused_moe(x, w, bad, ex, implementation="ffi").block_until_ready()
    keep = np.ones(np.asarray(ids).shape, bool)
    keep[3, 1] = False
    y = nbx.fused_moe(x, w, bad, ex, implementation="xla")
    assert rel_err(y, np_moe(x, w * keep, np.where(keep, np.asarray(ids), -1), ex)) < TOL["f32"]


def test_skip_mode_skips_wide_out_of_range_ids(prob):
    x, w, ids, ex = prob
    bad = np.asarray(ids).astype(np.uint32)
    bad[0, 0] = 2**32 - 1  # not expert 0 after any narrowing: skipped
    keep = np.ones(bad.shape, bool)
    keep[0, 0] = False
    y = nbx.fused_moe(x, w, bad, ex, ids_outside="skip")
    assert rel_err(y, np_moe(x, w * keep, np.where(keep, np.asarray(ids), -1), ex)) < TOL["f32"]


def test_float_and_bool_ids_stay_refused(prob):
    x, w, ids, ex = prob
    for bad in (np.asarray(ids, np.float32), np.asarray(ids) > 3):
        with pytest.raises(TypeError, match="topk_ids has dtype"):
            nbx.fused_moe(x, w, bad, ex)


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_vmap_over_an_empty_batch(prob, impl):
    x, w, ids, ex = prob
    xb, wb, ib = (jnp.zeros((0,) + a.shape, a.dtype) for a in (x, w, ids))
    y = jax.vmap(lambda a, b, c: nbx.fused_moe(a, b, c, ex, implementation=impl))(xb, wb, ib)
    assert y.shape == (0, T, H) and y.dtype == x.dtype
