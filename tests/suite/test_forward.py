"""The op against float64 on every backend (tests/support/runners.py): odd
shapes (T = 1, 33, 222; H and I multiples of no block), every dtype pair,
every activation, skewed and repeated routing, quantized formats, leading
axes, no tokens, NaN, weights on the input, shared experts."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from support.problems import DTYPES, dense, make_problem, np_moe, rel_err
from support.runners import LAYOUTS

# (T, E, k, H, I): T in {1, 33, 222}; E = 1 and k = E; H, I odd
CASES = [(1, 4, 2, 33, 20), (33, 8, 2, 65, 47), (222, 8, 3, 33, 20), (33, 1, 1, 17, 9), (5, 6, 6, 40, 24)]
DTYPE_PAIRS = [("f32", "f32"), ("bf16", "bf16"), ("f16", "f16"), ("f32", "bf16"), ("bf16", "f32")]
CORE = (pytest.mark.sanitize, pytest.mark.arm64)  # the tiers' subset (.ci/sanitize, .ci/arm64)
# (case, x dtype, weight dtype) in the tiers' subset
CORE_COMBOS = {(CASES[0], "f32", "f32"), (CASES[1], "f32", "f32"), (CASES[1], "bf16", "bf16"),
               (CASES[3], "f16", "f16"), (CASES[4], "f32", "bf16")}
COMBOS = [pytest.param(c, a, b, id="T{}-E{}-k{}-H{}-I{}".format(*c) + f"-x{a}-w{b}",
                       marks=CORE if (c, a, b) in CORE_COMBOS else pytest.mark.sweep)
          for c in CASES for a, b in DTYPE_PAIRS]


@functools.cache
def _jitted(implementation, **kw):
    return jax.jit(lambda x, w, ids, ex, sh: nbx.fused_moe(x, w, ids, ex, shared_experts=sh,
                                                           implementation=implementation, **kw))


def run(backend, x, w, ids, ex, shared_experts=None, **kw):
    """The backend's op under jax.jit: one compilation per shape and options,
    shared by the runners of one implementation (the CPU's instruction set is
    chosen when the call runs)."""
    return _jitted(backend.implementation, **kw)(x, w, ids, ex, shared_experts)


@pytest.mark.parametrize("case,xd,wd", COMBOS)
def test_matches_float64(backend, case, xd, wd):
    x, w, ids, ex = make_problem(sum(case), *case, DTYPES[xd], DTYPES[wd])
    y = run(backend, x, w, ids, ex)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32)))), "unwritten rows"
    assert rel_err(y, np_moe(x, w, ids, ex)) < backend.tol(DTYPES[xd], DTYPES[wd])


# swiglu_clamped with a limit of 0.8: its clamps of gate and up both bite at these scales
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "geglu_erf", "swiglu_clamped",
                                        nbx.Activation("swiglu_clamped", alpha=1.702, limit=0.8)], ids=str)
@pytest.mark.parametrize("T", [pytest.param(1, marks=pytest.mark.sweep), pytest.param(33, marks=CORE)])
def test_activations(backend, activation, T):
    x, w, ids, ex = make_problem(7 + T, T, 8, 2, 33, 20)
    y = run(backend, x, w, ids, ex, activation=activation)
    assert rel_err(y, np_moe(x, w, ids, ex, activation)) < backend.tol(x.dtype)


@pytest.mark.parametrize("routing", ["one", pytest.param("random", marks=pytest.mark.sweep)])
def test_skewed_and_repeated_routing(backend, routing):
    """Every slot on one expert; ids repeated within a token."""
    x, w, ids, ex = make_problem(11, 222, 8, 3, 33, 20, routing=routing)
    assert rel_err(run(backend, x, w, ids, ex), np_moe(x, w, ids, ex)) < backend.tol(x.dtype)


@pytest.mark.parametrize("fmt,G", [pytest.param("int8", None, marks=CORE), pytest.param("int4", 32, marks=CORE),
                                   pytest.param("int4", 64, marks=pytest.mark.sweep),
                                   pytest.param("mxfp4", 32, marks=CORE), ("fp8", 32), ("mxfp8", 32),
                                   ("nvfp4", 16)])
@pytest.mark.parametrize("T", [1, 33])
def test_quantized_formats_match_their_dequantization(backend, fmt, G, T):
    """Quantized experts give the float64 op on their dequantized weights."""
    backend.require_format(fmt)
    x, w, ids, ex = make_problem(T + 3, T, 6, 2, 64, 64)
    q = nbx.quantize(ex, fmt, group_size=G)
    y = run(backend, x, w, ids, q)
    assert rel_err(y, np_moe(x, w, ids, dense(q))) < backend.tol(x.dtype, jnp.float32)


@pytest.mark.parametrize("fmt,G", [("mxfp4", 32), ("int8", None), pytest.param("nvfp4", 16, marks=pytest.mark.sweep),
                                   pytest.param("fp8", 32, marks=pytest.mark.sweep),
                                   pytest.param("int4", 32, marks=pytest.mark.sweep)])
@pytest.mark.parametrize("T", [1, 33])
def test_quantized_experts_with_biases(backend, fmt, G, T):
    """gpt-oss's experts: quantized weights with gate, up and down biases and
    the clamped SwiGLU, against float64 on the dequantized weights."""
    backend.require_format(fmt)
    backend.require(LAYOUTS)
    x, w, ids, ex = make_problem(T + 5, T, 5, 2, 64, 96)
    rng = np.random.default_rng(T)
    b = [rng.standard_normal((5, s)) for s in (96, 96, 64)]
    q = nbx.quantize(ex, fmt, group_size=G)
    qb = nbx.Experts(q.gate, q.up, q.down, **{n: jnp.asarray(a, jnp.float32) for n, a in
                                             zip(("gate_bias", "up_bias", "down_bias"), b)})
    act = nbx.Activation("swiglu_clamped", alpha=1.702, limit=7.0)
    ref = np_moe(x, w, ids, dense(q), act, biases=tuple(np.asarray(a, np.float32).astype(np.float64) for a in b))
    assert rel_err(run(backend, x, w, ids, qb, activation=act), ref) < backend.tol(x.dtype, jnp.float32)


def _np_dequantized(w: nbx.QuantizedWeight) -> np.ndarray:
    """float32 [E, K, N] of fp8 / mxfp4 / mxfp8 weights, computed in float64
    from the formats' definition (rounded once): E4M3 / E2M1 element (ml_dtypes)
    times the scale of row k's group, k // G, over ceil(K / G) scale rows."""
    import ml_dtypes

    q = np.asarray(w.q)
    if w.kind == "mxfp4":
        q = np.stack([q & 15, q >> 4], axis=-2).reshape(q.shape[0], -1, q.shape[-1])
    elem = q.view(ml_dtypes.float4_e2m1fn if w.kind == "mxfp4" else ml_dtypes.float8_e4m3fn).astype(np.float64)
    s = np.asarray(jnp.asarray(w.scale).astype(jnp.float32), np.float64) if w.kind == "fp8" else \
        np.exp2(np.asarray(w.scale, np.float64) - 127.0)
    K = elem.shape[-2]
    assert s.shape[-2] == -(-K // w.group_size)
    return (elem * s[:, np.arange(K) // w.group_size, :]).astype(np.float32)


# (format, group, H, I): H or I not a multiple of the group -- the last group
# of K partial (issue #53); odd K for the byte formats (a lone last row)
PARTIAL_GROUPS = [("fp8", 128, 200, 96), ("mxfp4", 32, 200, 70), ("mxfp8", 32, 97, 40)]


@pytest.mark.parametrize("fmt,G,H,I", PARTIAL_GROUPS, ids=[f"{f}-g{g}-H{h}-I{i}" for f, g, h, i in PARTIAL_GROUPS])
@pytest.mark.parametrize("T", [1, 33])  # decode (streamed on the CPU) and prefill (packed K-blocks)
def test_partial_groups_match_float64(backend, fmt, G, H, I, T):
    """Block-scaled experts whose H or I the block does not divide (a
    128x128-block checkpoint of such a model): ceil(K / G) scale rows, the
    last group covering K % G rows, against the float64 op on the weights
    dequantized from the format's definition; every output row written."""
    backend.require_format(fmt)
    x, w, ids, ex = make_problem(T + 11, T, 6, 2, H, I)
    q = nbx.quantize(ex, fmt, group_size=G)
    assert q.gate.scale.shape[1] == -(-H // G) and q.down.scale.shape[1] == -(-I // G)
    y = run(backend, x, w, ids, q)
    assert y.shape == x.shape and bool(jnp.all(jnp.isfinite(y))), "unwritten rows"
    ref = np_moe(x, w, ids, nbx.Experts(*(jnp.asarray(_np_dequantized(m)) for m in (q.gate, q.up, q.down))))
    assert rel_err(y, ref) < backend.tol(x.dtype, jnp.float32)


def test_leading_axes_and_no_tokens(backend):
    x, w, ids, ex = make_problem(5, 24, 8, 2, 33, 20)
    y = backend(x.reshape(2, 3, 4, 33), w.reshape(2, 3, 4, 2), ids.reshape(2, 3, 4, 2), ex)
    assert y.shape == (2, 3, 4, 33)
    assert rel_err(y.reshape(24, 33), np_moe(x, w, ids, ex)) < backend.tol(x.dtype)
    y0 = backend(jnp.zeros((0, 4, 33), jnp.bfloat16), jnp.zeros((0, 4, 2)), jnp.zeros((0, 4, 2), jnp.int32), ex)
    assert y0.shape == (0, 4, 33) and y0.dtype == jnp.bfloat16


@pytest.mark.sanitize
def test_nan_propagates_like_the_reference(backend):
    """A NaN in x poisons its token only; a NaN weight the tokens routed to
    its expert; nothing else (padding rows and other experts stay clean)."""
    x, w, ids, ex = make_problem(4, 33, 8, 2, 33, 20)
    x = x.at[3, 5].set(jnp.nan)
    ex = nbx.Experts(ex.gate.at[2, 0, 7].set(jnp.nan), ex.up, ex.down)
    ref = np_moe(x, w, ids, ex)
    y = np.asarray(run(backend, x, w, ids, ex))
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
    ok = ~np.isnan(ref)
    assert np.max(np.abs(y[ok] - ref[ok])) / np.max(np.abs(ref[ok])) < backend.tol(x.dtype)
    assert np.isnan(ref[3]).all() and np.isnan(ref[np.any(np.asarray(ids) == 2, axis=1)]).all()


@pytest.mark.parametrize("k", [1, pytest.param(3, marks=CORE)])
def test_weights_on_the_input(backend, k):
    """Llama-4: mlp(w * x) per slot, summed."""
    x, w, ids, ex = make_problem(12 + k, 33, 6, k, 33, 20)
    y = run(backend, x, w, ids, ex, weights_on="input")
    xs = np.asarray(x, np.float64)[:, None, :] * np.asarray(w, np.float64)[:, :, None]
    ref = np_moe(xs.reshape(-1, 33), np.ones((33 * k, 1)), np.asarray(ids).reshape(-1, 1), ex)
    assert rel_err(y, ref.reshape(33, k, 33).sum(1)) < backend.tol(x.dtype)


@pytest.mark.parametrize("gated", [False, pytest.param(True, marks=CORE)])
def test_shared_experts(backend, gated):
    """Shared experts on every token (Qwen2-MoE's sigmoid gate), added in the same call."""
    x, w, ids, ex = make_problem(21, 33, 6, 2, 33, 20)
    _, _, _, sh = make_problem(22, 1, 2, 1, 33, 12)
    gate = jnp.asarray(np.random.default_rng(23).standard_normal((1, 33)), jnp.float32) if gated else None
    y = run(backend, x, w, ids, ex, shared_experts=nbx.SharedExperts(sh, gate))
    s = np.ones((33, 2)) if gate is None else np.repeat(
        1.0 / (1.0 + np.exp(-(np.asarray(x, np.float64) @ np.asarray(gate, np.float64).T))), 2, axis=1)
    ref = np_moe(x, w, ids, ex) + np_moe(x, s, np.tile(np.arange(2), (33, 1)), sh)
    assert rel_err(y, ref) < backend.tol(x.dtype)
