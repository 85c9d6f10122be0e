"""The "cuda" backend: jax_nbx's CUDA handlers (``xla_ffi/cuda/``) running a
launch program of Triton kernels on XLA's stream.

`calls` plans, compiles and calls the handlers (importing Triton only when a
call is traced); `plan` builds the launch program (kernels, grids, arguments,
workspace; no Triton import); `kernels` holds the Triton kernels; `compile`
makes cubins for the device.  The kernels also run on the CPU under Triton's
interpreter (the tests' `tests/support/triton_interpret.py`).
"""
from __future__ import annotations

import jax

from ... import _registry
from ...experts import Experts
from ..base import Backend, Problem
from . import plan


class CudaBackend(Backend):
    name = "cuda"
    kernels = "cuda"
    takes_lora = True  # the forward fuses the adapters; their gradients: the reference's VJP

    def why_not(self, problem: Problem) -> str:
        platform = jax.default_backend()
        if platform != "gpu" or not _registry.platform_is_cuda():
            return f"runs on a CUDA GPU; the default backend is {platform!r}"
        why = _registry.cuda_unavailable_reason()
        if why:
            return why
        if problem.int8_dot:
            return "precision='int8' runs on the CPU handler only"
        return plan.kernels_refusal(problem.quant, problem.layout.plain_views, problem.bf16_dot,
                                    problem.tensor_scales, problem.lora)

    device = "cuda"

    def workspace_bytes(self, problem: Problem, tokens: int, call_tokens: int | None = None) -> int:
        from . import calls

        return calls.band_workspace_bytes(tokens, problem.k, problem.E, problem.H, problem.I, problem.w_dtype,
                                          problem.quant, call_tokens)

    def plan(self, problem: Problem, T: int) -> int:
        from . import calls

        return calls.plan_band_tokens(T, problem.k, problem.E, problem.H, problem.I, problem.w_dtype,
                                      problem.max_workspace_bytes, problem.quant)

    def forward(self, problem, band_tokens, x, w, ids, experts: Experts, lora=None):
        from . import calls

        return calls.forward(x, w, ids, *experts.flat(), *experts.handler_biases(),
                             activation=problem.activation, band_tokens=band_tokens, lists=problem.lists,
                             skip_outside=problem.skip_outside, layout=problem.layout, lora=lora,
                             lora_spec=problem.lora)

    def backward(self, problem, dy, x, w, ids, experts: Experts, lora=None, weight_grads: bool = True):
        if problem.quant is not None or lora is not None:  # the reference's VJP (frozen base: dx, dw)
            return None
        from . import calls

        band = calls.plan_backward_band_tokens(x.shape[0], problem.k, problem.E, problem.H, problem.I,
                                               problem.w_dtype, problem.max_workspace_bytes)
        # (no adapters here; the experts' gradients always come)
        dx, dw, dws = calls.backward(dy, x, w, ids, *experts.flat(), *experts.handler_biases(),
                                     activation=problem.activation, band_tokens=band, lists=problem.lists,
                                     skip_outside=problem.skip_outside, layout=problem.layout)
        return dx, dw, dws, None
