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

import jax.numpy as jnp
import numpy as np

from ..experts import Experts
from . import dense, fp8, int4, int8, mxfp4, mxfp8, nvfp4  # noqa: F401  (each registers its format)
from .minifloat import as_bytes
from .registry import get, names, quantized_names
from .spec import Format
from .weight import QuantizedWeight

__all__ = ["QuantizedWeight", "Format", "quantize", "dequantize", "get", "names", "GROUP_SIZES",
           "is_quantized", "quant_format", "weight_groups"]

GROUP_SIZES = int4.INT4.group_sizes  # int4's (the loaders' GPTQ/AWQ/MLX affine imports)
_SCALE_DTYPES = (np.dtype("float32"), np.dtype(jnp.bfloat16))


def quantize(experts: Experts, kind: str = "int8", *, group_size: int | None = None,
             scale_dtype=jnp.float32) -> Experts:
    """Quantizes every projection of ``experts`` into the format ``kind``
    (`names`: "int8", "int4", "mxfp4", "fp8", "mxfp8", "nvfp4"; each format's
    module documents its math).
    Stacked experts stay stacked, lists stay lists; experts in a checkpoint
    layout (``layout="out_in"``, fused gate_up) are quantized from their
    plain ``[E, K, N]`` copies (stacked).  ``group_size``: the
    group along K of grouped formats (int4 and fp8: 32, 64 or 128, default
    128; mxfp4, mxfp8: 32; nvfp4: 16; ignored by int8).  ``scale_dtype``:
    int8's, int4's and fp8's scales (float32 or bfloat16; the mx formats'
    are E8M0 bytes, nvfp4's E4M3 bytes).  Raises ValueError
    for an unknown format, a group size the format does not take or that does
    not divide K, TypeError for a scale dtype other than float32/bfloat16."""
    if kind not in quantized_names():
        raise ValueError(f"kind must be one of {quantized_names()}; got {kind!r}")
    fmt = get(kind)
    if np.dtype(scale_dtype) not in _SCALE_DTYPES:
        raise TypeError(f"scale_dtype must be float32 or bfloat16; got {np.dtype(scale_dtype)}")
    if not isinstance(experts, Experts):
        raise TypeError(f"experts must be a jax_nbx.Experts; got {type(experts).__name__}")
    if is_quantized(experts):
        raise ValueError("experts are already quantized")
    if experts.has_bias:
        raise ValueError("quantize takes experts without biases: quantize the weights, then attach the "
                         "biases (nbx.Experts(q.gate, q.up, q.down, gate_bias=..., up_bias=..., "
                         "down_bias=...); every format but int8 takes them)")
    if not experts.is_plain:  # a checkpoint layout: quantize its plain [E, K, N] copies (stacked)
        experts = experts.canonical()[0]
    gs = (fmt.default_group_size if group_size is None else group_size) if fmt.grouped else None

    def one(a):
        return fmt.quantize_matrix(jnp.asarray(a).astype(jnp.float32), gs, scale_dtype)

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
    """(format name, group_size or 0) of quantized experts, None for dense ones."""
    d = experts.down  # present in every form (fused experts have no .gate)
    d = d[0] if experts.is_list and len(d) else d
    return (d.kind, d.group_size or 0) if isinstance(d, QuantizedWeight) else None


def is_quantized(experts: Experts) -> bool:
    return quant_format(experts) is not None


def _tensor_scale(m):
    """A matrix's tensor scale, or None (dense, or none)."""
    return m.tensor_scale if isinstance(m, QuantizedWeight) else None


def _projections(weights, lists: bool) -> list[list]:
    """`Experts.flat()` of plain experts as [gate, up, down], each one stacked
    array or the E per-expert arrays."""
    per = len(weights) // 3 if lists else 1
    return [list(weights[i * per:(i + 1) * per]) for i in range(3)]


def has_tensor_scale(experts: Experts) -> bool:
    """Whether any of the experts' quantized matrices carries a tensor scale."""
    return any(_tensor_scale(m) is not None for m in experts.flat())


def tensor_scales(weights, lists: bool) -> tuple:
    """The CPU handler's "tensor_scales" buffers of `Experts.flat()` of plain
    quantized experts: float32 ``[E]`` per projection (gate, up, down; ones
    where a matrix has none), or () when no matrix has a tensor scale."""
    if all(_tensor_scale(m) is None for m in weights):
        return ()
    projs = _projections(weights, lists)
    import jax.numpy as jnp

    def one(m, shape):
        ts = _tensor_scale(m)
        return jnp.ones(shape, jnp.float32) if ts is None else jnp.asarray(ts, jnp.float32).reshape(shape)

    if lists:
        return tuple(jnp.stack([one(m, ()) for m in p]) for p in projs)
    return tuple(one(p[0], (int(p[0].q.shape[0]),)) for p in projs)


def weight_groups(weights, lists: bool):
    """The handlers' view of `Experts.flat()` of plain experts: (groups of
    buffers in the contract's order -- part-major (the format's parts: q,
    then scale, then zero), then projection gate, up, down -- each a list of
    one stacked array or E per-expert arrays; E; I; (format, group_size) or
    None; the weights' or scales' dtype; whether every per-expert stride is
    a multiple of 16 bytes)."""
    projs = _projections(weights, lists)
    per = len(projs[0])
    w0 = projs[0][0]
    quant = quant_format(Experts(*projs))
    if quant:
        # byte parts given in their element dtype (float8_e4m3fn, ...) as uint8, bit for bit
        groups = [[as_bytes(getattr(m, part)) for m in proj]
                  for part in get(quant[0]).parts for proj in projs]
    else:
        groups = projs
    dtype = np.dtype(w0.dtype)  # for a QuantizedWeight: its compute (scales') dtype
    E = per if lists else int(w0.shape[0])
    I = int(w0.shape[-1])
    strides_ok = lists or all(
        (int(np.prod(g[0].shape[1:])) * np.dtype(g[0].dtype).itemsize) % 16 == 0 for g in groups)
    return groups, E, I, quant, dtype, strides_ok
