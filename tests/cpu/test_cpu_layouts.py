"""Checkpoint layouts read in place, expert biases, weights on the input and
shared experts (issue #17), on the CPU handler (forward and fused backward)
and the "xla" reference, against float64 numpy.

The float64 side never sees jax_nbx's views: the stored arrays are built from
canonical ``G, U [E, H, I]``, ``D [E, I, H]`` with numpy (transpose,
concatenate, interleave: `stored`), the reference computes on the canonical
ones, and its gradients are mapped into the stored layout the same way (the
map is a permutation, so it carries gradients as it carries weights).
Biases follow transformers' ``modeling_gpt_oss.py`` (``GptOssExperts``):
``gate_up = x @ W + b`` split into gate and up, ``down(h) + b_down``, then
the routing weight.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from conftest import f64, rel_err
from support.handlers import ffi_backward as _ffi_backward
from support.handlers import ffi_forward as _ffi_forward
from support.layouts import LAYOUTS, canonical, np_block, routing, stored

pytestmark = pytest.mark.sanitize


def _seed(*parts) -> int:
    return abs(hash(tuple(str(p) for p in parts))) % (2 ** 31)


E, K, H, I = 6, 2, 45, 19  # H and I multiples of no block


@pytest.mark.parametrize("T", [222])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_forward_reads_every_layout(name, bias, T):
    """The CPU handler (NaN-poisoned output, bands of 16 tokens: the same bits
    as fused_moe's one band) and the reference, on every layout with and
    without biases (T = 1 and 33 on every backend: tests/suite)."""
    rng = np.random.default_rng(_seed("fwd", name, bias, T))
    G, U, D, bg, bu, bd = canonical(rng, E, H, I, bias)
    ex = stored(name, G, U, D, bg, bu, bd)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    w, ids = routing(rng, T, E, K)
    ref = np_block(x, w, ids, G, U, D, bg, bu, bd)
    y = _ffi_forward(x, w, ids, *ex.flat(), *ex.handler_biases(), activation="swiglu",
                     band_tokens=16, poison=True, layout=ex.weight_layout())
    assert rel_err(y, ref) <= 1e-5
    y_op = nbx.fused_moe(x, w, ids, ex, implementation="ffi")
    np.testing.assert_array_equal(np.asarray(y_op), np.asarray(y))  # bands change no bit
    assert rel_err(nbx.fused_moe(x, w, ids, ex, implementation="xla"), ref) <= 1e-5


@pytest.mark.parametrize("wdt", ["f32", "bf16"])
@pytest.mark.parametrize("name", ["out_in", "interleaved", "interleaved_out_in"])
def test_streamed_and_packed_agree_bit_for_bit(isa, name, wdt):
    """On every instruction set: experts with few rows in a band stream their
    weights in the stored layout (the column-streaming kernels for out x in,
    one 2I-column run for interleaved gate||up, the stored sums then biases
    and the gated unit), the others pack them; both sum in the same order,
    so one band or bands of 2 tokens give the same bits, and match float64."""
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[wdt]
    rng = np.random.default_rng(_seed("isa", isa, name, wdt))
    En, Hn, In, T = 4, 70, 37, 40  # H > 64: whole 16 x 16 blocks and tails
    G, U, D, bg, bu, bd = canonical(rng, En, Hn, In, True)
    G, U, D = (f64(jnp.asarray(a, dtype)) for a in (G, U, D))
    ex = stored(name, G, U, D, bg, bu, bd, dtype=dtype)
    x = jnp.asarray(rng.standard_normal((T, Hn)), jnp.float32)
    w, ids = routing(rng, T, En, 2)
    run = lambda band: _ffi_forward(x, w, ids, *ex.flat(), *ex.handler_biases(),  # noqa: E731
                                    activation="swiglu_clamped", band_tokens=band, poison=True,
                                    layout=ex.weight_layout())
    streamed, packed = run(2), run(0)  # 4 slots per band: every expert streams; 80 slots: all pack
    np.testing.assert_array_equal(np.asarray(streamed), np.asarray(packed))
    assert rel_err(packed, np_block(x, w, ids, G, U, D, bg, bu, bd, "swiglu_clamped")) <= 1e-5


@pytest.mark.parametrize("name", ["plain", "interleaved", "interleaved_out_in"])
def test_sums_over_several_k_blocks(name):
    """H and I past one K-block (128 rows): GEMM1's stored sums continue
    across blocks before the bias and gated unit; bands of 2 tokens (all
    streamed) and one band (all packed) agree bit for bit and with float64."""
    rng = np.random.default_rng(_seed("kblocks", name))
    En, Hn, In, T = 3, 301, 157, 24
    G, U, D, bg, bu, bd = canonical(rng, En, Hn, In, True)
    ex = stored(name, G, U, D, bg, bu, bd)
    x = jnp.asarray(rng.standard_normal((T, Hn)), jnp.float32)
    w, ids = routing(rng, T, En, 2)
    run = lambda band: _ffi_forward(x, w, ids, *ex.flat(), *ex.handler_biases(),  # noqa: E731
                                    activation="geglu_erf", band_tokens=band, poison=True,
                                    layout=ex.weight_layout())
    streamed, packed = run(2), run(0)
    np.testing.assert_array_equal(np.asarray(streamed), np.asarray(packed))
    assert rel_err(packed, np_block(x, w, ids, G, U, D, bg, bu, bd, "geglu_erf")) <= 1e-5


@pytest.mark.parametrize("name", ["out_in", "interleaved", "concat_out_in"])
@pytest.mark.parametrize("wdt", ["f32", "bf16"])
def test_lists_and_bf16_weights_in_layout(name, wdt):
    """Per-expert lists (a checkpoint's experts.{i}.*) and bfloat16 weights, biased."""
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[wdt]
    rng = np.random.default_rng(_seed("lists", name, wdt))
    G, U, D, bg, bu, bd = canonical(rng, E, H, I, True)
    G, U, D = (f64(jnp.asarray(a, dtype)) for a in (G, U, D))  # the values the handler reads
    ex = stored(name, G, U, D, bg, bu, bd, lists=True, dtype=dtype)
    for T in (1, 33):
        x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
        w, ids = routing(rng, T, E, K)
        y = _ffi_forward(x, w, ids, *ex.flat(), *ex.handler_biases(), activation="swiglu",
                         band_tokens=0, poison=True, lists=True, layout=ex.weight_layout())
        assert rel_err(y, np_block(x, w, ids, G, U, D, bg, bu, bd)) <= 1e-5


@pytest.mark.parametrize("act", ["swiglu_clamped", "geglu_erf"])
@pytest.mark.parametrize("bias", [True], ids=["bias"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_backward_in_every_layout(name, bias, act):
    """The fused CPU backward (every result NaN-poisoned first, bands of 8
    tokens) against float64: dx, d(weights), the weight gradients in the
    stored layout and the bias gradients; and jax.grad through fused_moe
    returns the same structure as the experts."""
    T = 33
    rng = np.random.default_rng(_seed("bwd", name, bias, act))
    G, U, D, bg, bu, bd = canonical(rng, E, H, I, bias)
    G, U = 3 * G, 3 * U  # reach the clamp of swiglu_clamped (limit 7)
    ex = stored(name, G, U, D, bg, bu, bd)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    w, ids = routing(rng, T, E, K)
    ct = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    _, (dx, dw, dG, dU, dD, dbg, dbu, dbd) = np_block(x, w, ids, G, U, D, bg, bu, bd, act, ct=ct)
    want = stored(name, dG, dU, dD, dbg if bias else None, dbu if bias else None, dbd if bias else None,
                  dtype=jnp.float32)
    got_dx, got_dw, dws = _ffi_backward(ct, x, w, ids, *ex.flat(), *ex.handler_biases(), activation=act,
                                        band_tokens=8, poison=True, layout=ex.weight_layout())
    assert rel_err(got_dx, dx) <= 1e-5 and rel_err(got_dw, dw) <= 1e-5
    names = ex.weight_names()
    for n, d in zip(names, dws[:len(names)]):
        assert rel_err(d, f64(getattr(want, n))) <= 1e-5, n
    if bias:
        for d, r in zip(dws[len(names):], (dbg, dbu, dbd)):
            assert rel_err(d, r) <= 1e-5
    grads = jax.grad(lambda e: jnp.sum(nbx.fused_moe(x, w, ids, e, activation=act) * ct))(ex)
    assert jax.tree.structure(grads) == jax.tree.structure(ex)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        assert a.shape == b.shape and rel_err(a, f64(b)) <= 1e-5


def test_bias_subsets_lists_and_dtypes():
    """Any subset of biases, given as lists or in bfloat16: gradients come
    back in the bias's own structure and dtype."""
    rng = np.random.default_rng(7)
    G, U, D, bg, bu, bd = canonical(rng, E, H, I, True)
    T = 33
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    w, ids = routing(rng, T, E, K)
    ct = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    ex = nbx.Experts(jnp.asarray(G), jnp.asarray(U), jnp.asarray(D), up_bias=jnp.asarray(bu, jnp.bfloat16),
                     down_bias=[jnp.asarray(b) for b in bd])
    bu16 = f64(jnp.asarray(bu, jnp.bfloat16))
    y, grads = np_block(x, w, ids, G, U, D, None, bu16, bd, ct=ct)
    assert rel_err(nbx.fused_moe(x, w, ids, ex), y) <= 1e-5
    g = jax.grad(lambda e: jnp.sum(nbx.fused_moe(x, w, ids, e) * ct))(ex)
    assert g.gate_bias is None and g.up_bias.dtype == jnp.bfloat16 and isinstance(g.down_bias, list)
    assert rel_err(g.up_bias, grads[6]) <= 1e-2  # (rounded to bfloat16)
    assert rel_err(jnp.stack(g.down_bias), grads[7]) <= 1e-5


@pytest.mark.parametrize("k", [2])
def test_weights_on_input(k):
    """weights_on="input" (Llama-4, modeling_llama4.py Llama4TextMoe:
    ``routed_in = hidden_states * router_scores``): y = sum_j mlp(w_j x)."""
    rng = np.random.default_rng(_seed("input", k))
    G, U, D, *_ = canonical(rng, E, H, I, False)
    ex = stored("concat", G, U, D)
    T = 33
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    w, ids = routing(rng, T, E, k)
    ref = sum(np_block(f64(x) * f64(w)[:, j:j + 1], np.ones((T, 1)), ids[:, j:j + 1], G, U, D)
              for j in range(k))
    for impl in ("ffi", "xla"):
        assert rel_err(nbx.fused_moe(x, w, ids, ex, weights_on="input", implementation=impl), ref) <= 1e-5
    f = lambda impl: jax.grad(  # noqa: E731
        lambda x_, w_, e_: jnp.sum(nbx.fused_moe(x_, w_, ids, e_, weights_on="input",
                                                 implementation=impl) ** 2), argnums=(0, 1, 2))(x, w, ex)
    for a, b in zip(jax.tree.leaves(f("ffi")), jax.tree.leaves(f("xla"))):
        assert rel_err(a, f64(b)) <= 1e-5


@pytest.mark.parametrize("gated", [True], ids=["qwen2_gate"])
def test_shared_experts(gated):
    """SharedExperts: S always-on experts of their own width (nn.Linear layout,
    per-expert lists), optionally gated by Qwen2-MoE's sigmoid(x @ gate.T)
    (modeling_qwen2_moe.py Qwen2MoeSparseMoeBlock), in the same call."""
    rng = np.random.default_rng(_seed("shared", gated))
    G, U, D, bg, bu, bd = canonical(rng, E, H, I, True)
    ex = stored("interleaved", G, U, D, bg, bu, bd)
    S, Is = 2, 2 * I + 3
    sG, sU, sD, *_ = canonical(rng, S, H, Is, False)
    shared_ex = stored("out_in", sG, sU, sD, lists=True)
    gate = jnp.asarray(rng.standard_normal((1, H)) * H ** -0.5, jnp.float32) if gated else None
    shared = nbx.SharedExperts(shared_ex, gate=gate)
    T = 33
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    w, ids = routing(rng, T, E, K)
    sw = np.ones((T, S))
    if gated:
        sw *= 1.0 / (1.0 + np.exp(-(f64(x) @ f64(gate)[0])))[:, None]
    ref = np_block(x, w, ids, G, U, D, bg, bu, bd) + np_block(
        x, sw, np.broadcast_to(np.arange(S), (T, S)), sG, sU, sD)
    for impl in ("ffi", "xla"):
        y = jax.jit(functools.partial(nbx.fused_moe, implementation=impl))(x, w, ids, ex, shared_experts=shared)
        assert rel_err(y, ref) <= 1e-5
    f = lambda impl: jax.grad(  # noqa: E731
        lambda x_, sh: jnp.sum(nbx.fused_moe(x_, w, ids, ex, shared_experts=sh, implementation=impl) ** 2),
        argnums=(0, 1))(x, shared)
    got, want = f("ffi"), f("xla")
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_err(a, f64(b)) <= 1e-5


def _temp_bytes(f, *args) -> int:
    return int(jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes)


@pytest.mark.parametrize("name", ["out_in", "interleaved", "concat_out_in"])
def test_no_weight_sized_temporaries(name):
    """The compiled program of the CPU handler's path (forward, and forward +
    backward) holds no weight-sized temporary: the layout is read in place.
    The reference path, which transposes, does (the check can fail)."""
    rng = np.random.default_rng(3)
    En, Hn, In = 8, 256, 128
    G, U, D, bg, bu, bd = canonical(rng, En, Hn, In, True)
    ex = stored(name, G, U, D, bg, bu, bd)
    weight_bytes = G.nbytes  # one projection
    x = jnp.asarray(rng.standard_normal((4, Hn)), jnp.float32)
    w, ids = routing(rng, 4, En, 2)
    fwd = lambda impl: lambda x_, e: nbx.fused_moe(x_, w, ids, e, implementation=impl)  # noqa: E731
    assert _temp_bytes(fwd("ffi"), x, ex) < weight_bytes // 8
    assert _temp_bytes(fwd("xla"), x, ex) >= weight_bytes  # the reference copies
    grad = jax.grad(lambda x_, e: jnp.sum(nbx.fused_moe(x_, w, ids, e)), argnums=(0, 1))
    # (the gradients are results, not temporaries: at most a bias-sized scratch besides)
    assert _temp_bytes(grad, x, ex) < weight_bytes // 8


def test_vmap_over_tokens_with_biased_fused_experts():
    rng = np.random.default_rng(11)
    G, U, D, bg, bu, bd = canonical(rng, E, H, I, True)
    ex = stored("interleaved_out_in", G, U, D, bg, bu, bd)
    xb = jnp.asarray(rng.standard_normal((3, 5, H)), jnp.float32)
    w, ids = routing(rng, 15, E, K)
    wb, ib = w.reshape(3, 5, K), ids.reshape(3, 5, K)
    y = jax.vmap(lambda a, b, c: nbx.fused_moe(a, b, c, ex))(xb, wb, ib)
    ref = np_block(xb.reshape(15, H), w, ids, G, U, D, bg, bu, bd).reshape(3, 5, H)
    assert rel_err(y, ref) <= 1e-5


def test_bad_layouts_biases_and_options_are_named():
    rng = np.random.default_rng(5)
    G, U, D, bg, bu, bd = canonical(rng, E, H, I, True)
    x = jnp.asarray(rng.standard_normal((4, H)), jnp.float32)
    w, ids = routing(rng, 4, E, K)
    with pytest.raises(ValueError, match="layout must be one of"):
        nbx.Experts(G, U, D, layout="row_major")
    with pytest.raises(ValueError, match="fusion must be one of"):
        nbx.Experts.fused(np.concatenate([G, U], -1), D, fusion="zip")
    with pytest.raises(ValueError, match=r"experts.gate_up has shape \(6, 45, 38\); with "
                       r"layout='out_in'.*\[2I, H\], whose 2I axis \(45\)"):
        nbx.fused_moe(x, w, ids, nbx.Experts.fused(np.concatenate([G, U], -1), D.transpose(0, 2, 1),
                                                   layout="out_in"))
    with pytest.raises(ValueError, match=r"experts.down_bias has shape \(6, 19\); expected \(6, 45\)"):
        nbx.fused_moe(x, w, ids, nbx.Experts(G, U, D, down_bias=bg))
    with pytest.raises(TypeError, match="experts.gate_bias has dtype int32"):
        nbx.fused_moe(x, w, ids, nbx.Experts(G, U, D, gate_bias=np.zeros((E, I), np.int32)))
    with pytest.raises(ValueError, match="weights_on must be 'output' or 'input'; got 'inputs'"):
        nbx.fused_moe(x, w, ids, nbx.Experts(G, U, D), weights_on="inputs")
    with pytest.raises(TypeError, match="shared_experts must be a jax_nbx.SharedExperts"):
        nbx.fused_moe(x, w, ids, nbx.Experts(G, U, D), shared_experts=nbx.Experts(G, U, D))
    with pytest.raises(ValueError, match=r"shared_experts.gate has shape \(2, 45\)"):
        nbx.fused_moe(x, w, ids, nbx.Experts(G, U, D),
                      shared_experts=nbx.SharedExperts(nbx.Experts(G, U, D), gate=np.zeros((2, H))))
    with pytest.raises(ValueError, match=r"shared_experts: experts.up has shape"):
        nbx.fused_moe(x, w, ids, nbx.Experts(G, U, D),
                      shared_experts=nbx.SharedExperts(nbx.Experts(G, U[:, :, :3], D)))


def test_sharded_moe_refuses_layouts_and_biases_by_name():
    rng = np.random.default_rng(8)
    G, U, D, bg, bu, bd = canonical(rng, E, H, I, True)
    x = jnp.asarray(rng.standard_normal((4, H)), jnp.float32)
    w, ids = routing(rng, 4, E, K)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("expert", "data"))
    with pytest.raises(ValueError, match="sharded_moe takes plain experts"):
        nbx.sharded_moe(x, w, ids, stored("plain", G, U, D, bg, bu, bd), mesh)


def test_metal_refuses_layouts_and_biases_by_name(metal_sim):
    rng = np.random.default_rng(6)
    G, U, D, bg, bu, bd = canonical(rng, E, H, I, True)
    x = jnp.asarray(rng.standard_normal((4, H)), jnp.float32)
    w, ids = routing(rng, 4, E, K)
    for ex, what in ((stored("out_in", G, U, D), "layout='out_in'"),
                     (stored("plain", G, U, D, bg, bu, bd), "biases"),
                     (stored("interleaved", G, U, D), "fusion='interleaved'")):
        with pytest.raises(ValueError, match=f"'metal' cannot run this call: takes plain experts.*{what}"):
            nbx.fused_moe(x, w, ids, ex, implementation="metal")
    y = nbx.fused_moe(x, w, ids, stored("plain", G, U, D), implementation="metal")
    assert rel_err(y, np_block(x, w, ids, G, U, D)) <= 1e-5
