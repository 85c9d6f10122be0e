"""The `Experts` pytree: the weights of every expert's gated MLP."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["Experts"]

FLOAT_DTYPES = (np.dtype("float32"), np.dtype(jax.numpy.bfloat16), np.dtype("float16"))


@jax.tree_util.register_pytree_node_class
class Experts:
    """Stacked expert weights of a gated MLP.

    Args:
      gate: ``[E, H, I]`` gate projection of every expert.
      up:   ``[E, H, I]`` up projection.
      down: ``[E, I, H]`` down projection.

    Each expert ``e`` computes ``act(x @ gate[e]) * (x @ up[e]) @ down[e]``.
    The three arrays share one dtype among float32, bfloat16 and float16;
    it may differ from the activations' dtype.  Shapes are checked when the
    experts are used (``fused_moe``), so that JAX can rebuild the pytree with
    placeholder leaves.
    """

    __slots__ = ("gate", "up", "down")

    def __init__(self, gate: Any, up: Any, down: Any):
        self.gate = gate
        self.up = up
        self.down = down

    def tree_flatten(self):
        return (self.gate, self.up, self.down), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @property
    def num_experts(self) -> int:
        """E."""
        return int(self.gate.shape[0])

    @property
    def hidden(self) -> int:
        """H, the model width."""
        return int(self.gate.shape[1])

    @property
    def intermediate(self) -> int:
        """I, each expert's intermediate width."""
        return int(self.gate.shape[2])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.gate.dtype)

    def __repr__(self) -> str:
        def desc(a):
            return f"{getattr(a, 'dtype', '?')}{list(getattr(a, 'shape', ()))}"

        return f"Experts(gate={desc(self.gate)}, up={desc(self.up)}, down={desc(self.down)})"
