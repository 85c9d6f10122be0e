"""Importing GPTQ, AWQ and MLX 4-bit weights (jax_nbx.loaders): each
format's packer and dequantization are written here from the formats' specs
(independent of the module's unpacking), and the imported int4 weights must
dequantize to the format's own float32 values bit for bit; act-order GPTQ
down projections are absorbed into gate/up columns; whole MoE layers match a
float64 reference on the formats' dequantized weights."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx
from jax_nbx.loaders import absorb_act_order, from_awq, from_gptq, from_mlx, permute_columns

from conftest import np_moe, rel_err

pytestmark = pytest.mark.fast

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds column 8m + AWQ_ORDER[i]
BF16 = np.dtype(jnp.bfloat16)


# --- the formats' packers (from their specs) ---------------------------------------

def _asym(w: np.ndarray, scale_dtype=np.float16):
    """Asymmetric 4-bit over axis 0 of ``w`` (GPTQ's/AWQ's rule): scale =
    (max - min) / 15 (min <= 0 <= max, as GPTQ's quantizer), zero = round(-min
    / scale), q = clamp(round(w / scale) + zero, 0, 15); the stored 16-bit
    scale is the one q is computed with."""
    mn, mx = np.minimum(w.min(0), 0), np.maximum(w.max(0), 0)
    s = ((mx - mn) / 15).astype(scale_dtype)
    s32 = s.astype(np.float32)
    zero = np.clip(np.round(-mn / s32), 0, 15).astype(np.int64)
    q = np.clip(np.round(w / s32) + zero, 0, 15).astype(np.int64)
    return q, s, zero


def _words(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] values 0..15 -> int32 words, nibble j at bits 4j."""
    u = np.zeros(nibbles.shape[:-1], np.uint32)
    for j in range(8):
        u |= nibbles[..., j].astype(np.uint32) << np.uint32(4 * j)
    return u.view(np.int32)


