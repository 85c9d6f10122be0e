"""The CPU handler itself, through its poisoned twin (the output starts NaN,
so an unwritten row shows), on every instruction set the CPU has: shapes
past the kernels' blocking (T = 1024 with E = 64; H or I past one streamed
span), bands that stream or pack the weights giving the same bits, expert
groups that split an expert, token bands, per-expert lists.  The behaviours
every backend shares (dtypes, activations, routing, ids, transforms) are
tests/suite/'s."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DTYPES, TOL, as_lists, make_problem, np_moe, rel_err
from support.handlers import ffi_forward as _ffi_forward

pytestmark = pytest.mark.sanitize

# (T, E, k, H, I) past what the shared suite's small shapes reach: many
# experts at decode, 1024 tokens, I and H past one streamed span (1024 columns);
# H and I multiples of no block
CASES = [
    pytest.param((1, 64, 8, 129, 255), marks=pytest.mark.arm64),
    (222, 8, 6, 129, 511),
    (1024, 64, 8, 129, 127),
    (1024, 8, 2, 67, 99),
    (5, 4, 2, 40, 1100),    # I past one streamed span
    (5, 4, 2, 1030, 20),    # H past one streamed span
]
# (x dtype, weight dtype): the suite runs every pair
DTYPE_PAIRS = [("f32", "f32"), ("bf16", "bf16"), ("f16", "bf16")]


def _ids(case):
    return "T{}-E{}-k{}-H{}-I{}".format(*case) if isinstance(case, tuple) else None


@functools.cache
def _jitted_ffi(activation, band_tokens):
    return jax.jit(functools.partial(_ffi_forward, activation=activation,
                                     band_tokens=band_tokens, poison=True))


def run_ffi_poisoned(x, w, ids, experts, activation="swiglu", band_tokens=0):
    """The handler writing into a NaN-filled output buffer."""
    return _jitted_ffi(activation, band_tokens)(x, w, ids, experts.gate, experts.up, experts.down)


@pytest.mark.parametrize("xd,wd", DTYPE_PAIRS, ids=[f"x{a}-w{b}" for a, b in DTYPE_PAIRS])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_poisoned_output_matches_float64(case, xd, wd, isa):
    T, E, k, H, I = case
    x, w, ids, experts = make_problem(hash(case) % 1000, T, E, k, H, I, DTYPES[xd], DTYPES[wd])
    y = run_ffi_poisoned(x, w, ids, experts)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert bool(jnp.all(jnp.isfinite(y))), "unwritten (poisoned) rows in the output"
    assert rel_err(y, np_moe(x, w, ids, experts)) < TOL[xd]


@pytest.mark.parametrize("wd", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("band", [1, 7, 221, 500])
def test_bands_are_bit_identical(band, wd, isa):
    """Small bands stream the weights (few rows per expert), large ones pack
    them: the results must not differ in a single bit."""
    x, w, ids, experts = make_problem(3, 222, 64, 6, 129, 300, w_dtype=DTYPES[wd])
    whole = run_ffi_poisoned(x, w, ids, experts, band_tokens=0)
    banded = run_ffi_poisoned(x, w, ids, experts, band_tokens=band)
    assert bool(jnp.all(jnp.isfinite(banded)))
    np.testing.assert_array_equal(np.asarray(banded), np.asarray(whole))


@pytest.mark.parametrize("routing", ["one", "random"])
@pytest.mark.parametrize("band", [1, pytest.param(5, marks=pytest.mark.arm64), 64])
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


def test_lists_poisoned_output_fully_written():
    """Per-expert arrays read through the table: every row written."""
    x, w, ids, ex = make_problem(1, 40, 6, 2, 65, 33, jnp.bfloat16, jnp.bfloat16)
    f = jax.jit(functools.partial(_ffi_forward, activation="swiglu", band_tokens=16, poison=True, lists=True))
    y = f(x, w, ids, *as_lists(ex).flat())
    assert bool(jnp.all(jnp.isfinite(y)))
    assert rel_err(y, np_moe(x, w, ids, ex)) < TOL["bf16"]
