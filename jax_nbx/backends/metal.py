"""The "metal" backend: the Metal handler (``xla_ffi/metal/moe_metal.cc``,
platform "cpu": JAX's CPU client owns the buffers, the handler dispatches the
expert GEMMs to the active Metal device; `jax_nbx.metal`).  Experts in the
plain layout (gate, up [E, H, I], down [E, I, H], stacked or per-expert lists,
no biases), dense or quantized in every registered format (int8, int4, mxfp4,
fp8, mxfp8, nvfp4: read in place, each weight dequantized in the kernels'
loads, ``xla_ffi/metal/kernels/weights.metal``); LoRA adapters
(``moe_lora.metal``); gradients from the reference's VJP (quantized weights
frozen).  ``implementation=None`` takes it
on macOS on Apple silicon when Metal itself is active
(`jax_nbx.metal.is_default`); the simulated device runs only when named.
"""
from __future__ import annotations

import jax

from .. import _registry, metal
from ..experts import Experts
from .base import Backend, Problem
from .handler_calls import forward_call


class MetalBackend(Backend):
    name = "metal"
    kernels = "metal"
    takes_lora = True  # moe_lora.metal's kernels around the GEMMs; gradients: the reference's VJP

    def why_not(self, problem: Problem) -> str:
        platform = jax.default_backend()
        if platform != "cpu":
            return f"runs under JAX's CPU client; the default backend is {platform!r}"
        if not metal.available():
            return f"no Metal device is active ({metal.unavailable_reason()})"
        if not problem.plain:
            kind = f"{problem.quant[0]} experts" if problem.quant is not None else "experts"
            return (f"takes plain experts (gate, up [E, H, I], down [E, I, H], no biases); these {kind} "
                    f"have {problem.describe_layout()}: use implementation='xla' or the CPU handler")
        if problem.handler_precision:
            return f"precision={problem.handler_precision!r} runs on the CPU handler only"
        if problem.tensor_scales:
            return (f"{problem.quant[0]} experts with a tensor scale run on the CPU handler and the xla "
                    "reference (the Metal kernels have no tensor scale yet)")
        return ""

    def why_not_by_default(self, problem: Problem) -> str:
        if not metal.is_default():
            return "not the default here (macOS on Apple silicon with Metal itself active)"
        return self.why_not(problem)

    def initialise(self) -> str:
        # the kernels' library, compiled by the device once (a library Metal's compiler rejects: the
        # error names the kernel file, xla_ffi/metal/library_source.h LibraryCompileError)
        prepare = getattr(_registry.ffi_module(), "metal_prepare", None)  # (None: a module built before it)
        return prepare() if prepare is not None else ""

    device = "metal"

    def workspace_bytes(self, problem: Problem, tokens: int, call_tokens: int | None = None) -> int:
        p = problem
        ranks = p.lora.ranks if p.lora is not None else (0, 0, 0)
        return int(_registry.ffi_module().metal_forward_workspace_bytes(tokens, p.k, p.E, p.H, p.I, *ranks))

    def forward(self, problem, band_tokens, x, w, ids, experts: Experts, lora=None):
        name, operands, attrs, out = forward_call(problem, band_tokens, x, w, ids, experts.flat(),
                                                  target="metal_forward", lora=lora)
        return jax.ffi.ffi_call(name, out, vmap_method="sequential")(*operands, **attrs)
