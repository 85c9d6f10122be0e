"""The MoE baselines a model can run instead of the fused op: every expert on
every token (a dense einsum: E/k times the work) and `jax.lax.ragged_dot`
(slots sorted by expert), both on the same `MoEParams` and routing."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..experts import Experts
from ..nn.block import MoEConfig, MoEParams
from ..routing import route

__all__ = ["moe_dense", "moe_ragged_dot", "BASELINES"]


def _route_params(params: MoEParams, x2, config: MoEConfig):
    logits = jnp.einsum("th,eh->te", x2.astype(jnp.float32), params.router.astype(jnp.float32))
    return route(logits, config.top_k, normalize=config.norm_topk_prob)


def moe_dense(params: MoEParams, x, config: MoEConfig):
    """Every expert on every token, weighted by a dense ``[T, E]`` combine
    matrix (zero outside the top-k); stacked ``in_out`` experts."""
    lead, H = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, H)
    w, ids = _route_params(params, x2, config)
    T, E = x2.shape[0], config.num_experts
    comb = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], ids].add(w)
    ex = params.experts
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    xf = f32(x2)
    g = jnp.einsum("th,ehi->tei", xf, f32(ex.gate))
    u = jnp.einsum("th,ehi->tei", xf, f32(ex.up))
    h = jax.nn.silu(g) * u * comb[:, :, None]
    y = jnp.einsum("tei,eih->th", h, f32(ex.down))
    return y.astype(x.dtype).reshape(lead + (H,))


def moe_ragged_dot(params: MoEParams, x, config: MoEConfig):
    """Slots sorted by expert, three `jax.lax.ragged_dot` (benchmarks/cpu.py's
    baseline); stacked ``in_out`` experts."""
    lead, H = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, H)
    w, ids = _route_params(params, x2, config)
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x2[order // k].astype(jnp.float32)
    sizes = jnp.bincount(flat, length=config.num_experts).astype(jnp.int32)
    ex = params.experts
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    g = jax.lax.ragged_dot(xs, f32(ex.gate), sizes)
    u = jax.lax.ragged_dot(xs, f32(ex.up), sizes)
    o = jax.lax.ragged_dot(jax.nn.silu(g) * u, f32(ex.down), sizes)
    o = o * w.reshape(-1)[order][:, None]
    y = jnp.zeros((T, H), jnp.float32).at[order // k].add(o)
    return y.astype(x.dtype).reshape(lead + (H,))


BASELINES = {"dense": moe_dense, "ragged_dot": moe_ragged_dot}


def _stacked_in_out(experts: Experts) -> Experts:
    """The experts as stacked ``[E, H, I]``/``[E, I, H]`` arrays (a copy)."""
    st = experts.stacked() if experts.is_list else experts
    if st.layout == "in_out":
        return st
    t = lambda a: jnp.swapaxes(a, -1, -2)  # noqa: E731
    return Experts(t(st.gate), t(st.up), t(st.down), layout="in_out")
