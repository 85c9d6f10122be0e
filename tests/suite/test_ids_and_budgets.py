"""Expert ids and workspace budgets on every backend: an id outside [0, E)
fails the call naming its position and value (eagerly and under jit) or is
skipped on request; ids of any integer dtype keep their value (never wrapped
into a valid expert); a budget too small for one token is refused at trace
time with advice."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from support.problems import as_lists, make_problem, np_moe, rel_err
from support.runners import BANDS

T, E, K, H, I = 12, 8, 2, 33, 20


@pytest.fixture(scope="module")
def prob():
    return make_problem(14, T, E, K, H, I)


@pytest.mark.sanitize
@pytest.mark.arm64
def test_a_bad_id_is_named_eagerly_and_under_jit(backend, prob):
    x, w, ids, ex = prob
    bad = np.asarray(ids).copy()
    bad[5, 1] = E
    match = rf"topk_ids\[5, 1\] = {E} is outside \[0, {E}\)"
    with pytest.raises(jax.errors.JaxRuntimeError, match=match):
        jax.block_until_ready(backend(x, w, bad, ex))
    with pytest.raises(jax.errors.JaxRuntimeError, match=match):
        jax.block_until_ready(jax.jit(backend.__call__)(x, w, jnp.asarray(bad), ex))
    with pytest.raises(jax.errors.JaxRuntimeError, match=match):  # per-expert lists
        jax.block_until_ready(backend(x, w, bad, as_lists(ex)))
    # the backend recovers: the next call with good ids runs
    assert rel_err(backend(x, w, ids, ex), np_moe(x, w, ids, ex)) < backend.tol(x.dtype)


@pytest.mark.sanitize
@pytest.mark.arm64
def test_skip_leaves_out_bad_slots(backend, prob):
    x, w, ids, ex = prob
    bad = np.asarray(ids).copy()
    bad[0, 0], bad[7, 1] = -1, 2**31 - 1
    keep = np.ones(bad.shape, bool)
    keep[0, 0] = keep[7, 1] = False
    y = backend(x, w, bad, ex, ids_outside="skip")
    assert rel_err(y, np_moe(x, w * keep, np.where(keep, np.asarray(ids), -1), ex)) < backend.tol(x.dtype)


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=pytest.mark.sweep) for d in (np.uint8, np.uint32, np.int16)]
                         + [pytest.param(np.uint64, marks=pytest.mark.arm64), np.int64])
def test_every_integer_dtype_runs_the_same_experts(backend, prob, dtype):
    """Valid ids of any integer dtype, numpy or JAX, give the int32 result."""
    x, w, ids, ex = prob
    want = np_moe(x, w, ids, ex)
    host = np.asarray(ids).astype(dtype)
    for given in (host, jnp.asarray(host)):
        assert rel_err(backend(x, w, given, ex), want) < backend.tol(x.dtype), (dtype, type(given))


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype,value", [(np.uint32, 2**32 - 1), (np.uint64, 2**63 + 3), (np.int64, 2**32 + 1),
                                         (np.int64, -(2**40))])
def test_wide_ids_out_of_range_are_refused_not_wrapped(backend, prob, dtype, value):
    """A host id past int32 (x64 off: JAX alone would wrap 2**32 + 1 to 1)
    is refused by its position, or skipped: never another expert."""
    x, w, ids, ex = prob
    bad = np.asarray(ids).astype(dtype)
    bad[3, 1] = value
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"topk_ids\[3, 1\] = -?\d+ is outside \[0, 8\)"):
        jax.block_until_ready(backend(x, w, bad, ex))
    keep = np.ones(bad.shape, bool)
    keep[3, 1] = False
    y = backend(x, w, bad, ex, ids_outside="skip")
    assert rel_err(y, np_moe(x, w * keep, np.where(keep, np.asarray(ids), -1), ex)) < backend.tol(x.dtype)


def test_float_and_bool_ids_are_refused(backend, prob):
    x, w, ids, ex = prob
    for bad in (np.asarray(ids, np.float32), np.asarray(ids) > 3):
        with pytest.raises(TypeError, match="topk_ids has dtype"):
            backend(x, w, bad, ex)


@pytest.mark.sanitize
@pytest.mark.arm64
def test_a_budget_too_small_for_one_token_is_refused_with_advice(backend, prob):
    backend.require(BANDS)
    x, w, ids, ex = prob
    b, p = nbx.ops.resolve(x, w, ids, ex, implementation=backend.implementation)
    one = b.workspace_bytes(p, 1, T)
    with pytest.raises(nbx.DeviceOOMError, match=r"fused_moe workspace for T=12 tokens .*no band split alone "
                                                 r"reaches it"):
        backend(x, w, ids, ex, max_workspace_bytes=one - 1)
    # a cap of three tokens: bands of three, the whole result
    y = backend(x, w, ids, ex, max_workspace_bytes=b.workspace_bytes(p, 3, T))
    assert rel_err(y, np_moe(x, w, ids, ex)) < backend.tol(x.dtype)


@pytest.mark.parametrize("budget,error,match", [
    ("lots", ValueError, r"max_workspace_bytes: cannot read 'lots' as a byte count"),
    (-5, ValueError, r"max_workspace_bytes: a byte count must be finite and >= 0; got -5"),
    (float("nan"), ValueError, r"max_workspace_bytes: a byte count must be finite and >= 0; got nan"),
    (float("inf"), ValueError, r"max_workspace_bytes: a byte count must be finite and >= 0; got inf"),
    (True, TypeError, r"max_workspace_bytes: budget must be a byte count"),
    ([1], TypeError, r"max_workspace_bytes: budget must be a byte count"),
])
def test_an_unreadable_budget_is_refused_the_same_on_every_backend(backend, prob, budget, error, match):
    """Read once for every backend, the reference included (it has no
    workspace, and once took any value)."""
    x, w, ids, ex = prob
    with pytest.raises(error, match=match):
        backend(x, w, ids, ex, max_workspace_bytes=budget)


def test_zero_experts_are_refused_the_same_on_every_backend(backend, prob):
    x, w, ids, _ = prob
    ex0 = nbx.Experts(jnp.ones((0, H, I)), jnp.ones((0, H, I)), jnp.ones((0, I, H)))
    for outside in ("error", "skip"):
        with pytest.raises(ValueError, match=r"experts.gate holds no expert \(E=0"):
            backend(x, w, ids, ex0, ids_outside=outside)
