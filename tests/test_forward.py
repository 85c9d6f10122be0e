"""Forward correctness of both implementations against the float64 reference."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from conftest import DTYPES, TOL, make_problem, np_moe, rel_err
from support.handlers import ffi_forward as _ffi_forward

# (T, E, k, H, I): T in {0, 1, 33, 222, 1024}, E in {1, 8, 64}, k in {1, 2, 6, 8};
# H and I not multiples of 8 (nor of the kernel's 64-column tiles).
CASES = [
    (0, 8, 2, 129, 511),
    (1, 1, 1, 129, 511),
    (1, 64, 8, 129, 255),
    (33, 8, 2, 129, 511),
    (33, 64, 6, 65, 129),
    (222, 8, 6, 129, 511),
    (222, 1, 1, 33, 65),
    (1024, 64, 8, 129, 127),
    (1024, 8, 2, 67, 99),
    (5, 4, 2, 40, 1100),    # I past one streamed span (1024 columns)
    (5, 4, 2, 1030, 20),    # H past one streamed span
]
# (x dtype, weight dtype)
DTYPE_PAIRS = [("f32", "f32"), ("bf16", "bf16"), ("f16", "f16"), ("f32", "bf16"), ("bf16", "f32"),
               ("f16", "bf16")]


def _ids(case):
    return "T{}-E{}-k{}-H{}-I{}".format(*case)


@functools.cache
def _jitted_ffi(activation, band_tokens):
    return jax.jit(functools.partial(_ffi_forward, activation=activation,
                                     band_tokens=band_tokens, poison=True))


def run_ffi_poisoned(x, w, ids, experts, activation="swiglu", band_tokens=0):
    """The handler writing into a NaN-filled output buffer."""
    return _jitted_ffi(activation, band_tokens)(x, w, ids, experts.gate, experts.up, experts.down)


@pytest.mark.parametrize("xd,wd", DTYPE_PAIRS, ids=[f"x{a}-w{b}" for a, b in DTYPE_PAIRS])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_ffi_matches_float64_reference(case, xd, wd, isa):
    T, E, k, H, I = case
    x, w, ids, experts = make_problem(hash(case) % 1000, T, E, k, H, I, DTYPES[xd], DTYPES[wd])
    ref = np_moe(x, w, ids, experts)
    if T:
        y = run_ffi_poisoned(x, w, ids, experts)
        assert y.dtype == x.dtype and y.shape == x.shape
        assert bool(jnp.all(jnp.isfinite(y))), "unwritten (poisoned) rows in the output"
        assert rel_err(y, ref) < TOL[xd]
    y = nbx.fused_moe(x, w, ids, experts, implementation="ffi")
    assert y.dtype == x.dtype and y.shape == x.shape
    assert rel_err(y, ref) < TOL[xd]


@pytest.mark.parametrize("xd,wd", [("f32", "f32"), ("bf16", "bf16"), ("f16", "f32")],
                         ids=["xf32-wf32", "xbf16-wbf16", "xf16-wf32"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_xla_matches_float64_reference(case, xd, wd):
    T, E, k, H, I = case
    x, w, ids, experts = make_problem(hash(case) % 1000 + 1, T, E, k, H, I, DTYPES[xd], DTYPES[wd])
    y = jax.jit(functools.partial(nbx.fused_moe, implementation="xla"))(x, w, ids, experts)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert rel_err(y, np_moe(x, w, ids, experts)) < TOL[xd]


# swiglu_clamped with a limit of 0.8: the clamps of gate and up both bite at these scales
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "geglu_erf", "swiglu_clamped",
                                        nbx.Activation("swiglu_clamped", alpha=1.702, limit=0.8)], ids=str)
@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_activations(activation, impl, isa):
    x, w, ids, experts = make_problem(7, 33, 8, 2, 129, 511)
    y = nbx.fused_moe(x, w, ids, experts, activation=activation, implementation=impl)
    assert rel_err(y, np_moe(x, w, ids, experts, activation)) < TOL["f32"]


@pytest.mark.parametrize("routing", ["one", "random"])
@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_skewed_and_repeated_routing(routing, impl, isa):
    """All slots on one expert; ids repeated within a token."""
    x, w, ids, experts = make_problem(11, 222, 8, 6, 129, 200, routing=routing)
    y = nbx.fused_moe(x, w, ids, experts, implementation=impl)
    assert rel_err(y, np_moe(x, w, ids, experts)) < TOL["f32"]


@pytest.mark.parametrize("wd", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("band", [1, 7, 32, 221, 222, 500])
def test_bands_are_bit_identical(band, wd, isa):
    """Small bands stream the weights (few rows per expert), large ones pack
    them: the results must not differ in a single bit."""
    x, w, ids, experts = make_problem(3, 222, 64, 6, 129, 300, w_dtype=DTYPES[wd])
    whole = run_ffi_poisoned(x, w, ids, experts, band_tokens=0)
    banded = run_ffi_poisoned(x, w, ids, experts, band_tokens=band)
    assert bool(jnp.all(jnp.isfinite(banded)))
    np.testing.assert_array_equal(np.asarray(banded), np.asarray(whole))


@pytest.mark.parametrize("routing", ["one", "random"])
@pytest.mark.parametrize("band", [1, 5, 64])
def test_expert_groups_split_an_expert(routing, band, isa):
    """float32 x runs in expert-major groups of what a band holds: with every
    slot on one expert (or repeated ids) an expert's rows span several groups;
    the result is the float64 reference, every row written, and the same bits
    as one group."""
    x, w, ids, experts = make_problem(13, 97, 5, 3, 37, 45, routing=routing)
    whole = run_ffi_poisoned(x, w, ids, experts, band_tokens=0)
    banded = run_ffi_poisoned(x, w, ids, experts, band_tokens=band)
    assert bool(jnp.all(jnp.isfinite(banded)))
    assert rel_err(banded, np_moe(x, w, ids, experts)) < TOL["f32"]
    np.testing.assert_array_equal(np.asarray(banded), np.asarray(whole))


@pytest.mark.parametrize("xd", ["bf16", "f16"])
@pytest.mark.parametrize("band", [1, 7, 100])
def test_token_bands_are_bit_identical(band, xd, isa):
    """bfloat16/float16 x runs in token bands (each band summed and stored):
    banded and unbanded results are the same bits."""
    x, w, ids, experts = make_problem(17, 150, 16, 4, 65, 70, x_dtype=DTYPES[xd])
    whole = run_ffi_poisoned(x, w, ids, experts, band_tokens=0)
    banded = run_ffi_poisoned(x, w, ids, experts, band_tokens=band)
    assert bool(jnp.all(jnp.isfinite(banded.astype(jnp.float32))))
    assert rel_err(banded, np_moe(x, w, ids, experts)) < TOL[xd]
    np.testing.assert_array_equal(np.asarray(banded.astype(jnp.float32)),
                                  np.asarray(whole.astype(jnp.float32)))


def test_leading_dims():
    x, w, ids, experts = make_problem(5, 24, 8, 2, 65, 33)
    ref = np_moe(x, w, ids, experts)
    for impl in ("ffi", "xla"):
        y = nbx.fused_moe(x.reshape(2, 3, 4, 65), w.reshape(2, 3, 4, 2), ids.reshape(2, 3, 4, 2),
                          experts, implementation=impl)
        assert y.shape == (2, 3, 4, 65)
        assert rel_err(y.reshape(24, 65), ref) < TOL["f32"]


def test_empty_leading_dims_return_empty():
    _, _, _, experts = make_problem(0, 1, 8, 2, 65, 33)
    for impl in ("ffi", "xla"):
        y = nbx.fused_moe(jnp.zeros((0, 4, 65), jnp.bfloat16), jnp.zeros((0, 4, 2)),
                          jnp.zeros((0, 4, 2), jnp.int32), experts, implementation=impl)
        assert y.shape == (0, 4, 65) and y.dtype == jnp.bfloat16


def test_int64_and_uint8_ids_and_bf16_weights_accepted():
    x, w, ids, experts = make_problem(2, 33, 8, 2, 65, 33)
    ref = np_moe(x, w, ids, experts)
    for ids_ in (np.asarray(ids, np.int64), np.asarray(ids, np.uint8)):
        y = nbx.fused_moe(x, w.astype(jnp.bfloat16).astype(jnp.float32), ids_, experts)
        assert rel_err(y, ref) < 1e-2


def test_nan_propagates_like_the_reference():
    x, w, ids, experts = make_problem(4, 33, 8, 2, 65, 33)
    x = x.at[3, 5].set(jnp.nan)
    gate = experts.gate.at[2, 0, 7].set(jnp.nan)
    experts = nbx.Experts(gate, experts.up, experts.down)
    ref = np_moe(x, w, ids, experts)
    for impl in ("ffi", "xla"):
        y = np.asarray(nbx.fused_moe(x, w, ids, experts, implementation=impl))
        np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
        ok = ~np.isnan(ref)
        assert np.max(np.abs(y[ok] - ref[ok])) / np.max(np.abs(ref[ok])) < TOL["f32"]
    assert np.isnan(ref[3]).all() and np.isnan(ref[np.any(np.asarray(ids) == 2, axis=1)]).all()


def test_default_implementation_is_ffi_on_cpu():
    x, w, ids, experts = make_problem(8, 33, 8, 2, 65, 33)
    y = nbx.fused_moe(x, w, ids, experts)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(nbx.fused_moe(x, w, ids, experts,
                                                                         implementation="ffi")))


def test_route_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 7, 16)).astype(np.float32)
    for normalize in (True, False):
        w, ids = nbx.route(logits, k=3, normalize=normalize)
        assert w.shape == ids.shape == (5, 7, 3) and ids.dtype == jnp.int32 and w.dtype == jnp.float32
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        top = np.argsort(-p, axis=-1)[..., :3]
        np.testing.assert_array_equal(np.asarray(ids), top)
        pw = np.take_along_axis(p, top, -1)
        if normalize:
            pw = pw / pw.sum(-1, keepdims=True)
        np.testing.assert_allclose(np.asarray(w), pw, rtol=1e-5)
