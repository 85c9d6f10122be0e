"""The op's transformations: a backend's raw forward wrapped with a batching
rule (`custom_vmap`) and a derivative (`custom_vjp`).

`op(backend, problem, band_tokens)` is cached per static key.  Batching:
experts shared across the batch fold the batch into the token axis; experts
that differ per element run one call per element.  Derivative: the
backend's fused backward where it has one for the problem (CPU; CUDA, dense
experts), else the reference's VJP (quantized experts are frozen: dx and
d(topk_weights) only).  The experts' gradients are computed only where the
experts are differentiated (`jax.custom_vjp`'s symbolic zeros: frozen
experts under LoRA skip them).  Gradients never flow to topk_ids.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero, custom_vjp_primal_tree_values

from .backends import Backend, Problem
from .experts import _CHILDREN as _EXPERT_CHILDREN
from .experts import Experts
from .reference import moe_reference
from .validation import check_slots

__all__ = ["op"]


def _weight_grads(experts: Experts, dws) -> Experts:
    """The handlers' weight gradients (`Experts.flat` order) as an `Experts`
    pytree like ``experts`` (bias leaves None)."""
    per = experts.num_experts if experts.is_list else 1
    names = experts.weight_names()
    children = {n: (list(dws[i * per:(i + 1) * per]) if experts.is_list else dws[i])
                for i, n in enumerate(names)}
    return Experts.tree_unflatten((experts.layout, experts.fusion),
                                  [children.get(n) for n in _EXPERT_CHILDREN])


def _bias_grads(experts: Experts, dbiases) -> Experts | None:
    """The handlers' float32 bias gradients mapped back through
    `Experts.handler_biases` onto ``experts``' own bias leaves (fused, lists,
    dtypes); weight leaves None."""
    bias_names = [n for n in _EXPERT_CHILDREN if n.endswith("_bias")]
    leaves = {n: getattr(experts, n) for n in bias_names}

    def biases(b):
        e = Experts.tree_unflatten((experts.layout, experts.fusion),
                                   [b.get(n) if n in b else getattr(experts, n) for n in _EXPERT_CHILDREN])
        return e.handler_biases()

    present = {n: v for n, v in leaves.items() if v is not None}
    _, vjp = jax.vjp(biases, present)
    (d,) = vjp(tuple(dbiases))
    return Experts.tree_unflatten((experts.layout, experts.fusion), [d.get(n) for n in _EXPERT_CHILDREN])


def _regroup(experts: Experts, dws) -> Experts:
    """The handlers' gradients (`Experts.flat` then `Experts.handler_biases`
    order) as an `Experts` pytree like ``experts``."""
    n = len(experts.flat())
    dexperts = _weight_grads(experts, dws[:n])
    if experts.has_bias:
        dbias = _bias_grads(experts, dws[n:])
        dexperts = Experts.tree_unflatten(
            (experts.layout, experts.fusion),
            [getattr(dexperts, c) if getattr(dexperts, c) is not None else getattr(dbias, c)
             for c in _EXPERT_CHILDREN])
    return dexperts


def _perturbed(tree) -> bool:
    """Whether any leaf of a symbolic-zeros forward rule's argument is
    differentiated (`jax.custom_vjp` with ``symbolic_zeros=True``)."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda a: isinstance(a, CustomVJPPrimal))
    return any(a.perturbed for a in leaves)


@functools.cache
def op(backend: Backend, problem: Problem, band_tokens: int):
    """The raw forward of ``backend`` on 2-D inputs ``(x, w, ids, experts,
    lora, packed)`` (``lora`` None or a `jax_nbx.LoRA`, only where the backend
    `takes_lora`; ``packed`` None or the `jax_nbx.PackedExperts` of
    ``experts``, only where it `takes_prepacked`: the forward reads it, the
    derivative the experts) with a batching rule and a derivative."""

    @custom_vmap
    def forward(x, w, ids, experts, lora, packed):
        check_slots(*ids.shape)  # (a vmapped batch folds into the tokens: checked again here)
        extra = {} if lora is None else {"lora": lora}
        if packed is not None:
            extra["packed"] = packed
        return backend.forward(problem, band_tokens, x, w, ids, experts, **extra)

    @forward.def_vmap
    def _batch(axis_size, in_batched, x, w, ids, experts, lora, packed):
        args = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
                for a, b in zip((x, w, ids), in_batched[:3])]
        if not any(jax.tree.leaves(in_batched[3:])):
            # Experts (and adapters) shared across the batch: the batch is just more tokens.
            xb, wb, ib = args
            B, T, H = xb.shape
            k = wb.shape[-1]  # (not -1: an empty batch has nothing to infer it from)
            y = forward(xb.reshape(B * T, H), wb.reshape(B * T, k), ib.reshape(B * T, k), experts, lora,
                        packed)
            return y.reshape(B, T, H), True
        # Experts or adapters differ per batch element: one call per element.
        ex, lo, pk = jax.tree.map(lambda a, b: a if b else jnp.broadcast_to(a, (axis_size,) + a.shape),
                                  (experts, lora, packed), tuple(in_batched[3:]))
        return jax.lax.map(lambda a: forward(*a), (*args, ex, lo, pk)), True

    @jax.custom_vjp
    def run(x, w, ids, experts, lora, packed):
        return forward(x, w, ids, experts, lora, packed)

    def run_fwd(x, w, ids, experts, lora, packed):
        # The experts' gradients are computed only when they are differentiated
        # (frozen experts under LoRA, or x-only gradients, skip the dW GEMMs):
        # the residuals' structure carries that, () or None.
        train = () if _perturbed(experts) else None
        x, w, ids, experts, lora, packed = custom_vjp_primal_tree_values((x, w, ids, experts, lora, packed))
        return forward(x, w, ids, experts, lora, packed), (x, w, ids, experts, lora, train)

    def run_bwd(res, g):
        x, w, ids, experts, lora, train = res
        train = train is not None
        if isinstance(g, SymbolicZero):
            g = jnp.zeros(x.shape, x.dtype)
        fused = backend.backward(problem, g, x, w, ids, experts, lora=lora, weight_grads=train)
        if fused is not None:
            dx, dw, dws, dlora = fused
            return dx, dw, None, (_regroup(experts, dws) if train and dws is not None else None), dlora, None
        ref = functools.partial(moe_reference, activation=problem.activation)
        if problem.quant is not None or not train:  # quantized weights are frozen
            _, vjp = jax.vjp(lambda x_, w_, l_: ref(x_, w_, ids, experts, lora=l_), x, w, lora)
            dx, dw, dlora = vjp(g)
            return dx, dw, None, None, dlora, None
        _, vjp = jax.vjp(lambda x_, w_, e_, l_: ref(x_, w_, ids, e_, lora=l_), x, w, experts, lora)
        dx, dw, dexperts, dlora = vjp(g)
        return dx, dw, None, dexperts, dlora, None

    run.defvjp(run_fwd, run_bwd, symbolic_zeros=True)
    return run
