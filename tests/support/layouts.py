"""Experts in every checkpoint layout built with numpy from canonical
``G, U [E, H, I]``, ``D [E, I, H]`` (transpose, concatenate, interleave:
`stored`), and the float64 block on the canonical weights (`np_block`,
forward and gradients, biases as transformers' ``modeling_gpt_oss.py``
``GptOssExperts`` adds them).  The float64 side never sees jax_nbx's views."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import jax_nbx as nbx

from .problems import f64, np_glu

# name -> (fusion, layout)
LAYOUTS = {
    "plain": (None, "in_out"),
    "out_in": (None, "out_in"),
    "concat": ("concat", "in_out"),
    "interleaved": ("interleaved", "in_out"),
    "concat_out_in": ("concat", "out_in"),
    "interleaved_out_in": ("interleaved", "out_in"),
}


def canonical(rng, E, H, I, bias):
    """float32 G, U [E, H, I], D [E, I, H] and biases (None when bias is falsy)."""
    r = lambda *s, sc=1.0: (rng.standard_normal(s) * sc).astype(np.float32)  # noqa: E731
    G, U, D = r(E, H, I, sc=H ** -0.5), r(E, H, I, sc=H ** -0.5), r(E, I, H, sc=I ** -0.5)
    B = (r(E, I, sc=0.5), r(E, I, sc=0.5), r(E, H, sc=0.5)) if bias else (None, None, None)
    return (G, U, D) + B


def stored(name, G, U, D, bg=None, bu=None, bd=None, lists=False, dtype=jnp.float32):
    """An `Experts` holding (G, U, D, biases) in layout `name`, built with numpy."""
    fusion, layout = LAYOUTS[name]
    E, H, I = G.shape
    t = (lambda a: np.swapaxes(a, -1, -2)) if layout == "out_in" else (lambda a: a)

    def arr(a):
        a = np.ascontiguousarray(a)
        return [jnp.asarray(v, dtype) for v in a] if lists else jnp.asarray(a, dtype)

    def bias(b):
        if b is None:
            return None
        return [jnp.asarray(v) for v in b] if lists else jnp.asarray(b)

    if fusion is None:
        return nbx.Experts(arr(t(G)), arr(t(U)), arr(t(D)), gate_bias=bias(bg), up_bias=bias(bu),
                           down_bias=bias(bd), layout=layout)
    if fusion == "concat":
        gu = np.concatenate([G, U], -1)
        bgu = None if bg is None else np.concatenate([bg, bu], -1)
    else:
        gu = np.stack([G, U], -1).reshape(E, H, 2 * I)
        bgu = None if bg is None else np.stack([bg, bu], -1).reshape(E, 2 * I)
    return nbx.Experts.fused(arr(t(gu)), arr(t(D)), fusion=fusion, layout=layout,
                             gate_up_bias=bias(bgu), down_bias=bias(bd))


def np_block(x, w, ids, G, U, D, bg=None, bu=None, bd=None, act="swiglu", ct=None):
    """float64 y (and with ``ct`` the gradients of sum(y * ct): dx, dw, dG,
    dU, dD, dbg, dbu, dbd) of the biased MoE block on canonical weights."""
    x, w, ids = f64(x), f64(w), np.asarray(ids)
    G, U, D = (np.asarray(a, np.float64) for a in (G, U, D))
    E, H, I = G.shape
    z = lambda b, n: np.zeros((E, n)) if b is None else np.asarray(b, np.float64)  # noqa: E731
    bg, bu, bd = z(bg, I), z(bu, I), z(bd, H)
    y = np.zeros_like(x)
    grads = [np.zeros_like(x), np.zeros_like(w), np.zeros_like(G), np.zeros_like(U), np.zeros_like(D),
             np.zeros_like(bg), np.zeros_like(bu), np.zeros_like(bd)]
    for e in range(E):
        t_idx, j_idx = np.nonzero(ids == e)
        if t_idx.size == 0:
            continue
        a, wt = x[t_idx], w[t_idx, j_idx][:, None]
        g, u = a @ G[e] + bg[e], a @ U[e] + bu[e]
        h, dh_dg, dh_du = np_glu(g, u, act)
        o = h @ D[e] + bd[e]
        np.add.at(y, t_idx, wt * o)
        if ct is None:
            continue
        c = f64(ct)[t_idx]
        dx, dw, dG, dU, dD, dbg, dbu, dbd = grads
        np.add.at(dw, (t_idx, j_idx), np.sum(o * c, axis=1))
        do = wt * c
        dD[e] += h.T @ do
        dbd[e] += do.sum(0)
        dh = do @ D[e].T
        dg, du = dh * dh_dg, dh * dh_du
        dG[e] += a.T @ dg
        dU[e] += a.T @ du
        dbg[e] += dg.sum(0)
        dbu[e] += du.sum(0)
        np.add.at(dx, t_idx, dg @ G[e].T + du @ U[e].T)
    return y if ct is None else (y, grads)


def routing(rng, T, E, k):
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    return jnp.asarray(w), jnp.asarray(ids)
