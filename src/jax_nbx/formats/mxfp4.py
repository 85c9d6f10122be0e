"""mxfp4: OCP Microscaling MXFP4 (spec: ``xla_ffi/formats/mxfp4.h``).

One matrix ``W [K, N]`` in blocks of 32 rows of K: ``W[k, n] =
E2M1(code[k, n]) * 2^(scale[k // 32, n] - 127)``.  ``q`` uint8 ``[K/2, N]``
holds the 4-bit E2M1 codes two per byte along K, the even row in the low
nibble -- the byte order of gpt-oss's checkpoints (transformers
``integrations/mxfp4.py``) and of MLX's ``mx.quantize(mode="mxfp4")``, whose
``[N, K]`` matrices the loaders transpose; ``scale`` uint8 ``[K/32, N]`` holds
E8M0 exponents (bias 127, 255 = NaN).  The weights compute in float32.

`quantize` (this library's producer) takes each block's scale as the
smallest power of two that keeps the block's largest magnitude within E2M1's
6 (``2^ceil(log2(amax / 6))``, as MLX 0.32 and CUDA's ``cvt.rp`` do, so no
value clips; a block of zeros gets 2^0), then rounds ``W / scale`` to the
nearest E2M1 value, ties to the even code (as ``ml_dtypes.float4_e2m1fn``
and NVIDIA's quantizers do; MLX 0.32's CPU quantizer breaks ties toward
zero, so its codes can differ from ours at exact ties only).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import registry
from .int4 import unpack_nibbles
from .spec import Format
from .weight import QuantizedWeight

BLOCK = 32
# E2M1's values by code (sign bit 3): OCP MX v1.0 section 5.3.3
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
# magnitude code m is the number of these that |v| passes; at a tie (the
# midpoint of two values) the even code wins: > below an even code, >= below an odd one
_UP = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_codes(v: jax.Array) -> jax.Array:
    """float32 ``v`` rounded to the nearest E2M1 value (ties to even,
    saturating at ±6) as its 4-bit code (uint8); the sign bit of -0.0 kept."""
    a = jnp.abs(v)
    m = sum(((a >= t) if eq else (a > t)).astype(jnp.uint8) for t, eq in _UP)
    return m | (jnp.signbit(v).astype(jnp.uint8) << 3)


def e8m0_values(s: jax.Array) -> jax.Array:
    """E8M0 bytes as float32: 2^(s - 127), 255 as NaN (0 is the subnormal 2^-127)."""
    s = s.astype(jnp.uint32)
    v = jax.lax.bitcast_convert_type(s << 23, jnp.float32)
    v = jnp.where(s == 0, jnp.float32(2.0 ** -127), v)
    return jnp.where(s == 255, jnp.float32(np.nan), v)


class Mxfp4(Format):
    name = "mxfp4"
    default_group_size = BLOCK

    def quantize_matrix(self, w: jax.Array, group_size, scale_dtype) -> QuantizedWeight:
        K, N = w.shape[-2:]
        self.check_group_size(group_size, K, f"mxfp4 weights {tuple(w.shape)}: ")
        g = w.reshape(w.shape[:-2] + (K // BLOCK, BLOCK, N))
        amax = jnp.max(jnp.abs(g), axis=-2)
        # ceil(log2(amax / 6)) from the exact binary exponent: amax / 6 = f * 2^e, f in [0.5, 1)
        f, e = jnp.frexp(amax / 6.0)
        exp = jnp.where(f == 0.5, e - 1, e)
        exp = jnp.where(amax > 0, jnp.clip(exp, -127, 127), 0)
        scale = (exp + 127).astype(jnp.uint8)
        codes = e2m1_codes(g / e8m0_values(scale)[..., None, :]).reshape(w.shape)
        packed = codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)
        return QuantizedWeight(packed, scale, None, kind=self.name, group_size=BLOCK)

    def dequantize(self, w: QuantizedWeight) -> jax.Array:
        values = jnp.asarray(E2M1_VALUES)[unpack_nibbles(w.q)]
        return values * jnp.repeat(e8m0_values(w.scale), w.group_size, axis=-2)


MXFP4 = registry.register(Mxfp4())
