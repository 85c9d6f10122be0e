"""Lossless import of FP8 checkpoints into the "fp8" format.

jax_nbx's fp8 (``jax_nbx.formats.fp8``): one matrix ``W [K, N]`` (``[in,
out]``), ``W[k, n] = E4M3(q[k, n]) * scale[k // G, n]``, ``G`` 32, 64 or 128.
The checkpoints store ``nn.Linear``'s ``[out, in]`` E4M3 weight and float32
scales that multiply it:

* block scales (transformers' fine-grained FP8, ``quant_method: "fp8"``,
  DeepSeek-V3/R1 and Qwen3 "-FP8"): ``weight_scale_inv`` float32
  ``[ceil(N / bn), ceil(K / bk)]`` for ``weight_block_size = [bn, bk]``
  (``[128, 128]``): ``W[n, k] = q[n, k] * weight_scale_inv[n // bn, k // bk]``
  (transformers ``integrations/finegrained_fp8.py``: the scale is the block's
  ``amax / 448``, the "inverse" of the quantizer's multiplier);
* per-channel or per-tensor scales (compressed-tensors ``float-quantized``,
  strategy ``"channel"`` / ``"tensor"``): ``weight_scale`` ``[N, 1]`` or
  ``[1]``: ``W[n, k] = q[n, k] * weight_scale[n]``.

Converted: the E4M3 bytes unchanged, transposed to ``[K, N]``; each group of
``G`` rows of K gets its block's or column's scale, so every weight is the same
product of the same two numbers: exact.  ``G`` is the largest of 128, 64, 32
that divides the block's ``bk`` (any K: the fp8 format takes a partial last
group, ``ceil(K / G)`` scale rows, as the checkpoints' ``ceil(K / bk)`` block
columns do; a group never crosses a block's edge, since ``G`` divides ``bk``);
128 for per-channel and per-tensor scales.  A block no group divides is
refused.  Activations are not quantized here (the checkpoints' dynamic
activation scales are a runtime choice of their kernels; jax_nbx multiplies
in the input's dtype).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..checkpoint_files import CheckpointError, check_value, config_value
from ..formats import QuantizedWeight

__all__ = ["from_fp8", "checkpoint_block"]

_E4M3 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.uint8))
_GROUPS = (128, 64, 32)  # the fp8 format's group sizes, largest first


def from_fp8(weight: Any, scale: Any, *, block: tuple[int, int] | None = None) -> QuantizedWeight:
    """One FP8 E4M3 linear layer (``[..., N, K]``, out x in; leading expert
    axes kept) as an fp8 `QuantizedWeight` ``[..., K, N]``.

    ``weight``: float8_e4m3fn (or its uint8 bits).  ``block``: ``(bn, bk)``
    for block scales (``scale`` float32 ``[..., ceil(N/bn), ceil(K/bk)]``,
    transformers' ``weight_scale_inv``); None for per-channel
    (``[..., N, 1]`` or ``[..., N]``) or per-tensor (``[..., 1]``) scales.
    Scales float32, bfloat16 or float16 (float16 widened to float32, exact).
    Any K: the group is the largest of 128, 64, 32 dividing ``bk`` (128
    without a block), the last group partial where it does not divide K.
    Raises TypeError/ValueError naming the argument."""
    w = np.asarray(weight)
    if w.dtype not in _E4M3:
        raise TypeError(f"weight has dtype {w.dtype}; expected float8_e4m3fn (or its uint8 bits)")
    if w.ndim < 2:
        raise ValueError(f"weight has shape {w.shape}; expected [..., out, in]")
    q = w.view(np.uint8)
    s = np.asarray(scale)
    if s.dtype not in (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)):
        raise TypeError(f"scale has dtype {s.dtype}; expected float32, bfloat16 or float16")
    if s.dtype == np.float16:
        s = s.astype(np.float32)
    lead, N, K = q.shape[:-2], q.shape[-2], q.shape[-1]
    if block is not None:
        bn, bk = (int(b) for b in block)
        if bn < 1 or bk < 1:
            raise ValueError(f"block=({bn}, {bk}): expected two positive integers [rows, columns]")
        # G divides bk: each group lies inside one block column, so its one scale is exact (any K:
        # the last group, like the last block, may be partial)
        G = next((g for g in _GROUPS if bk % g == 0), None)
        if G is None:
            raise ValueError(f"block=({bn}, {bk}): none of the fp8 format's groups (128, 64, 32) divides the "
                             f"block's {bk} columns of K (in_features), so a group would straddle two block "
                             "scales")
        want = lead + (-(-N // bn), -(-K // bk))
        if s.shape != want:
            raise ValueError(f"scale has shape {s.shape}; expected {want} ([ceil(out/{bn}), ceil(in/{bk})] "
                             f"block scales for weight {q.shape})")
        cols = s[..., np.arange(N) // bn, :]                            # [..., N, ceil(K/bk)]
        per = cols[..., (np.arange(-(-K // G)) * G) // bk]              # [..., N, ceil(K/G)]
    else:
        G = _GROUPS[0]  # one scale per column: any group fits it
        if s.shape in (lead + (N, 1), lead + (N,)):
            col = s.reshape(lead + (N,))
        elif s.shape in (lead + (1,), lead + (1, 1), ()):
            col = np.broadcast_to(s.reshape(lead + (1,)) if lead or s.ndim else s.reshape(1), lead + (N,))
        else:
            raise ValueError(f"scale has shape {s.shape}; expected per-channel {lead + (N, 1)} or per-tensor "
                             f"{lead + (1,)} for weight {q.shape} (block scales: pass block=)")
        per = np.broadcast_to(col[..., :, None], lead + (N, -(-K // G)))
    qt = np.ascontiguousarray(np.swapaxes(q, -1, -2))
    st = np.ascontiguousarray(np.swapaxes(per, -1, -2))
    out = QuantizedWeight(jnp.asarray(qt), jnp.asarray(st), None, kind="fp8", group_size=G)
    out.validate("from_fp8")
    return out


def _block(b, label: str, where: str) -> tuple[int, int]:
    """A block ``[bn, bk]`` of a config (``label``): two positive integers, ``bk`` a multiple of one
    of the fp8 format's groups (`from_fp8`), else CheckpointError."""
    if not (isinstance(b, (list, tuple)) and len(b) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and 1 <= v < 2 ** 31 for v in b)):
        raise CheckpointError(f"{where}: {label}={b!r} is not [rows, columns]: two positive integers (below 2**31)")
    if all(b[1] % g for g in _GROUPS):
        raise CheckpointError(f"{where}: {label}={b!r}: none of the fp8 format's groups (128, 64, 32) divides the "
                              f"block's {b[1]} columns of K (in_features), so a group would straddle two block "
                              "scales; not read")
    return int(b[0]), int(b[1])


