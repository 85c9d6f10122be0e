"""Lossless import of NVFP4 checkpoints into the "nvfp4" format with its tensor scale.

jax_nbx's nvfp4 (``jax_nbx.formats.nvfp4``): one matrix ``W [K, N]`` (``[in,
out]``), ``W[k, n] = E2M1(code[k, n]) * E4M3(scale[k // 16, n])`` times the
matrix's optional float32 ``tensor_scale`` (`QuantizedWeight.tensor_scale`,
applied by the kernels to each column's sum).  compressed-tensors'
``nvfp4-pack-quantized`` (its ``compressors/nvfp4``; llm-compressor's NVFP4
exports) stores ``nn.Linear``'s ``[out, in]`` as:

* ``weight_packed`` uint8 ``[N, K/2]``: E2M1 codes, two per byte along K, the
  even k in the low nibble (its ``pack_fp4_to_uint8``);
* ``weight_scale`` float8_e4m3fn ``[N, K/16]``;
* ``weight_global_scale`` float32 ``[1]``: ``W = E2M1 * (E4M3 / global_scale)``
  (its ``dequantize``: the group scale divided by the global one).

Converted: the codes and the E4M3 bytes unchanged, transposed to ``[K/2, N]``
and ``[K/16, N]``; ``tensor_scale = 1 / global_scale`` rounded to float32 once
(the one rounding of the import: each weight then differs from
compressed-tensors' own float32 value by at most an ulp or two).  ModelOpt's
NVFP4 (``weight_scale_2``, a multiplier) would map to ``tensor_scale`` as is;
no ModelOpt checkpoint has been checked here, so the loaders refuse its
``quant_method`` by name.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..checkpoint_files import CheckpointError, check_value, config_value
from ..formats import QuantizedWeight

__all__ = ["from_nvfp4", "is_compressed_tensors_nvfp4"]

_BYTES = (np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e4m3fn))


def tensor_scale_of(global_scale: Any) -> np.float32:
    """The tensor scale (a multiplier) of compressed-tensors' ``weight_global_scale``
    (a divisor: ``[1]`` or a scalar): 1 / it in float32; ValueError unless positive and finite."""
    g = np.asarray(global_scale, np.float32).reshape(-1)
    if g.size != 1 or not np.isfinite(g[0]) or g[0] <= 0:
        raise ValueError(f"global_scale must be one positive finite float32; got {np.asarray(global_scale)!r}")
    return np.float32(1.0) / g[0]


def from_nvfp4(packed: Any, scale: Any, *, global_scale: Any = None, tensor_scale: Any = None) -> QuantizedWeight:
    """One ``[out, in]`` NVFP4 matrix as a `QuantizedWeight` ``[K/2, N]``.

    ``packed`` uint8 ``[N, K/2]`` (low nibble: even k), ``scale`` E4M3
    ``[N, K/16]`` (float8_e4m3fn or its uint8 bits); at most one of
    ``global_scale`` (compressed-tensors' divisor, ``[1]`` or a scalar) and
    ``tensor_scale`` (a multiplier).  ValueError/TypeError naming the argument."""
    packed, scale = np.asarray(packed), np.asarray(scale)
    if packed.dtype != np.uint8 or packed.ndim != 2:
        raise TypeError(f"packed must be uint8 [N, K/2]; got {packed.dtype} {packed.shape}")
    if scale.dtype not in _BYTES or scale.shape != (packed.shape[0], packed.shape[1] * 2 // 16) \
            or (packed.shape[1] * 2) % 16:
        raise ValueError(f"scale must be float8_e4m3fn [N, K/16] = {(packed.shape[0], packed.shape[1] * 2 // 16)} "
                         f"for packed {packed.shape} (K = {packed.shape[1] * 2} a multiple of 16); "
                         f"got {scale.dtype} {scale.shape}")
    if global_scale is not None and tensor_scale is not None:
        raise ValueError("pass global_scale (compressed-tensors) or tensor_scale (a multiplier), not both")
    ts = None
    if global_scale is not None:
        ts = tensor_scale_of(global_scale)
    elif tensor_scale is not None:
        ts = np.asarray(tensor_scale, np.float32).reshape(())
    return QuantizedWeight(jnp.asarray(np.ascontiguousarray(packed.T)),
                           jnp.asarray(np.ascontiguousarray(scale.view(np.uint8).T)), None,
                           None if ts is None else jnp.asarray(ts, jnp.float32), kind="nvfp4", group_size=16)


def is_compressed_tensors_nvfp4(qc: dict, where: str = "checkpoint") -> bool:
    """Whether a compressed-tensors ``quantization_config`` is NVFP4 weights
    (``nvfp4-pack-quantized``: 4-bit float weights, groups of 16);
    CheckpointError (``where``: the config file) for a value of the wrong type or
    an nvfp4-pack-quantized config whose weights are anything else."""
    s = "quantization_config"
    groups = {f"{s}.config_groups.{name}": g for name, g in
              config_value(qc, "config_groups", where, "dict", {}, section=s, nullable=True).items()}
    groups = {label: check_value({} if g is None else g, label, where, "dict") for label, g in groups.items()}
    formats = {config_value(qc, "format", where, "str", None, section=s, nullable=True)}
    formats |= {config_value(g, "format", where, "str", None, section=label, nullable=True)
                for label, g in groups.items()}
    if "nvfp4-pack-quantized" not in formats:
        return False
    for label, g in groups.items():
        w = config_value(g, "weights", where, "dict", {}, section=label, nullable=True)
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", 16):
            raise CheckpointError(f"{where}: compressed-tensors nvfp4-pack-quantized weights with num_bits="
                                  f"{w.get('num_bits')}, type={w.get('type')!r}, group_size={w.get('group_size')} "
                                  "are not read; NVFP4 is 4-bit float weights in groups of 16")
    return True
