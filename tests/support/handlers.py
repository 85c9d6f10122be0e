"""The CPU handlers called directly, for tests: the raw forward and backward
(no batching rule, no derivative, bands given), optionally through the
test-only poisoned twins (one NaN-filled input per result, aliased to it, so
an element the handler leaves unwritten shows).  Operands and attributes come
from the product's builders (`jax_nbx.backends.handler_calls.forward_call` /
`backward_call`), so these call exactly what `fused_moe` calls."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_nbx import activations, backends
from jax_nbx.backends import handler_calls
from jax_nbx.experts import WeightLayout
from jax_nbx.lora import validate_lora

from . import ffi_testing


def _problem(x, ids, arrays, activation, lists, layout, skip_outside, bf16_dot,
             int8_dot=False) -> backends.Problem:
    """A `Problem` for the raw arrays (`Experts.flat` [+ biases])."""
    if layout is None:  # the plain layout, read off the arrays
        g = arrays[0]
        d = arrays[2 * (len(arrays) // 3) if lists else 2]
        layout = WeightLayout.plain(H=int(d.shape[-1]), I=int(g.shape[-1]))
    weights, _ = handler_calls.split_arrays(arrays, layout)
    groups = 2 if layout.fused else 3
    per = len(weights) // groups if lists else 1
    E = per if lists else int(weights[0].shape[0])
    quant = (handler_calls.weight_groups(weights, lists)[3] if layout.native else None)
    first = weights[0]
    return backends.Problem(E=E, H=int(x.shape[1]), I=int(layout.intermediate), k=int(ids.shape[1]),
                            x_dtype=jnp.dtype(x.dtype), w_dtype=jnp.dtype(first.dtype), quant=quant,
                            lists=lists, layout=layout, layout_name="in_out", fusion=None,
                            activation=activations.as_activation(activation), skip_outside=skip_outside,
                            bf16_dot=bf16_dot, int8_dot=int8_dot)


def poisoned_call(target: str, outs, operands, attrs):
    """``target`` with one NaN-filled input per result after the operands,
    aliased to that result."""
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    twins = [jnp.full(o.shape, jnp.nan, o.dtype) for o in outs]
    call = jax.ffi.ffi_call(target, list(outs), vmap_method="sequential",
                            input_output_aliases={len(operands) + i: i for i in range(len(outs))})
    return call(*operands, *twins, **attrs)


def _with_lora(p, lora):
    return p if lora is None else p.replace(lora=validate_lora(lora, p.E, p.H, p.I))


def ffi_forward(x, w, ids, *arrays, activation="swiglu", band_tokens: int = 0, poison: bool = False,
                lists: bool = False, skip_outside: bool = False, layout: WeightLayout | None = None,
                bf16_dot: bool = False, lora=None, int8_dot: bool = False, packed=None):
    """The CPU forward on 2-D inputs; ``arrays`` = `Experts.flat` (then
    `Experts.handler_biases` when ``layout.bias``); ``poison``: the twin;
    ``lora``: a `jax_nbx.LoRA` on the experts; ``packed``: their
    `jax_nbx.PackedExperts`."""
    p = _with_lora(_problem(x, ids, arrays, activation, lists, layout, skip_outside, bf16_dot, int8_dot),
                   lora)
    name, operands, attrs, out = handler_calls.forward_call(
        p, band_tokens, x, w, ids, arrays, lora=lora, packed=packed,
        name=ffi_testing.load().target_forward_poisoned if poison else None)
    if poison:
        (y,) = poisoned_call(name, [out], operands, attrs)
        return y
    return jax.ffi.ffi_call(name, out, vmap_method="sequential")(*operands, **attrs)


def ffi_backward(dy, x, w, ids, *arrays, activation="swiglu", band_tokens: int = 0, lists: bool = False,
                 skip_outside: bool = False, poison: bool = False, layout: WeightLayout | None = None,
                 lora=None, weight_grads: bool = True):
    """The CPU backward on 2-D inputs: ``(dx, dw, dweights)`` with
    ``dweights`` in ``arrays``' order, cast to their dtypes (``[]`` without
    ``weight_grads``); with ``lora``, then the adapters' float32 gradients
    (`LoRA.handler_arrays` order)."""
    p = _with_lora(_problem(x, ids, arrays, activation, lists, layout, skip_outside, False), lora)
    name, operands, attrs, outs = handler_calls.backward_call(
        p, band_tokens, dy, x, w, ids, arrays, lora=lora, weight_grads=weight_grads,
        name=ffi_testing.load().target_backward_poisoned if poison else None)
    if poison:
        dx, dw, *dws = poisoned_call(name, outs, operands, attrs)
    else:
        dx, dw, *dws = jax.ffi.ffi_call(name, outs, vmap_method="sequential")(*operands, **attrs)
    n = len(arrays) if weight_grads else 0
    out = dx, dw, [d.astype(a.dtype) for d, a in zip(dws[:n], arrays)]
    return out if lora is None else (*out, dws[n:])
