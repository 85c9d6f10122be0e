"""dense: the weights themselves (float32, bfloat16 or float16), one part.

``xla_ffi/formats/dense.h`` is its spec.  Dense experts are plain arrays in
`jax_nbx.Experts` (never a `QuantizedWeight`); the entry exists so that every
format code, dense's included, is named in one registry.
"""
from __future__ import annotations

from . import registry
from .spec import Format


class Dense(Format):
    name = "dense"


DENSE = registry.register(Dense())
