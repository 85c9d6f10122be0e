"""Weight formats: the registry, quantization and the handlers' view.

Each format is one module here (``dense``, ``int8``, ``int4``, ``mxfp4``, ``fp8``,
``mxfp8``, ``nvfp4``; shared element encodings in ``minifloat``) with its math,
over a spec read from the contract (``xla_ffi/formats/<name>.h``: parts,
dtypes, shapes, packing, groups); ``registry`` holds them by name.  Adding a
format is its code in ``xla_ffi/abi.h``, its C++ header in
``xla_ffi/formats/`` (listed in ``registry.h``), its module here, then its
kernels: the CPU kernels' cases (``xla_ffi/cpu/kernels_quant.h``), a branch
of the Triton kernels' ``_wtile`` (``backends/cuda/kernels.py``, named in
``plan.kernels_formats``) and the Metal handler's switch.

Public: `quantize`, `dequantize`, `QuantizedWeight`, `get`, `names`.
"""
from __future__ import annotations

import importlib
import warnings

from . import dense, fp8, int4, int8, mxfp4, mxfp8, nvfp4  # noqa: F401  (each registers its format)
from .registry import get, names, quantized_names
from .spec import Format
from .weight import QuantizedWeight

__all__ = ["QuantizedWeight", "Format", "get", "names", "quantized_names", "GROUP_SIZES"]

GROUP_SIZES = int4.INT4.group_sizes  # int4's (the loaders' GPTQ/AWQ/MLX affine imports)


# Names that moved out of this package (formats know nothing of `Experts` or
# of handlers): importable from here still, with a DeprecationWarning.
_MOVED = {
    "quantize": "jax_nbx.quantization", "dequantize": "jax_nbx.quantization",
    "quant_format": "jax_nbx.quantization", "is_quantized": "jax_nbx.quantization",
    "has_tensor_scale": "jax_nbx.quantization",
    "weight_groups": "jax_nbx.backends.handler_calls", "tensor_scales": "jax_nbx.backends.handler_calls",
}


def __getattr__(name: str):
    where = _MOVED.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"jax_nbx.formats.{name} moved to {where}.{name} (the top-level jax_nbx.{name} "
                  "where there is one); the old name will be removed", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(where), name)
