"""Quantizing experts: `quantize` and `dequantize` of whole `Experts`, and
what format a set of experts is in (`quant_format`, `is_quantized`,
`has_tensor_scale`).

Sits above `jax_nbx.formats` (each format's math on one matrix, the
registry) and `jax_nbx.experts` (the pytree): formats know nothing of
experts; this module applies a format to every projection of them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .experts import Experts
from .formats import QuantizedWeight, get, quantized_names

__all__ = ["quantize", "dequantize", "quant_format", "is_quantized", "has_tensor_scale"]

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
    128; mxfp4, mxfp8: 32; nvfp4: 16; int8 takes none: None or 0).
    ``scale_dtype``: int8's, int4's and fp8's scales (float32 or bfloat16;
    the mx formats' are E8M0 bytes, nvfp4's E4M3 bytes).  Raises ValueError
    for an unknown format, a group size the format does not take, a K the
    group does not divide for formats that take whole groups only (int4,
    nvfp4: fp8, mxfp4 and mxfp8 take a partial last group, ``ceil(K / group)``
    scales), a K that does not pack (4-bit codes: odd), a NaN or infinite weight (naming its projection, expert and
    position: no format's codes hold one, so it would come out finite and
    wrong; checked on concrete arrays; under ``jax.jit``, which sees no
    values, it is carried as NaN: the group (int8: column) holding it gets a
    NaN scale -- float NaN, E8M0 255, E4M3 0x7F -- and dequantizes to all
    NaN, so the tokens routed there come out NaN), TypeError for a scale
    dtype other than float32/bfloat16."""
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
    if not fmt.grouped:
        fmt.check_group_size(group_size, what="quantize: ")
    gs = (fmt.default_group_size if group_size is None else group_size) if fmt.grouped else None
    _check_finite(experts)

    def one(a):
        return fmt.quantize_matrix(jnp.asarray(a).astype(jnp.float32), gs, scale_dtype)

    if experts.is_list:
        return Experts(*([one(a) for a in getattr(experts, n)] for n in ("gate", "up", "down")))
    return Experts(one(experts.gate), one(experts.up), one(experts.down))


def _check_finite(experts: Experts) -> None:
    """ValueError naming the first NaN or infinite weight of plain experts
    (projection, expert, [k, n]); arrays being traced are not checked (the
    formats carry their non-finite weights as NaN groups)."""
    for name in ("gate", "up", "down"):
        arrays = getattr(experts, name)
        for e, a in (enumerate(arrays) if experts.is_list else [(None, arrays)]):
            if isinstance(a, jax.core.Tracer) or bool(jnp.all(jnp.isfinite(a))):
                continue
            bad = np.argwhere(~np.isfinite(np.asarray(jnp.asarray(a, jnp.float32))))[0]
            if e is None:
                e, bad = int(bad[0]), bad[1:]
            value = float(np.asarray(jnp.asarray(getattr(experts, name)[e], jnp.float32))[tuple(bad)])
            raise ValueError(f"quantize: experts.{name} of expert {e} holds {value} at [{int(bad[0])}, "
                             f"{int(bad[1])}] ([k, n] of its [K, N] matrix): no weight format holds a "
                             "non-finite weight; fix or drop it before quantizing")


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


def has_tensor_scale(experts: Experts) -> bool:
    """Whether any of the experts' quantized matrices carries a tensor scale."""
    return any((isinstance(m, QuantizedWeight) and m.tensor_scale is not None) for m in experts.flat())
