"""gpt-oss's MXFP4 experts (its release format) as mxfp4 `Experts` with biases.

The tensors, as the released checkpoints and transformers'
``integrations/mxfp4.py`` (``convert_moe_packed_tensors``) lay them out, per
layer under ``mlp.experts.``:

* ``gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]`` and ``gate_up_proj_scales``
  uint8 ``[E, 2I, H/32]``: for each output row, blocks of 32 E2M1 codes along
  the input axis, two per byte (element ``2j`` in the low nibble), one E8M0
  scale per block; gate's and up's rows interleaved (gate the even rows:
  ``GptOssExperts`` takes ``gate_up[..., ::2]`` and ``[..., 1::2]``);
* ``down_proj_blocks`` ``[E, H, I/32, 16]``, ``down_proj_scales`` ``[E, H, I/32]``;
* ``gate_up_proj_bias`` ``[E, 2I]`` (interleaved alike), ``down_proj_bias`` ``[E, H]``.

These are jax_nbx's mxfp4 bytes (``xla_ffi/formats/mxfp4.h``) along the rows
of ``[N, K]`` matrices: the rows are de-interleaved and the matrices
transposed to ``[K/2, N]`` and ``[K/32, N]``, the bytes unchanged (lossless).
The biases become float32 (exact from bfloat16).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from ..experts import Experts
from ..formats import QuantizedWeight

__all__ = ["from_gpt_oss_mxfp4", "gpt_oss_biases"]


def _mxfp4(blocks: np.ndarray, scales: np.ndarray, name: str) -> QuantizedWeight:
    """``blocks [E, N, K/32, 16]``, ``scales [E, N, K/32]`` -> mxfp4 ``[E, K, N]``."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise TypeError(f"{name}_blocks / {name}_scales have dtypes {blocks.dtype} / {scales.dtype}; expected uint8")
    if blocks.ndim != 4 or blocks.shape[-1] != 16 or scales.shape != blocks.shape[:-1]:
        raise ValueError(f"{name}_blocks has shape {blocks.shape} and {name}_scales {scales.shape}; expected "
                         "[E, N, K/32, 16] and [E, N, K/32]")
    E, N, nb = scales.shape
    q = np.ascontiguousarray(np.swapaxes(blocks.reshape(E, N, nb * 16), -1, -2))   # [E, K/2, N]
    s = np.ascontiguousarray(np.swapaxes(scales, -1, -2))                            # [E, K/32, N]
    w = QuantizedWeight(jnp.asarray(q), jnp.asarray(s), None, kind="mxfp4", group_size=32)
    w.validate(name)
    return w


def from_gpt_oss_mxfp4(gate_up_blocks: Any, gate_up_scales: Any, down_blocks: Any, down_scales: Any,
                       gate_up_bias: Any = None, down_bias: Any = None) -> Experts:
    """gpt-oss's MXFP4 experts (the module docstring's tensors) as stacked
    mxfp4 `Experts` (gate, up ``[E, H, I]``, down ``[E, I, H]``) with float32
    biases.  Raises TypeError/ValueError naming the tensor."""
    gub, gus = np.asarray(gate_up_blocks), np.asarray(gate_up_scales)
    db, ds = np.asarray(down_blocks), np.asarray(down_scales)
    if gub.ndim != 4 or gub.shape[1] % 2:
        raise ValueError(f"gate_up_proj_blocks has shape {gub.shape}; expected [E, 2I, H/32, 16]")
    if gus.shape != gub.shape[:-1]:
        raise ValueError(f"gate_up_proj_scales has shape {gus.shape}; expected {gub.shape[:-1]} (gate_up_proj_blocks "
                         f"{gub.shape} without its last axis)")
    gate = _mxfp4(gub[:, 0::2], gus[:, 0::2], "gate_up_proj (gate rows)")
    up = _mxfp4(gub[:, 1::2], gus[:, 1::2], "gate_up_proj (up rows)")
    down = _mxfp4(db, ds, "down_proj")
    E, H, I = gate.shape
    if down.shape != (E, I, H):
        raise ValueError(f"down_proj_blocks gives [E, I, H] = {down.shape}; expected {(E, I, H)} from gate_up_proj")
    return Experts(gate, up, down, **gpt_oss_biases(gate_up_bias, down_bias, E, H, I))


def gpt_oss_biases(gate_up_bias: Any, down_bias: Any, E: int, H: int, I: int) -> dict:
    """gpt-oss's ``gate_up_proj_bias [E, 2I]`` (gate and up interleaved) and
    ``down_proj_bias [E, H]`` (either None) as `Experts`' float32
    ``gate_bias``, ``up_bias``, ``down_bias``; ValueError naming a misshaped one."""
    biases = {}
    if gate_up_bias is not None:
        b = np.asarray(gate_up_bias).astype(np.float32)
        if b.shape != (E, 2 * I):
            raise ValueError(f"gate_up_proj_bias has shape {b.shape}; expected {(E, 2 * I)}")
        biases.update(gate_bias=jnp.asarray(b[:, 0::2]), up_bias=jnp.asarray(b[:, 1::2]))
    if down_bias is not None:
        b = np.asarray(down_bias).astype(np.float32)
        if b.shape != (E, H):
            raise ValueError(f"down_proj_bias has shape {b.shape}; expected {(E, H)}")
        biases["down_bias"] = jnp.asarray(b)
    return biases
