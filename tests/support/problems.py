"""Random MoE problems and the float64 numpy references every test compares
against (the oracles: written here, independently of the package's code)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_nbx as nbx

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# max |y - ref| / max |ref|: f32 accumulation; bf16/f16 add the output's rounding.
TOL = {"f32": 1e-5, "bf16": 1e-2, "f16": 2e-3}


def np_silu(g):
    return g / (1.0 + np.exp(-g))


def np_gelu_tanh(g):
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))


NP_ACT = {"swiglu": np_silu, "geglu": np_gelu_tanh}
_np_erf = np.vectorize(math.erf, otypes=[np.float64])


def np_act_grad(g, activation="swiglu"):
    """(act(g), act'(g)) in float64."""
    if activation == "geglu":
        c = np.sqrt(2.0 / np.pi)
        th = np.tanh(c * (g + 0.044715 * g ** 3))
        return 0.5 * g * (1.0 + th), 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th ** 2) * c * (1.0 + 3 * 0.044715 * g ** 2)
    s = 1.0 / (1.0 + np.exp(-g))
    return g * s, s + g * s * (1.0 - s)


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


def dense(experts: nbx.Experts) -> nbx.Experts:
    """Stacked plain float experts of any experts (dequantized, transposed,
    split, biases dropped: use `canonical` for those)."""
    if nbx.quantization.is_quantized(experts):
        experts = nbx.dequantize(experts, jnp.float32)
    return experts.canonical()[0]


def np_lora(lora) -> dict:
    """A `jax_nbx.LoRA` as float64: projection -> (A [E, in, r], B [E, r, out], scale)."""
    if lora is None:
        return {}
    out = {}
    for name in ("gate", "up", "down"):
        pair = getattr(lora, name)
        if pair is not None:
            A, B = (np.stack([f64(v) for v in a]) if isinstance(a, (list, tuple)) else f64(a) for a in pair)
            out[name] = (A, B, lora.scale(name))
    return out


def _np_project(v, W, adapters, name, e):
    """v @ W[e] + s * (v @ A[e]) @ B[e] (LoRA), float64."""
    out = v @ W[e]
    if name in adapters:
        A, B, s = adapters[name]
        out = out + s * (v @ A[e]) @ B[e]
    return out


def np_moe(x, w, ids, experts: nbx.Experts, activation="swiglu", biases=None, lora=None) -> np.ndarray:
    """float64 MoE forward, one expert at a time; x [T, H], w/ids [T, k];
    slots whose id is outside [0, E) contribute nothing.  ``biases``: float64
    (gate [E, I], up [E, I], down [E, H]) or None; ``lora``: a `jax_nbx.LoRA`
    (``x @ W + s * (x @ A) @ B`` per adapted projection) or None."""
    x, w, ids = f64(x), f64(w), np.asarray(ids)
    ex = dense(experts)
    gate, up, down = f64(ex.gate), f64(ex.up), f64(ex.down)
    ad = np_lora(lora)
    T, H = x.shape
    y = np.zeros((T, H))
    for e in range(gate.shape[0]):
        t_idx, j_idx = np.nonzero(ids == e)
        if t_idx.size == 0:
            continue
        a = x[t_idx]
        g, u = _np_project(a, gate, ad, "gate", e), _np_project(a, up, ad, "up", e)
        if biases is not None:
            g, u = g + biases[0][e], u + biases[1][e]
        o = _np_project(np_glu(g, u, activation)[0], down, ad, "down", e)
        if biases is not None:
            o = o + biases[2][e]
        np.add.at(y, t_idx, w[t_idx, j_idx][:, None] * o)
    return y


