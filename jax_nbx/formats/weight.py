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

    def __bool__(self) -> bool:  # a weight is a value, whatever its length
        return True

    def __len__(self) -> int:
        if self.ndim != 3:
            raise TypeError(f"len() of one expert's {self.kind} weights {list(self.shape)}: only stacked "
                            "[E, K, N] weights have experts")
        return int(self.q.shape[0])

    def __getitem__(self, experts) -> QuantizedWeight:
        """Experts of stacked ``[E, K, N]`` weights, in the same format: an int
        gives that expert's ``[K, N]`` weights; a slice, a sequence or an array
        of ids gives stacked ``[E', K, N]`` ones (every part, and the tensor
        scales, indexed alike).  Ids are checked against E (negative ones
        count from the end, as numpy's); anything else is refused by name."""
        if self.ndim != 3:
            raise TypeError(f"one expert's {self.kind} weights {list(self.shape)} cannot be indexed by "
                            "expert: only stacked [E, K, N] weights can")
        E = len(self)
        if isinstance(experts, (bool, np.bool_)) or experts is None or experts is Ellipsis or \
                isinstance(experts, tuple):
            raise TypeError(f"index the experts of {self.kind} weights with an int, a slice or a sequence of "
                            f"ids; got {experts!r}")
        if isinstance(experts, (int, np.integer)):
            if not -E <= int(experts) < E:
                raise IndexError(f"expert {int(experts)} is outside the {E} experts of these {self.kind} weights")
            index = int(experts)
        elif isinstance(experts, slice):
            index = experts
        else:
            index = np.asarray(experts)
            if index.ndim != 1 or not np.issubdtype(index.dtype, np.integer):
                raise TypeError(f"expert ids of {self.kind} weights must be an int, a slice or a 1-D sequence of "
                                f"ints; got {experts!r}")
            bad = index[(index < -E) | (index >= E)]
            if bad.size:
                raise IndexError(f"expert {int(bad[0])} is outside the {E} experts of these {self.kind} weights")

        def take(a):
            return None if a is None else a[index]

        return QuantizedWeight(take(self.q), take(self.scale), take(self.zero), take(self.tensor_scale),
                               kind=self.kind, group_size=self.group_size)

    def __repr__(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        t = ", tensor_scale" if self.tensor_scale is not None else ""
        return f"QuantizedWeight({self.kind}{g}, shape={list(self.shape)}, scale {self.scale.dtype}{t})"
