"""The `Experts` pytree: the weights of every expert's gated MLP."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["Experts"]

FLOAT_DTYPES = (np.dtype("float32"), np.dtype(jax.numpy.bfloat16), np.dtype("float16"))


@jax.tree_util.register_pytree_node_class
class Experts:
    """The expert weights of a gated MLP: stacked arrays, or one array per expert.

    Args:
      gate: ``[E, H, I]`` gate projection of every expert, or a list of E
        ``[H, I]`` arrays (e.g. a checkpoint's ``experts.{i}.w1``).
      up:   ``[E, H, I]`` up projection, or a list of E ``[H, I]``.
      down: ``[E, I, H]`` down projection, or a list of E ``[I, H]``.

    Each expert ``e`` computes ``act(x @ gate[e]) * (x @ up[e]) @ down[e]``.
    The weights share one dtype among float32, bfloat16 and float16; it may
    differ from the activations' dtype.  Lists are read in place by the
    handlers (never stacked into a copy); the three projections are all
    stacked or all lists.  Shapes are checked when the experts are used
    (``fused_moe``), so that JAX can rebuild the pytree with placeholder leaves.
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
    def is_list(self) -> bool:
        """True when the weights are given as one array per expert."""
        return isinstance(self.gate, (list, tuple))

    @property
    def num_experts(self) -> int:
        """E."""
        return len(self.gate) if self.is_list else int(self.gate.shape[0])

    @property
    def hidden(self) -> int:
        """H, the model width."""
        return int(self.gate[0].shape[0]) if self.is_list else int(self.gate.shape[1])

    @property
    def intermediate(self) -> int:
        """I, each expert's intermediate width."""
        return int(self.gate[0].shape[1]) if self.is_list else int(self.gate.shape[2])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype((self.gate[0] if self.is_list else self.gate).dtype)

    def flat(self) -> tuple:
        """The weight arrays in call order: (gate, up, down) when stacked, else
        gate[0..E), up[0..E), down[0..E)."""
        if self.is_list:
            return (*self.gate, *self.up, *self.down)
        return (self.gate, self.up, self.down)

    def stacked(self) -> Experts:
        """Stacked ``[E, ...]`` arrays (a copy of every weight when given as lists:
        for the pure-JAX reference and tests, never the handlers' path)."""
        if not self.is_list:
            return self
        import jax.numpy as jnp

        def stack(lst):  # arrays, or QuantizedWeight pytrees leaf by leaf
            return jax.tree.map(lambda *a: jnp.stack(a), *lst)

        return Experts(stack(self.gate), stack(self.up), stack(self.down))

    def __repr__(self) -> str:
        def desc(a):
            if isinstance(a, (list, tuple)):
                return f"{len(a)} x {desc(a[0])}" if a else "[]"
            return f"{getattr(a, 'dtype', '?')}{list(getattr(a, 'shape', ()))}"

        return f"Experts(gate={desc(self.gate)}, up={desc(self.up)}, down={desc(self.down)})"
