"""Weight formats: the registry and each format's math on one matrix.

Each format is one module here, named as the contract names it (the formats
of ``xla_ffi/abi.h``'s NBX_WEIGHT_FORMATS, imported below from that list;
shared element encodings in ``minifloat``), with its math over a spec read
from the contract (``xla_ffi/formats/<name>.h``: parts, dtypes, shapes,
packing, groups, arithmetic, the backends whose kernels read it);
``registry`` holds them by name.  docs/development.md lists the files adding
a format takes.  Quantizing whole experts is `jax_nbx.quantization`'s; the
handlers' view of the weights is `jax_nbx.backends.handler_calls`'s.

Public: `QuantizedWeight`, `Format`, `get`, `names`, `quantized_names`.
"""
from __future__ import annotations

import importlib

from .. import contract
from .._moved import moved_attributes
from .registry import get, names, quantized_names
from .spec import Format
from .weight import QuantizedWeight

for _name in contract.WEIGHT_FORMATS:  # each module registers its format
    importlib.import_module(f"{__name__}.{_name}")
del _name

__all__ = ["QuantizedWeight", "Format", "get", "names", "quantized_names", "GROUP_SIZES"]

GROUP_SIZES = get("int4").group_sizes  # int4's (the loaders' GPTQ/AWQ/MLX affine imports)


# Names that moved out of this package (formats know nothing of `Experts` or
# of handlers): importable from here still, with a DeprecationWarning.
_MOVED = {
    "quantize": "jax_nbx.quantization", "dequantize": "jax_nbx.quantization",
    "quant_format": "jax_nbx.quantization", "is_quantized": "jax_nbx.quantization",
    "has_tensor_scale": "jax_nbx.quantization",
    "weight_groups": "jax_nbx.backends.handler_calls", "tensor_scales": "jax_nbx.backends.handler_calls",
}


__getattr__ = moved_attributes(__name__, _MOVED)