def _compressed_tensors_block(qc: dict, where: str) -> tuple[int, int] | None:
    """The weights' block (bn, bk) of a compressed-tensors FP8 quantization_config (None:
    per-channel or per-tensor); anything but 8-bit float weights in the float-quantized format is
    refused naming the key (CheckpointError)."""
    s = "quantization_config"
    fmt = config_value(qc, "format", where, "str", None, section=s, nullable=True)
    if fmt not in (None, "float-quantized"):
        raise CheckpointError(f"{where}: quantization_config.format={fmt!r} (compressed-tensors) is not read; only "
                              "'float-quantized' (FP8 E4M3 weights) converts")
    blocks = set()
    for name, group in config_value(qc, "config_groups", where, "dict", {}, section=s, nullable=True).items():
        gs = f"{s}.config_groups.{name}"
        group = check_value({} if group is None else group, gs, where, "dict")
        w = config_value(group, "weights", where, "dict", {}, section=gs, nullable=True)
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise CheckpointError(f"{where}: {gs}.weights has num_bits={w.get('num_bits')!r}, type="
                                  f"{w.get('type')!r}; only 8-bit float (FP8) reads")
        strategy = w.get("strategy")
        if strategy == "block":
            b = config_value(w, "block_structure", where, "list", [128, 128], section=gs + ".weights", nullable=True)
            blocks.add(_block(b, gs + ".weights.block_structure", where))
        elif strategy not in ("channel", "tensor"):
            raise CheckpointError(f"{where}: {gs}.weights.strategy={strategy!r} is not read (channel, tensor or "
                                  "block)")
    if len(blocks) > 1:
        raise CheckpointError(f"{where}: compressed-tensors groups with different blocks {sorted(blocks)}")
    return next(iter(blocks), None)


def checkpoint_block(qc: dict, scale_inv: bool, where: str = "checkpoint") -> tuple[int, int] | None:
    """The block (bn, bk) of a checkpoint's FP8 weights from its ``quantization_config`` ``qc``:
    transformers' ``weight_block_size`` (FineGrainedFP8Config's default [128, 128]) for
    ``weight_scale_inv``; compressed-tensors' block (None: per-channel / per-tensor) for
    ``weight_scale``.  CheckpointError (``where``: the config file) for a block that is not two
    positive integers or a compressed-tensors config that is not FP8."""
    if scale_inv:
        b = config_value(qc, "weight_block_size", where, "list", [128, 128], section="quantization_config")
        return _block(b, "quantization_config.weight_block_size", where)
    method = config_value(qc, "quant_method", where, "str", "", section="quantization_config", nullable=True)
    if method.lower() == "compressed-tensors":
        return _compressed_tensors_block(qc, where)
    return None
