"""`QuantizedWeight`: one projection's quantized weights as a pytree."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from . import registry


@jax.tree_util.register_pytree_with_keys_class
class QuantizedWeight:
    """One projection's quantized weights (stacked ``[E, ...]`` or one expert).

    Attributes:
      q, scale, zero: the format's parts (``jax_nbx.formats``; a part the
        format lacks is None), e.g. int8: q int8 ``[..., K, N]``, scale
        ``[..., N]``; int4: q uint8 ``[..., K/2, N]`` (packed), scale and zero
        ``[..., K/group_size, N]``.
      tensor_scale: None, or (formats whose spec takes one: nvfp4) a float32
        scale of the whole matrix, ``[E]`` when stacked, ``[]`` for one
        expert: every weight is the format's value times it (ModelOpt's
        ``weight_scale_2``; 1 / compressed-tensors' ``weight_global_scale``).
        The kernels multiply each column's sum by it once.
      kind: the format's name.  group_size: its group along K (None for
        formats without groups).
    """

    __slots__ = ("q", "scale", "zero", "tensor_scale", "kind", "group_size")
    _CHILDREN = ("q", "scale", "zero", "tensor_scale")

    def __init__(self, q: Any, scale: Any, zero: Any = None, tensor_scale: Any = None, *, kind: str,
                 group_size: int | None = None):
        self.q, self.scale, self.zero, self.tensor_scale = q, scale, zero, tensor_scale
        self.kind, self.group_size = kind, group_size

    def tree_flatten(self):
        return tuple(getattr(self, n) for n in self._CHILDREN), (self.kind, self.group_size)

    def tree_flatten_with_keys(self):
        return (tuple((jax.tree_util.GetAttrKey(n), getattr(self, n)) for n in self._CHILDREN),
                (self.kind, self.group_size))

    @classmethod
    def tree_unflatten(cls, aux, children):
        kind, group_size = aux
        return cls(*children, kind=kind, group_size=group_size)

    @property
    def format(self):
        """The `jax_nbx.formats.Format` of ``kind`` (ValueError if unknown)."""
        return registry.get(self.kind)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape of the dense weights (``[E, K, N]`` or ``[K, N]``)."""
        return self.format.logical_shape(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    @property
    def dtype(self) -> np.dtype:
        """The dtype the weights compute in (the scales', or float32 where
        the scales are no float type)."""
        part = self.format.compute_part
        return np.dtype(getattr(self, part).dtype) if part else np.dtype(np.float32)

    def validate(self, name: str) -> None:
        """Raises ValueError/TypeError naming ``name`` if the arrays do not fit the format."""
        try:
            fmt = self.format
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        fmt.validate(self, name)

    def dequantize(self, dtype=None) -> jax.Array:
        """The dense weights (float32 math, returned in ``dtype`` or the
        compute dtype): the format's values, times the tensor scale if any."""
        w = self.format.dequantize(self)
        if self.tensor_scale is not None:
            import jax.numpy as jnp

            w = w * jnp.asarray(self.tensor_scale, jnp.float32)[..., None, None]
        return w.astype(dtype or self.dtype)

    def __repr__(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        t = ", tensor_scale" if self.tensor_scale is not None else ""
        return f"QuantizedWeight({self.kind}{g}, shape={list(self.shape)}, scale {self.scale.dtype}{t})"
