"""The pure-JAX reference ("xla" implementation).

Correct on every platform and differentiable by JAX itself.  It never runs
the dense all-experts einsum: token slots are ordered by expert, each expert's
group is padded to a block of B rows, and a loop over blocks runs one
expert's matmuls per block (blocks past the last used one are skipped), then
results are scatter-added back to their tokens.  Work is at most
(T*k + E*B) rows of one expert instead of T*E.  JAX's VJP of it recomputes
each block (`jax.checkpoint`): without, every block's slices of its expert's
weights were kept as residuals (3.7 GB for OLMoE's layer at T=512, against
0.26 GB; benchmarks/training.py --lora).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .activations import ACTIVATIONS, Activation, as_activation
from .experts import Experts
from .lora import LoRA

__all__ = ["moe_reference", "ACTIVATIONS"]


def block_rows(slots: int, num_experts: int) -> int:
    """Rows per block: the power of two near the mean group size, in [8, 128]."""
    mean = max(1, -(-slots // num_experts))
    return int(min(128, max(8, 1 << (mean - 1).bit_length())))


def moe_reference(x: jax.Array, topk_weights: jax.Array, topk_ids: jax.Array,
                  experts: Experts, activation: str | Activation = "swiglu",
                  lora: LoRA | None = None) -> jax.Array:
    """MoE forward on 2-D inputs: x ``[T, H]``, weights/ids ``[T, k]``;
    experts in any layout, with or without biases (`Experts`); ``lora``:
    adapters on the projections (`jax_nbx.LoRA`, validated by the caller),
    ``x @ W + s * (x @ A) @ B`` before the biases.

    Accumulates in float32 and returns ``x.dtype``.  Slots whose id lies
    outside ``[0, E)`` contribute nothing (this path cannot raise at run time;
    the FFI path reports them).
    """
    glu = as_activation(activation)
    # stacked, transposed, de-interleaved copies in the plain layout (this is
    # the reference; the handlers read every layout in place), biases float32
    experts, biases = experts.canonical()
    from .quantization import dequantize, is_quantized

    if is_quantized(experts):
        experts = dequantize(experts, jnp.float32)
    T, H = x.shape
    k = topk_ids.shape[1]
    E, _, I = experts.gate.shape
    S = T * k
    if S == 0:
        return jnp.zeros((T, H), x.dtype)
    B = block_rows(S, E)
    n_blocks = -(-S // B) + E          # sum_e ceil(n_e / B) never exceeds this
    P = n_blocks * B

    flat_ids = topk_ids.reshape(S).astype(jnp.int32)
    valid = (flat_ids >= 0) & (flat_ids < E)
    eid = jnp.where(valid, flat_ids, E)                 # bucket E = dropped
    order = jnp.argsort(eid, stable=True)               # slots ordered by expert
    sorted_e = eid[order]
    counts = jnp.bincount(eid, length=E + 1)[:E]
    padded = (counts + B - 1) // B * B
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    start = jnp.cumsum(counts) - counts
    e_c = jnp.minimum(sorted_e, E - 1)
    dest = jnp.where(sorted_e < E, padded_start[e_c] + jnp.arange(S) - start[e_c], P)
    slot_at = jnp.full((P,), S, jnp.int32).at[dest].set(order.astype(jnp.int32), mode="drop")

    token_at = jnp.where(slot_at < S, slot_at // k, T)   # T = a zero row
    x_rows = jnp.concatenate([x, jnp.zeros((1, H), x.dtype)])[token_at]
    w_rows = jnp.concatenate([topk_weights.reshape(S).astype(jnp.float32),
                              jnp.zeros((1,), jnp.float32)])[slot_at]
    block_start = jnp.arange(n_blocks) * B
    block_expert = jnp.minimum(jnp.searchsorted(padded_end, block_start, side="right"), E - 1)
    used = block_start < padded_end[-1]

    hi = jax.lax.Precision.HIGHEST
    adapters = None if lora is None else lora.stacked()

    def project(v, name, e):  # v @ W_e (+ s * (v @ A_e) @ B_e), float32
        out = jnp.dot(v, getattr(experts, name)[e].astype(jnp.float32), precision=hi)
        pair = None if adapters is None else adapters.pair(name)
        if pair is not None:
            va = jnp.dot(v, pair[0][e].astype(jnp.float32), precision=hi)
            out = out + adapters.scale(name) * jnp.dot(va, pair[1][e].astype(jnp.float32), precision=hi)
        return out

    # the backward recomputes a block (its weights are not saved per block);
    # prevent_cse=False: inside lax.map, as JAX's docs advise for scan
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def run_block(args):
        xb, wb, e, use = args

        def compute(_):
            xf = xb.astype(jnp.float32)
            g = project(xf, "gate", e)
            u = project(xf, "up", e)
            if biases:
                g, u = g + biases[0][e][None, :], u + biases[1][e][None, :]
            o = project(glu(g, u), "down", e)
            if biases:
                o = o + biases[2][e][None, :]
            return o * wb[:, None]

        return jax.lax.cond(use, compute, lambda _: jnp.zeros((B, H), jnp.float32), None)

    out = jax.lax.map(run_block, (x_rows.reshape(n_blocks, B, H), w_rows.reshape(n_blocks, B),
                                  block_expert, used))
    y = jnp.zeros((T + 1, H), jnp.float32).at[token_at].add(out.reshape(P, H))
    return y[:T].astype(x.dtype)
