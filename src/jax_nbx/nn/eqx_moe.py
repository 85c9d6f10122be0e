"""The MoE block as an Equinox module (`EqxMoE`)."""
from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from .block import MoEConfig, MoEParams, RouterAux, init_params, moe_block

__all__ = ["EqxMoE"]


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
    """

    params: MoEParams
    config: MoEConfig = eqx.field(static=True)

    def __init__(self, config: MoEConfig, *, key: jax.Array | None = None, param_dtype=jnp.float32,
                 lists: bool = False, params: MoEParams | None = None):
        if params is None:
            if key is None:
                raise ValueError("EqxMoE: pass key= to initialize, or params= to hold given parameters")
            params = init_params(config, key, param_dtype, lists=lists)
        self.params = params
        self.config = config

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> tuple[jax.Array, RouterAux]:
        """``(y, aux)``: ``y`` like ``x [..., H]``; ``aux`` the router losses
        and expert counts (`jax_nbx.nn.RouterAux`), ``mask`` keeping padding
        out of them."""
        return moe_block(self.params, x, self.config, mask=mask)
