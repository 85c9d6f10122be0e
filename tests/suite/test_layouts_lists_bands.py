"""Every backend reads the experts as they come: checkpoint layouts and
biases in place, per-expert lists equal to stacked experts bit for bit, and
bands of tokens cut by a workspace budget giving the same bits as one band."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from support.layouts import LAYOUTS, canonical, np_block, routing, stored
from support.problems import DTYPES, as_lists, dense, make_problem, np_moe, rel_err
from support.runners import BANDS
from support.runners import LAYOUTS as LAYOUTS_FEATURE

E, K, H, I = 6, 2, 45, 19  # H and I multiples of no block
CORE = (pytest.mark.sanitize, pytest.mark.arm64)  # the tiers' subset (.ci/sanitize, .ci/arm64)


@pytest.mark.parametrize("T", [pytest.param(1, marks=pytest.mark.sweep), pytest.param(33, marks=pytest.mark.sanitize)])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_matches_float64(backend, name, bias, T):
    if name != "plain" or bias:
        backend.require(LAYOUTS_FEATURE)
    rng = np.random.default_rng(abs(hash((name, bias, T))) % 2**31)
    G, U, D, bg, bu, bd = canonical(rng, E, H, I, bias)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    w, ids = routing(rng, T, E, K)
    y = backend(x, w, ids, stored(name, G, U, D, bg, bu, bd))
    assert rel_err(y, np_block(x, w, ids, G, U, D, bg, bu, bd)) < backend.tol(x.dtype)


@pytest.mark.parametrize("wd", ["f32", pytest.param("bf16", marks=CORE)])
@pytest.mark.parametrize("T", [1, 33])
def test_lists_equal_stacked_bitwise(backend, wd, T):
    """E separate arrays per projection, read in place: the stacked bits."""
    x, w, ids, ex = make_problem(T + 40, T, 5, 2, 33, 20, jnp.float32, DTYPES[wd])
    lists = as_lists(ex)
    assert lists.is_list and lists.num_experts == 5 and (lists.hidden, lists.intermediate) == (33, 20)
    f = jax.jit(backend.__call__)
    np.testing.assert_array_equal(np.asarray(f(x, w, ids, lists)), np.asarray(f(x, w, ids, ex)))


@pytest.mark.parametrize("name", ["out_in", "interleaved"])
def test_lists_in_a_layout_with_biases(backend, name):
    backend.require(LAYOUTS_FEATURE)
    rng = np.random.default_rng(31)
    G, U, D, bg, bu, bd = canonical(rng, E, H, I, True)
    x = jnp.asarray(rng.standard_normal((9, H)), jnp.float32)
    w, ids = routing(rng, 9, E, K)
    y = backend(x, w, ids, stored(name, G, U, D, bg, bu, bd, lists=True))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(backend(x, w, ids, stored(name, G, U, D, bg, bu, bd))))


def _cap(backend, x, w, ids, ex, tokens: int) -> int:
    """A workspace cap that holds one band of ``tokens`` tokens on this backend."""
    b, p = nbx.ops.resolve(x, w, ids, ex, implementation=backend.implementation)
    return b.workspace_bytes(p, tokens, x.shape[0])


# (quantized bands on the sweeping runners only: the banding is the format's
# no business, and the Metal emulation of one quantized band takes ~35 s)
BAND_CASES = [pytest.param(f, b, marks=CORE if (f, b) == ("dense", 3) else pytest.mark.sweep)
              for f in ("dense", "int4", "mxfp4") for b in (1, 3, 16)]


@pytest.mark.parametrize("fmt,band", BAND_CASES)
def test_bands_are_bit_identical(backend, fmt, band):
    """Small bands stream the weights (few rows per expert), large ones pack
    them: the results do not differ in a single bit, eagerly or under jit."""
    backend.require(BANDS)
    # ~13 rows per expert unbanded (packed); a band of 3 tokens leaves each <= 6 (streamed)
    x, w, ids, ex = make_problem(3, 40, 6, 2, 64, 96, jnp.bfloat16)
    backend.require_format(fmt)
    if fmt != "dense":
        ex = nbx.quantize(ex, fmt, group_size=32 if nbx.formats.get(fmt).grouped else None)
    whole = backend(x, w, ids, ex)
    cap = _cap(backend, x, w, ids, ex, band)
    banded = jax.jit(lambda x: backend(x, w, ids, ex, max_workspace_bytes=cap))(x)
    np.testing.assert_array_equal(np.asarray(banded.astype(jnp.float32)), np.asarray(whole.astype(jnp.float32)))
    assert rel_err(whole, np_moe(x, w, ids, dense(ex))) < backend.tol(x.dtype, jnp.float32)
