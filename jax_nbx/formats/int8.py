"""int8: symmetric per output column (spec: ``xla_ffi/formats/int8.h``).

One matrix ``W [K, N]``: ``scale[n] = max_k |W[k, n]| / 127`` (1 where a
column is all zero), ``q = round(W / scale)`` in ``[-127, 127]`` (int8), and
``W ≈ q[k, n] * scale[n]``.  Scales float32 or bfloat16.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import registry
from .spec import Format
from .weight import QuantizedWeight


class Int8(Format):
    name = "int8"

    def quantize_matrix(self, w: jax.Array, group_size, scale_dtype) -> QuantizedWeight:
        self.check_group_size(group_size)
        scale = jnp.max(jnp.abs(w), axis=-2) / 127.0
        scale = jnp.where(scale > 0, scale, 1.0).astype(scale_dtype)
        q = jnp.clip(jnp.round(w / scale.astype(jnp.float32)[..., None, :]), -127, 127).astype(jnp.int8)
        return QuantizedWeight(q, scale, None, kind=self.name)

    def dequantize(self, w: QuantizedWeight) -> jax.Array:
        return w.q.astype(jnp.float32) * w.scale.astype(jnp.float32)[..., None, :]


INT8 = registry.register(Int8())
