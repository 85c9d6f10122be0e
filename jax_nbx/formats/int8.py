"""int8: symmetric per output column (spec: ``xla_ffi/formats/int8.h``).

One matrix ``W [K, N]``: ``scale[n] = max_k |W[k, n]| / 127`` (1 where a
column is all zero), ``q = round(W / scale)`` in ``[-127, 127]`` (int8), and
``W ≈ q[k, n] * scale[n]``.  Scales float32 or bfloat16.  A column holding
a NaN or infinity (only under ``jax.jit``: `jax_nbx.quantize` refuses one on
concrete arrays) gets scale NaN and codes 0: every weight of it is NaN.
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
        bad = self.non_finite(w)  # a column holding NaN/Inf: scale NaN, codes 0 (all NaN)
        scale = self.quotient(jnp.max(jnp.abs(w), axis=-2), 127.0)
        scale = jnp.where(bad, jnp.nan, jnp.where(scale > 0, scale, 1.0)).astype(scale_dtype)
        q = jnp.clip(jnp.round(w / scale.astype(jnp.float32)[..., None, :]), -127, 127)
        q = jnp.where(bad[..., None, :], 0.0, q).astype(jnp.int8)
        return QuantizedWeight(q, scale, None, kind=self.name)

    def dequantize(self, w: QuantizedWeight) -> jax.Array:
        return w.q.astype(jnp.float32) * w.scale.astype(jnp.float32)[..., None, :]


INT8 = registry.register(Int8())
