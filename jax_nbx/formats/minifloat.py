"""The element encodings the microscaling and FP8 formats share (spec:
``xla_ffi/formats/minifloat.h``): E2M1 (FP4) codes, E4M3 ("fn") bytes and E8M0
power-of-two scales, to and from float32, exactly as OCP MX v1.0 (sections
5.3, 5.4) and ml_dtypes' ``float4_e2m1fn`` / ``float8_e4m3fn`` /
``float8_e8m0fnu`` define them.

Byte parts may be given as JAX arrays of the element dtype itself
(``jnp.float8_e4m3fn`` codes, ``jnp.float8_e8m0fnu`` scales): `as_bytes`
reinterprets them as the uint8 the handlers read, bit for bit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

E4M3_MAX = 448.0  # the largest E4M3 ("fn") magnitude
E4M3_NAN = 0x7F  # S.1111.111 with the sign clear: E4M3's NaN byte (no infinity)
E8M0_NAN = 0xFF  # E8M0's NaN byte (OCP MX v1.0 section 5.4.1; ml_dtypes float8_e8m0fnu)
E2M1_MAX = 6.0
# E2M1's values by code (sign bit 3): OCP MX v1.0 section 5.3.3
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
# magnitude code m is the number of these that |v| passes; at a tie (the
# midpoint of two values) the even code wins: > below an even code, >= below an odd one
_UP = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
# element dtypes a byte part may be given in, reinterpreted as uint8
BYTE_DTYPES = {np.dtype(jnp.float8_e4m3fn): "E4M3", np.dtype(jnp.float8_e8m0fnu): "E8M0"}


def as_bytes(a):
    """``a`` as uint8 bits: float8_e4m3fn / float8_e8m0fnu arrays bitcast, others unchanged."""
    if a is not None and np.dtype(a.dtype) in BYTE_DTYPES:
        return jax.lax.bitcast_convert_type(a, jnp.uint8)
    return a


def e2m1_codes(v: jax.Array) -> jax.Array:
    """float32 ``v`` rounded to the nearest E2M1 value (ties to even,
    saturating at ±6) as its 4-bit code (uint8); the sign bit of -0.0 kept."""
    a = jnp.abs(v)
    m = sum(((a >= t) if eq else (a > t)).astype(jnp.uint8) for t, eq in _UP)
    return m | (jnp.signbit(v).astype(jnp.uint8) << 3)


def e2m1_values(codes: jax.Array) -> jax.Array:
    """4-bit E2M1 codes (uint8, 0..15) as float32."""
    return jnp.asarray(E2M1_VALUES)[codes]


def e8m0_values(s: jax.Array) -> jax.Array:
    """E8M0 bytes as float32: 2^(s - 127), 255 as NaN (0 is the subnormal 2^-127)."""
    s = as_bytes(s).astype(jnp.uint32)
    v = jax.lax.bitcast_convert_type(s << 23, jnp.float32)
    v = jnp.where(s == 0, jnp.float32(2.0 ** -127), v)
    return jnp.where(s == 255, jnp.float32(np.nan), v)


def e4m3_values(b: jax.Array) -> jax.Array:
    """E4M3 ("fn") bytes (or float8_e4m3fn values) as float32, exactly."""
    return jax.lax.bitcast_convert_type(as_bytes(b), jnp.float8_e4m3fn).astype(jnp.float32)


def e4m3_codes(v: jax.Array) -> jax.Array:
    """float32 ``v`` rounded to the nearest E4M3 value (ties to even),
    saturating at ±448, as uint8 bits (XLA's conversion, as ml_dtypes'; it
    gives NaN past 464, hence the clip)."""
    v = jnp.clip(v, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return jax.lax.bitcast_convert_type(v, jnp.uint8)


def pow2_scale_bytes(amax: jax.Array, elem_max: float) -> jax.Array:
    """The E8M0 byte of the smallest power of two ``2^e`` with ``amax / 2^e <=
    elem_max`` (``e = ceil(log2(amax / elem_max))``, as MLX 0.32's mxfp4 /
    mxfp8 quantizers choose it, so no value clips), 2^0 for a block of zeros."""
    f, e = jnp.frexp(amax / elem_max)  # amax / elem_max = f * 2^e, f in [0.5, 1)
    exp = jnp.where(f == 0.5, e - 1, e)
    exp = jnp.where(amax > 0, jnp.clip(exp, -127, 127), 0)
    return (exp + 127).astype(jnp.uint8)