def gptq_pack(W: np.ndarray, G: int, g_idx=None, zero_col=None, scale_dtype=np.float16):
    """GPTQ v1 checkpoint tensors and the format's dequantization (float32):
    (qweight, qzeros, scales, g_idx, W_format).  ``zero_col``: a column forced
    to all-positive weights in group 0, so its zero is 0 and v1 stores -1,
    which reads back as nibble 15 (offset 16): the format's arithmetic, not
    the quantizer's intent, is what an importer must follow."""
    K, N = W.shape
    W = W.copy()
    if zero_col is not None:
        rows = (np.arange(K) // G == 0) if g_idx is None else (g_idx == 0)
        W[rows, zero_col] = np.abs(W[rows, zero_col]) + 0.01
    g_idx = np.arange(K) // G if g_idx is None else g_idx
    q = np.zeros((K, N), np.int64)
    scales = np.zeros((K // G, N), scale_dtype)
    znib = np.zeros((K // G, N), np.int64)
    for g in range(K // G):
        rows = g_idx == g
        q[rows], scales[g], zero = _asym(W[rows], scale_dtype)
        znib[g] = (zero - 1) & 0xF  # stored zero - 1, as a nibble
    qweight = _words(q.reshape(K // 8, 8, N).transpose(0, 2, 1))  # row 8i+j in bits 4j of [i, n]
    qzeros = _words(znib.reshape(K // G, N // 8, 8))               # column 8m+j in bits 4j of [g, m]
    w_fmt = scales.astype(np.float32)[g_idx] * (q - (znib[g_idx] + 1)).astype(np.float32)
    return qweight, qzeros, scales, g_idx.astype(np.int32), w_fmt


def awq_pack(W: np.ndarray, G: int):
    """AutoAWQ GEMM tensors and ``(q - z) * scales`` in float32."""
    K, N = W.shape
    q = np.zeros((K, N), np.int64)
    scales = np.zeros((K // G, N), np.float16)
    z = np.zeros((K // G, N), np.int64)
    for g in range(K // G):
        q[g * G:(g + 1) * G], scales[g], z[g] = _asym(W[g * G:(g + 1) * G])

    def pack(a):  # [R, N] -> [R, N/8], nibble i = column 8m + AWQ_ORDER[i]
        return _words(a.reshape(a.shape[0], N // 8, 8)[..., AWQ_ORDER])

    rep = np.arange(K) // G
    w_fmt = (q - z[rep]).astype(np.float32) * scales.astype(np.float32)[rep]
    return pack(q), pack(z), scales, w_fmt


def mlx_pack(W: np.ndarray, G: int, dtype):
    """mlx.core.quantize's affine tensors for ``W [K, N]`` (stored out x in,
    ``[N, K/8]`` uint32, groups along K) and ``q * scale + bias`` in float32,
    returned ``[K, N]``."""
    Wt = W.T  # [N, K]
    N, K = Wt.shape
    g = Wt.reshape(N, K // G, G)
    mn, mx = g.min(-1), g.max(-1)
    scales = ((mx - mn) / 15).astype(dtype)
    biases = mn.astype(dtype)
    s32, b32 = scales.astype(np.float32)[..., None], biases.astype(np.float32)[..., None]
    q = np.clip(np.round((g - b32) / s32), 0, 15).astype(np.int64)  # [N, K/G, G]
    weight = _words(q.reshape(N, K // 8, 8)).view(np.uint32)  # element 8i+j in bits 4j of word i
    w_fmt = (q.astype(np.float32) * s32 + b32).reshape(N, K)
    return weight, scales, biases, w_fmt.T


def assert_bits_equal(ours, want):
    """Equal float32 bit patterns (-0.0 and +0.0 taken as one)."""
    a = np.asarray(ours, np.float32) + np.float32(0)
    b = np.asarray(want, np.float32) + np.float32(0)
    assert a.shape == b.shape
    diff = a.view(np.uint32) != b.view(np.uint32)
    assert not diff.any(), (f"{diff.sum()} of {diff.size} differ, e.g. {a[diff][:4]} vs {b[diff][:4]}")


def _dq(qw):
    return np.asarray(qw.dequantize(jnp.float32))


def _rand(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# --- one matrix, bit for bit -------------------------------------------------------

@pytest.mark.parametrize("G", [32, 64, 128])
def test_gptq_is_bit_exact(G):
    K, N = 256, 40
    qweight, qzeros, scales, g_idx, w_fmt = gptq_pack(_rand(G, K, N), G, zero_col=3)
    assert ((qzeros.view(np.uint32) >> 12) & 0xF)[0, 0] == 15  # the stored -1 is there
    qw = from_gptq(qweight, qzeros, scales)
    assert (qw.kind, qw.group_size, qw.shape) == ("int4", G, (K, N))
    assert qw.q.dtype == jnp.uint8 and qw.scale.dtype == jnp.float32 and qw.zero.dtype == jnp.float32
    assert_bits_equal(_dq(qw), w_fmt)
    assert_bits_equal(_dq(from_gptq(qweight, qzeros, scales, g_idx, group_size=G)), w_fmt)
    qw2, perm = from_gptq(qweight, qzeros, scales, g_idx, allow_row_permutation=True)
    assert perm is None
    assert_bits_equal(_dq(qw2), w_fmt)


def test_gptq_bf16_scales_are_exact_too():
    K, N, G = 128, 16, 32
    qweight, qzeros, scales, _, w_fmt = gptq_pack(_rand(5, K, N), G, scale_dtype=BF16)
    assert scales.dtype == BF16
    assert_bits_equal(_dq(from_gptq(qweight, qzeros, scales)), w_fmt)


@pytest.mark.parametrize("G", [32, 64, 128])
def test_awq_is_bit_exact(G):
    K, N = 256, 48
    qweight, qzeros, scales, w_fmt = awq_pack(_rand(G + 1, K, N), G)
    qw = from_awq(qweight, qzeros, scales)
    assert (qw.kind, qw.group_size, qw.shape, qw.scale.dtype) == ("int4", G, (K, N), jnp.float32)
    assert_bits_equal(_dq(qw), w_fmt)
    # the interleave matters: reading the nibbles in plain order gives other weights
    plain = from_awq(_plain_order(qweight), _plain_order(qzeros), scales)
    assert not np.array_equal(_dq(plain), w_fmt)


def _plain_order(words):
    """AWQ words re-packed without the interleave (nibble i = column 8m + i)."""
    u = words.view(np.uint32)
    nib = np.stack([(u >> np.uint32(4 * i)) & 0xF for i in range(8)], -1)  # nib[..., i]: column AWQ_ORDER[i]
    return _words(nib[..., np.argsort(AWQ_ORDER)])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("G", [32, 64, 128])
def test_mlx_is_bit_exact(G, dtype):
    K, N = 256, 24
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    weight, scales, biases, w_fmt = mlx_pack(_rand(G + 2, K, N), G, dt)
    assert weight.shape == (N, K // 8) and weight.dtype == np.uint32 and scales.shape == (N, K // G)
    qw = from_mlx(weight, scales, biases, group_size=G)
    assert (qw.kind, qw.group_size, qw.shape, qw.scale.dtype) == ("int4", G, (K, N), jnp.float32)
    assert_bits_equal(_dq(qw), w_fmt)


def test_gptq_act_order_is_refused_or_a_row_permutation():
    K, N, G = 256, 40, 64
    rng = np.random.default_rng(11)
    g_idx = rng.permutation(np.arange(K) // G)  # every group exactly G rows, scattered
    qweight, qzeros, scales, g_idx, w_fmt = gptq_pack(_rand(12, K, N), G, g_idx=g_idx)
    with pytest.raises(ValueError, match=r"g_idx: .*act-order.*only a down projection"):
        from_gptq(qweight, qzeros, scales, g_idx)
    qw, perm = from_gptq(qweight, qzeros, scales, g_idx, allow_row_permutation=True)
    assert perm.dtype == np.int64 and sorted(perm) == list(range(K))
    assert np.array_equal(g_idx[perm], np.arange(K) // G)
    assert_bits_equal(_dq(qw), w_fmt[perm])
    uneven = g_idx.copy()
    uneven[np.flatnonzero(uneven == 0)[0]] = 1
    with pytest.raises(ValueError, match=r"exactly group_size=64 rows"):
        from_gptq(qweight, qzeros, scales, uneven, allow_row_permutation=True)


def test_permute_columns_is_lossless():
    K, N, G = 128, 32, 32
    qweight, qzeros, scales, _, w_fmt = gptq_pack(_rand(3, K, N), G)
    qw = from_gptq(qweight, qzeros, scales)
    perm = np.random.default_rng(4).permutation(N)
    assert_bits_equal(_dq(permute_columns(qw, perm)), w_fmt[:, perm])
    q8 = nbx.formats.get("int8").quantize_matrix(jnp.asarray(w_fmt, jnp.float32), None, jnp.float32)
    assert_bits_equal(_dq(permute_columns(q8, perm)), _dq(q8)[:, perm])
    assert_bits_equal(permute_columns(w_fmt, perm), w_fmt[:, perm])
    stacked = nbx.QuantizedWeight(*(jnp.stack([a, a]) for a in (qw.q, qw.scale, qw.zero)),
                                  kind="int4", group_size=G)
    perms = np.stack([perm, np.arange(N)])
    out = _dq(permute_columns(stacked, perms))
    assert_bits_equal(out[0], w_fmt[:, perm])
    assert_bits_equal(out[1], w_fmt)
    with pytest.raises(ValueError, match=r"perm is not a permutation of range\(32\)"):
        permute_columns(qw, np.zeros(N, np.int64))


# --- whole MoE layers --------------------------------------------------------------

E, K_TOP, H, I = 4, 2, 256, 128


def _routing(seed, T):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    w, ids = nbx.route(jnp.asarray(rng.standard_normal((T, E)), jnp.float32), K_TOP)
    return x, w, ids


def _mats(seed):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((H, I)) / np.sqrt(H), rng.standard_normal((H, I)) / np.sqrt(H),
             rng.standard_normal((I, H)) / np.sqrt(I)) for _ in range(E)]


def _check_moe(T, impl, experts, ref_gate, ref_up, ref_down, seed):
    x, w, ids = _routing(seed, T)
    ref = np_moe(x, w, ids, nbx.Experts(np.stack(ref_gate), np.stack(ref_up), np.stack(ref_down)))
    y = nbx.fused_moe(x, w, ids, experts, implementation=impl)
    assert rel_err(y, ref) < 1e-5


@pytest.mark.parametrize("T", [1, 33])
@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_gptq_moe_with_act_order_down(T, impl):
    """Per-expert lists, groups of 32 (the op takes one group size for every
    projection): gate/up without act-order, down (K = I) with act-order, its
    row order absorbed into gate's and up's columns; the reference uses the
    checkpoint's order."""
    rng = np.random.default_rng(21)
    gates, ups, downs, rg, ru, rd = [], [], [], [], [], []
    for e, (g, u, d) in enumerate(_mats(20)):
        gt, ut = gptq_pack(g.astype(np.float32), 32), gptq_pack(u.astype(np.float32), 32)
        g_idx = rng.permutation(np.arange(I) // 32)
        dt = gptq_pack(d.astype(np.float32), 32, g_idx=g_idx)
        gq, uq, dq = absorb_act_order(from_gptq(*gt[:3]), from_gptq(*ut[:3], gt[3]),
                                      from_gptq(*dt[:4], allow_row_permutation=True))
        gates.append(gq), ups.append(uq), downs.append(dq)
        rg.append(gt[4]), ru.append(ut[4]), rd.append(dt[4])
        if e == 0:  # the permutation is really there (the check below would hide a no-op otherwise)
            assert not np.array_equal(_dq(dq), dt[4])
    _check_moe(T, impl, nbx.Experts(gates, ups, downs), rg, ru, rd, T)


@pytest.mark.parametrize("T", [1, 33])
@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_awq_moe_stacked(T, impl):
    """Stacked [E, ...] checkpoint tensors in, stacked QuantizedWeights out."""
    packs = [[awq_pack(m.astype(np.float32), 64) for m in mats] for mats in _mats(30)]
    proj = []
    for p in range(3):
        qweight, qzeros, scales = (np.stack([packs[e][p][i] for e in range(E)]) for i in range(3))
        proj.append(from_awq(qweight, qzeros, scales, group_size=64))
    assert proj[0].shape == (E, H, I) and proj[2].shape == (E, I, H)
    refs = [[packs[e][p][3] for e in range(E)] for p in range(3)]
    _check_moe(T, impl, nbx.Experts(*proj), *refs, T + 1)


@pytest.mark.parametrize("T", [1, 33])
@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_mlx_moe_stacked_bf16(T, impl):
    """MLX SwitchLinear-style stacked [E, N, K/8] weights with bfloat16 scales/biases."""
    packs = [[mlx_pack(m.astype(np.float32), 32, BF16) for m in mats] for mats in _mats(40)]
    proj = []
    for p in range(3):
        weight, scales, biases = (np.stack([packs[e][p][i] for e in range(E)]) for i in range(3))
        proj.append(from_mlx(weight, scales, biases, group_size=32))
    refs = [[packs[e][p][3] for e in range(E)] for p in range(3)]
    _check_moe(T, impl, nbx.Experts(*proj), *refs, T + 2)


# --- errors ------------------------------------------------------------------------

def test_errors_name_the_argument():
    K, N = 256, 40
    qweight, qzeros, scales, g_idx, _ = gptq_pack(_rand(1, K, N), 64)
    with pytest.raises(ValueError, match=r"bits=8"):
        from_gptq(qweight, qzeros, scales, bits=8)
    with pytest.raises(ValueError, match=r"group_size=16 .* not supported"):
        from_gptq(qweight, np.zeros((16, N // 8), np.int32), np.zeros((16, N), np.float16))
    with pytest.raises(ValueError, match=r"group_size=128 does not match the shapes: .*group_size=64"):
        from_gptq(qweight, qzeros, scales, group_size=128)
    with pytest.raises(ValueError, match=r"qzeros has shape \(4, 4\); expected \(4, 5\)"):
        from_gptq(qweight, qzeros[:, :4], scales)
    with pytest.raises(ValueError, match=r"scales has shape \(4, 39\); expected"):
        from_gptq(qweight, qzeros, scales[:, :39])
    with pytest.raises(TypeError, match=r"qweight has dtype float32; expected int32 or uint32"):
        from_gptq(qweight.astype(np.float32), qzeros, scales)
    with pytest.raises(TypeError, match=r"scales has dtype float32; expected float16 or bfloat16"):
        from_gptq(qweight, qzeros, scales.astype(np.float32))
    with pytest.raises(ValueError, match=r"g_idx has shape \(255,\); expected \(256,\)"):
        from_gptq(qweight, qzeros, scales, g_idx[:255])
    with pytest.raises(ValueError, match=r"g_idx has values in \[0, 4\]; expected \[0, 4\)"):
        from_gptq(qweight, qzeros, scales, np.where(g_idx == 3, 4, g_idx))

    aw, az, asc, _ = awq_pack(_rand(2, K, N), 32)
    with pytest.raises(ValueError, match=r"bits=8"):
        from_awq(aw, az, asc, bits=8)
    with pytest.raises(ValueError, match=r"qzeros has shape \(7, 5\); expected \(8, 5\)"):
        from_awq(aw, az[:7], asc)
    with pytest.raises(TypeError, match=r"qzeros has dtype int64"):
        from_awq(aw, az.astype(np.int64), asc)
    with pytest.raises(ValueError, match=r"group_size=256 .* not supported"):
        from_awq(aw, az[:1], asc[:1])

    mw, ms, mb, _ = mlx_pack(_rand(3, K, N), 64, np.float16)
    with pytest.raises(ValueError, match=r"bits=3"):
        from_mlx(mw, ms, mb, bits=3)
    with pytest.raises(ValueError, match=r"group_size=32 does not match the shapes"):
        from_mlx(mw, ms, mb, group_size=32)
    with pytest.raises(ValueError, match=r"biases has shape \(40, 3\); expected \(40, 4\)"):
        from_mlx(mw, ms, mb[:, :3])
    with pytest.raises(TypeError, match=r"biases has dtype float64"):
        from_mlx(mw, ms, mb.astype(np.float64))
    with pytest.raises(TypeError, match=r"down_and_perm must be the \(weight, perm\) pair"):
        absorb_act_order(None, None, from_gptq(qweight, qzeros, scales))


def test_from_fp8_block_and_channel_scales_are_exact():
    """from_fp8 against the checkpoints' formula W[n, k] = E4M3(q[n, k]) *
    scale[n // bn, k // bk] (float64): partial blocks along both axes (N=200,
    K=192: groups of 128, the largest of the format's that divides the block's
    128, the last one partial; K=100: one partial group; blocks of 64 columns:
    groups of 64), per-channel [N, 1] and per-tensor [1] scales (groups of
    128 over any K); stacked experts kept."""
    import ml_dtypes

    from jax_nbx.loaders import from_fp8

    rng = np.random.default_rng(0)
    q = rng.integers(0, 256, (3, 200, 192), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 1  # no NaN codes
    f8 = q.view(ml_dtypes.float8_e4m3fn)
    vals = f8.astype(np.float64)
    s = rng.uniform(0.5, 2.0, (3, 2, 2)).astype(np.float32)
    w = from_fp8(f8, s, block=(128, 128))
    assert w.kind == "fp8" and w.group_size == 128 and w.shape == (3, 192, 200) and w.scale.shape == (3, 2, 200)
    want = vals * np.repeat(np.repeat(s.astype(np.float64), 128, 1), 128, 2)[:, :200, :192]
    np.testing.assert_array_equal(np.swapaxes(np.asarray(w.dequantize(jnp.float32)), -1, -2), want.astype(np.float32))
    w100 = from_fp8(f8[..., :100], s[..., :1], block=(128, 128))
    assert w100.group_size == 128 and w100.scale.shape == (3, 1, 200)
    np.testing.assert_array_equal(np.swapaxes(np.asarray(w100.dequantize(jnp.float32)), -1, -2),
                                  want[..., :100].astype(np.float32))
    s64 = rng.uniform(0.5, 2.0, (3, 4, 3)).astype(np.float32)  # [ceil(200/64), ceil(192/64)]
    w64 = from_fp8(f8, s64, block=(64, 64))
    assert w64.group_size == 64 and w64.scale.shape == (3, 3, 200)
    np.testing.assert_array_equal(np.swapaxes(np.asarray(w64.dequantize(jnp.float32)), -1, -2),
                                  (vals * np.repeat(np.repeat(s64.astype(np.float64), 64, 1), 64, 2)[:, :200, :192]
                                   ).astype(np.float32))
    ch = rng.uniform(0.5, 2.0, (3, 200, 1)).astype(np.float32)
    wch = from_fp8(q, ch)
    assert wch.group_size == 128 and wch.scale.shape == (3, 2, 200)
    np.testing.assert_array_equal(np.swapaxes(np.asarray(wch.dequantize(jnp.float32)), -1, -2),
                                  (vals * ch).astype(np.float32))
    t = np.array([0.25], np.float32)
    np.testing.assert_array_equal(np.asarray(from_fp8(f8[0], t).dequantize(jnp.float32)).T,
                                  (vals[0] * 0.25).astype(np.float32))
    with pytest.raises(TypeError, match=r"weight has dtype int8; expected float8_e4m3fn"):
        from_fp8(q.view(np.int8), s, block=(128, 128))
    with pytest.raises(ValueError, match=r"scale has shape \(3, 2, 1\); expected \(3, 2, 2\)"):
        from_fp8(q, s[..., :1], block=(128, 128))
    with pytest.raises(ValueError, match=r"scale has shape \(3, 2, 2\); expected \(3, 2, 1\)"):
        from_fp8(q[..., :100], s, block=(128, 128))
    with pytest.raises(ValueError, match=r"block=\(128, 48\): none of the fp8 format's groups \(128, 64, 32\) "
                                         r"divides the block's 48 columns"):
        from_fp8(q, s, block=(128, 48))
    with pytest.raises(ValueError, match=r"expected per-channel \(3, 200, 1\)"):
        from_fp8(q, s)
