"""Shared helpers: random MoE problems and a float64 numpy reference."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx
from jax_nbx import _registry

_registry.register_testing()  # the test-only targets: handlers with NaN-filled output twins

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# max |y - ref| / max |ref|: f32 accumulation; bf16/f16 add the output's rounding.
TOL = {"f32": 1e-5, "bf16": 1e-2, "f16": 2e-3}


def np_silu(g):
    return g / (1.0 + np.exp(-g))


def np_gelu_tanh(g):
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))


NP_ACT = {"swiglu": np_silu, "geglu": np_gelu_tanh}
_np_erf = np.vectorize(math.erf, otypes=[np.float64])


def np_glu(g, u, activation="swiglu"):
    """(glu(g, u), d glu/dg, d glu/du) in float64, jax_nbx.activations' table
    written out: swiglu_clamped from transformers' modeling_gpt_oss.py
    (GptOssExperts.forward: gate.clamp(max=limit), up.clamp(-limit, limit),
    gate * sigmoid(gate * alpha) * (up + 1)); a clamp passes the gradient
    inside its range only (torch.clamp)."""
    a = nbx.activations.as_activation(activation)
    if a.name == "swiglu_clamped":
        L, al = a.limit, a.alpha
        gc, uc = np.minimum(g, L), np.clip(u, -L, L)
        s = 1.0 / (1.0 + np.exp(-al * gc))
        f, df = gc * s, s * (1.0 + al * gc * (1.0 - s))
        return f * (uc + 1.0), np.where(g <= L, df * (uc + 1.0), 0.0), np.where(np.abs(u) <= L, f, 0.0)
    if a.name == "geglu_erf":
        cdf = 0.5 * (1.0 + _np_erf(g / np.sqrt(2.0)))
        f, df = g * cdf, cdf + g * np.exp(-0.5 * g * g) / np.sqrt(2.0 * np.pi)
    else:
        f, df = np_act_grad(g, a.name)
    return f * u, df * u, f


def f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32), dtype=np.float64)


def np_moe(x, w, ids, experts: nbx.Experts, activation="swiglu") -> np.ndarray:
    """float64 MoE forward, one expert at a time; x [T, H], w/ids [T, k]."""
    x, w, ids = f64(x), f64(w), np.asarray(ids)
    gate, up, down = f64(experts.gate), f64(experts.up), f64(experts.down)
    T, H = x.shape
    y = np.zeros((T, H))
    for e in range(gate.shape[0]):
        t_idx, j_idx = np.nonzero(ids == e)
        if t_idx.size == 0:
            continue
        a = x[t_idx]
        h = np_glu(a @ gate[e], a @ up[e], activation)[0]
        np.add.at(y, t_idx, w[t_idx, j_idx][:, None] * (h @ down[e]))
    return y


def np_act_grad(g, activation="swiglu"):
    """(act(g), act'(g)) in float64."""
    if activation == "geglu":
        c = np.sqrt(2.0 / np.pi)
        th = np.tanh(c * (g + 0.044715 * g ** 3))
        return 0.5 * g * (1.0 + th), 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th ** 2) * c * (1.0 + 3 * 0.044715 * g ** 2)
    s = 1.0 / (1.0 + np.exp(-g))
    return g * s, s + g * s * (1.0 - s)


def np_moe_grads(x, w, ids, experts: nbx.Experts, ct, activation="swiglu"):
    """float64 gradients of sum(y * ct): (dx, dw, dgate, dup, ddown).  Slots
    whose id is outside [0, E) contribute nothing (their dw is 0)."""
    x, w, ids, ct = f64(x), f64(w), np.asarray(ids), f64(ct)
    G, U, D = f64(experts.gate), f64(experts.up), f64(experts.down)
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    dG, dU, dD = np.zeros_like(G), np.zeros_like(U), np.zeros_like(D)
    for e in range(G.shape[0]):
        t_idx, j_idx = np.nonzero(ids == e)
        if t_idx.size == 0:
            continue
        a, c, wt = x[t_idx], ct[t_idx], w[t_idx, j_idx][:, None]
        g, u = a @ G[e], a @ U[e]
        h, dh_dg, dh_du = np_glu(g, u, activation)
        o = h @ D[e]
        np.add.at(dw, (t_idx, j_idx), np.sum(o * c, axis=1))
        do = wt * c
        dD[e] += h.T @ do
        dh = do @ D[e].T
        dg = dh * dh_dg
        du = dh * dh_du
        dG[e] += a.T @ dg
        dU[e] += a.T @ du
        np.add.at(dx, t_idx, dg @ G[e].T + du @ U[e].T)
    return dx, dw, dG, dU, dD


def rel_err(y, ref) -> float:
    y = np.asarray(jnp.asarray(y).astype(jnp.float32), dtype=np.float64)
    scale = max(np.max(np.abs(ref)), 1e-30) if ref.size else 1.0
    return float(np.max(np.abs(y - ref)) / scale) if ref.size else 0.0


def make_problem(seed, T, E, k, H, I, x_dtype=jnp.float32, w_dtype=jnp.float32,
                 routing="topk"):
    """x [T, H], routed (w, ids) [T, k] and Experts with unit-scale outputs."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, H)), x_dtype)
    experts = nbx.Experts(
        gate=jnp.asarray(rng.standard_normal((E, H, I)) / np.sqrt(H), w_dtype),
        up=jnp.asarray(rng.standard_normal((E, H, I)) / np.sqrt(H), w_dtype),
        down=jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), w_dtype),
    )
    if routing == "topk":
        w, ids = nbx.route(jnp.asarray(rng.standard_normal((T, E)), jnp.float32), k)
    elif routing == "one":  # every slot to expert E-1 (skewed), repeated ids allowed
        ids = jnp.full((T, k), E - 1, jnp.int32)
        w = jnp.asarray(rng.uniform(0.1, 1.0, (T, k)), jnp.float32)
    else:  # independent draws: repeats within a token allowed
        ids = jnp.asarray(rng.integers(0, E, (T, k)), jnp.int32)
        w = jnp.asarray(rng.uniform(0.1, 1.0, (T, k)), jnp.float32)
    return x, w, ids, experts


ISAS = ["avx512", "avx2", "generic"]


@pytest.fixture(params=ISAS)
def isa(request):
    """Runs the test once per micro-kernel instruction set this CPU supports."""
    if request.param not in nbx.cpu.supported_isas():
        pytest.skip(f"this CPU lacks {request.param} (supports {nbx.cpu.supported_isas()})")
    before = nbx.cpu.isa()
    nbx.cpu.set_isa(request.param)
    yield request.param
    nbx.cpu.set_isa(before)


@pytest.fixture
def metal_sim():
    """The simulated Metal device, fresh for the test (default limits); after
    it, nothing live on metal:0, no live wrap, no unreported violation."""
    ffi = nbx._registry.ffi_module()
    nbx.tables.release_pinned()
    nbx.metal.use("sim")
    yield ffi
    nbx.tables.release_pinned()
    ffi.metal_sim_hold_completions(False)
    s = nbx.memory.stats()["metal:0"]
    assert s["live"] == 0, s
    assert ffi.metal_sim_state()["live_wraps"] == 0
    assert ffi.metal_sim_take_violations() == []
    nbx.tables.set_capacity(256)
    nbx.metal.use("none")


@pytest.fixture(autouse=True)
def _no_leaked_handler_bytes():
    """Every test leaves the handlers' live allocation count at zero."""
    yield
    assert nbx.memory.stats()["cpu:0"]["live"] == 0


jax.config.update("jax_numpy_rank_promotion", "raise")
