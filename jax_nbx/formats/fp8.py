"""fp8: E4M3 values with a float scale per group of K and column (spec:
``xla_ffi/formats/fp8.h``).

One matrix ``W [K, N]``: ``W[k, n] = E4M3(q[k, n]) * scale[k // group_size,
n]``, ``q`` uint8 ``[K, N]`` (float8_e4m3fn bits; ``jnp.float8_e4m3fn``
arrays are taken too), ``scale`` float32 or bfloat16 ``[ceil(K/group_size),
N]``, ``group_size`` 32, 64 or 128 (default 128, the block of DeepSeek-V3's
and Qwen3's "-FP8" checkpoints, whose 128x128 block scales the loaders repeat
over each block's 128 columns; per-channel scales repeat over the groups).
K need not be a multiple of the group: the last group covers the remaining
``K % group_size`` rows, as the producers' block grids are sized by a
ceiling division (DeepSeek-V3 ``inference/kernel.py weight_dequant``, vLLM's
block FP8, compressed-tensors' block strategy).

`quantize` (this library's producer) scales each group of one column by
``amax / 448`` over its rows (a partial last group: its real rows alone; 1
for a group of zeros; in the scale dtype, the division by
the rounded scale), as transformers' ``integrations/finegrained_fp8.py``
does per block, and rounds ``W / scale`` to E4M3, ties to even (XLA's
conversion, as ml_dtypes').  A group holding a NaN or infinity (only under
``jax.jit``: `jax_nbx.quantize` refuses one on concrete arrays) gets scale NaN
and codes 0: all NaN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import registry
from .minifloat import E4M3_MAX, e4m3_codes, e4m3_values
from .spec import Format
from .weight import QuantizedWeight


class Fp8(Format):
    name = "fp8"
    default_group_size = 128
    element_dtypes = {"q": jnp.float8_e4m3fn}

    def quantize_matrix(self, w: jax.Array, group_size, scale_dtype) -> QuantizedWeight:
        K = w.shape[-2]
        self.check_group_size(group_size, K, f"fp8 weights {tuple(w.shape)}: ")
        g = self.grouped_rows(w, group_size)
        bad = self.non_finite(g)  # a group holding NaN/Inf: scale NaN, codes 0 (all NaN)
        amax = jnp.max(jnp.abs(g), axis=-2)
        scale = jnp.where(bad, jnp.nan, jnp.where(amax > 0, self.quotient(amax, E4M3_MAX), 1.0)).astype(scale_dtype)
        q = e4m3_codes(w / self.group_rows(scale.astype(jnp.float32), group_size, K))
        q = jnp.where(self.group_rows(bad, group_size, K), jnp.uint8(0), q)
        return QuantizedWeight(q, scale, None, kind=self.name, group_size=group_size)

    def dequantize(self, w: QuantizedWeight) -> jax.Array:
        q = e4m3_values(w.q)
        return q * self.group_rows(w.scale.astype(jnp.float32), w.group_size, q.shape[-2])


FP8 = registry.register(Fp8())
