"""mxfp8: OCP Microscaling MXFP8 with E4M3 elements (spec:
``xla_ffi/formats/mxfp8.h``).

One matrix ``W [K, N]`` in blocks of 32 rows of K: ``W[k, n] = E4M3(q[k, n])
* 2^(scale[k // 32, n] - 127)``; ``q`` uint8 ``[K, N]`` (float8_e4m3fn bits),
``scale`` uint8 ``[ceil(K/32), N]`` (E8M0; ``jnp.float8_e4m3fn`` /
``jnp.float8_e8m0fnu`` arrays are taken too), as MLX's
``mx.quantize(mode="mxfp8")`` stores an ``[N, K]`` matrix's (the loaders
transpose).  K need not be a multiple of 32: the last block covers the
remaining ``K % 32`` rows, its scale from them alone (as mxfp4's, whose
module names the producers).  The weights compute in float32.

`quantize` (this library's producer) takes each block's scale as
``2^ceil(log2(amax / 448))`` and rounds ``W / scale`` to E4M3, ties to even:
MLX 0.32's rule, whose codes and scales ours equal
(tests/library/test_format_producers.py).  A block holding a NaN or infinity
(only under ``jax.jit``: `jax_nbx.quantize` refuses one on concrete arrays)
gets scale 255 (E8M0's NaN) and codes 0: all NaN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import registry
from .minifloat import E4M3_MAX, E8M0_NAN, e4m3_codes, e4m3_values, e8m0_values, pow2_scale_bytes
from .spec import Format
from .weight import QuantizedWeight

BLOCK = 32


class Mxfp8(Format):
    name = "mxfp8"
    default_group_size = BLOCK
    element_dtypes = {"q": jnp.float8_e4m3fn, "scale": jnp.float8_e8m0fnu}

    def quantize_matrix(self, w: jax.Array, group_size, scale_dtype) -> QuantizedWeight:
        K = w.shape[-2]
        self.check_group_size(group_size, K, f"mxfp8 weights {tuple(w.shape)}: ")
        g = self.grouped_rows(w, BLOCK)
        bad = self.non_finite(g)  # a block holding NaN/Inf: scale 255 (E8M0 NaN), codes 0 (all NaN)
        scale = jnp.where(bad, jnp.uint8(E8M0_NAN), pow2_scale_bytes(jnp.max(jnp.abs(g), axis=-2), E4M3_MAX))
        q = e4m3_codes(w / self.group_rows(e8m0_values(scale), BLOCK, K))
        q = jnp.where(self.group_rows(bad, BLOCK, K), jnp.uint8(0), q)
        return QuantizedWeight(q, scale, None, kind=self.name, group_size=BLOCK)

    def dequantize(self, w: QuantizedWeight) -> jax.Array:
        q = e4m3_values(w.q)
        return q * self.group_rows(e8m0_values(w.scale), w.group_size, q.shape[-2])


MXFP8 = registry.register(Mxfp8())
