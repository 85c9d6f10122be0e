"""Quantized experts: the int8, int4, mxfp4, fp8, mxfp8 and nvfp4 formats,
quantize/dequantize, the op on quantized experts (the CPU handler's streaming
decode kernels and its dequantizing packers, the "xla" path), and the errors.

The ASan tier (.ci/sanitize, the CI's longest job) runs the int8/int4 cases
(and mxfp4's of the tests before the other formats came); the other formats'
kernels run there through the kernel testers (tests/cpu/test_kernels.py:
qstream1/2, qpack, every format)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from conftest import TOL, make_problem, np_moe, rel_err
from support.handlers import ffi_forward as _ffi_forward

SAN = pytest.mark.sanitize
NEW = ("fp8", "mxfp8", "nvfp4")  # outside the ASan tier's op tests (see above)


def _params(cases):
    """(kind, G) cases, those of the formats before NEW in the ASan tier."""
    return [pytest.param(k, g, marks=() if k in NEW else SAN, id=f"{k}-{g}") for k, g in cases]


# max |y - ref| / max |ref| against the ORIGINAL float weights (random Gaussian
# weights, the hard case for 4 bits); against the dequantized weights the op is exact to f32.
QUANT_ERR = {("int8", None): 0.03, ("int4", 32): 0.2, ("int4", 64): 0.25, ("int4", 128): 0.3,
             ("mxfp4", 32): 0.35, ("fp8", 128): 0.07, ("mxfp8", 32): 0.07, ("nvfp4", 16): 0.27}


@pytest.mark.parametrize("kind,G", _params(QUANT_ERR))
def test_quantization_error_is_bounded(kind, G):
    """The op on quantized experts equals float64 on their dequantized weights
    (tests/suite for every backend) and stays within the format's error of the
    original float weights."""
    x, w, ids, ex = make_problem(7, 33, 5, 3, 256, 128)
    q = nbx.quantize(ex, kind, group_size=G)
    y = jax.jit(lambda *a: nbx.fused_moe(*a, implementation="cpu"))(x, w, ids, q)
    assert rel_err(y, np_moe(x, w, ids, nbx.dequantize(q))) < TOL["f32"]
    assert rel_err(y, np_moe(x, w, ids, ex)) < QUANT_ERR[(kind, G)]


@SAN
@pytest.mark.parametrize("T", [1, 222])
def test_quantized_ffi_odd_sizes_bands_and_bad_ids(T):
    x, w, ids, ex = make_problem(T, T, 7, 3, 128, 64, jnp.bfloat16, jnp.bfloat16)
    q = nbx.quantize(ex, "int4", group_size=64, scale_dtype=jnp.bfloat16)
    ref = np_moe(x, w, ids, nbx.dequantize(q, jnp.float32))
    y = nbx.fused_moe(x, w, ids, q)
    assert bool(jnp.all(jnp.isfinite(y))) and rel_err(y, ref) < TOL["bf16"]
    cap = nbx.memory.fused_moe_workspace_bytes(max(T // 2, 1), 3, 7, 128, 64)  # bands of ~T/2 (T > 1)
    y_bands = nbx.fused_moe(x, w, ids, q, max_workspace_bytes=cap)
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(y_bands.astype(jnp.float32)))
    with pytest.raises(Exception, match=r"topk_ids\[0, 1\] = 7 is outside \[0, 7\)"):
        nbx.fused_moe(x, w, ids.at[0, 1].set(7), q, implementation="ffi")


FORMATS = [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128), ("mxfp4", 32), ("fp8", 32), ("fp8", 64),
           ("mxfp8", 32), ("nvfp4", 16)]
SCALES = {"sf32": jnp.float32, "sbf16": jnp.bfloat16}


def run_quant_poisoned(x, w, ids, q, band_tokens=0):
    """The CPU handler on quantized experts writing into a NaN-filled output
    buffer (the test-only twin target), so any row it fails to write shows."""
    return _ffi_forward(x, w, ids, *q.flat(), activation="swiglu", band_tokens=band_tokens,
                        lists=q.is_list, poison=True)


def _shape(kind, G, wide=False):
    """(H, I): int8 any size (odd, not multiples of any VL); int4 multiples of
    the group.  ``wide``: I past one streamed item (1024 columns)."""
    if kind == "int8":
        return (129, 1100) if wide else (129, 257)
    return (2 * G, 1152) if wide else (3 * G, 2 * G) if G < 128 else (128, 256)


# T=1 and T=3 (k=2 of E=5: every expert <= 6 rows) take the streaming decode
# kernels; T=64 (about 26 rows per expert) the dequantizing packers; each with
# float32 and bfloat16 scales, stacked and per-expert lists
STREAM_PACK = [(1, False, "sf32"), (3, True, "sbf16"), (64, False, "sbf16"), (64, True, "sf32")]


@pytest.mark.parametrize("T,lists,scale", STREAM_PACK, ids=[f"T{t}-{'lists' if li else 'stacked'}-{sc}"
                                                              for t, li, sc in STREAM_PACK])
@pytest.mark.parametrize("kind,G", _params(FORMATS))
def test_quant_stream_and_pack_match_float64(kind, G, scale, lists, T, isa):
    H, I = _shape(kind, G)
    x, w, ids, ex = make_problem(T * 7 + (G or 0), T, 5, 2, H, I)
    if lists:
        ex = nbx.Experts(*([a[e] for e in range(5)] for a in (ex.gate, ex.up, ex.down)))
    q = nbx.quantize(ex, kind, group_size=G, scale_dtype=SCALES[scale])
    d = nbx.dequantize(q, jnp.float32)
    ref = np_moe(x, w, ids, d.stacked() if lists else d)
    y = run_quant_poisoned(x, w, ids, q)
    assert bool(jnp.all(jnp.isfinite(y))), "unwritten (poisoned) rows in the output"
    assert rel_err(y, ref) < TOL["f32"]


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("kind,G", _params([("int8", None), ("int4", 64)])
                         + [("mxfp4", 32), ("fp8", 32), ("nvfp4", 16)])
def test_quant_stream_past_one_item(kind, G, T, isa):
    """N past kMaxStreamCols (1024): several streamed items per projection."""
    H, I = _shape(kind, G, wide=True)
    x, w, ids, ex = make_problem(5, T, 3, 1, H, I)
    q = nbx.quantize(ex, kind, group_size=G, scale_dtype=jnp.bfloat16)
    ref = np_moe(x, w, ids, nbx.dequantize(q, jnp.float32))
    y = run_quant_poisoned(x, w, ids, q)
    assert bool(jnp.all(jnp.isfinite(y))), "unwritten (poisoned) rows in the output"
    assert rel_err(y, ref) < TOL["f32"]


@pytest.mark.parametrize("xd", ["f32", "bf16"])
@pytest.mark.parametrize("band", [1, 7])
@pytest.mark.parametrize("kind,G", _params([("int8", None), ("int4", 32), ("mxfp4", 32), ("fp8", 64), ("mxfp8", 32),
                                            ("nvfp4", 16)]))
def test_quant_bands_are_bit_identical(kind, G, band, xd, isa):
    """Unbanded, each expert has ~24 rows (packed); in bands of 1 or 2 tokens
    (bf16 x: token bands) each has <= 6 (streamed): the same bits."""
    H, I = _shape(kind, G)
    xdt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[xd]
    x, w, ids, ex = make_problem(19, 60, 5, 2, H, I, x_dtype=xdt)
    q = nbx.quantize(ex, kind, group_size=G, scale_dtype=jnp.bfloat16)
    whole = run_quant_poisoned(x, w, ids, q, band_tokens=0)
    banded = run_quant_poisoned(x, w, ids, q, band_tokens=band)
    assert bool(jnp.all(jnp.isfinite(banded.astype(jnp.float32))))
    assert rel_err(whole, np_moe(x, w, ids, nbx.dequantize(q, jnp.float32))) < TOL[xd]
    np.testing.assert_array_equal(np.asarray(banded.astype(jnp.float32)),
                                  np.asarray(whole.astype(jnp.float32)))


def test_quantized_grads_flow_to_x_and_weights_only():  # (the reference's VJP: outside the ASan tier)
    x, w, ids, ex = make_problem(4, 10, 4, 2, 64, 32)
    q = nbx.quantize(ex, "int8")
    gx, gw = jax.grad(lambda x, w: jnp.sum(nbx.fused_moe(x, w, ids, q) ** 2), argnums=(0, 1))(x, w)
    d = nbx.dequantize(q)
    rx, rw = jax.grad(lambda x, w: jnp.sum(nbx.fused_moe(x, w, ids, d, implementation="xla") ** 2),
                      argnums=(0, 1))(x, w)
    assert rel_err(gx, np.asarray(rx, np.float64)) < 1e-4 and rel_err(gw, np.asarray(rw, np.float64)) < 1e-4


@SAN
def test_int8_format():
    w = jnp.asarray([[1.0, -2.0], [0.5, 4.0], [-1.0, 0.0]])  # K=3, N=2
    q = nbx.quantize(nbx.Experts(w[None], w[None], w.T[None]), "int8").gate
    np.testing.assert_allclose(np.asarray(q.scale[0]), [1 / 127, 4 / 127], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(q.q[0]), [[127, -64], [64, 127], [-127, 0]])


@SAN
def test_int4_packing_low_nibble_first():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    q = nbx.quantize(nbx.Experts(w[None], w[None], jnp.tile(w.T, (1, 2))[None]), "int4", group_size=32).gate
    assert q.q.shape == (1, 32, 32) and q.q.dtype == jnp.uint8 and q.scale.shape == (1, 2, 32)
    packed = np.asarray(q.q[0])
    lo, hi = packed & 0xF, packed >> 4
    s, z = np.asarray(q.scale[0]), np.asarray(q.zero[0])
    rebuilt = np.empty((64, 32))
    rebuilt[0::2], rebuilt[1::2] = lo, hi
    rebuilt = rebuilt * np.repeat(s, 32, 0) + np.repeat(z, 32, 0)
    np.testing.assert_allclose(np.asarray(q.dequantize())[0], rebuilt, rtol=1e-6, atol=1e-6)
    assert np.max(np.abs(rebuilt - np.asarray(w))) <= np.max(s) / 2 + 1e-6


@SAN
def test_bf16_scales():
    x, w, ids, ex = make_problem(1, 8, 4, 2, 128, 64)
    q = nbx.quantize(ex, "int4", group_size=64, scale_dtype=jnp.bfloat16)
    assert q.gate.scale.dtype == jnp.bfloat16 and q.dtype == jnp.bfloat16
    assert rel_err(nbx.fused_moe(x, w, ids, q), np_moe(x, w, ids, nbx.dequantize(q, jnp.float32))) < 1e-5


@SAN
def test_quantize_errors():
    x, w, ids, ex = make_problem(2, 4, 4, 2, 96, 64)
    with pytest.raises(ValueError, match=r"K=96 .* not divisible by group_size=64"):
        nbx.quantize(ex, "int4", group_size=64)
    with pytest.raises(ValueError, match="group_size must be one of"):
        nbx.quantize(ex, "int4", group_size=48)
    with pytest.raises(ValueError, match=r"kind must be one of \('int8', 'int4', 'mxfp4', 'fp8', 'mxfp8', "
                                         r"'nvfp4'\); got 'int2'"):
        nbx.quantize(ex, "int2")
    q = nbx.quantize(ex, "int8")
    with pytest.raises(ValueError, match="already quantized"):
        nbx.quantize(q, "int8")
    with pytest.raises(TypeError, match="mixed dense and quantized experts"):
        nbx.fused_moe(x, w, ids, nbx.Experts(q.gate, ex.up, ex.down))
    bad = nbx.QuantizedWeight(q.up.q, q.up.scale[:, :10], kind="int8")
    with pytest.raises(ValueError, match=r"experts.up.scale has shape \(4, 10\); expected \(4, 64\)"):
        nbx.fused_moe(x, w, ids, nbx.Experts(q.gate, bad, q.down))
    lists = nbx.Experts(*([a[e] for e in range(4)] for a in (ex.gate, ex.up, ex.down)))
    ql = nbx.quantize(lists, "int8")
    mixed = nbx.Experts(ql.gate[:3] + [lists.gate[3]], ql.up, ql.down)
    with pytest.raises(TypeError, match="gate expert 3 is dense, expert 0 quantized"):
        nbx.fused_moe(x, w, ids, mixed)


@pytest.mark.parametrize("kind,G", [("int8", None), ("int4", 32), ("mxfp4", 32), ("nvfp4", 16), ("fp8", 32)])
def test_quantized_experts_with_biases(kind, G):
    """gpt-oss's experts: quantized weights with gate, up and down biases and
    the clamped SwiGLU, on the CPU handler (T=1 streams, T=40 packs; bands of
    one token bit-identical to the whole call: int8's column scales reach the
    stored sums of both paths alike) and the xla reference, against float64
    on the dequantized weights."""
    x, w, ids, ex = make_problem(11, 40, 5, 2, 64, 96)
    rng = np.random.default_rng(3)
    b = {n: jnp.asarray(rng.standard_normal((5, s)), jnp.float32)
         for n, s in (("gate_bias", 96), ("up_bias", 96), ("down_bias", 64))}
    q = nbx.quantize(ex, kind, group_size=G)
    qb = nbx.Experts(q.gate, q.up, q.down, **b)
    act = nbx.Activation("swiglu_clamped", alpha=1.702, limit=7.0)
    bias64 = tuple(np.asarray(b[n], np.float64) for n in ("gate_bias", "up_bias", "down_bias"))
    for T in (1, 40):
        ref = np_moe(x[:T], w[:T], ids[:T], nbx.dequantize(q, jnp.float32), act, biases=bias64)
        for impl in ("cpu", "xla"):
            y = nbx.fused_moe(x[:T], w[:T], ids[:T], qb, activation=act, implementation=impl)
            assert rel_err(y, ref) < TOL["f32"], (T, impl)
    cap = nbx.memory.fused_moe_workspace_bytes(1, 2, 5, 64, 96)
    whole = nbx.fused_moe(x, w, ids, qb, activation=act, implementation="cpu")
    banded = nbx.fused_moe(x, w, ids, qb, activation=act, implementation="cpu", max_workspace_bytes=cap)
    np.testing.assert_array_equal(np.asarray(banded), np.asarray(whole))


def _with_tensor_scales(q, rng, lists=False):
    """nvfp4 experts ``q`` with a random float32 tensor scale per expert and projection."""
    def one(w):
        ts = jnp.asarray(rng.uniform(0.25, 4.0, w.q.shape[0]), jnp.float32)
        if lists:
            return [nbx.QuantizedWeight(w.q[e], w.scale[e], None, ts[e], kind=w.kind, group_size=w.group_size)
                    for e in range(w.q.shape[0])]
        return nbx.QuantizedWeight(w.q, w.scale, None, ts, kind=w.kind, group_size=w.group_size)
    return nbx.Experts(one(q.gate), one(q.up), one(q.down))


@pytest.mark.parametrize("lists", [False, True], ids=["stacked", "lists"])
def test_nvfp4_tensor_scales(lists):
    """nvfp4's optional float32 tensor scale (ModelOpt's weight_scale_2), one
    per expert and projection: the CPU handler multiplies each column's sum by
    it (T=1 streams, T=40 packs; bands of one token bit-identical to the whole
    call; with biases too) and the xla reference dequantizes with it, against
    float64 on the scaled weights."""
    rng = np.random.default_rng(8)
    x, w, ids, ex = make_problem(17, 40, 5, 2, 64, 96)
    q = _with_tensor_scales(nbx.quantize(ex, "nvfp4"), rng, lists)
    d = nbx.dequantize(q, jnp.float32)  # the scaled weights
    plain = nbx.dequantize(nbx.quantize(ex, "nvfp4"), jnp.float32)
    assert not np.allclose(np.asarray(d.gate if not lists else jnp.stack(d.gate)), np.asarray(plain.gate))
    b = {n: jnp.asarray(rng.standard_normal((5, s)), jnp.float32)
         for n, s in (("gate_bias", 96), ("up_bias", 96), ("down_bias", 64))}
    for biases in ({}, b):
        qb = nbx.Experts(q.gate, q.up, q.down, **biases)
        ref_b = tuple(np.asarray(biases[n], np.float64) for n in ("gate_bias", "up_bias", "down_bias")) \
            if biases else None
        for T in (1, 40):
            ref = np_moe(x[:T], w[:T], ids[:T], d, biases=ref_b)
            for impl in ("cpu", "xla"):
                y = nbx.fused_moe(x[:T], w[:T], ids[:T], qb, implementation=impl)
                assert rel_err(y, ref) < TOL["f32"], (T, impl, bool(biases))
        cap = nbx.memory.fused_moe_workspace_bytes(1, 2, 5, 64, 96)
        whole = nbx.fused_moe(x, w, ids, qb, implementation="cpu")
        banded = nbx.fused_moe(x, w, ids, qb, implementation="cpu", max_workspace_bytes=cap)
        np.testing.assert_array_equal(np.asarray(banded), np.asarray(whole))


def test_tensor_scales_are_checked_and_refused_by_name():
    """Only formats whose spec takes a tensor scale (nvfp4) accept one, float32
    with one value per expert; the CUDA and Metal kernels have none yet and
    say so (the default then takes the CPU handler)."""
    from jax_nbx.backends.cuda import plan

    x, w, ids, ex = make_problem(18, 3, 4, 2, 64, 32)
    q4 = nbx.quantize(ex, "int4", group_size=32)
    bad = nbx.QuantizedWeight(q4.gate.q, q4.gate.scale, q4.gate.zero, jnp.ones(4), kind="int4", group_size=32)
    with pytest.raises(ValueError, match=r"int4 weights take no tensor_scale \(only \['nvfp4'\] do\)"):
        nbx.fused_moe(x, w, ids, nbx.Experts(bad, q4.up, q4.down))
    qn = nbx.quantize(ex, "nvfp4")
    for ts, what in ((jnp.ones(4, jnp.float16), "float16 \\(4,\\)"), (jnp.ones(3), "float32 \\(3,\\)")):
        g = nbx.QuantizedWeight(qn.gate.q, qn.gate.scale, None, ts, kind="nvfp4", group_size=16)
        with pytest.raises(TypeError, match=f"experts.gate.tensor_scale must be float32 of shape \\(4,\\).*got {what}"):
            nbx.fused_moe(x, w, ids, nbx.Experts(g, qn.up, qn.down))
    scaled = _with_tensor_scales(qn, np.random.default_rng(0))
    problem = nbx.backends.Problem.of(scaled, x.dtype, 4, 64, 32, 2, nbx.Activation("swiglu"))
    assert problem.tensor_scales
    assert "nvfp4 experts with a tensor scale run on the CPU handler" in plan.kernels_refusal(
        problem.quant, True, False, True)
    from support import ffi_testing

    if not ffi_testing.metal_sim_unavailable():
        with ffi_testing.metal_sim():
            assert "no tensor scale yet" in nbx.backends.get("metal").why_not(problem)
    assert nbx.ops.resolve(x, w, ids, scaled)[0].name == "cpu"


# H or I not a multiple of the group: the last group of K partial (fp8, mxfp4,
# mxfp8 take them: FormatSpec::partial_groups), odd K for the byte formats
PARTIAL = [("fp8", 128, 200, 96), ("fp8", 32, 97, 45), ("mxfp4", 32, 70, 200), ("mxfp8", 32, 97, 40)]


@pytest.mark.parametrize("kind,G,H,I", PARTIAL, ids=[f"{k}-g{g}-H{h}-I{i}" for k, g, h, i in PARTIAL])
def test_quant_partial_groups_stream_and_pack_alike(kind, G, H, I, isa):
    """Unbanded, each expert has ~24 rows (the dequantizing packer's K-blocks);
    in bands of one token each has <= 2 (the streaming kernels, a lone last
    row where K is odd): both write every row of a poisoned output, match
    float64 on the dequantized weights, and give the same bits."""
    x, w, ids, ex = make_problem(H + I, 60, 5, 2, H, I)
    q = nbx.quantize(ex, kind, group_size=G, scale_dtype=jnp.bfloat16)
    assert q.gate.scale.shape[1] == -(-H // G) and q.down.scale.shape[1] == -(-I // G)
    whole = run_quant_poisoned(x, w, ids, q, band_tokens=0)
    streamed = run_quant_poisoned(x, w, ids, q, band_tokens=1)
    assert bool(jnp.all(jnp.isfinite(whole))) and bool(jnp.all(jnp.isfinite(streamed)))
    assert rel_err(whole, np_moe(x, w, ids, nbx.dequantize(q, jnp.float32))) < TOL["f32"]
    np.testing.assert_array_equal(np.asarray(streamed), np.asarray(whole))
