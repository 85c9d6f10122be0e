"""`fused_moe(..., implementation="metal")` on the simulated Metal device
(issue #16): the Metal handler orders the slots, runs the expert GEMMs as the
Metal kernels (through the MSL emulation), and combines in (t, j) order;
weights read in place through pinned GPU-address tables, workspace from the
metal:0 account.  Checked against the float64 reference.  Nothing here ran
on Apple hardware."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx
from jax_nbx import memory

from conftest import make_problem, np_moe, np_moe_grads, rel_err

F = nbx._registry.ffi_module()


pytestmark = pytest.mark.usefixtures("metal_sim")  # conftest.py: the simulated device


def metal(x, w, ids, ex, **kw):
    return nbx.fused_moe(x, w, ids, ex, implementation="metal", **kw)


@pytest.mark.parametrize("T,E,k,H,I,routing", [
    (1, 1, 1, 17, 9, "topk"), (3, 4, 4, 8, 16, "topk"), (33, 4, 2, 45, 70, "draws"),
    (33, 6, 3, 129, 17, "one"), (222, 8, 2, 33, 40, "topk")])
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_matches_float64(T, E, k, H, I, routing, activation):
    x, w, ids, ex = make_problem(T + E + H, T, E, k, H, I, routing=routing)
    y = metal(x, w, ids, ex, activation=activation)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, np_moe(x, w, ids, ex, activation)) < 1e-5


def test_lists_bands_and_jit_are_bit_identical():
    x, w, ids, ex = make_problem(7, 40, 5, 2, 33, 48)
    whole = np.asarray(metal(x, w, ids, ex))
    lists = nbx.Experts(*([a[e] for e in range(5)] for a in (ex.gate, ex.up, ex.down)))
    np.testing.assert_array_equal(np.asarray(metal(x, w, ids, lists)), whole)
    cap = int(F.metal_forward_workspace_bytes(9, 2, 5, 33, 48))
    banded = jax.jit(lambda x: metal(x, w, ids, ex, max_workspace_bytes=cap))(x)
    np.testing.assert_array_equal(np.asarray(banded), whole)
    assert memory.stats()["metal:0"]["peak"] >= cap // 2


def test_gradients_through_the_reference_vjp():
    x, w, ids, ex = make_problem(8, 12, 4, 2, 16, 24)
    ct = jnp.asarray(np.random.default_rng(0).standard_normal((12, 16)), jnp.float32)
    dx, dw = jax.grad(lambda x, w: jnp.sum(metal(x, w, ids, ex) * ct), argnums=(0, 1))(x, w)
    ref = np_moe_grads(x, w, ids, ex, ct)
    assert rel_err(dx, ref[0]) < 1e-5 and rel_err(dw, ref[1]) < 1e-5


def test_bad_ids_are_named_and_skip_works():
    x, w, ids, ex = make_problem(9, 10, 8, 2, 16, 24)
    bad = ids.at[5, 1].set(9)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"topk_ids\[5, 1\] = 9 is outside \[0, 8\)"):
        metal(x, w, bad, ex)
    y = metal(x, w, bad, ex, ids_outside="skip")
    ok = np.asarray(bad) < 8
    assert rel_err(y, np_moe(x, w * ok, np.where(ok, np.asarray(bad), 0), ex)) < 1e-5


def test_a_budget_too_small_is_refused_with_advice():
    x, w, ids, ex = make_problem(10, 64, 4, 2, 32, 48)
    one_token = int(F.metal_forward_workspace_bytes(1, 2, 4, 32, 48))
    F.metal_sim_configure(one_token - 1, 2**30, 512)
    with pytest.raises(nbx.DeviceOOMError, match=r"on metal:0; short by .*no band split alone reaches it"):
        metal(x, w, ids, ex)
    F.metal_sim_configure(one_token * 3, 2**30, 512)  # planned into bands that fit
    assert rel_err(metal(x, w, ids, ex), np_moe(x, w, ids, ex)) < 1e-5
    whole = int(F.metal_forward_workspace_bytes(64, 2, 4, 32, 48))
    with pytest.raises(nbx.DeviceOOMError, match=r"jax_nbx account \(metal:0\) refused .* it would fit in"):
        metal(x, w, ids, ex, max_workspace_bytes=whole)  # the cap trusted, the account holds the line


def test_what_the_metal_path_does_not_take_yet_is_refused_by_name():
    x, w, ids, ex = make_problem(11, 4, 4, 2, 16, 24)
    with pytest.raises(TypeError, match="float32 x and weights only so far"):
        metal(x.astype(jnp.bfloat16), w, ids, ex)
    with pytest.raises(ValueError, match="quantized experts are not supported on the Metal path yet"):
        metal(x, w, ids, nbx.quantize(ex, "int8"))
    assert metal(x[:0], w[:0], ids[:0], ex).shape == (0, 16)


def test_without_a_metal_device_the_implementation_is_refused():
    nbx.metal.use("none")
    x, w, ids, ex = make_problem(12, 4, 4, 2, 16, 24)
    with pytest.raises(ValueError, match="implementation='metal': no Metal device is active"):
        metal(x, w, ids, ex)
    nbx.metal.use("sim")
