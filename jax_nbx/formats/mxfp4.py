"""mxfp4: OCP Microscaling MXFP4 (spec: ``xla_ffi/formats/mxfp4.h``).

One matrix ``W [K, N]`` in blocks of 32 rows of K: ``W[k, n] =
E2M1(code[k, n]) * 2^(scale[k // 32, n] - 127)``.  ``q`` uint8 ``[K/2, N]``
holds the 4-bit E2M1 codes two per byte along K, the even row in the low
nibble -- the byte order of gpt-oss's checkpoints (transformers
``integrations/mxfp4.py``) and of MLX's ``mx.quantize(mode="mxfp4")``, whose
``[N, K]`` matrices the loaders transpose; ``scale`` uint8 ``[ceil(K/32),
N]`` holds E8M0 exponents (bias 127, 255 = NaN; ``jnp.float8_e8m0fnu`` arrays
are taken too).  K (even) need not be a multiple of 32: the last block covers
the remaining ``K % 32`` rows, its scale from them alone, as the MX reference
emulation (microsoft/microxcaling) and OpenAI's triton_kernels
``downcast_to_mxfp_torch`` (transformers' gpt-oss quantizer) make them; MLX
refuses such K.  The weights compute in float32.

`quantize` (this library's producer) takes each block's scale as the
smallest power of two that keeps the block's largest magnitude within E2M1's
6 (``2^ceil(log2(amax / 6))``, as MLX 0.32 and CUDA's ``cvt.rp`` do, so no
value clips; a block of zeros gets 2^0), then rounds ``W / scale`` to the
nearest E2M1 value, ties to the even code (as ``ml_dtypes.float4_e2m1fn``
and NVIDIA's quantizers do; MLX 0.32's CPU quantizer breaks ties toward
zero, so its codes can differ from ours at exact ties only).  A block holding
a NaN or infinity (only under ``jax.jit``: `jax_nbx.quantize` refuses one on
concrete arrays) gets scale 255 (E8M0's NaN) and codes 0: all NaN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import registry
from .int4 import pack_nibbles, unpack_nibbles
from .minifloat import E2M1_MAX, E8M0_NAN, e2m1_codes, e2m1_values, e8m0_values, pow2_scale_bytes
from .spec import Format
from .weight import QuantizedWeight

BLOCK = 32


class Mxfp4(Format):
    name = "mxfp4"
    default_group_size = BLOCK
    element_dtypes = {"scale": jnp.float8_e8m0fnu}

    def quantize_matrix(self, w: jax.Array, group_size, scale_dtype) -> QuantizedWeight:
        K = w.shape[-2]
        self.check_group_size(group_size, K, f"mxfp4 weights {tuple(w.shape)}: ")
        g = self.grouped_rows(w, BLOCK)
        bad = self.non_finite(g)  # a block holding NaN/Inf: scale 255 (E8M0 NaN), codes 0 (all NaN)
        scale = jnp.where(bad, jnp.uint8(E8M0_NAN), pow2_scale_bytes(jnp.max(jnp.abs(g), axis=-2), E2M1_MAX))
        codes = e2m1_codes(w / self.group_rows(e8m0_values(scale), BLOCK, K))
        codes = jnp.where(self.group_rows(bad, BLOCK, K), jnp.uint8(0), codes)
        return QuantizedWeight(pack_nibbles(codes), scale, None, kind=self.name, group_size=BLOCK)

    def dequantize(self, w: QuantizedWeight) -> jax.Array:
        values = e2m1_values(unpack_nibbles(w.q))
        return values * self.group_rows(e8m0_values(w.scale), w.group_size, values.shape[-2])


MXFP4 = registry.register(Mxfp4())
