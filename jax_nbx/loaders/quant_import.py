"""Lossless import of GPTQ, AWQ and MLX 4-bit checkpoints into the "int4" format.

jax_nbx's int4 (see `jax_nbx.quant`): one matrix ``W [K, N]`` (``[in, out]``)
in groups of ``G`` (32, 64, 128) rows of K, ``W[k, n] = q[k, n] * scale[g, n]
+ zero[g, n]`` with ``g = k // G``, ``q`` in ``0..15`` packed two per byte along
K (low nibble first).  The three checkpoint formats below are asymmetric 4-bit
with groups along the input axis too, so each converts without requantizing:
the 4-bit values are kept, only the bits move and the zero point becomes an
additive offset.  Conversion is numpy at load time (never under ``jit``); the
results hold jax arrays.

Exactness.  GPTQ and AWQ dequantize ``scale * (q - z)`` with 16-bit float
scales and integers ``q - z`` in ``-16..15``.  Here ``scale`` becomes float32
(exact) and ``zero = -(z * scale)`` in float32: an 11-bit (fp16) or 8-bit
(bf16) significand times an integer below 2**5 fits float32's 24 bits, so the
product is exact, as is ``q * scale``; their sum is ``scale * (q - z)``, itself
representable, so the float32 addition (fused or not) is exact too: our
``q * scale + zero`` equals the format's ``scale * (q - z)`` computed in float32
bit for bit (tests/library/test_quant_import.py checks it).  The scales stay float32:
bfloat16 (our other scale dtype) would round fp16 scales (8 significand bits
against 11).  MLX's affine format is already ``q * scale + bias``: its scales
and biases convert to float32 exactly and the formula is the same.

Act-order (GPTQ ``desc_act``): rows are grouped by ``g_idx[k]``, not by
``k // G``, so a group's rows are scattered over K.  Sorting the rows by group
(``perm``) makes the groups contiguous but changes the matrix to ``W[perm]``.
For a down projection (K = the intermediate axis) that is harmless: the MLP
``(act(x @ Wg) * (x @ Wu)) @ Wd`` equals ``(act(x @ Wg[:, perm]) * (x @
Wu[:, perm])) @ Wd[perm]``, and permuting gate's and up's output columns is
lossless (int4 groups run along K, not N).  `absorb_act_order` does that.
Gate's and up's K is the hidden axis shared with ``x``: their row order cannot
be absorbed, and `from_gptq` refuses act-order there.

Every function accepts leading (expert) axes on its arrays: ``[E, ...]`` in,
a stacked `QuantizedWeight` out.  Biases of the linear layers are not handled
(MoE experts have none in these formats).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from ..formats import GROUP_SIZES, QuantizedWeight

__all__ = ["from_gptq", "from_awq", "from_mlx", "dequantize_mlx", "check_mlx_mode", "permute_columns",
           "absorb_act_order", "AWQ_ORDER", "MLX_MODES"]

# AutoAWQ's GEMM packing: nibble i of a word holds column 8m + AWQ_ORDER[i].
# As in AutoAWQ's awq/utils/packing_utils.py (AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7],
# unpack_awq, reverse_awq_order with AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7],
# dequantize_gemm: (iweight - izeros) * scales, zeros stored as they are).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_REVERSE = tuple(int(i) for i in np.argsort(AWQ_ORDER))  # (0, 4, 1, 5, 2, 6, 3, 7)

_WORD_DTYPES = (np.dtype("int32"), np.dtype("uint32"))
_SCALE16 = (np.dtype("float16"), np.dtype(jnp.bfloat16))
_MLX_SCALES = _SCALE16 + (np.dtype("float32"),)
_SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)


def _array(name: str, a: Any, dtypes: tuple, why: str = "") -> np.ndarray:
    a = np.asarray(a)
    if a.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {a.dtype}; expected {want}{why}")
    if a.ndim < 2:
        raise ValueError(f"{name} has shape {a.shape}; expected a 2-D matrix (with optional leading expert axes)")
    return a


def _check_shape(name: str, a: np.ndarray, want: tuple, what: str) -> None:
    if tuple(a.shape) != tuple(want):
        raise ValueError(f"{name} has shape {tuple(a.shape)}; expected {tuple(want)} ({what})")


def _check_bits(bits: int, fmt: str) -> None:
    if bits != 4:
        raise ValueError(f"bits={bits}: jax_nbx imports 4-bit {fmt} weights only (int4); "
                         f"other widths have no lossless int4 form")


def _group_size(K: int, n_groups: int, group_size, fmt: str, scales_name: str = "scales") -> int:
    """G from the shapes (K / number of groups), checked against ``group_size``."""
    if n_groups <= 0 or K % n_groups:
        raise ValueError(f"{scales_name} has {n_groups} groups for K={K} input rows: K is not a whole "
                         f"number of groups")
    G = K // n_groups
    agrees = group_size is None or group_size == G or (group_size == -1 and n_groups == 1)  # -1: one group
    if not agrees:
        raise ValueError(f"group_size={group_size} does not match the shapes: {scales_name} has "
                         f"{n_groups} groups for K={K} rows, i.e. group_size={G}")
    if G not in GROUP_SIZES:
        raise ValueError(f"group_size={G} ({fmt}: K={K} rows in {n_groups} groups of {scales_name}) "
                         f"is not supported: jax_nbx's int4 groups are one of {GROUP_SIZES} rows")
    return G


def _nibbles_along_rows(words: np.ndarray) -> np.ndarray:
    """uint32 ``[..., R, C]`` packed along rows (row 8i+j in bits 4j.. of word [i, c]) -> uint8 ``[..., 8R, C]``."""
    w = words.view(np.uint32)
    v = (w[..., :, None, :] >> _SHIFTS[:, None]) & 0xF
    return v.reshape(w.shape[:-2] + (w.shape[-2] * 8, w.shape[-1])).astype(np.uint8)


def _nibbles_along_cols(words: np.ndarray) -> np.ndarray:
    """uint32 ``[..., R, C]`` packed along columns (column 8m+j in bits 4j..) -> uint8 ``[..., R, 8C]``."""
    w = words.view(np.uint32)
    v = (w[..., None] >> _SHIFTS) & 0xF
    return v.reshape(w.shape[:-1] + (w.shape[-1] * 8,)).astype(np.uint8)


def _pack_int4(q: np.ndarray) -> np.ndarray:
    """uint8 ``[..., K, N]`` values 0..15 -> jax_nbx's ``[..., K/2, N]`` (low nibble = even row)."""
    return (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).astype(np.uint8)


