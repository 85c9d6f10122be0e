"""int4: asymmetric in groups along K (spec: ``xla_ffi/formats/int4.h``).

One matrix ``W [K, N]`` in groups of ``group_size`` rows of K (32, 64 or
128): ``W[k, n] ≈ q[k, n] * scale[g, n] + zero[g, n]`` with ``g = k //
group_size``, ``zero`` the group's minimum, ``scale = (max - min) / 15`` (1
where a group is constant) and ``q`` in ``0..15``, packed two per byte along
K, low nibble first: ``packed[j, n] = q[2j, n] | q[2j + 1, n] << 4`` (uint8
``[K/2, N]``).  Scales and zeros float32 or bfloat16 (one dtype).  A group
holding a NaN or infinity (only under ``jax.jit``: `jax_nbx.quantize` refuses
one on concrete arrays) gets scale and zero NaN and codes 0: all NaN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import registry
from .spec import Format
from .weight import QuantizedWeight


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """uint8 ``[..., K/2, N]`` -> the values ``[..., K, N]`` (uint8, 0..15), low nibble = even row."""
    lo, hi = packed & 0xF, packed >> 4
    s = packed.shape
    return jnp.stack([lo, hi], axis=-2).reshape(s[:-2] + (2 * s[-2], s[-1]))


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """uint8 4-bit codes ``[..., K, N]`` -> ``[..., K/2, N]``, the even row in the low nibble."""
    return codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)


class Int4(Format):
    name = "int4"
    default_group_size = 128
    whole_groups_rule = ("its producers quantize whole groups (AWQ's WQLinear asserts in_features % "
                         "group_size == 0; MLX's affine mx.quantize and compressed-tensors' group strategy "
                         "refuse a K the group does not divide)")

    def quantize_matrix(self, w: jax.Array, group_size, scale_dtype) -> QuantizedWeight:
        K, N = w.shape[-2:]
        self.check_group_size(group_size, K, f"int4 weights {tuple(w.shape)}: ")
        g = w.reshape(w.shape[:-2] + (K // group_size, group_size, N))
        bad = self.non_finite(g)  # a group holding NaN/Inf: scale and zero NaN, codes 0 (all NaN)
        mn, mx = jnp.min(g, axis=-2), jnp.max(g, axis=-2)
        scale = self.quotient(mx - mn, 15.0)
        scale = jnp.where(bad, jnp.nan, jnp.where(scale > 0, scale, 1.0)).astype(scale_dtype)
        zero = jnp.where(bad, jnp.nan, mn).astype(scale_dtype)
        s32, z32 = scale.astype(jnp.float32)[..., None, :], zero.astype(jnp.float32)[..., None, :]
        q = jnp.clip(jnp.round((g - z32) / s32), 0, 15)
        q = jnp.where(bad[..., None, :], 0.0, q).astype(jnp.uint8).reshape(w.shape)
        return QuantizedWeight(pack_nibbles(q), scale, zero, kind=self.name, group_size=group_size)

    def dequantize(self, w: QuantizedWeight) -> jax.Array:
        q = unpack_nibbles(w.q).astype(jnp.float32)
        G = w.group_size
        s = jnp.repeat(w.scale.astype(jnp.float32), G, axis=-2)
        z = jnp.repeat(w.zero.astype(jnp.float32), G, axis=-2)
        return q * s + z


INT4 = registry.register(Int4())
