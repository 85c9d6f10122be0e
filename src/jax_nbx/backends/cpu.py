"""The "cpu" backend: jax_nbx's CPU handlers (``xla_ffi/cpu/``), forward and
fused backward, every weight format and layout, stacked or per-expert lists
read in place, on XLA's intra-op thread pool; LoRA adapters over every
format (abi.h "LoRA adapters"); quantized experts frozen in the backward.

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
from ..lora import LoRA, LoRASpec
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


def lora_attrs(spec: LoRASpec | None) -> dict:
    """The handlers' LoRA attributes (abi.h NBX_ATTRS_LORA) of ``spec``
    (None: no adapters, every rank 0); the CPU and CUDA handlers take them."""
    ranks, scales = (spec.ranks, spec.scales) if spec is not None else ((0, 0, 0), (1.0, 1.0, 1.0))
    return dict(lora_ranks=ranks, lora_scale_gate=scales[0], lora_scale_up=scales[1],
                lora_scale_down=scales[2])


def _weights_and_attrs(problem: Problem, band_tokens: int, arrays, lora: LoRA | None):
    """The weight operands (groups, float32 biases, tensor scales, then the
    adapters) and the attributes the CPU forward and backward share."""
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
    if lora is not None:
        bufs += lora.handler_arrays()
    act = problem.activation
    return bufs, dict(
        activation=act.code, act_alpha=act.alpha, act_limit=act.limit, band_tokens=band_tokens,
        max_workers=cpu.planned_workers(), skip_outside=problem.skip_outside, num_experts=E,
        format=contract.FORMAT_CODES[quant[0] if quant else None], stacked=not problem.lists,
        group_size=quant[1] if quant else 0, views=layout.views, intermediate=layout.intermediate,
        fused_gate_up=layout.fused, has_bias=layout.bias, tensor_scales=bool(scales),
        **lora_attrs(problem.lora if lora is not None else None))


def forward_call(problem: Problem, band_tokens: int, x, w, ids, arrays, target: str = "forward",
                 lora: LoRA | None = None, packed=None):
    """``(target name, operands, attributes, result)`` of the CPU forward (or
    of a target with its attributes: "metal_forward", the tests'
    "forward_poisoned") on 2-D inputs.  ``arrays``: `Experts.flat` then
    `Experts.handler_biases`; they reach the handler as the contract's
    buffer groups (weights, then scales, then zeros; biases float32, then
    the quantized matrices' tensor scales, float32 [E] per projection),
    read in place; then ``lora``'s adapters (`LoRA.handler_arrays`); then
    ``packed``'s two buffers (a `jax_nbx.PackedExperts`: abi.h "prepacked
    weights")."""
    bufs, attrs = _weights_and_attrs(problem, band_tokens, arrays, lora)
    if packed is not None:
        bufs += [packed.gate_up, packed.down]
    attrs = contract.attributes(target, dict(attrs, bf16_dot=problem.bf16_dot, int8_dot=problem.int8_dot,
                                             prepacked=packed is not None))
    name = {"forward": contract.TARGET_FORWARD, "metal_forward": contract.TARGET_METAL_FORWARD,
            "forward_poisoned": contract.TARGET_FORWARD_POISONED}[target]
    return name, [x, w, ids, *bufs], attrs, jax.ShapeDtypeStruct(x.shape, x.dtype)


def prepack_call(problem: Problem, arrays, words: tuple[int, int]):
    """``(target name, operands, attributes, results)`` of the prepack handler
    (abi.h "prepacked weights") on the experts' ``arrays`` (as `forward_call`'s):
    two uint32 buffers of ``words`` (gate_up, down) words each, header included."""
    bufs, attrs = _weights_and_attrs(problem, 0, arrays, None)
    keep = contract.TARGET_ATTRIBUTES["prepack"]
    attrs = contract.attributes("prepack", dict({n: v for n, v in attrs.items() if n in keep},
                                                hidden=problem.H, bf16_dot=problem.bf16_dot))
    outs = tuple(jax.ShapeDtypeStruct((n,), jnp.uint32) for n in words)
    return contract.TARGET_PREPACK, bufs, attrs, outs


def backward_call(problem: Problem, band_tokens: int, dy, x, w, ids, arrays, target: str = "backward",
                  lora: LoRA | None = None, weight_grads: bool = True):
    """``(target name, operands, attributes, results)`` of the CPU backward:
    results dx, d(topk_weights) (float32), then (``weight_grads``) the
    float32 gradients of ``arrays`` (weights, then biases) in their shapes,
    then those of ``lora``'s adapters (`LoRA.handler_arrays`).  Quantized
    experts take the forward's operands and are frozen (no ``weight_grads``)."""
    if problem.quant is not None and weight_grads:
        raise ValueError(f"quantized experts ({problem.quant[0]}) are frozen: weight_grads must be False")
    bufs, attrs = _weights_and_attrs(problem, band_tokens, arrays, lora)
    grads_of = list(arrays) if weight_grads else []
    adapters = lora.handler_arrays() if lora is not None else []
    outs = ([jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, jnp.float32)]
            + [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (*grads_of, *adapters)])
    attrs = contract.attributes(target, dict(attrs, weight_grads=weight_grads))
    name = {"backward": contract.TARGET_BACKWARD,
            "backward_poisoned": contract.TARGET_BACKWARD_POISONED}[target]
    return name, [dy.astype(x.dtype), x, w, ids, *bufs], attrs, outs


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


