"""Layer shapes of real MoE models (E experts, k active, hidden H, expert intermediate I),
and a random layer of such a shape (`ModelShape.random_layer`)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..experts import Experts
from ..routing import route

__all__ = ["ModelShape", "MODELS"]


class ModelShape(NamedTuple):
    name: str
    E: int
    k: int
    H: int
    I: int
    normalize: bool  # renormalize the top-k router weights

    def routed_flops(self, T: int) -> int:
        """FLOPs of the routed work: T*k rows through gate, up (H->I) and down (I->H)."""
        return 2 * T * self.k * 3 * self.H * self.I

    def weight_bytes(self, itemsize: int) -> int:
        return 3 * self.E * self.H * self.I * itemsize

    def random_layer(self, T: int, dtype=jnp.float32, seed: int = 0):
        """Random x [T, H], router output (w, ids) [T, k] and Experts of this
        layer shape, scaled so activations stay O(1): ``(x, w, ids, experts)``.
        The draws are float32, then cast to ``dtype``: one seed gives the same
        values, rounded, in every dtype."""
        keys = jax.random.split(jax.random.PRNGKey(seed), 5)
        E, H, I = self.E, self.H, self.I
        x = jax.random.normal(keys[0], (T, H), jnp.float32).astype(dtype)
        experts = Experts(
            gate=(jax.random.normal(keys[1], (E, H, I), jnp.float32) * H ** -0.5).astype(dtype),
            up=(jax.random.normal(keys[2], (E, H, I), jnp.float32) * H ** -0.5).astype(dtype),
            down=(jax.random.normal(keys[3], (E, I, H), jnp.float32) * I ** -0.5).astype(dtype),
        )
        w, ids = route(jax.random.normal(keys[4], (T, E), jnp.float32), self.k, normalize=self.normalize)
        return x, w, ids, experts


MODELS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("mixtral-8x7b", 8, 2, 4096, 14336, True),
    ModelShape("olmoe-1b-7b", 64, 8, 2048, 1024, False),
    ModelShape("qwen3-30b-a3b", 128, 8, 2048, 768, True),
    ModelShape("deepseek-v2-lite", 64, 6, 2048, 1408, False),
    ModelShape("granite-3.0-1b-a400m", 32, 8, 1024, 512, True),
)}
