"""The "xla" backend: the pure-JAX reference (`jax_nbx.reference`), on every
platform, differentiated and batched by JAX itself.

With ``ids_outside="error"`` the ids pass through a host check first
(`checked_ids`: an ``io_callback`` whose result the reference then uses, so
it runs before the op, eagerly and under ``jax.jit``/``vmap``/``grad``): an
id outside ``[0, E)`` fails the call naming its position and value, as the
handlers do.  ``"skip"`` leaves the check out (such slots contribute nothing).
"""
from __future__ import annotations

import jax
import numpy as np
from jax.experimental import io_callback

from ..experts import Experts
from ..lora import LoRA
from ..reference import moe_reference
from .base import Backend, Problem


def _first_bad(ids: np.ndarray, E: int) -> str:
    """The handlers' message for the first id outside [0, E) of ``ids [..., T, k]``, or ""."""
    bad = np.argwhere((ids < 0) | (ids >= E))
    if bad.size == 0:
        return ""
    t, j = (int(v) for v in bad[0][-2:])
    return f"topk_ids[{t}, {j}] = {int(ids[tuple(bad[0])])} is outside [0, {E})"


def checked_ids(ids: jax.Array, E: int) -> jax.Array:
    """``ids`` [T, k] (int32) after a host check that raises ValueError naming
    the first id outside ``[0, E)``; under jit the call fails with a
    ``JaxRuntimeError`` carrying that text."""
    def check(a):
        a = np.asarray(a)
        why = _first_bad(a, E)
        if why:
            raise ValueError(why)
        return a

    return io_callback(check, jax.ShapeDtypeStruct(ids.shape, ids.dtype), ids)


class XlaBackend(Backend):
    name = "xla"
    traced_by_jax = True
    takes_lora = True

    def why_not(self, problem: Problem) -> str:
        if problem.handler_precision:
            return f"precision={problem.handler_precision!r} runs on the CPU handler only"
        return ""

    def forward(self, problem: Problem, band_tokens: int, x, w, ids, experts: Experts,
                lora: LoRA | None = None) -> jax.Array:
        if not problem.skip_outside:
            ids = checked_ids(ids, problem.E)
        if problem.quant is not None:  # quantized weights are frozen, as on every backend
            experts = jax.tree.map(jax.lax.stop_gradient, experts)
        return moe_reference(x, w, ids, experts, problem.activation, lora)
