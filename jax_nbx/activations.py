"""The experts' gated unit: ``h = glu(x @ gate, x @ up)``, then ``h @ down``.

Names and constants come from the shared contract (``xla_ffi/abi.h`` through
`jax_nbx.contract`); every implementation (the CPU handler's kernels and fused
backward, the Triton kernels, the Metal kernels, the pure-JAX reference)
computes the same formulas:

==================  ===================================================  ==================
name                glu(g, u)                                            models
==================  ===================================================  ==================
``swiglu``          silu(g) * u                                          Mixtral, Qwen, OLMoE, DeepSeek
``geglu``           gelu_tanh(g) * u                                     (tanh-approximated GELU)
``geglu_erf``       0.5 g (1 + erf(g / sqrt 2)) * u  (exact GELU)        Gemma-style
``swiglu_clamped``  g' sigmoid(alpha g') (u' + 1), g' = min(g, limit),   gpt-oss
                    u' = clip(u, -limit, limit)
==================  ===================================================  ==================

``swiglu_clamped`` follows transformers' ``modeling_gpt_oss.py``
(``GptOssExperts``: alpha 1.702, ``config.swiglu_limit`` 7.0 by default);
its gradient passes through a clamp inside its range only, as
``torch.clamp``'s does.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import contract

__all__ = ["Activation", "as_activation", "ACTIVATIONS"]

ACTIVATIONS: tuple[str, ...] = contract.ACTIVATIONS


class Activation(NamedTuple):
    """An activation with its parameters (only ``swiglu_clamped`` has any:
    ``alpha`` and ``limit``).  ``fused_moe(..., activation=...)`` takes one of
    these or a name (the defaults)."""

    name: str
    alpha: float = contract.CLAMPED_SWIGLU_ALPHA
    limit: float = contract.CLAMPED_SWIGLU_LIMIT

    @property
    def code(self) -> int:
        """The contract's code (the FFI attribute ``activation``)."""
        return contract.ACTIVATION_CODES[self.name]

    def attrs(self) -> dict:
        """The FFI attributes: ``activation``, ``act_alpha``, ``act_limit``."""
        return dict(activation=np.int32(self.code), act_alpha=np.float32(self.alpha),
                    act_limit=np.float32(self.limit))

    def __call__(self, g: jax.Array, u: jax.Array) -> jax.Array:
        """glu(g, u) in the arrays' dtype (the reference calls it in float32)."""
        if self.name == "geglu":
            return jax.nn.gelu(g, approximate=True) * u
        if self.name == "geglu_erf":
            return jax.nn.gelu(g, approximate=False) * u
        if self.name == "swiglu_clamped":
            gc = jnp.minimum(g, self.limit)
            uc = jnp.clip(u, -self.limit, self.limit)
            return gc * jax.nn.sigmoid(self.alpha * gc) * (uc + 1.0)
        return jax.nn.silu(g) * u


def as_activation(activation: str | Activation) -> Activation:
    """A name or an `Activation`, checked; parameters of activations that take
    none are reset to the defaults (so equal activations compare equal)."""
    if isinstance(activation, str):
        activation = Activation(activation)
    if not isinstance(activation, Activation):
        raise TypeError(f"activation must be a name in {ACTIVATIONS} or a jax_nbx.Activation; "
                        f"got {activation!r}")
    if activation.name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation.name!r}")
    if activation.name != "swiglu_clamped":
        return Activation(activation.name)
    alpha, limit = activation.alpha, activation.limit
    for n, v in (("alpha", alpha), ("limit", limit)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"Activation('swiglu_clamped').{n} must be a finite number; got {v!r}")
    if not limit > 0:
        raise ValueError(f"Activation('swiglu_clamped').limit must be > 0; got {limit!r}")
    return Activation("swiglu_clamped", float(alpha), float(limit))
