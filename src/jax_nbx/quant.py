"""Quantized expert weights: int8 per output channel, int4 in groups along K.

Formats (one expert's matrix ``W [K, N]``: gate/up ``[H, I]``, down ``[I, H]``):

* ``"int8"``: symmetric per output column: ``scale[n] = max_k |W[k, n]| / 127``,
  ``q = round(W / scale)`` in ``[-127, 127]`` (int8); ``W ≈ q * scale[n]``.
* ``"int4"``: asymmetric in groups of ``group_size`` rows of K (32, 64 or 128):
  ``W[k, n] ≈ q[k, n] * scale[g, n] + min[g, n]`` with ``g = k // group_size``
  and ``q`` in ``0..15``, packed two per byte along K, low nibble first:
  ``packed[j, n] = q[2j, n] | q[2j + 1, n] << 4`` (uint8 ``[K/2, N]``).

Scales (and mins) are float32 or bfloat16.  Stacked experts carry a leading
E axis on every array; per-expert lists hold one `QuantizedWeight` each.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _abi
from .experts import Experts

__all__ = ["QuantizedWeight", "quantize", "dequantize", "GROUP_SIZES"]

GROUP_SIZES = (32, 64, 128)
_SCALE_DTYPES = (np.dtype("float32"), np.dtype(jnp.bfloat16))


@jax.tree_util.register_pytree_with_keys_class
class QuantizedWeight:
    """One projection's quantized weights (stacked ``[E, ...]`` or one expert).

    Attributes:
      q: int8 ``[..., K, N]`` ("int8") or uint8 ``[..., K/2, N]`` ("int4", packed).
      scale: ``[..., N]`` ("int8") or ``[..., K/group_size, N]`` ("int4").
      zero: None ("int8") or the group minimums, shaped like ``scale`` ("int4").
      kind: "int8" or "int4".  group_size: int4's group along K (else None).
    """

    __slots__ = ("q", "scale", "zero", "kind", "group_size")

    def __init__(self, q: Any, scale: Any, zero: Any = None, *, kind: str,
                 group_size: int | None = None):
        self.q, self.scale, self.zero = q, scale, zero
        self.kind, self.group_size = kind, group_size

    def tree_flatten(self):
        return (self.q, self.scale, self.zero), (self.kind, self.group_size)

    def tree_flatten_with_keys(self):
        return (tuple((jax.tree_util.GetAttrKey(n), getattr(self, n)) for n in ("q", "scale", "zero")),
                (self.kind, self.group_size))

    @classmethod
    def tree_unflatten(cls, aux, children):
        kind, group_size = aux
        return cls(*children, kind=kind, group_size=group_size)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape of the dense weights (``[E, K, N]`` or ``[K, N]``)."""
        s = tuple(self.q.shape)
        return s[:-2] + (s[-2] * 2, s[-1]) if self.kind == "int4" else s

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    @property
    def dtype(self) -> np.dtype:
        """The dtype the weights dequantize to (the scales')."""
        return np.dtype(self.scale.dtype)

    def validate(self, name: str) -> None:
        """Raises ValueError/TypeError naming ``name`` if the arrays do not fit the format."""
        q, sc = self.q, self.scale
        if np.dtype(sc.dtype) not in _SCALE_DTYPES:
            raise TypeError(f"{name}.scale has dtype {sc.dtype}; expected float32 or bfloat16")
        if self.kind == "int8":
            if np.dtype(q.dtype) != np.int8:
                raise TypeError(f"{name}.q has dtype {q.dtype}; int8 weights need int8")
            want = tuple(q.shape[:-2]) + (q.shape[-1],)
            if tuple(sc.shape) != want:
                raise ValueError(f"{name}.scale has shape {tuple(sc.shape)}; expected {want} (one per output column)")
            if self.zero is not None:
                raise ValueError(f"{name}: int8 weights are symmetric and take no zero/min")
        elif self.kind == "int4":
            G = self.group_size
            if G not in GROUP_SIZES:
                raise ValueError(f"{name}: group_size must be one of {GROUP_SIZES}; got {G}")
            if np.dtype(q.dtype) != np.uint8:
                raise TypeError(f"{name}.q has dtype {q.dtype}; int4 weights are packed in uint8")
            K = q.shape[-2] * 2
            if K % G:
                raise ValueError(f"{name}: K={K} is not divisible by group_size={G}")
            want = tuple(q.shape[:-2]) + (K // G, q.shape[-1])
            if tuple(sc.shape) != want:
                raise ValueError(f"{name}.scale has shape {tuple(sc.shape)}; expected {want} (K/group_size, N)")
            if self.zero is None or tuple(self.zero.shape) != want:
                raise ValueError(f"{name}.zero has shape {getattr(self.zero, 'shape', None)}; expected {want}")
            if self.zero.dtype != sc.dtype:
                raise TypeError(f"{name}.zero has dtype {self.zero.dtype}; expected the scale's {sc.dtype}")
        else:
            raise ValueError(f"{name}: kind must be 'int8' or 'int4'; got {self.kind!r}")

    def dequantize(self, dtype=None) -> jax.Array:
        """The dense weights (float32 math, returned in ``dtype`` or the scales' dtype)."""
        dtype = dtype or self.scale.dtype
        sc = self.scale.astype(jnp.float32)
        if self.kind == "int8":
            w = self.q.astype(jnp.float32) * sc[..., None, :]
        else:
            lo = (self.q & 0xF).astype(jnp.float32)
            hi = (self.q >> 4).astype(jnp.float32)
            q = jnp.stack([lo, hi], axis=-2).reshape(self.shape)
            G = self.group_size
            s = jnp.repeat(sc, G, axis=-2)
            z = jnp.repeat(self.zero.astype(jnp.float32), G, axis=-2)
            w = q * s + z
        return w.astype(dtype)

    def __repr__(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        return f"QuantizedWeight({self.kind}{g}, shape={list(self.shape)}, scale {self.scale.dtype})"


def _quantize_one(w: jax.Array, kind: str, group_size: int, scale_dtype) -> QuantizedWeight:
    w = jnp.asarray(w).astype(jnp.float32)
    if kind == "int8":
        scale = jnp.max(jnp.abs(w), axis=-2) / 127.0
        scale = jnp.where(scale > 0, scale, 1.0).astype(scale_dtype)
        q = jnp.clip(jnp.round(w / scale.astype(jnp.float32)[..., None, :]), -127, 127).astype(jnp.int8)
        return QuantizedWeight(q, scale, None, kind="int8")
    K, N = w.shape[-2:]
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}; got {group_size}")
    if K % group_size:
        raise ValueError(f"K={K} (the input axis of a {tuple(w.shape)} weight) is not divisible by "
                         f"group_size={group_size}")
    g = w.reshape(w.shape[:-2] + (K // group_size, group_size, N))
    mn, mx = jnp.min(g, axis=-2), jnp.max(g, axis=-2)
    scale = ((mx - mn) / 15.0)
    scale = jnp.where(scale > 0, scale, 1.0).astype(scale_dtype)
    zero = mn.astype(scale_dtype)
    s32, z32 = scale.astype(jnp.float32)[..., None, :], zero.astype(jnp.float32)[..., None, :]
    q = jnp.clip(jnp.round((g - z32) / s32), 0, 15).astype(jnp.uint8).reshape(w.shape)
    packed = q[..., 0::2, :] | (q[..., 1::2, :] << 4)
    return QuantizedWeight(packed, scale, zero, kind="int4", group_size=group_size)


def quantize(experts: Experts, kind: str = "int8", *, group_size: int = 128,
             scale_dtype=jnp.float32) -> Experts:
    """Quantizes every projection of ``experts`` ("int8" or "int4"; see the
    module docstring for the formats).  Stacked experts stay stacked, lists
    stay lists.  Raises ValueError when K is not divisible by ``group_size``
    (int4) or ``kind``/``group_size``/``scale_dtype`` is unsupported."""
    if kind not in ("int8", "int4"):
        raise ValueError(f"kind must be 'int8' or 'int4'; got {kind!r}")
    if np.dtype(scale_dtype) not in _SCALE_DTYPES:
        raise TypeError(f"scale_dtype must be float32 or bfloat16; got {np.dtype(scale_dtype)}")
    if not isinstance(experts, Experts):
        raise TypeError(f"experts must be a jax_nbx.Experts; got {type(experts).__name__}")
    if is_quantized(experts):
        raise ValueError("experts are already quantized")

    def one(a):
        return _quantize_one(a, kind, group_size, scale_dtype)

    if experts.is_list:
        return Experts(*([one(a) for a in getattr(experts, n)] for n in ("gate", "up", "down")))
    return Experts(one(experts.gate), one(experts.up), one(experts.down))


def dequantize(experts: Experts, dtype=None) -> Experts:
    """Dense experts back from quantized ones (stacked stay stacked, lists
    stay lists), in ``dtype`` or the scales' dtype."""
    def one(a):
        return a.dequantize(dtype) if isinstance(a, QuantizedWeight) else a

    if experts.is_list:
        return Experts(*([one(a) for a in getattr(experts, n)] for n in ("gate", "up", "down")))
    return Experts(one(experts.gate), one(experts.up), one(experts.down))


def quant_format(experts: Experts) -> tuple[str, int] | None:
    """(kind, group_size or 0) of quantized experts, None for dense ones."""
    d = experts.down  # present in every form (fused experts have no .gate)
    d = d[0] if experts.is_list and len(d) else d
    return (d.kind, d.group_size or 0) if isinstance(d, QuantizedWeight) else None


def is_quantized(experts: Experts) -> bool:
    return quant_format(experts) is not None


def weight_groups(weights, lists: bool):
    """The handlers' view of `Experts.flat()`: (groups of buffers — gate, up,
    down; for quantized experts then their scales, then (int4) their mins —
    each a list of one stacked array or E per-expert arrays, E, I,
    (kind, group_size) or None, the weights' or scales' dtype, whether every
    per-expert stride is a multiple of 16 bytes)."""
    per = len(weights) // 3 if lists else 1
    projs = [list(weights[i * per:(i + 1) * per]) for i in range(3)]  # gate, up, down
    w0 = projs[0][0]
    quant = quant_format(Experts(*projs))
    if quant:  # the contract's group order: part-major (q, scale, zero), then projection
        groups = [[getattr(m, part) for m in proj]
                  for part in _abi.parts_of(quant[0]) for proj in projs]
    else:
        groups = projs
    dtype = np.dtype(w0.dtype)  # for a QuantizedWeight: the dtype of its scales
    E = per if lists else int(w0.shape[0])
    I = int(w0.shape[-1])
    strides_ok = lists or all(
        (int(np.prod(g[0].shape[1:])) * np.dtype(g[0].dtype).itemsize) % 16 == 0 for g in groups)
    return groups, E, I, quant, dtype, strides_ok
