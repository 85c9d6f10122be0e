"""The MoE block as a Flax NNX module (`NNXMoE`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..expert_store import store_of
from ..lora import PROJECTIONS
from .block import MoEConfig, MoEParams, RouterAux, init_lora, init_params, moe_block

__all__ = ["NNXMoE", "Frozen", "Buffer"]


class Frozen(nnx.Variable):
    """Weights not trained: quantized experts (integer codes, their scales
    and offsets; `jax_nbx.fused_moe` gives them no gradient), and the base
    experts of a layer with LoRA adapters (``lora_rank``)."""


class Buffer(nnx.Variable):
    """Non-trained state: DeepSeek-V3's routing correction bias (updated by
    its load-balancing rule, not by gradient)."""


def _is_var(v) -> bool:
    return isinstance(v, nnx.Variable)


def _wrap(tree, quantized: bool):
    if tree is None:
        return None
    return nnx.data(jax.tree.map(lambda a: Frozen(a) if quantized else nnx.Param(a), tree))


def _unwrap(tree):
    return jax.tree.map(lambda v: v[...], tree, is_leaf=_is_var)


class NNXMoE(nnx.Module):
    """A Mixture-of-Experts block (router, routed experts, optional shared
    expert) running as one `jax_nbx.fused_moe` call.

    Parameters (`nnx.Param` unless noted) follow Hugging Face's layout, so a
    checkpoint's tensors load without a copy (`jax_nbx.loaders.load_moe`):
    ``router [E, H]``, ``router_bias [E]`` (gpt-oss), ``experts``
    (`jax_nbx.Experts`: stacked or per-expert lists, any layout; quantized
    experts are `Frozen` state), ``correction_bias`` (a `Buffer`,
    DeepSeek-V3), ``shared`` (`jax_nbx.SharedExperts`).

    Example::

        import jax, jax.numpy as jnp
        from flax import nnx
        from jax_nbx import nn

        config = nn.MoEConfig(hidden_size=64, intermediate_size=32, num_experts=8, top_k=2)
        layer = nn.NNXMoE(config, rngs=nnx.Rngs(0))
        x = jnp.ones((4, 16, 64))

        @nnx.jit
        def loss_fn(layer, x):
            y, aux = layer(x)
            return jnp.mean(y ** 2) + 0.01 * aux.load_balancing_loss

        grads = nnx.grad(loss_fn)(layer, x)     # an nnx.State of the Params

    Args:
      config: `MoEConfig`.
      rngs: `nnx.Rngs` for the initialization (``rngs.params()``); not
        needed with ``params``.
      param_dtype: the weights' dtype when initialized (biases float32).
      lists: initialize the routed experts as per-expert lists.
      params: `MoEParams` to hold instead of initializing (e.g. from
        `jax_nbx.loaders.load_moe`).
      lora_rank: > 0: LoRA adapters of this rank on the routed experts
        (`jax_nbx.LoRA`; A random, B = 0, so the layer starts equal to its
        base), held as ``self.lora`` (`nnx.Param`); the routed and shared
        experts become `Frozen` (``nnx.grad`` gives them no gradient; the
        router stays a Param).  ``params.lora``, when given, is held instead.
      lora_projections: the adapted projections (of "gate", "up", "down").
      lora_alpha: the scale is ``lora_alpha / lora_rank`` (default: scale 1).
    """

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs | None = None, param_dtype=jnp.float32,
                 lists: bool = False, params: MoEParams | None = None, lora_rank: int = 0,
                 lora_projections=PROJECTIONS, lora_alpha: float | None = None):
        if params is None:
            if rngs is None:
                raise ValueError("NNXMoE: pass rngs= to initialize, or params= to hold given parameters")
            params = init_params(config, rngs.params(), param_dtype, lists=lists)
        if lora_rank and params.lora is None:
            if rngs is None:
                raise ValueError("NNXMoE: lora_rank needs rngs= to initialize the adapters")
            params = params._replace(lora=init_lora(config, rngs.params(), lora_rank, projections=lora_projections,
                                                    alpha=lora_alpha, dtype=param_dtype,
                                                    lists=params.experts.is_list))
        from ..quantization import is_quantized
        frozen = params.lora is not None
        self.config = config
        self.router = nnx.Param(params.router)
        self.router_bias = None if params.router_bias is None else nnx.Param(params.router_bias)
        self.correction_bias = None if params.correction_bias is None else Buffer(params.correction_bias)
        # quantized and mapped experts (an expert store's: jax_nbx.loaders.map_moe) are frozen
        self.experts = _wrap(params.experts, frozen or is_quantized(params.experts) or bool(store_of(params.experts)))
        self.shared = _wrap(params.shared,
                            frozen or (is_quantized(params.shared.experts) if params.shared else False))
        self.lora = _wrap(params.lora, False)

    def params(self) -> MoEParams:
        """The held parameters as plain arrays (`MoEParams`)."""
        return MoEParams(
            router=self.router[...],
            experts=_unwrap(self.experts),
            router_bias=None if self.router_bias is None else self.router_bias[...],
            correction_bias=None if self.correction_bias is None else self.correction_bias[...],
            shared=_unwrap(self.shared),
            lora=_unwrap(self.lora),
        )

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> tuple[jax.Array, RouterAux]:
        """``(y, aux)``: ``y`` like ``x [..., H]``; ``aux`` the router losses
        and expert counts (`jax_nbx.nn.RouterAux`), ``mask`` keeping padding
        out of them."""
        return moe_block(self.params(), x, self.config, mask=mask)