def why_no_int8_dot(problem: Problem, what: str = "experts") -> str:
    """Why the int8-arithmetic kernels cannot run these experts ("" when they
    can), worded to follow "precision='int8' "."""
    if problem.quant is None or problem.quant[0] not in ("int8", "int4"):
        kind = problem.quant[0] if problem.quant is not None else f"dense {problem.w_dtype.name}"
        return f"takes int8 or int4 {what}; these are {kind}"
    if problem.quant[0] == "int4" and problem.quant[1] % contract.INT8_BLOCK:
        return (f"takes int4 {what} whose group_size is a multiple of {contract.INT8_BLOCK}; "
                f"these have group_size={problem.quant[1]}")
    return ""


def _lora_rank(problem: Problem) -> int:
    return sum(problem.lora.ranks) if problem.lora is not None else 0


class CpuBackend(Backend):
    name = "cpu"
    takes_lora = True
    takes_prepacked = True

    def why_not(self, problem: Problem) -> str:
        platform = jax.default_backend()
        if platform != "cpu":
            return f"runs under JAX's CPU backend; the default backend is {platform!r}"
        prec = problem.handler_precision
        if prec is not None:
            if problem.lora is not None:
                return f"LoRA adapters (lora=) run in float32 arithmetic, not precision={prec!r}"
            why = (why_no_bf16_dot if prec == "bfloat16" else why_no_int8_dot)(problem)
            if why:
                return f"precision={prec!r} {why}"
        return ""

    device = "cpu"

    def workspace_bytes(self, problem: Problem, tokens: int, call_tokens: int | None = None) -> int:
        return memory.fused_moe_workspace_bytes(tokens, problem.k, problem.E, problem.H, problem.I,
                                                bf16_dot=problem.bf16_dot, lora_rank=_lora_rank(problem))

    def plan(self, problem: Problem, T: int) -> int:
        return plan_band_tokens(T, problem.k, problem.E, problem.H, problem.I,
                                problem.max_workspace_bytes, bf16_dot=problem.bf16_dot,
                                lora_rank=_lora_rank(problem))

    def forward(self, problem, band_tokens, x, w, ids, experts: Experts, lora: LoRA | None = None,
                packed=None):
        name, operands, attrs, out = forward_call(problem, band_tokens, x, w, ids,
                                                  (*experts.flat(), *experts.handler_biases()),
                                                  lora=lora, packed=packed)
        return jax.ffi.ffi_call(name, out, vmap_method="sequential")(*operands, **attrs)

    def backward(self, problem, dy, x, w, ids, experts: Experts, lora: LoRA | None = None,
                 weight_grads: bool = True):
        weight_grads = weight_grads and problem.quant is None  # quantized experts are frozen
        T = x.shape[0]
        band = plan_band_tokens(T, problem.k, problem.E, problem.H, problem.I,
                                problem.max_workspace_bytes, backward=True,
                                lora_rank=_lora_rank(problem))
        arrays = (*experts.flat(), *experts.handler_biases())
        name, operands, attrs, outs = backward_call(problem, band, dy, x, w, ids, arrays, lora=lora,
                                                    weight_grads=weight_grads)
        dx, dw, *rest = jax.ffi.ffi_call(name, outs, vmap_method="sequential")(*operands, **attrs)
        n = len(arrays) if weight_grads else 0
        dws = [d.astype(a.dtype) for d, a in zip(rest[:n], arrays)] if weight_grads else None
        return dx, dw, dws, (lora.from_handler_grads(rest[n:]) if lora is not None else None)
