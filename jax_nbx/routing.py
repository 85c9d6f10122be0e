"""Routing: router logits to (top-k weights, top-k expert ids)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["route"]


def route(logits: jax.Array, k: int, *, normalize: bool = True) -> tuple[jax.Array, jax.Array]:
    """Softmax top-k routing.

    Args:
      logits: ``[..., E]`` router logits, any float dtype.
      k: experts per token, ``1 <= k <= E``.
      normalize: renormalize the k chosen probabilities to sum to 1
        (Mixtral, Qwen-MoE); ``False`` keeps the raw softmax probabilities
        (OLMoE, DeepSeek).

    Returns:
      ``(topk_weights [..., k] float32, topk_ids [..., k] int32)``, the
      weights in descending order.
    """
    logits = jnp.asarray(logits)
    if logits.ndim < 1:
        raise ValueError(f"logits must have shape [..., E]; got shape {logits.shape}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(f"logits must be a float array; got dtype {logits.dtype}")
    E = logits.shape[-1]
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= E:
        raise ValueError(f"k must be an int in [1, E={E}] for logits of shape {logits.shape}; got k={k!r}")
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)
