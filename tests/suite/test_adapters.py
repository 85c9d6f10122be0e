"""LoRA adapters (``fused_moe(..., lora=)``) on every backend that takes them
(tests/support/runners.py `LORA`): the forward and every gradient against
the float64 oracle (support/problems.py), on the decode and prefill paths
(T = 1, 5, 17, 33, 222), ranks 1, 3, 4 and 16, stacked and per-expert lists, any
subset of the projections, dense and quantized (QLoRA, frozen) base experts,
and checkpoint layouts with biases.
The output is checked for unwritten rows (NaN) and against the base, so an
adapter that is dropped shows."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from support.layouts import canonical, routing, stored
from support.lora_checks import check_lora_grads, loss_and_grads, make_lora
from support.problems import DTYPES, as_lists, make_problem, np_moe, np_moe_grads, rel_err
from support.runners import LAYOUTS as LAYOUTS_FEATURE
from support.runners import LORA

ALL3 = ("gate", "up", "down")
CORE = (pytest.mark.sanitize, pytest.mark.arm64)
QUANTIZED = ("int8", "int4", "mxfp4", "fp8", "mxfp8", "nvfp4")
# (T, rank, lists, projections, x dtype, weight format, H, I); E = 5, k = 2.  Dense
# experts: H, I not a multiple of any block; quantized: whole groups of 32.
CASES = [
    pytest.param(1, 1, False, ALL3, "f32", "dense", 40, 24, marks=CORE, id="T1-r1-f32"),
    pytest.param(33, 16, True, ALL3, "f32", "dense", 40, 24, id="T33-r16-lists"),
    pytest.param(222, 16, False, ("gate", "down"), "bf16", "dense", 40, 24, id="T222-r16-bf16-gate-down"),
    pytest.param(33, 3, False, ("up",), "f32", "dense", 40, 24, marks=CORE, id="T33-r3-up"),
    pytest.param(5, 4, False, ALL3, "bf16", "mxfp4", 64, 32, id="T5-r4-bf16-mxfp4"),
] + [pytest.param(17, 4, False, ALL3, "f32", f, 64, 32, id=f"T17-r4-{f}") for f in QUANTIZED]


@pytest.mark.parametrize("T, r, lists, projections, xd, fmt, H, I", CASES)
def test_lora_forward_and_gradients_match_float64(backend, T, r, lists, projections, xd, fmt, H, I):
    backend.require(LORA)
    backend.require_format(fmt)
    E, k = 5, 2
    x, w, ids, ex = make_problem(T + r, T, E, k, H, I, x_dtype=DTYPES[xd], w_dtype=DTYPES[xd])
    if fmt != "dense":
        ex = nbx.quantize(ex, fmt, group_size=32 if fmt in ("int4", "fp8") else None)
    lora = make_lora(T + r, E, H, I, r, projections, lists=lists)
    if lists:
        ex = as_lists(ex)
    ct = jnp.asarray(np.random.default_rng(1).standard_normal((T, H)), jnp.float32)
    y, (dx, dw, glora, gex) = loss_and_grads(x, w, ids, ex, lora, ct, implementation=backend.implementation)
    tol = backend.tol(x.dtype, x.dtype)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32)))), "unwritten rows"
    assert rel_err(y, np_moe(x, w, ids, ex, lora=lora)) < tol
    assert rel_err(y, np_moe(x, w, ids, ex)) > 10 * tol  # the adapters changed the result
    rdx, rdw, rdG, rdU, rdD, dad = np_moe_grads(x, w, ids, ex, ct, lora=lora)
    gtol = 1e-5 if xd == "f32" else 2e-2
    assert rel_err(dx, rdx) < gtol and rel_err(dw, rdw) < gtol
    check_lora_grads(glora, dad, gtol)
    assert glora.projections == tuple(projections) and glora.scales == lora.scales
    if fmt == "dense":  # a dense base trains too
        for name, want in (("gate", rdG), ("up", rdU), ("down", rdD)):
            got = getattr(gex, name)
            got = jnp.stack(got) if isinstance(got, list) else got
            assert rel_err(got, want) < gtol, (name, rel_err(got, want))
    else:  # quantized experts are frozen
        floats = [leaf for leaf in jax.tree.leaves(gex) if leaf.dtype != jax.dtypes.float0]
        assert not any(np.any(np.asarray(leaf, np.float32)) for leaf in floats), "quantized experts are frozen"


@pytest.mark.parametrize("T", [1, 33])
@pytest.mark.parametrize("name", ["out_in", "interleaved"])
def test_lora_over_a_checkpoint_layout_with_biases(backend, name, T):
    """Adapters on experts read in place in a checkpoint layout with biases
    (the handlers take the adapters after the bias buffers: abi.h "LoRA
    adapters"), decode and prefill, against float64."""
    backend.require(LORA)
    backend.require(LAYOUTS_FEATURE)
    E, k, H, I = 6, 2, 45, 19
    rng = np.random.default_rng(41 + T)
    G, U, D, bg, bu, bd = canonical(rng, E, H, I, True)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    w, ids = routing(rng, T, E, k)
    lora = make_lora(T, E, H, I, 4)
    y = backend(x, w, ids, stored(name, G, U, D, bg, bu, bd), lora=lora)
    plain = nbx.Experts(jnp.asarray(G), jnp.asarray(U), jnp.asarray(D))
    ref = np_moe(x, w, ids, plain, biases=(bg, bu, bd), lora=lora)
    assert rel_err(y, ref) < backend.tol(x.dtype)
    assert rel_err(y, np_moe(x, w, ids, plain, biases=(bg, bu, bd))) > 10 * backend.tol(x.dtype)


# (T, x dtype, weight format, H, I): decode and prefill, 32-bit and 16-bit x, dense and quantized
ZERO_CASES = [
    pytest.param(1, "f32", "dense", 40, 24, marks=CORE, id="T1-f32"),
    pytest.param(33, "f32", "dense", 40, 24, marks=CORE, id="T33-f32"),
    pytest.param(1, "bf16", "dense", 40, 24, id="T1-bf16"),
    pytest.param(33, "bf16", "dense", 40, 24, id="T33-bf16"),
    pytest.param(5, "f32", "int4", 64, 32, id="T5-f32-int4"),
    pytest.param(33, "bf16", "mxfp4", 64, 32, id="T33-bf16-mxfp4"),
]


@pytest.mark.parametrize("T, xd, fmt, H, I", ZERO_CASES)
def test_zero_adapters_give_the_base_bits(backend, T, xd, fmt, H, I):
    """Adapters with B = 0 (`LoRA.init`, as PEFT starts them) are an addition
    of zero to what the base path computes: the output equals the call
    without adapters bit for bit, in every dtype (docs/lora.md), and the
    adapters' B still gets its gradient."""
    backend.require(LORA)
    backend.require_format(fmt)
    E, k = 5, 2
    x, w, ids, ex = make_problem(71 + T, T, E, k, H, I, x_dtype=DTYPES[xd], w_dtype=DTYPES[xd])
    if fmt != "dense":
        ex = nbx.quantize(ex, fmt, group_size=32 if fmt in ("int4", "fp8") else None)
    lora = nbx.LoRA.init(jax.random.PRNGKey(T), E, H, I, rank=4)
    base = np.asarray(backend(x, w, ids, ex))
    got = np.asarray(backend(x, w, ids, ex, lora=lora))
    assert got.dtype == base.dtype
    np.testing.assert_array_equal(got.view(np.uint8), base.view(np.uint8))
    ct = jnp.asarray(np.random.default_rng(2).standard_normal((T, H)), jnp.float32)
    _, (_, _, glora, _) = loss_and_grads(x, w, ids, ex, lora, ct, implementation=backend.implementation)
    assert np.any(np.asarray(glora.pair("down")[1])), "B's gradient reaches the adapters"
