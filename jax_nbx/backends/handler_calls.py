"""Building handler calls: the one place that turns a problem and its arrays
into a handler's operands and attributes (`jax_nbx.contract`), for every
backend that calls our handlers -- the CPU forward, backward and prepack, the
Metal forward (the CPU forward's operands and attributes), the CUDA handlers
(`backends.cuda.calls`: the same weight view and LoRA attributes) and the
tests' own twins of the CPU targets.

The weights as handlers see them (`weight_groups`, `tensor_scales`): the
contract's buffer groups of `Experts.flat()` (abi.h "weight formats"), read
in place.  Nothing here belongs to one backend; each backend module imports
this one, never another backend's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import contract, cpu
from ..experts import Experts, WeightLayout
from ..formats import QuantizedWeight, get
from ..formats.minifloat import as_bytes
from ..lora import LoRA, LoRASpec
from ..quantization import quant_format
from .base import Problem

__all__ = ["split_arrays", "lora_attrs", "weights_and_attrs", "forward_call", "prepack_call",
           "backward_call", "weight_groups", "tensor_scales"]


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


def weights_and_attrs(problem: Problem, band_tokens: int, arrays, lora: LoRA | None):
    """The weight operands (groups, float32 biases, tensor scales, then the
    adapters) and the attributes the CPU forward and backward share.  Mapped
    experts (``problem.expert_store``) have no weight groups: the handler
    leases them from their store (abi.h "weight views")."""
    layout = problem.layout
    weights, biases = split_arrays(arrays, layout)
    scales = ()
    if problem.expert_store:
        E, quant, bufs = problem.E, problem.quant, []
        scales = tensor_scales(weights, True) if quant else ()
    elif layout.plain_views:
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
        format=get(quant[0] if quant else "dense").code, stacked=not problem.lists,
        group_size=quant[1] if quant else 0, views=layout.views, intermediate=layout.intermediate,
        fused_gate_up=layout.fused, has_bias=layout.bias, tensor_scales=bool(scales),
        expert_store=problem.expert_store, **lora_attrs(problem.lora if lora is not None else None))


def forward_call(problem: Problem, band_tokens: int, x, w, ids, arrays, target: str = "forward",
                 lora: LoRA | None = None, packed=None, name: str | None = None):
    """``(target name, operands, attributes, result)`` of the CPU forward, or
    of another target with its attributes (``target="metal_forward"``; a
    ``name`` of the caller's own, e.g. the tests' poisoned twin, takes the
    forward's attributes) on 2-D inputs.  ``arrays``: `Experts.flat` then
    `Experts.handler_biases`; they reach the handler as the contract's
    buffer groups (weights, then scales, then zeros; biases float32, then
    the quantized matrices' tensor scales, float32 [E] per projection),
    read in place; then ``lora``'s adapters (`LoRA.handler_arrays`); then
    ``packed``'s two buffers (a `jax_nbx.PackedExperts`: abi.h "prepacked
    weights")."""
    bufs, attrs = weights_and_attrs(problem, band_tokens, arrays, lora)
    if packed is not None:
        bufs += [packed.gate_up, packed.down]
    attrs = contract.attributes(target, dict(attrs, bf16_dot=problem.bf16_dot, int8_dot=problem.int8_dot,
                                             prepacked=packed is not None))
    name = name or {"forward": contract.TARGET_FORWARD, "metal_forward": contract.TARGET_METAL_FORWARD}[target]
    return name, [x, w, ids, *bufs], attrs, jax.ShapeDtypeStruct(x.shape, x.dtype)


def prepack_call(problem: Problem, arrays, words: tuple[int, int]):
    """``(target name, operands, attributes, results)`` of the prepack handler
    (abi.h "prepacked weights") on the experts' ``arrays`` (as `forward_call`'s):
    two uint32 buffers of ``words`` (gate_up, down) words each, header included."""
    bufs, attrs = weights_and_attrs(problem, 0, arrays, None)
    keep = contract.TARGET_ATTRIBUTES["prepack"]
    attrs = contract.attributes("prepack", dict({n: v for n, v in attrs.items() if n in keep},
                                                hidden=problem.H, bf16_dot=problem.bf16_dot))
    outs = tuple(jax.ShapeDtypeStruct((n,), jnp.uint32) for n in words)
    return contract.TARGET_PREPACK, bufs, attrs, outs


def backward_call(problem: Problem, band_tokens: int, dy, x, w, ids, arrays, target: str = "backward",
                  lora: LoRA | None = None, weight_grads: bool = True, name: str | None = None):
    """``(target name, operands, attributes, results)`` of the CPU backward
    (or of a target ``name`` of the caller's own with its attributes):
    results dx, d(topk_weights) (float32), then (``weight_grads``) the
    float32 gradients of ``arrays`` (weights, then biases) in their shapes,
    then those of ``lora``'s adapters (`LoRA.handler_arrays`).  Quantized
    experts take the forward's operands and are frozen (no ``weight_grads``),
    and so are mapped ones."""
    if problem.quant is not None and weight_grads:
        raise ValueError(f"quantized experts ({problem.quant[0]}) are frozen: weight_grads must be False")
    if problem.expert_store and weight_grads:
        raise ValueError("mapped experts (jax_nbx.loaders.map_moe) are frozen: weight_grads must be False")
    bufs, attrs = weights_and_attrs(problem, band_tokens, arrays, lora)
    grads_of = list(arrays) if weight_grads else []
    adapters = lora.handler_arrays() if lora is not None else []
    outs = ([jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, jnp.float32)]
            + [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (*grads_of, *adapters)])
    attrs = contract.attributes(target, dict(attrs, weight_grads=weight_grads))
    name = name or {"backward": contract.TARGET_BACKWARD}[target]
    return name, [dy.astype(x.dtype), x, w, ids, *bufs], attrs, outs


def _tensor_scale(m):
    """A matrix's tensor scale, or None (dense, or none)."""
    return m.tensor_scale if isinstance(m, QuantizedWeight) else None


def _projections(weights, lists: bool) -> list[list]:
    """`Experts.flat()` of plain experts as [gate, up, down], each one stacked
    array or the E per-expert arrays."""
    per = len(weights) // 3 if lists else 1
    return [list(weights[i * per:(i + 1) * per]) for i in range(3)]


def tensor_scales(weights, lists: bool) -> tuple:
    """The CPU handler's "tensor_scales" buffers of `Experts.flat()` of plain
    quantized experts: float32 ``[E]`` per projection (gate, up, down; ones
    where a matrix has none), or () when no matrix has a tensor scale."""
    if all(_tensor_scale(m) is None for m in weights):
        return ()
    projs = _projections(weights, lists)
    def one(m, shape):
        ts = _tensor_scale(m)
        return jnp.ones(shape, jnp.float32) if ts is None else jnp.asarray(ts, jnp.float32).reshape(shape)

    if lists:
        return tuple(jnp.stack([one(m, ()) for m in p]) for p in projs)
    return tuple(one(p[0], (int(p[0].q.shape[0]),)) for p in projs)


def weight_groups(weights, lists: bool):
    """The handlers' view of `Experts.flat()` of plain experts: (groups of
    buffers in the contract's order -- part-major (the format's parts: q,
    then scale, then zero), then projection gate, up, down -- each a list of
    one stacked array or E per-expert arrays; E; I; (format, group_size) or
    None; the weights' or scales' dtype; whether every per-expert stride is
    a multiple of 16 bytes)."""
    projs = _projections(weights, lists)
    per = len(projs[0])
    w0 = projs[0][0]
    quant = quant_format(Experts(*projs))
    if quant:
        # byte parts given in their element dtype (float8_e4m3fn, ...) as uint8, bit for bit
        groups = [[as_bytes(getattr(m, part)) for m in proj]
                  for part in get(quant[0]).parts for proj in projs]
    else:
        groups = projs
    dtype = np.dtype(w0.dtype)  # for a QuantizedWeight: its compute (scales') dtype
    E = per if lists else int(w0.shape[0])
    I = int(w0.shape[-1])
    strides_ok = lists or all(
        (int(np.prod(g[0].shape[1:])) * np.dtype(g[0].dtype).itemsize) % 16 == 0 for g in groups)
    return groups, E, I, quant, dtype, strides_ok
