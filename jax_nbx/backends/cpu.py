"""The "cpu" backend: jax_nbx's CPU handlers (``xla_ffi/cpu/``), forward and
fused backward, every weight format and layout, stacked or per-expert lists
read in place, on XLA's intra-op thread pool; LoRA adapters over every
format (abi.h "LoRA adapters"); quantized experts frozen in the backward.

The handlers' operands and attributes are built by `handler_calls`, which
every backend shares; this module is the CPU backend alone.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from .. import contract, memory
from .._moved import moved_attributes
from ..expert_store import ExpertStore
from ..experts import Experts
from ..lora import LoRA
from ..planning import plan_band_tokens
from .base import Backend, Problem
from .handler_calls import backward_call, forward_call


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


def _in_passes(problem: Problem, ids, run_pass, zeros):
    """A call on mapped experts whose store reads in passes (``stream_bytes``,
    `ExpertStore.fetch_pass`): a loop over the passes, each pass's handler
    call on its own experts' slots (every other id skipped), the results
    (``run_pass(problem, ids)``: a tuple) summed in float32 over
    ``zeros``.  One pass gives the one call's bits (0 + y is exact)."""
    store = ExpertStore.get(problem.expert_store)
    E = problem.E
    each = problem.replace(skip_outside=True)
    shapes = (jax.ShapeDtypeStruct((E,), jnp.bool_), jax.ShapeDtypeStruct((), jnp.bool_))
    fetch = functools.partial(store.fetch_pass, skip_outside=problem.skip_outside)
    valid = (ids >= 0) & (ids < E)

    def body(carry):
        p, acc, _ = carry
        mask, more = io_callback(fetch, shapes, p, ids, ordered=False)
        mine = jnp.where(valid & mask[jnp.clip(ids, 0, E - 1)], ids, -1)
        out = run_pass(each, mine)
        return p + 1, tuple(a + o.astype(jnp.float32) for a, o in zip(acc, out)), more

    _, acc, _ = jax.lax.while_loop(lambda c: c[2], body, (jnp.int32(0), zeros, jnp.bool_(True)))
    return acc


def _passes(problem: Problem) -> bool:
    return bool(problem.expert_store) and ExpertStore.get(problem.expert_store).pass_experts is not None


class CpuBackend(Backend):
    name = "cpu"
    kernels = "cpu"
    takes_lora = True
    takes_prepacked = True
    takes_mapped = True

    def why_not(self, problem: Problem) -> str:
        platform = jax.default_backend()
        if platform != "cpu":
            return f"runs under JAX's CPU backend; the default backend is {platform!r}"
        prec = problem.handler_precision
        if prec is not None:
            if problem.lora is not None and prec == "int8":
                return f"LoRA adapters (lora=) run in float32 or bfloat16 arithmetic, not precision={prec!r}"
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
        arrays = (*experts.flat(), *experts.handler_biases())
        passes = _passes(problem)

        def call(problem, ids):
            name, operands, attrs, out = forward_call(problem, band_tokens, x, w, ids, arrays, lora=lora,
                                                      packed=packed)
            return jax.ffi.ffi_call(name, out, vmap_method="sequential")(*operands, **attrs)

        if passes:
            (y,) = _in_passes(problem, ids, lambda p, i: (call(p, i),),
                              (jnp.zeros(x.shape, jnp.float32),))
            return y.astype(x.dtype)
        return call(problem, ids)

    def backward(self, problem, dy, x, w, ids, experts: Experts, lora: LoRA | None = None,
                 weight_grads: bool = True):
        # quantized and mapped experts are frozen
        weight_grads = weight_grads and problem.quant is None and not problem.expert_store
        T = x.shape[0]
        band = plan_band_tokens(T, problem.k, problem.E, problem.H, problem.I,
                                problem.max_workspace_bytes, backward=True,
                                lora_rank=_lora_rank(problem))
        arrays = (*experts.flat(), *experts.handler_biases())
        passes = _passes(problem)

        def call(problem, ids):
            name, operands, attrs, outs = backward_call(problem, band, dy, x, w, ids, arrays, lora=lora,
                                                        weight_grads=weight_grads)
            return tuple(jax.ffi.ffi_call(name, outs, vmap_method="sequential")(*operands, **attrs))

        if passes:  # (mapped experts: no weight gradients)
            outs = backward_call(problem, band, dy, x, w, ids, arrays, lora=lora, weight_grads=False)[3]
            sums = _in_passes(problem, ids, call, tuple(jnp.zeros(o.shape, jnp.float32) for o in outs))
            dx, dw, *rest = (s.astype(o.dtype) for s, o in zip(sums, outs))
        else:
            dx, dw, *rest = call(problem, ids)
        n = len(arrays) if weight_grads else 0
        dws = [d.astype(a.dtype) for d, a in zip(rest[:n], arrays)] if weight_grads else None
        return dx, dw, dws, (lora.from_handler_grads(rest[n:]) if lora is not None else None)


# The call builders every backend shares moved to `handler_calls` (the CPU
# backend's own file held them): importable from here still, with a warning.
__getattr__ = moved_attributes(__name__, dict.fromkeys(("split_arrays", "lora_attrs", "prepack_call"),
                                                      "jax_nbx.backends.handler_calls"))
