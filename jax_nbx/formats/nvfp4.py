"""nvfp4: NVIDIA's NVFP4 (spec: ``xla_ffi/formats/nvfp4.h``).

One matrix ``W [K, N]`` in blocks of 16 rows of K: ``W[k, n] =
E2M1(code[k, n]) * E4M3(scale[k // 16, n])``; ``q`` uint8 ``[K/2, N]`` holds
the 4-bit codes two per byte along K, the even row in the low nibble (as
mxfp4 and MLX's ``mx.quantize(mode="nvfp4")``), ``scale`` uint8 ``[K/16,
N]`` E4M3 bytes (``jnp.float8_e4m3fn`` arrays are taken too).  The optional
float32 per-tensor scale of ModelOpt / compressed-tensors NVFP4 checkpoints
(and MLX's ``global_scale``) is not part of the format: weights that carry one
are refused by the loaders, naming it.  The weights compute in float32.

`quantize` (this library's producer) takes each block's scale as
``E4M3(amax / 6)`` (rounded to nearest, as MLX 0.32 does) and rounds ``W /
scale`` to the nearest E2M1 value, ties to even, saturating at ±6; a block
whose scale rounds to 0 gets codes 0.  A block holding a NaN or infinity (only
under ``jax.jit``: `jax_nbx.quantize` refuses one on concrete arrays) gets
scale 0x7F (E4M3's NaN) and codes 0: all NaN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import registry
from .int4 import pack_nibbles, unpack_nibbles
from .minifloat import E2M1_MAX, E4M3_NAN, e2m1_codes, e2m1_values, e4m3_codes, e4m3_values
from .spec import Format
from .weight import QuantizedWeight

BLOCK = 16


class Nvfp4(Format):
    name = "nvfp4"
    default_group_size = BLOCK
    element_dtypes = {"scale": jnp.float8_e4m3fn}
    whole_groups_rule = ("NVFP4's producers quantize whole blocks of 16 (MLX's mx.quantize(mode='nvfp4') "
                         "and compressed-tensors' group strategy refuse a K that is not a multiple of 16)")

    def quantize_matrix(self, w: jax.Array, group_size, scale_dtype) -> QuantizedWeight:
        K, N = w.shape[-2:]
        self.check_group_size(group_size, K, f"nvfp4 weights {tuple(w.shape)}: ")
        g = w.reshape(w.shape[:-2] + (K // BLOCK, BLOCK, N))
        bad = self.non_finite(g)  # a block holding NaN/Inf: scale 0x7F (E4M3 NaN), codes 0 (all NaN)
        scale = jnp.where(bad, jnp.uint8(E4M3_NAN), e4m3_codes(self.quotient(jnp.max(jnp.abs(g), axis=-2), E2M1_MAX)))
        s = e4m3_values(scale)[..., None, :]  # NaN > 0 is false: a NaN block's codes are 0
        codes = e2m1_codes(jnp.where(s > 0, g / jnp.where(s > 0, s, 1.0), 0.0)).reshape(w.shape)
        return QuantizedWeight(pack_nibbles(codes), scale, None, kind=self.name, group_size=BLOCK)

    def dequantize(self, w: QuantizedWeight) -> jax.Array:
        values = e2m1_values(unpack_nibbles(w.q))
        return values * jnp.repeat(e4m3_values(w.scale), w.group_size, axis=-2)


NVFP4 = registry.register(Nvfp4())
