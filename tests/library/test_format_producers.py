"""The weight formats against producers nobody here wrote: ml_dtypes'
E2M1, E4M3 and E8M0 element types, and MLX 0.32.4's mx.quantize /
mx.dequantize / mx.gather_qmm with mode="mxfp4", "nvfp4" and "mxfp8"
(tests/data/mlx_lm/<mode>_matrices.safetensors, written by
benchmarks/make_loader_fixtures.py; MLX is not imported here)."""
from __future__ import annotations

import pathlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

import jax_nbx as nbx
from jax_nbx.formats.minifloat import E2M1_VALUES, e2m1_codes, e4m3_codes, e4m3_values, e8m0_values
from jax_nbx.loaders import dequantize_mlx, from_mlx

pytestmark = pytest.mark.fast

MLX = pathlib.Path(__file__).resolve().parents[1] / "data" / "mlx_lm"


def test_e2m1_and_e8m0_values_are_ml_dtypes():
    """Every E2M1 code's value and every E8M0 byte's (255: NaN; 0: 2^-127)."""
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(E2M1_VALUES, codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert np.array_equal(np.signbit(E2M1_VALUES), codes >= 8)
    s = np.arange(256, dtype=np.uint8)
    want = s.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(e8m0_values(jnp.asarray(s))), want)


def test_e2m1_rounding_is_ml_dtypes():
    """Our rounding to E2M1 codes (ties to even, saturating, the sign of -0
    kept) is ml_dtypes' float32 -> float4_e2m1fn cast, bit for bit, on every
    tie, around every value and far outside the range."""
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    grid = np.concatenate([E2M1_VALUES[:8], mids, np.nextafter(mids, 0), np.nextafter(mids, 9),
                           [6.5, 7.0, 100.0, np.inf, 1e-30, 0.0]]).astype(np.float32)
    v = np.concatenate([grid, -grid, np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 3])
    want = v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(e2m1_codes(jnp.asarray(v))), want)


def test_e4m3_values_and_rounding_are_ml_dtypes():
    """Every E4M3 byte's value (S.1111.111: NaN), and our rounding to E4M3
    (ties to even, saturating at 448) is ml_dtypes' cast of the clipped value."""
    b = np.arange(256, dtype=np.uint8)
    want = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(e4m3_values(jnp.asarray(b)))
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got[~np.isnan(got)]), (b >= 128)[~np.isnan(got)])
    grid = want[~np.isnan(want)]
    mids = (grid[1:128] + grid[:127]) / 2  # the positive ties (grid[0:128] ascends)
    v = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9), [449.0, 464.0, 1e6, 1e-12],
                        np.random.default_rng(0).standard_normal(4096) * 50]).astype(np.float32)
    v = np.concatenate([v, -v])
    np.testing.assert_array_equal(np.asarray(e4m3_codes(jnp.asarray(v))),
                                  np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


MODES = ["mxfp4", "nvfp4", "mxfp8"]
BLOCK = {"mxfp4": 32, "nvfp4": 16, "mxfp8": 32}


def _mlx(mode: str = "mxfp4"):
    return load_file(str(MLX / f"{mode}_matrices.safetensors"))


@pytest.mark.parametrize("mode", MODES)
def test_mlx_float_modes_dequantize_bit_for_bit(mode):
    """from_mlx(mode=...) reads MLX's bytes as they are; our dequantization
    equals mx.dequantize's (float32), transposed."""
    t = _mlx(mode)
    w = from_mlx(t["weight"], t["scales"], None, mode=mode)
    per_byte = 2 if mode != "mxfp8" else 1
    assert w.kind == mode and w.shape == (3, 96, 40) and w.q.shape == (3, 96 // per_byte, 40)
    assert w.scale.shape == (3, 96 // BLOCK[mode], 40)
    np.testing.assert_array_equal(np.swapaxes(np.asarray(w.dequantize(jnp.float32)), -1, -2), t["dequantized"])
    np.testing.assert_array_equal(dequantize_mlx(t["weight"], t["scales"], None, bits=8 if mode == "mxfp8" else 4,
                                                 mode=mode), t["dequantized"])


@pytest.mark.parametrize("mode", MODES)
def test_mlx_gather_qmm_is_our_dequantization(mode):
    """mx.gather_qmm (MLX's own kernel: x @ W[ids].T) against float64
    products with our dequantized weights."""
    t = _mlx(mode)
    w = np.swapaxes(np.asarray(from_mlx(t["weight"], t["scales"], None, mode=mode).dequantize(jnp.float32)), -1, -2)
    x, ids = t["x"].astype(np.float64), t["ids"]
    ref = np.einsum("tk,tnk->tn", x[:, 0], w[ids].astype(np.float64))
    got = t["gather_qmm"][:, 0]
    assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))


def test_quantize_mxfp8_is_mlx_bit_for_bit():
    """jax_nbx.quantize(..., "mxfp8") on the float32 matrices MLX quantized:
    MLX's E8M0 scales and E4M3 bytes exactly."""
    t = _mlx("mxfp8")
    w = np.swapaxes(t["w"], -1, -2)                                # [E, K, N]
    ours = nbx.quantize(nbx.Experts(w, w, w[:, :64, :64].copy()), "mxfp8").gate
    theirs = from_mlx(t["weight"], t["scales"], None, mode="mxfp8")
    np.testing.assert_array_equal(np.asarray(ours.scale), np.asarray(theirs.scale))
    np.testing.assert_array_equal(np.asarray(ours.q), np.asarray(theirs.q))


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4"])
def test_quantize_fp4_agrees_with_mlx(mode):
    """jax_nbx.quantize(..., mode) on the float32 matrices MLX quantized: the
    same scale in every block (mxfp4: E8M0 2^ceil(log2(amax / 6)), no value
    clipped, a block of zeros 2^0; nvfp4: E4M3(amax / 6)), the same values
    except at exact E2M1 ties, where MLX 0.32's CPU rounds toward zero and we
    round to the even code as ml_dtypes does."""
    t = _mlx(mode)
    w = np.swapaxes(t["w"], -1, -2)                                # [E, K, N]
    ours = nbx.quantize(nbx.Experts(w, w, w[:, :64, :64].copy()), mode).gate
    theirs = from_mlx(t["weight"], t["scales"], None, mode=mode)
    np.testing.assert_array_equal(np.asarray(ours.scale), np.asarray(theirs.scale))
    qa, qb = np.asarray(ours.q), np.asarray(theirs.q)
    codes = lambda q: np.stack([q & 15, q >> 4], axis=-2).reshape(q.shape[0], -1, q.shape[-1])  # noqa: E731
    ca, cb = codes(qa), codes(qb)
    decode = e8m0_values if mode == "mxfp4" else e4m3_values
    with np.errstate(invalid="ignore", divide="ignore"):  # (nvfp4: a block of zeros has scale 0)
        scaled = np.abs(w / np.repeat(np.asarray(decode(jnp.asarray(theirs.scale))), BLOCK[mode], axis=-2))
    ties = np.isin(scaled, [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # (MLX writes a negative value that rounds to zero as +0, code 0; we keep its sign, code 8,
    # as ml_dtypes does: the same value)
    diff = E2M1_VALUES[ca] != E2M1_VALUES[cb]
    assert not np.any(diff & ~ties) and diff.sum() >= 4
    assert np.all(ca[ties] % 2 == 0)                                              # ours: the even code
    assert np.all(np.abs(E2M1_VALUES[cb[diff]]) < np.abs(E2M1_VALUES[ca[diff]]))  # MLX: toward zero
