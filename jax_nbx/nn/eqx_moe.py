"""The MoE block as an Equinox module (`EqxMoE`)."""
from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp

from ..lora import PROJECTIONS
from .block import MoEConfig, MoEParams, RouterAux, init_lora, init_params, moe_block

__all__ = ["EqxMoE"]

_LORA_KEY = 0x4C6F5241  # "LoRA": the adapters' key, folded into the layer's


class EqxMoE(eqx.Module):
    """A Mixture-of-Experts block (router, routed experts, optional shared
    expert) running as one `jax_nbx.fused_moe` call.

    Fields: ``params`` (`jax_nbx.nn.MoEParams`: ``router [E, H]`` in Hugging
    Face's layout, ``experts`` as `jax_nbx.Experts` in any layout, stacked or
    per-expert lists, dense or quantized, optional biases and shared expert)
    and ``config`` (static).  Quantized codes are integer arrays, which
    ``eqx.filter_grad`` leaves alone; DeepSeek-V3's ``correction_bias`` gets
    no gradient (it is stopped in `moe_block`).

    Example::

        import equinox as eqx, jax, jax.numpy as jnp
        from jax_nbx import nn

        config = nn.MoEConfig(hidden_size=64, intermediate_size=32, num_experts=8, top_k=2)
        layer = nn.EqxMoE(config, key=jax.random.key(0))
        x = jnp.ones((4, 16, 64))

        @eqx.filter_jit
        @eqx.filter_grad
        def grads(layer, x):
            y, aux = layer(x)
            return jnp.mean(y ** 2) + 0.01 * aux.load_balancing_loss

        g = grads(layer, x)        # an EqxMoE of gradients (None where not trained)

    Args:
      config: `MoEConfig`.
      key: PRNG key for the initialization; not needed with ``params``.
      param_dtype: the weights' dtype when initialized (biases float32).
      lists: initialize the routed experts as per-expert lists.
      params: `MoEParams` to hold instead (e.g. from
        `jax_nbx.loaders.load_moe`).
      lora_rank: > 0: LoRA adapters of this rank on the routed experts
        (``params.lora``, `jax_nbx.LoRA`; A random, B = 0, so the layer
        starts equal to its base; ``params.lora``, when given, is kept).
        The routed and shared experts are then frozen: the call stops their
        gradient (``eqx.filter_grad`` returns zeros for them; partition them
        out with `trainable` to keep no such arrays).
      lora_projections: the adapted projections (of "gate", "up", "down").
      lora_alpha: the scale is ``lora_alpha / lora_rank`` (default: scale 1).
    """

    params: MoEParams
    config: MoEConfig = eqx.field(static=True)

    def __init__(self, config: MoEConfig, *, key: jax.Array | None = None, param_dtype=jnp.float32,
                 lists: bool = False, params: MoEParams | None = None, lora_rank: int = 0,
                 lora_projections=PROJECTIONS, lora_alpha: float | None = None):
        if params is None:
            if key is None:
                raise ValueError("EqxMoE: pass key= to initialize, or params= to hold given parameters")
            params = init_params(config, key, param_dtype, lists=lists)
        if lora_rank and params.lora is None:
            if key is None:
                raise ValueError("EqxMoE: lora_rank needs key= to initialize the adapters")
            # (fold_in(key, c) for c < 4 is one of init_params' split(key, 4) keys: the experts')
            lora = init_lora(config, jax.random.fold_in(key, _LORA_KEY), lora_rank, projections=lora_projections,
                             alpha=lora_alpha, dtype=param_dtype, lists=params.experts.is_list)
            params = params._replace(lora=lora)
        self.params = params
        self.config = config

    def trainable(self) -> EqxMoE:
        """A filter spec (a pytree of bools like this module) for
        ``eqx.partition``: with adapters, True on the adapters and the
        router's arrays only; without, on every inexact array."""
        spec = jax.tree.map(eqx.is_inexact_array, self)
        if self.params.lora is None:
            return spec
        p = spec.params
        off = functools.partial(jax.tree.map, lambda _: False)
        params = p._replace(experts=off(p.experts), shared=off(p.shared), correction_bias=off(p.correction_bias))
        return eqx.tree_at(lambda m: m.params, spec, params)

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> tuple[jax.Array, RouterAux]:
        """``(y, aux)``: ``y`` like ``x [..., H]``; ``aux`` the router losses
        and expert counts (`jax_nbx.nn.RouterAux`), ``mask`` keeping padding
        out of them."""
        params = self.params
        if params.lora is not None:  # the base is frozen under adapters
            params = params._replace(experts=jax.lax.stop_gradient(params.experts),
                                     shared=jax.lax.stop_gradient(params.shared))
        return moe_block(params, x, self.config, mask=mask)