def np_moe_grads(x, w, ids, experts: nbx.Experts, ct, activation="swiglu", lora=None):
    """float64 gradients of sum(y * ct): (dx, dw, dgate, dup, ddown), and with
    ``lora`` (a `jax_nbx.LoRA`) a sixth: projection -> (dA, dB).  Slots
    whose id is outside [0, E) contribute nothing (their dw is 0)."""
    x, w, ids, ct = f64(x), f64(w), np.asarray(ids), f64(ct)
    ex = dense(experts)
    G, U, D = f64(ex.gate), f64(ex.up), f64(ex.down)
    ad = np_lora(lora)
    dad = {n: (np.zeros_like(A), np.zeros_like(B)) for n, (A, B, _) in ad.items()}
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    dG, dU, dD = np.zeros_like(G), np.zeros_like(U), np.zeros_like(D)

    def back(v, dout, W, dW, name, e):
        """Adds the weight and adapter gradients of v @ W[e] (+ LoRA); dv."""
        dW[e] += v.T @ dout
        dv = dout @ W[e].T
        if name in ad:
            A, B, s = ad[name]
            dA, dB = dad[name]
            dB[e] += s * (v @ A[e]).T @ dout
            dva = s * dout @ B[e].T
            dA[e] += v.T @ dva
            dv = dv + dva @ A[e].T
        return dv

    for e in range(G.shape[0]):
        t_idx, j_idx = np.nonzero(ids == e)
        if t_idx.size == 0:
            continue
        a, c, wt = x[t_idx], ct[t_idx], w[t_idx, j_idx][:, None]
        g, u = _np_project(a, G, ad, "gate", e), _np_project(a, U, ad, "up", e)
        h, dh_dg, dh_du = np_glu(g, u, activation)
        o = _np_project(h, D, ad, "down", e)
        np.add.at(dw, (t_idx, j_idx), np.sum(o * c, axis=1))
        do = wt * c
        dh = back(h, do, D, dD, "down", e)
        dg = dh * dh_dg
        du = dh * dh_du
        np.add.at(dx, t_idx, back(a, dg, G, dG, "gate", e) + back(a, du, U, dU, "up", e))
    if lora is None:
        return dx, dw, dG, dU, dD
    return dx, dw, dG, dU, dD, dad


def rel_err(y, ref) -> float:
    y = np.asarray(jnp.asarray(y).astype(jnp.float32), dtype=np.float64)
    ref = np.asarray(ref, np.float64)
    scale = max(np.max(np.abs(ref)), 1e-30) if ref.size else 1.0
    return float(np.max(np.abs(y - ref)) / scale) if ref.size else 0.0


def make_problem(seed, T, E, k, H, I, x_dtype=jnp.float32, w_dtype=jnp.float32, routing="topk"):
    """x [T, H], routed (w, ids) [T, k] and Experts with unit-scale outputs.
    routing: "topk" (softmax top-k of random logits), "one" (every slot to
    expert E-1: skewed, repeats within a token), "random" (independent draws)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, H)), x_dtype)
    experts = nbx.Experts(
        gate=jnp.asarray(rng.standard_normal((E, H, I)) / np.sqrt(H), w_dtype),
        up=jnp.asarray(rng.standard_normal((E, H, I)) / np.sqrt(H), w_dtype),
        down=jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), w_dtype),
    )
    if routing == "topk":
        w, ids = nbx.route(jnp.asarray(rng.standard_normal((T, E)), jnp.float32), k)
    elif routing == "one":
        ids = jnp.full((T, k), E - 1, jnp.int32)
        w = jnp.asarray(rng.uniform(0.1, 1.0, (T, k)), jnp.float32)
    else:
        ids = jnp.asarray(rng.integers(0, E, (T, k)), jnp.int32)
        w = jnp.asarray(rng.uniform(0.1, 1.0, (T, k)), jnp.float32)
    return x, w, ids, experts


def as_lists(ex: nbx.Experts) -> nbx.Experts:
    """Per-expert arrays (separate buffers) of stacked experts, layout kept."""
    E = ex.num_experts
    children = [getattr(ex, n) for n in nbx.experts._CHILDREN]
    split = [None if c is None else [jax.tree.map(lambda v, e=e: v[e], c) for e in range(E)]
             for c in children]
    return nbx.Experts.tree_unflatten((ex.layout, ex.fusion), split)
