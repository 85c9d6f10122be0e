"""The "cpu" backend: jax_nbx's CPU handlers (``xla_ffi/cpu/``), forward and
fused backward, every weight format and layout, stacked or per-expert lists
read in place, on XLA's intra-op thread pool.

`forward_call` / `backward_call` are the one place that turns a problem and
its arrays into the handlers' operands and attributes (`jax_nbx.contract`);
the Metal backend's forward takes the same operands and attributes, and the
tests' poisoned twins call the same builders.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import contract, cpu, memory
from ..experts import Experts, WeightLayout
from ..formats import tensor_scales, weight_groups
from ..planning import plan_band_tokens
from .base import Backend, Problem


def split_arrays(arrays, layout: WeightLayout):
    """(weights, biases) of the handlers' operands: the weight groups (2 when
    fused, else 3; one array or E each), then 3 biases when ``layout.bias``."""
    nb = contract.NUM_BIASES if layout.bias else 0
    return arrays[:len(arrays) - nb], arrays[len(arrays) - nb:]


def _num_experts(weights, layout: WeightLayout, lists: bool) -> int:
    groups = 2 if layout.fused else 3
    return len(weights) // groups if lists else int(weights[0].shape[0])


def forward_call(problem: Problem, band_tokens: int, x, w, ids, arrays, target: str = "forward"):
    """``(target name, operands, attributes, result)`` of the CPU forward (or
    of a target with its attributes: "metal_forward", the tests'
    "forward_poisoned") on 2-D inputs.  ``arrays``: `Experts.flat` then
    `Experts.handler_biases`; they reach the handler as the contract's
    buffer groups (weights, then scales, then zeros; biases float32, then
    the quantized matrices' tensor scales, float32 [E] per projection),
    read in place."""
    layout = problem.layout
    weights, biases = split_arrays(arrays, layout)
    scales = ()
    if layout.plain_views:
        groups, E, _, quant, _, _ = weight_groups(weights, problem.lists)
        bufs = [b for g in groups for b in (g if problem.lists else g[:1])]
        scales = tensor_scales(weights, problem.lists)
    else:
        E, quant, bufs = _num_experts(weights, layout, problem.lists), None, list(weights)
    bufs += [b.astype(jnp.float32) for b in biases] + list(scales)
    act = problem.activation
    attrs = contract.attributes(target, dict(
        activation=act.code, act_alpha=act.alpha, act_limit=act.limit, band_tokens=band_tokens,
        max_workers=cpu.planned_workers(), skip_outside=problem.skip_outside, num_experts=E,
        format=contract.FORMAT_CODES[quant[0] if quant else None], stacked=not problem.lists,
        group_size=quant[1] if quant else 0, views=layout.views, intermediate=layout.intermediate,
        fused_gate_up=layout.fused, has_bias=layout.bias, bf16_dot=problem.bf16_dot,
        tensor_scales=bool(scales)))
    name = {"forward": contract.TARGET_FORWARD, "metal_forward": contract.TARGET_METAL_FORWARD,
            "forward_poisoned": contract.TARGET_FORWARD_POISONED}[target]
    return name, [x, w, ids, *bufs], attrs, jax.ShapeDtypeStruct(x.shape, x.dtype)


def backward_call(problem: Problem, band_tokens: int, dy, x, w, ids, arrays, target: str = "backward"):
    """``(target name, operands, attributes, results)`` of the CPU backward:
    results dx, d(topk_weights) (float32), then the float32 gradients of
    ``arrays`` (weights, then biases) in their shapes."""
    layout = problem.layout
    weights, biases = split_arrays(arrays, layout)
    biases = [b.astype(jnp.float32) for b in biases]
    E = _num_experts(weights, layout, problem.lists)
    outs = ([jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, jnp.float32)]
            + [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (*weights, *biases)])
    act = problem.activation
    attrs = contract.attributes(target, dict(
        activation=act.code, act_alpha=act.alpha, act_limit=act.limit, band_tokens=band_tokens,
        max_workers=cpu.planned_workers(), skip_outside=problem.skip_outside, num_experts=E,
        stacked=not problem.lists, views=layout.views, intermediate=layout.intermediate,
        fused_gate_up=layout.fused, has_bias=layout.bias))
    name = {"backward": contract.TARGET_BACKWARD,
            "backward_poisoned": contract.TARGET_BACKWARD_POISONED}[target]
    return name, [dy.astype(x.dtype), x, w, ids, *weights, *biases], attrs, outs


def why_no_bf16_dot(problem: Problem, what: str = "experts") -> str:
    """Why the bfloat16 dot-product kernels cannot run these experts ("" when
    they can), worded to follow "precision='bfloat16' "."""
    if problem.quant is not None or problem.w_dtype != np.dtype(jnp.bfloat16):
        kind = "quantized" if problem.quant is not None else problem.w_dtype.name
        return f"needs dense bfloat16 {what}; these are {kind}"
    if problem.layout_name != "in_out" or problem.fusion == "interleaved":
        return (f"reads {what} stored by rows (layout='in_out', not interleaved); these have "
                f"layout={problem.layout_name!r}, fusion={problem.fusion!r}")
    return ""


class CpuBackend(Backend):
    name = "cpu"

    def why_not(self, problem: Problem) -> str:
        platform = jax.default_backend()
        if platform != "cpu":
            return f"runs under JAX's CPU backend; the default backend is {platform!r}"
        if problem.bf16_dot:
            why = why_no_bf16_dot(problem)
            if why:
                return f"precision='bfloat16' {why}"
        return ""

    device = "cpu"

    def workspace_bytes(self, problem: Problem, tokens: int, call_tokens: int | None = None) -> int:
        return memory.fused_moe_workspace_bytes(tokens, problem.k, problem.E, problem.H, problem.I,
                                                bf16_dot=problem.bf16_dot)

    def plan(self, problem: Problem, T: int) -> int:
        return plan_band_tokens(T, problem.k, problem.E, problem.H, problem.I,
                                problem.max_workspace_bytes, bf16_dot=problem.bf16_dot)

    def forward(self, problem, band_tokens, x, w, ids, experts: Experts):
        name, operands, attrs, out = forward_call(problem, band_tokens, x, w, ids,
                                                  (*experts.flat(), *experts.handler_biases()))
        return jax.ffi.ffi_call(name, out, vmap_method="sequential")(*operands, **attrs)

    def backward(self, problem, dy, x, w, ids, experts: Experts):
        if problem.quant is not None:  # quantized weights are frozen: the reference's dx, dw
            return None
        T = x.shape[0]
        band = plan_band_tokens(T, problem.k, problem.E, problem.H, problem.I,
                                problem.max_workspace_bytes, backward=True)
        arrays = (*experts.flat(), *experts.handler_biases())
        name, operands, attrs, outs = backward_call(problem, band, dy, x, w, ids, arrays)
        dx, dw, *dws = jax.ffi.ffi_call(name, outs, vmap_method="sequential")(*operands, **attrs)
        return dx, dw, [d.astype(a.dtype) for d, a in zip(dws, arrays)]
