"""A float64 twin of the CPU handler's ``precision="int8"`` arithmetic
(xla_ffi/abi.h "int8 arithmetic"), written from that definition: the rows of
x (and of the intermediate) quantized in float32 exactly as the handler does,
then every product and sum in float64 on the dequantized values."""
from __future__ import annotations

import numpy as np

from jax_nbx import contract

BLOCK = contract.INT8_BLOCK


def quantize_rows(v) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [T, K], d float32 [T, ceil(K / BLOCK)]) of float32 rows v [T, K]."""
    v = np.asarray(v, np.float32)
    T, K = v.shape
    q = np.zeros((T, K), np.int8)
    d = np.zeros((T, -(-K // BLOCK)), np.float32)
    for b0 in range(0, K, BLOCK):
        blk = v[:, b0:b0 + BLOCK]
        finite = np.isfinite(blk).all(axis=1)
        amax = np.where(finite, np.abs(np.where(np.isfinite(blk), blk, 0)).max(axis=1), 0).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = np.where(amax > 0, np.float32(127) / amax, 0).astype(np.float32)
            codes = np.clip(np.rint((blk * inv[:, None]).astype(np.float32)), -127, 127)
        codes = np.where((finite & (amax > 0))[:, None], codes, 0)
        q[:, b0:b0 + BLOCK] = codes.astype(np.int8)
        d[:, b0 // BLOCK] = np.where(finite, amax / np.float32(127), np.nan)
    return q, d


def dequantized_rows(v) -> np.ndarray:
    """float64 [T, K]: v's int8 codes times their blocks' d (NaN rows where a
    block held a NaN or an infinity)."""
    q, d = quantize_rows(v)
    dd = np.repeat(d.astype(np.float64), BLOCK, axis=1)[:, :q.shape[1]]
    out = q.astype(np.float64) * dd
    return np.where(np.isnan(dd).any(axis=1, keepdims=True), np.nan, out)


def half_step(v) -> np.ndarray:
    """float64 [T, K]: d / 2 of each value's block, the most its dequantized
    value moves from it."""
    _, d = quantize_rows(v)
    return np.repeat(d.astype(np.float64), BLOCK, axis=1)[:, :np.shape(v)[1]] / 2