def _result(q: np.ndarray, scale: np.ndarray, zero: np.ndarray, G: int, name: str) -> QuantizedWeight:
    qw = QuantizedWeight(jnp.asarray(_pack_int4(q)), jnp.asarray(scale, jnp.float32),
                         jnp.asarray(zero, jnp.float32), kind="int4", group_size=G)
    qw.validate(name)
    return qw


def _zero_offset(z: np.ndarray, scale32: np.ndarray) -> np.ndarray:
    """``-(z * scale)`` in float32 (exact for 16-bit scales and integer z <= 16)."""
    return -(z.astype(np.float32) * scale32)


def from_gptq(qweight, qzeros, scales, g_idx=None, *, bits: int = 4, group_size: int | None = None,
              allow_row_permutation: bool = False):
    """One GPTQ linear layer (AutoGPTQ / GPTQModel "v1" checkpoints, as
    transformers/optimum save them) as an int4 `QuantizedWeight` ``[K, N]``.

    The format (AutoGPTQ's ``qlinear_cuda_old.QuantLinear``: ``pack`` and the
    torch dequantization in ``forward``):

    * ``qweight`` int32 ``[K/8, N]`` packed along K: row ``8i + j`` in bits
      ``4j..4j+3`` of word ``[i, n]``;
    * ``qzeros`` int32 ``[K/G, N/8]`` packed along N (column ``8m + j`` in
      bits ``4j..``), storing ``zero - 1`` (read as a nibble, so the offset
      ``z + 1`` is in ``1..16``, exactly as the format's ``& 0xF`` then ``+ 1``);
    * ``scales`` float16 (or bfloat16) ``[K/G, N]``;
    * ``g_idx`` int ``[K]`` (optional): row k's group; ``k // G`` unless
      quantized with act-order;
    * ``W[k] = scales[g] * (q[k] - (z[g] + 1))`` with ``g = g_idx[k]``.

    (GPTQModel's in-memory "v2" format stores the zeros without the ``- 1``;
    its checkpoints are saved as v1 unless their config says
    ``checkpoint_format: gptq_v2``, which this function does not read.)

    Converted: q unchanged (repacked), ``scale = float32(scales)``, ``zero =
    float32(-(z + 1) * scale)``: exact (module docstring), and float32 rather
    than bfloat16, which would round the fp16 scales.

    G is inferred from the shapes (``K / scales.shape[-2]``); ``group_size``,
    when given, must agree.  Leading expert axes are accepted on every array.

    Act-order (``g_idx`` other than ``arange(K) // G``): with
    ``allow_row_permutation=False`` (the default) a ValueError; with True, the
    rows are sorted by group (``perm``, the stable argsort of ``g_idx``,
    int64 ``[..., K]``) and ``(weight, perm)`` is returned, ``weight`` being
    ``W[perm]``; only a down projection's rows can be permuted that way (see
    `absorb_act_order`).  With ``allow_row_permutation=True`` and no act-order
    the result is ``(weight, None)``.

    Raises ValueError (bits, group size, shapes, act-order, groups of unequal
    size) or TypeError (dtypes), naming the argument.
    """
    _check_bits(bits, "GPTQ")
    qweight = _array("qweight", qweight, _WORD_DTYPES)
    qzeros = _array("qzeros", qzeros, _WORD_DTYPES)
    scales = _array("scales", scales, _SCALE16, " (16-bit scales make the conversion exact)")
    lead, K, N = qweight.shape[:-2], qweight.shape[-2] * 8, qweight.shape[-1]
    if scales.ndim != qweight.ndim or scales.shape[:-2] != lead or scales.shape[-1] != N:
        raise ValueError(f"scales has shape {scales.shape}; expected {lead + ('K/G', N)} "
                         f"(groups, out_features) for qweight of shape {qweight.shape}")
    n_groups = scales.shape[-2]
    G = _group_size(K, n_groups, group_size, "GPTQ")
    if N % 8:
        raise ValueError(f"qweight has {N} output columns, not a multiple of 8: GPTQ's qzeros "
                         f"pack 8 columns per int32")
    _check_shape("qzeros", qzeros, lead + (n_groups, N // 8), "K/G groups, N/8 int32 words of 8 zeros")

    q = _nibbles_along_rows(qweight)                              # [..., K, N]
    z = _nibbles_along_cols(qzeros).astype(np.int32) + 1          # [..., K/G, N], 1..16
    s32 = scales.astype(np.float32)
    zero = _zero_offset(z, s32)

    perm = None
    if g_idx is not None:
        g_idx = np.asarray(g_idx)
        if not np.issubdtype(g_idx.dtype, np.integer):
            raise TypeError(f"g_idx has dtype {g_idx.dtype}; expected an integer type")
        _check_shape("g_idx", g_idx, lead + (K,), "one group index per input row")
        if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= n_groups):
            raise ValueError(f"g_idx has values in [{g_idx.min()}, {g_idx.max()}]; expected "
                             f"[0, {n_groups}) (the groups of scales)")
        trivial = np.arange(K) // G
        if not np.array_equal(g_idx, np.broadcast_to(trivial, g_idx.shape)):
            if not allow_row_permutation:
                bad = tuple(int(i) for i in np.argwhere(g_idx != trivial)[0])
                where = f"row {bad[-1]}" + (f" of expert {bad[:-1]}" if lead else "")
                raise ValueError(
                    f"g_idx: this GPTQ weight was quantized with act-order (desc_act): row k "
                    f"belongs to group g_idx[k], not k // {G} (first at {where}: g_idx = "
                    f"{int(g_idx[bad])}, expected {bad[-1] // G}), so a group's rows "
                    f"are not contiguous, and jax_nbx's int4 groups are contiguous rows of K.  Sorting "
                    f"the rows permutes the matrix, which only a down projection can absorb (by "
                    f"permuting gate's and up's output columns); pass allow_row_permutation=True for "
                    f"(weight, perm) and see absorb_act_order")
            counts = np.apply_along_axis(np.bincount, -1, g_idx, minlength=n_groups)
            if np.any(counts != G):
                raise ValueError(f"g_idx puts between {counts.min()} and {counts.max()} rows in a group; "
                                 f"sorted by group, every group must have exactly group_size={G} rows")
            perm = np.argsort(g_idx, axis=-1, kind="stable").astype(np.int64)
            q = np.take_along_axis(q, perm[..., None], axis=-2)
    qw = _result(q, s32, zero, G, "from_gptq")
    return (qw, perm) if allow_row_permutation else qw


def from_awq(qweight, qzeros, scales, *, bits: int = 4, group_size: int | None = None) -> QuantizedWeight:
    """One AWQ linear layer (AutoAWQ's GEMM format, as transformers loads it)
    as an int4 `QuantizedWeight` ``[K, N]``.

    The format (AutoAWQ ``awq/utils/packing_utils.py``: ``unpack_awq``,
    ``reverse_awq_order``, ``dequantize_gemm``):

    * ``qweight`` int32 ``[K, N/8]`` packed along N, interleaved: nibble ``i``
      (bits ``4i..``) of word ``[k, m]`` holds column ``8m + AWQ_ORDER[i]``,
      ``AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``;
    * ``qzeros`` int32 ``[K/G, N/8]``, the same packing, zeros as they are;
    * ``scales`` float16 (or bfloat16) ``[K/G, N]``;
    * ``W[k] = (q[k] - z[g]) * scales[g]``, ``g = k // G``.

    Converted: ``scale = float32(scales)``, ``zero = float32(-z * scale)``,
    exact (module docstring); float32, not bfloat16, which would round fp16
    scales.  G is inferred from the shapes; ``group_size``, when given, must
    agree.  Leading expert axes are accepted.  Raises ValueError/TypeError
    naming the argument.
    """
    _check_bits(bits, "AWQ")
    qweight = _array("qweight", qweight, _WORD_DTYPES)
    qzeros = _array("qzeros", qzeros, _WORD_DTYPES)
    scales = _array("scales", scales, _SCALE16, " (16-bit scales make the conversion exact)")
    lead, K, N = qweight.shape[:-2], qweight.shape[-2], qweight.shape[-1] * 8
    if scales.ndim != qweight.ndim or scales.shape[:-2] != lead or scales.shape[-1] != N:
        raise ValueError(f"scales has shape {scales.shape}; expected {lead + ('K/G', N)} "
                         f"(groups, out_features = 8 * qweight.shape[-1]) for qweight of shape {qweight.shape}")
    n_groups = scales.shape[-2]
    G = _group_size(K, n_groups, group_size, "AWQ")
    _check_shape("qzeros", qzeros, lead + (n_groups, N // 8), "K/G groups, N/8 int32 words of 8 zeros")

    def unpack(words):  # [..., R, N/8] -> [..., R, N], AWQ's interleave undone
        v = _nibbles_along_cols(words)
        v = v.reshape(v.shape[:-1] + (N // 8, 8))[..., list(_AWQ_REVERSE)]
        return v.reshape(v.shape[:-2] + (N,))

    q, z = unpack(qweight), unpack(qzeros)
    s32 = scales.astype(np.float32)
    return _result(q, s32, _zero_offset(z, s32), G, "from_awq")


# mlx.core.quantize's modes (MLX 0.32): (default group size, default bits) of each, as
# mlx_lm.utils.quantize_model's defaults_for_mode and nn.QuantizedLinear take them.
MLX_MODES: dict[str, tuple[int, int]] = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
MLX_AFFINE_BITS = (2, 3, 4, 5, 6, 8)  # mlx.core.quantize's affine widths


# MLX's float modes, each read as the jax_nbx format of the same name: (bits, block)
MLX_FLOAT_MODES: dict[str, tuple[int, int]] = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
MLX_READ_MODES = ("affine",) + tuple(MLX_FLOAT_MODES)  # the modes jax_nbx reads


def check_mlx_mode(mode: str) -> None:
    """The one place where MLX's quantization modes are checked: ``"affine"``
    converts to int4 (4 bits), the float modes ``"mxfp4"``, ``"nvfp4"`` and
    ``"mxfp8"`` are read as they are (the formats of those names); anything
    else is refused naming it (ValueError)."""
    if mode in MLX_READ_MODES:
        return
    if mode in MLX_MODES:
        raise ValueError(f"mode={mode!r}: jax_nbx does not read MLX's {mode} weights yet (it reads "
                         f"modes {MLX_READ_MODES})")
    raise ValueError(f"mode={mode!r} is not one of MLX's quantization modes {tuple(MLX_MODES)}")


def _from_mlx_float(weight, scales, biases, bits: int, group_size: int | None, mode: str) -> QuantizedWeight:
    """`from_mlx` of a float mode: MLX's bytes are the format's, transposed
    (lossless).  ``weight`` uint32 ``[..., N, K·bits/32]``, words low bits
    first, so its bytes are the format's along K (4-bit: the even element in
    the low nibble); ``scales`` uint8 ``[..., N, K/block]`` (E8M0 for the mx
    modes, E4M3 for nvfp4)."""
    want_bits, block = MLX_FLOAT_MODES[mode]
    if bits not in (None, want_bits):
        raise ValueError(f"bits={bits}: MLX's {mode} mode is {want_bits} bits")
    if group_size not in (None, block):
        raise ValueError(f"group_size={group_size}: MLX's {mode} mode has blocks of {block}")
    if biases is not None:
        raise ValueError(f"biases: MLX's {mode} mode has none (pass biases=None)")
    weight = _array("weight", weight, _WORD_DTYPES)
    kind = "E4M3" if mode == "nvfp4" else "E8M0"
    scales = _array("scales", scales, (np.dtype(np.uint8),), f" ({mode}'s {kind} scales)")
    lead, N, K = weight.shape[:-2], weight.shape[-2], weight.shape[-1] * 32 // want_bits
    _check_shape("scales", scales, lead + (N, K // block), f"(out_features, K/{block})")
    by = np.ascontiguousarray(weight).astype("<u4").view(np.uint8)     # [..., N, K·bits/8]
    q = np.ascontiguousarray(np.swapaxes(by, -1, -2))                   # [..., K·bits/8, N]
    s = np.ascontiguousarray(np.swapaxes(scales, -1, -2))               # [..., K/block, N]
    return QuantizedWeight(jnp.asarray(q), jnp.asarray(s), None, kind=mode, group_size=block)


def _mlx_scales(name: str, a, mode: str) -> np.ndarray:
    why = ""
    if a is not None and np.asarray(a).dtype == np.uint8:
        why = (f" (uint8 scales are those of MLX's float modes mxfp4, nvfp4 and mxfp8: pass mode= to name it; "
               f"got mode={mode!r})")
    return _array(name, a, _MLX_SCALES, why)


def from_mlx(weight, scales, biases, *, bits: int | None = None, group_size: int | None = None,
             mode: str = "affine") -> QuantizedWeight:
    """One MLX affine-quantized linear layer (``mlx.core.quantize``, mode
    "affine"; ``mlx.nn.QuantizedLinear``'s ``weight``/``scales``/``biases``)
    as an int4 `QuantizedWeight` ``[K, N]`` (transposed from MLX's out x in).

    The format: ``weight`` uint32 ``[N, K/8]`` (``nn.Linear``'s out x in)
    packed along K, low bits first (element ``8i + j`` of a row in bits
    ``4j..`` of word ``i``); ``scales``, ``biases`` ``[N, K/G]`` (float16,
    bfloat16 or float32); ``W[n, k] = q * scales[n, g] + biases[n, g]``
    (MLX's documented ``w = s * q + beta``), groups of G along K.

    Converted: scale and bias to float32 (exact), transposed to ``[K/G, N]``;
    ``zero = bias``: the same formula.  ``group_size`` (MLX's default 64; a
    checkpoint's config.json says which; None, the default: from the shapes;
    mxfp4: 32) must agree with the shapes.  Leading expert axes (e.g. mlx-lm's ``SwitchLinear``
    ``[E, N, K/8]``) are accepted.

    ``mode``: MLX's quantization mode: ``"affine"`` (the default), or a
    float mode, read as the jax_nbx format of the same name, its bytes as
    they are (transposed, lossless; no biases): ``"mxfp4"`` (``weight``
    uint32 ``[N, K/8]``, ``scales`` uint8 E8M0 ``[N, K/32]``), ``"nvfp4"``
    (``[N, K/8]``, E4M3 ``[N, K/16]``; weights MLX quantized with a
    ``global_scale`` are not representable: that scale is not passed here)
    or ``"mxfp8"`` (``[N, K/4]``, E8M0 ``[N, K/32]``).  ``bits``: None (the
    default) is the mode's (affine: 4); anything else is refused naming the mode
    (`check_mlx_mode`).  Raises ValueError/TypeError naming the argument.
    """
    check_mlx_mode(mode)
    if mode in MLX_FLOAT_MODES:
        return _from_mlx_float(weight, scales, biases, bits, group_size, mode)
    bits = 4 if bits is None else bits
    _check_bits(bits, "MLX")
    weight = _array("weight", weight, _WORD_DTYPES)
    scales = _mlx_scales("scales", scales, mode)
    biases = _array("biases", biases, _MLX_SCALES)
    lead, N, K = weight.shape[:-2], weight.shape[-2], weight.shape[-1] * 8
    if scales.ndim != weight.ndim or scales.shape[:-2] != lead or scales.shape[-2] != N:
        raise ValueError(f"scales has shape {scales.shape}; expected {lead + (N, 'K/G')} "
                         f"(out_features, groups) for weight of shape {weight.shape}")
    G = _group_size(K, scales.shape[-1], group_size, "MLX")
    _check_shape("biases", biases, scales.shape, "like scales")
    q = np.swapaxes(_nibbles_along_cols(weight), -1, -2)           # [..., K, N]
    s32 = np.swapaxes(scales.astype(np.float32), -1, -2)
    b32 = np.swapaxes(biases.astype(np.float32), -1, -2)
    return _result(np.ascontiguousarray(q), np.ascontiguousarray(s32), np.ascontiguousarray(b32),
                   G, "from_mlx")


def dequantize_mlx(weight, scales, biases, *, bits: int, group_size: int | None = None,
                   mode: str = "affine") -> np.ndarray:
    """An MLX affine-quantized matrix as float32 ``[..., N, K]`` (its own
    out x in layout), at any width MLX's affine mode takes (2, 3, 4, 5, 6, 8
    bits): what `load_moe` does with a quantized router (mlx-lm keeps
    Qwen3-MoE's at 8 bits), which jax_nbx holds in float.

    ``weight`` uint32 ``[..., N, K·bits/32]``: each row a little-endian bit
    stream, element ``k`` in bits ``k·bits ..`` (words low bits first; at 3,
    5 and 6 bits an element may straddle two words); ``scales``, ``biases``
    ``[..., N, K/G]``; ``W = q * scale + bias`` per group of G along K,
    computed in float32 (what ``mx.dequantize`` gives with float32 scales and
    biases; bit for bit with 16-bit ones).  ``group_size`` None: from the
    shapes (any G dividing K).  ``mode`` as `from_mlx` (a float mode: its
    format's dequantization, exact in float32)."""
    check_mlx_mode(mode)
    if mode in MLX_FLOAT_MODES:
        w = _from_mlx_float(weight, scales, biases, bits, group_size, mode).dequantize(jnp.float32)
        return np.ascontiguousarray(np.swapaxes(np.asarray(w), -1, -2))
    if bits not in MLX_AFFINE_BITS:
        raise ValueError(f"bits={bits}: MLX's affine mode packs {MLX_AFFINE_BITS} bits")
    weight = _array("weight", weight, _WORD_DTYPES)
    scales = _mlx_scales("scales", scales, mode)
    biases = _array("biases", biases, _MLX_SCALES)
    lead, N, words = weight.shape[:-2], weight.shape[-2], weight.shape[-1]
    if (words * 32) % bits:
        raise ValueError(f"weight has {words} words per row: not a whole number of {bits}-bit values")
    K = words * 32 // bits
    if scales.ndim != weight.ndim or scales.shape[:-2] != lead or scales.shape[-2] != N:
        raise ValueError(f"scales has shape {scales.shape}; expected {lead + (N, 'K/G')} "
                         f"(out_features, groups) for weight of shape {weight.shape}")
    n_groups = scales.shape[-1]
    if n_groups <= 0 or K % n_groups or (group_size is not None and group_size * n_groups != K):
        raise ValueError(f"scales has {n_groups} groups for K={K} ({bits}-bit weight of shape {weight.shape})"
                         + ("" if group_size is None else f"; group_size={group_size} does not match"))
    _check_shape("biases", biases, scales.shape, "like scales")
    G = K // n_groups
    by = np.ascontiguousarray(weight).view(np.uint32).astype("<u4").view(np.uint8)
    stream = np.unpackbits(by.reshape(lead + (N, words * 4)), axis=-1, bitorder="little")
    vals = stream.reshape(lead + (N, K, bits)).astype(np.uint32) << np.arange(bits, dtype=np.uint32)
    q = vals.sum(-1, dtype=np.uint32).astype(np.float32).reshape(lead + (N, n_groups, G))
    w = q * scales.astype(np.float32)[..., None] + biases.astype(np.float32)[..., None]
    return w.reshape(lead + (N, K)).astype(np.float32)


def _check_perm(perm, N: int, lead: tuple) -> np.ndarray:
    perm = np.asarray(perm)
    if not np.issubdtype(perm.dtype, np.integer):
        raise TypeError(f"perm has dtype {perm.dtype}; expected an integer type")
    if perm.shape not in ((N,), lead + (N,)):
        raise ValueError(f"perm has shape {perm.shape}; expected ({N},) or {lead + (N,)} "
                         f"(one permutation of the {N} output columns)")
    if not np.array_equal(np.sort(perm, axis=-1), np.broadcast_to(np.arange(N), perm.shape)):
        raise ValueError(f"perm is not a permutation of range({N})")
    return perm.astype(np.int64)


def permute_columns(w, perm):
    """``w[..., :, perm]``: a weight's output columns permuted (lossless).

    ``w``: a `QuantizedWeight` (int8 or int4: columns carry their own scales
    and zeros, int4 groups run along K) or a dense array ``[..., K, N]``.
    ``perm``: ``[N]``, or ``[..., N]`` matching a stacked weight's leading
    axes (one permutation per expert)."""
    if not isinstance(w, QuantizedWeight):
        a = jnp.asarray(w)
        p = _check_perm(perm, a.shape[-1], tuple(a.shape[:-2]))
        return jnp.take_along_axis(a, jnp.asarray(p)[..., None, :], axis=-1) if p.ndim > 1 else a[..., p]
    N = w.shape[-1]
    p = jnp.asarray(_check_perm(perm, N, tuple(w.shape[:-2])))

    def cols(a, matrix: bool):
        if a is None:
            return None
        if p.ndim == 1:
            return a[..., p]
        return jnp.take_along_axis(a, p[..., None, :] if matrix else p, axis=-1)

    int8 = w.kind == "int8"
    return QuantizedWeight(cols(w.q, True), cols(w.scale, not int8), cols(w.zero, True),
                           kind=w.kind, group_size=w.group_size)


def absorb_act_order(gate, up, down_and_perm):
    """One expert's ``(gate, up, down)`` with down's act-order row permutation
    absorbed: ``down_and_perm`` is `from_gptq`'s ``(weight, perm)`` (with
    ``allow_row_permutation=True``; ``weight = Wd[perm]``), and gate's and up's
    output columns (the intermediate axis) are permuted by the same ``perm``,
    so that ``glu(x @ Wg[:, perm], x @ Wu[:, perm]) @ Wd[perm]`` equals the
    checkpoint's MLP: the gated unit acts column by column, and summing over
    the intermediate axis does not depend on its order.  ``perm=None`` (no
    act-order) leaves gate and up as they are.  gate/up: `QuantizedWeight`s
    (any format) or dense arrays ``[H, I]`` (or stacked, with ``[E, I]``
    perms).  A loader::

        gate, up, down = absorb_act_order(
            from_gptq(*gate_tensors), from_gptq(*up_tensors),
            from_gptq(*down_tensors, g_idx=down_g_idx, allow_row_permutation=True))
    """
    if not (isinstance(down_and_perm, tuple) and len(down_and_perm) == 2):
        raise TypeError("down_and_perm must be the (weight, perm) pair from_gptq(..., "
                        "allow_row_permutation=True) returns")
    down, perm = down_and_perm
    if perm is None:
        return gate, up, down
    return permute_columns(gate, perm), permute_columns(up, perm), down
