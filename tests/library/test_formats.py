"""The weight-format registry (xla_ffi/formats/, jax_nbx/formats/): every
format of the contract is registered with its spec, the specs drive the
checks, and a format code or name the registry does not know is refused by
name on every path."""
from __future__ import annotations

import contextlib
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx
from jax_nbx import contract, formats
from jax_nbx.backends.handler_calls import forward_call
from jax_nbx.formats import minifloat

from conftest import make_problem

pytestmark = pytest.mark.fast


def test_the_registry_holds_every_format_of_the_contract():
    assert formats.names() == contract.WEIGHT_FORMATS == ("dense", "int8", "int4", "mxfp4", "fp8", "mxfp8",
                                                                 "nvfp4")
    for name in formats.names():
        fmt = formats.get(name)
        assert fmt.code == contract.FORMAT_CODES[name]
        assert fmt.parts == contract.parts_of(name)
    assert formats.get("int8").parts == ("q", "scale") and not formats.get("int8").grouped
    int4 = formats.get("int4")
    assert int4.parts == ("q", "scale", "zero") and int4.group_sizes == (32, 64, 128)
    assert int4.values_per_byte == 2 and int4.part_shape("q", 64, 5, 32) == (32, 5)
    assert int4.part_shape("scale", 64, 5, 32) == (2, 5)
    assert formats.get("int8").part_shape("scale", 64, 5, None) == (5,)
    mx = formats.get("mxfp4")
    assert mx.parts == ("q", "scale") and mx.group_sizes == (32,) and mx.values_per_byte == 2
    assert mx.part_dtypes == {"q": (np.dtype("uint8"),), "scale": (np.dtype("uint8"),)}
    assert mx.part_shape("q", 64, 5, 32) == (32, 5) and mx.part_shape("scale", 64, 5, 32) == (2, 5)
    assert mx.compute_part is None and mx.default_group_size == 32


def test_the_spec_drives_validation():
    _, _, _, ex = make_problem(1, 2, 4, 2, 64, 32)
    q = nbx.quantize(ex, "int4", group_size=32).gate  # [E=4, K=64, N=32]
    with pytest.raises(TypeError, match=r"w.zero has dtype bfloat16; expected the scale's float32"):
        nbx.QuantizedWeight(q.q, q.scale, q.zero.astype(jnp.bfloat16), kind="int4", group_size=32).validate("w")
    with pytest.raises(ValueError, match=r"w.scale has shape \(4, 1, 32\); expected \(4, 2, 32\)"):
        nbx.QuantizedWeight(q.q, q.scale[:, :1], q.zero[:, :1], kind="int4", group_size=16 * 2).validate("w")
    with pytest.raises(ValueError, match=r"group_size must be one of \(32, 64, 128\) for int4; got 48"):
        nbx.QuantizedWeight(q.q, q.scale, q.zero, kind="int4", group_size=48).validate("w")
    with pytest.raises(ValueError, match="int8 weights take no zero part"):
        nbx.QuantizedWeight(q.q.astype(jnp.int8), q.scale[:, 0], q.zero, kind="int8").validate("w")


UNKNOWN = 9  # a format code the registry does not hold


def _raw_cpu(x, w, ids, ex, target="forward", **overrides):
    problem = nbx.backends.Problem.of(ex, x.dtype, ex.num_experts, ex.hidden, ex.intermediate, ids.shape[1],
                                      nbx.Activation("swiglu"))
    name, ops, attrs, out = forward_call(problem, 0, x, w, ids, ex.flat(), target=target)
    return jax.ffi.ffi_call(name, out, vmap_method="sequential")(*ops, **dict(attrs, **overrides))


def test_an_unknown_format_is_refused_by_name_on_every_path():
    x, w, ids, ex = make_problem(2, 5, 4, 2, 64, 32)
    # Python: the registry, the weights' validation, quantize, fused_moe (before any backend)
    with pytest.raises(ValueError,
                       match=r"unknown weight format 'int3'; jax_nbx knows \('dense', 'int8', 'int4', "
                             r"'mxfp4', 'fp8', 'mxfp8', 'nvfp4'\)"):
        formats.get("int3")
    q = nbx.quantize(ex, "int8").down
    odd = nbx.QuantizedWeight(q.q, q.scale, kind="int3")
    with pytest.raises(ValueError, match="w: unknown weight format 'int3'"):
        odd.validate("w")
    with pytest.raises(ValueError, match=r"kind must be one of \('int8', 'int4', 'mxfp4', 'fp8', 'mxfp8', "
                                         r"'nvfp4'\); got 'int3'"):
        nbx.quantize(ex, "int3")
    q3 = nbx.Experts(*(nbx.QuantizedWeight(a.q, a.scale, kind="int3") for a in
                       (nbx.quantize(ex, "int8").gate, nbx.quantize(ex, "int8").up, q)))
    for impl in ("xla", "cpu"):
        with pytest.raises(ValueError, match="unknown weight format 'int3'"):
            nbx.fused_moe(x, w, ids, q3, implementation=impl)
    # the CPU handler (C++ decoder): an unknown code is INVALID_ARGUMENT naming it
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"unknown weight format code {UNKNOWN}"):
        jax.block_until_ready(_raw_cpu(x, w, ids, ex, format=np.int32(UNKNOWN)))
    # the Metal handler's own check (before any device is needed)
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"unknown weight format code {UNKNOWN}"):
        jax.block_until_ready(_raw_cpu(x, w, ids, ex, target="metal_forward", format=np.int32(UNKNOWN)))
    # the CUDA launch program (the Triton kernels): refused by name before anything compiles
    from jax_nbx.backends.cuda import plan

    with pytest.raises(ValueError, match="unknown weight format 'int3'"):
        plan.build(4, 4, 2, 4, 64, 32, np.float32, np.float32, 0, quant=("int3", 0))
    if importlib.util.find_spec("triton") is not None:  # the kernels' own guard: a static_assert
        from jax_nbx.backends.cuda import kernels

        assert "static_assert(QUANT == QUANT_INT4" in open(kernels.__file__).read()


class _Toy(formats.Format):
    """A format outside the contract, registered by the Python registry
    alone: 4-bit codes in a byte, W[k, n] = (q[k, n] - 8) * scale[n]."""

    name = "toy_offset8"
    spec = {"summary": "a test's toy: (q - 8) * scale[n]",
            "parts": ({"name": "q", "dtypes": ("uint8",), "rows": "K", "same_dtype_as": -1},
                      {"name": "scale", "dtypes": ("float32",), "rows": "none", "same_dtype_as": -1}),
            "values_per_byte": 1, "group_sizes": (), "compute_dtype_part": 1}

    def quantize_matrix(self, w, group_size, scale_dtype):
        self.check_group_size(group_size)
        scale = jnp.maximum(jnp.max(jnp.abs(w), axis=-2) / 7.0, 1e-30)
        q = (jnp.clip(jnp.round(w / scale[..., None, :]), -8, 7) + 8).astype(jnp.uint8)
        return nbx.QuantizedWeight(q, scale.astype(jnp.float32), kind=self.name)

    def dequantize(self, w):
        return (w.q.astype(jnp.float32) - 8.0) * w.scale.astype(jnp.float32)[..., None, :]


def _np_toy_moe(x, w, ids, q: nbx.Experts) -> np.ndarray:
    """float64 forward of toy experts from the toy's definition (not its dequantize)."""
    def dense(m):
        return (np.asarray(m.q, np.float64) - 8.0) * np.asarray(m.scale, np.float64)[:, None, :]

    g, u, d = dense(q.gate), dense(q.up), dense(q.down)
    x64, w64, ids = np.asarray(x, np.float64), np.asarray(w, np.float64), np.asarray(ids)
    y = np.zeros_like(x64)
    for t in range(x64.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            a, b = x64[t] @ g[e], x64[t] @ u[e]
            y[t] += w64[t, j] * ((a / (1.0 + np.exp(-a)) * b) @ d[e])
    return y


def test_a_toy_format_through_the_registry_alone():
    """A format added by its Python module alone (no C++ spec, no kernels):
    quantize makes it, the reference runs it against float64 (named, and by
    default), and every handler backend refuses it by name -- the registry's
    check, before any backend's own."""
    from jax_nbx.backends.cuda import plan
    from jax_nbx.formats import registry

    toy = registry.register(_Toy())
    try:
        assert toy.code >= len(contract.WEIGHT_FORMATS) and toy.kernels == frozenset()
        assert "toy_offset8" in formats.quantized_names() and toy.code not in plan.kernels_formats()
        x, w, ids, ex = make_problem(3, 9, 5, 2, 24, 20)  # odd sizes
        q = nbx.quantize(ex, "toy_offset8")
        ref = _np_toy_moe(x, w, ids, q)
        for impl in ("xla", None):
            y = jax.jit(lambda x, w, ids, q, impl=impl: nbx.fused_moe(x, w, ids, q, implementation=impl))(
                x, w, ids, q)
            err = float(np.max(np.abs(np.asarray(y, np.float64) - ref)) / np.max(np.abs(ref)))
            assert err < 1e-5, (impl, err)
        for impl in ("cpu", "ffi", "metal", "cuda"):
            with pytest.raises(ValueError, match=rf"implementation='{impl}'.*its kernels do not read "
                                                 r"toy_offset8 experts .*'xla'.* run them"):
                nbx.fused_moe(x, w, ids, q, implementation=impl)
        assert "toy_offset8" in plan.kernels_refusal(("toy_offset8", 0), True, False)
        with pytest.raises(ValueError, match="is the contract's"):
            registry.unregister("int8")
    finally:
        registry.unregister("toy_offset8")
    with pytest.raises(ValueError, match="unknown weight format 'toy_offset8'"):
        formats.get("toy_offset8")


def test_each_contract_format_names_its_kernels():
    """The spec says which backends' kernels read a format (xla_ffi/formats/<name>.h
    FormatSpec::kernels); today every format of the contract has all three,
    and int8 alone sums a * q before its column scale."""
    for name in formats.names():
        fmt = formats.get(name)
        assert fmt.kernels == {"cpu", "metal", "cuda"}, name
        assert fmt.column_scaled == (name == "int8"), name


@pytest.mark.parametrize("kind", [n for n in contract.WEIGHT_FORMATS if n != "dense"])
def test_quantize_refuses_a_non_finite_weight_by_name(kind):
    """No format's codes hold NaN or Inf faithfully (the scales absorb them):
    quantize names the projection, expert and position instead of making
    finite, wrong weights; stacked and lists alike."""
    rng = np.random.default_rng(abs(hash(kind)) % 2**32)
    E, H, I = 3, 128, 128  # K a multiple of every format's default group
    arrays = [rng.standard_normal(s).astype(np.float32) for s in ((E, H, I), (E, H, I), (E, I, H))]
    proj = int(rng.integers(3))
    e, k, n = int(rng.integers(E)), int(rng.integers(arrays[proj].shape[1])), int(rng.integers(arrays[proj].shape[2]))
    for bad in (np.nan, np.inf, -np.inf):
        a = [x.copy() for x in arrays]
        a[proj][e, k, n] = bad
        name = ("gate", "up", "down")[proj]
        want = rf"experts\.{name} of expert {e} holds {bad} at \[{k}, {n}\]"
        with pytest.raises(ValueError, match=want):
            nbx.quantize(nbx.Experts(*map(jnp.asarray, a)), kind)
        with pytest.raises(ValueError, match=want):
            nbx.quantize(nbx.Experts(*([jnp.asarray(m) for m in x] for x in a)), kind)
    nbx.quantize(nbx.Experts(*map(jnp.asarray, arrays)), kind)  # the finite weights quantize


NON_FINITE = [(kind, bad) for kind in contract.WEIGHT_FORMATS if kind != "dense" for bad in ("nan", "inf", "-inf")]


@pytest.mark.parametrize("kind,bad", NON_FINITE, ids=[f"{k}-{b}" for k, b in NON_FINITE])
def test_quantize_under_jit_carries_non_finite_weights_as_nan(kind, bad):
    """Under jax.jit quantize cannot refuse a NaN or infinite weight (it sees
    no values): the group holding it (int8: its column) gets a NaN scale
    (float NaN, E8M0 255, E4M3 0x7F) and dequantizes to all NaN, every other
    group to the finite experts' bits, and the tokens routed to that expert
    come out NaN from the reference and the CPU kernels -- not finite and
    wrong -- while the others equal the finite run's."""
    rng = np.random.default_rng(abs(hash((kind, bad))) % 2**32)
    E, H, I = 4, 128, 128  # K a multiple of every format's default group
    x, w, _, ex = make_problem(int(rng.integers(1 << 16)), 2, E, 2, H, I)
    proj = ("gate", "up")[int(rng.integers(2))]  # gate or up: every output column of the token goes NaN
    e, k, n = int(rng.integers(E)), int(rng.integers(H)), int(rng.integers(I))
    arrays = {name: np.asarray(getattr(ex, name)).copy() for name in ("gate", "up", "down")}
    arrays[proj][e, k, n] = float(bad)
    broken = nbx.Experts(*(jnp.asarray(arrays[name]) for name in ("gate", "up", "down")))
    quantize = jax.jit(lambda ex: nbx.quantize(ex, kind))
    q, q_finite = quantize(broken), quantize(ex)

    G = getattr(q, proj).group_size or H  # int8: the whole column
    in_group = np.zeros((E, H, I), bool)
    in_group[e, (k // G) * G:(k // G + 1) * G, n] = True
    for name in ("gate", "up", "down"):
        got = np.asarray(getattr(q, name).dequantize(jnp.float32))
        want = np.asarray(getattr(q_finite, name).dequantize(jnp.float32))
        if name == proj:
            assert np.isnan(got[in_group]).all(), (name, e, k, n)
            got, want = got[~in_group], want[~in_group]
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=name)
    scale = np.asarray(minifloat.as_bytes(getattr(q, proj).scale))
    nan_scale = {"mxfp4": 0xFF, "mxfp8": 0xFF, "nvfp4": 0x7F}.get(kind)
    at = (e, n) if kind == "int8" else (e, k // G, n)
    assert (scale[at] == nan_scale) if nan_scale is not None else np.isnan(scale[at]), scale[at]

    # token 0 routed to expert e (and another), token 1 to two others
    others = [o for o in range(E) if o != e]
    ids = jnp.asarray([[others[0], e], [others[1], others[2]]], jnp.int32)
    for impl in ("xla", "cpu"):
        y = np.asarray(nbx.fused_moe(x, w, ids, q, implementation=impl))
        y_finite = np.asarray(nbx.fused_moe(x, w, ids, q_finite, implementation=impl))
        assert np.isnan(y[0]).all(), (impl, y[0])
        assert np.isfinite(y[1]).all(), (impl, y[1])
        np.testing.assert_array_equal(y[1], y_finite[1], err_msg=impl)


def test_a_group_size_a_format_does_not_take_is_refused():
    _, _, _, ex = make_problem(1, 2, 4, 2, 64, 32)
    for gs in (32, 7):
        with pytest.raises(ValueError, match=f"quantize: int8 weights take no group_size; got {gs}"):
            nbx.quantize(ex, "int8", group_size=gs)
    for gs in (None, 0):
        assert nbx.quantize(ex, "int8", group_size=gs).gate.group_size is None
    with pytest.raises(ValueError, match=r"group_size must be one of \(32,\) for mxfp4; got 64"):
        nbx.quantize(ex, "mxfp4", group_size=64)


@pytest.mark.parametrize("kind", [n for n in contract.WEIGHT_FORMATS if n != "dense"])
def test_stacked_quantized_weights_index_by_expert(kind):
    """q.gate[e], [a:b] and a list of ids give the same format's weights of
    those experts (every part and tensor scale alike): their values are the
    stacked weights' experts bit for bit, and stacked experts become lists."""
    x, w, ids, ex = make_problem(5, 7, 5, 2, 128, 128)  # K a multiple of every default group
    q = nbx.quantize(ex, kind)
    if kind == "nvfp4":  # a tensor scale per expert, indexed with the rest
        q = nbx.Experts(*(nbx.QuantizedWeight(m.q, m.scale, m.zero, jnp.linspace(0.5, 2.0, 5, dtype=jnp.float32),
                                              kind=m.kind, group_size=m.group_size) for m in (q.gate, q.up, q.down)))
    dense = np.asarray(q.gate.dequantize(jnp.float32))
    assert len(q.gate) == 5 and bool(q.gate[0])
    for index, want in ((3, dense[3]), (-1, dense[4]), (slice(1, 4), dense[1:4]), ([4, 0, 4], dense[[4, 0, 4]]),
                        (np.array([2]), dense[[2]])):
        got = q.gate[index]
        assert got.kind == kind and got.group_size == q.gate.group_size
        np.testing.assert_array_equal(np.asarray(got.dequantize(jnp.float32)), want)
    lists = nbx.Experts(*([m[e] for e in range(len(m))] for m in (q.gate, q.up, q.down)))
    np.testing.assert_array_equal(np.asarray(nbx.fused_moe(x, w, ids, lists)), np.asarray(nbx.fused_moe(x, w, ids, q)))
    for bad, err in ((5, IndexError), (-6, IndexError), ([0, 9], IndexError), (1.5, TypeError), ((0, 1), TypeError),
                     (None, TypeError)):
        with pytest.raises(err, match=kind):
            q.gate[bad]
    with pytest.raises(TypeError, match="only stacked"):
        q.gate[0][0]


# ---- partial groups: a K the group does not divide (issue #53)

def _np_blocks(K: int, G: int):
    """The producers' grid of a K: ceil(K / G) blocks of rows, the last one
    the remaining K % G (DeepSeek-V3's weight_dequant, triton_kernels'
    downcast_to_mxfp_torch, microxcaling's zero-padded blocks)."""
    return [(a, min(a + G, K)) for a in range(0, K, G)]


def _np_quantize(kind: str, w: np.ndarray, G: int):
    """float32 ``w [E, K, N]`` quantized by the producers' rule, in numpy:
    each block's scale from the largest magnitude of its real rows (fp8:
    amax / 448 in IEEE division, 1 for zeros; mxfp4 / mxfp8: the
    E8M0 byte of the smallest power of two >= amax / 6 or / 448), each value
    w / scale rounded to the nearest element, ties to even (ml_dtypes).
    (q bytes [E, K, N] unpacked, scale [E, ceil(K/G), N].)"""
    import ml_dtypes

    E, K, N = w.shape
    blocks = _np_blocks(K, G)
    q = np.empty((E, K, N), np.uint8)
    scale = np.empty((E, len(blocks), N), np.float32 if kind == "fp8" else np.uint8)
    for g, (a, b) in enumerate(blocks):
        amax = np.abs(w[:, a:b]).max(axis=1)
        if kind == "fp8":
            s = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
            scale[:, g] = s
        else:
            elem_max = np.float32(6 if kind == "mxfp4" else 448)
            bits = (amax / elem_max).astype(np.float32).view(np.uint32).astype(np.uint64)
            byte = ((bits + 0x7FFFFF) & 0x7F800000) >> 23                       # round up to 2^e
            scale[:, g] = np.where(amax > 0, byte, 127).astype(np.uint8)
            s = (scale[:, g].astype(np.uint32) << 23).view(np.float32)
        v = w[:, a:b] / s[:, None, :]
        q[:, a:b] = (v.astype(ml_dtypes.float4_e2m1fn) if kind == "mxfp4"
                     else np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn)).view(np.uint8)
    return q, scale


def _np_dequantize(kind: str, q: np.ndarray, scale: np.ndarray, G: int) -> np.ndarray:
    """float64 W[k, n] = element(q[k, n]) * scale[k // G, n] over unpacked codes."""
    import ml_dtypes

    K = q.shape[-2]
    elem = q.view(ml_dtypes.float4_e2m1fn if kind == "mxfp4" else ml_dtypes.float8_e4m3fn).astype(np.float64)
    s = (scale.astype(np.float64) if kind == "fp8"
         else np.exp2(scale.astype(np.float64) - 127.0))
    return elem * s[:, np.arange(K) // G, :]


# (kind, group, K): K = 96 and 200 (not multiples of 128 or 64), odd K for the byte formats, an
# even K that is no multiple of 32 for mxfp4, one partial group only (K < group), whole groups
PARTIAL = [("fp8", 128, 96), ("fp8", 128, 200), ("fp8", 64, 200), ("fp8", 32, 97), ("fp8", 128, 127),
           ("fp8", 128, 256), ("mxfp4", 32, 200), ("mxfp4", 32, 70), ("mxfp4", 32, 14), ("mxfp8", 32, 97),
           ("mxfp8", 32, 200)]


@pytest.mark.parametrize("kind,G,K", PARTIAL, ids=[f"{k}-g{g}-K{K}" for k, g, K in PARTIAL])
def test_partial_last_group_quantizes_as_the_producers(kind, G, K):
    """quantize / dequantize of a K the group does not divide: ceil(K / G)
    scales, the last group's from its real rows alone, every code and scale
    the numpy producer's bit for bit, and the dequantized weights the float64
    E(q) * scale[k // G] of those (rounded once to float32)."""
    rng = np.random.default_rng(K * 1000 + G)
    E, N = 2, 24
    w = rng.standard_normal((E, K, N)).astype(np.float32)
    w[1, -1, :] *= 50.0  # the last row dominates its group: a scale taken over padding would show
    q = nbx.quantize(nbx.Experts(w, w, np.swapaxes(w, 1, 2).copy()), kind, group_size=G).gate
    fmt = formats.get(kind)
    assert fmt.partial_groups and q.scale.shape == (E, -(-K // G), N) and q.group_size == G
    want_q, want_s = _np_quantize(kind, w, G)
    got_q = np.asarray(q.q)
    if fmt.values_per_byte == 2:
        got_q = np.stack([got_q & 15, got_q >> 4], axis=-2).reshape(E, K, N)
    np.testing.assert_array_equal(got_q, want_q)
    np.testing.assert_array_equal(np.asarray(q.scale), want_s)
    ref = _np_dequantize(kind, want_q, want_s, G)
    got = np.asarray(q.dequantize(jnp.float32))
    np.testing.assert_array_equal(got, ref.astype(np.float32))
    assert np.max(np.abs(ref - w)) <= np.max(np.abs(w)) * (0.26 if kind == "mxfp4" else 0.07)
    q.validate("w")  # the shapes the spec gives (ceil(K / G) scale rows)
    with pytest.raises(ValueError, match=rf"w.scale has shape \({E}, {K // G}, {N}\); expected "
                                         rf"\({E}, {-(-K // G)}, {N}\)") if K % G else contextlib.nullcontext():
        nbx.QuantizedWeight(q.q, q.scale[:, :K // G], kind=kind, group_size=G).validate("w")


@pytest.mark.parametrize("kind,G,K,rule", [
    ("int4", 64, 96, r"int4 takes whole groups along K: K=96 is not divisible by group_size=64: .*AWQ"),
    ("int4", 128, 200, r"int4 takes whole groups along K: K=200 is not divisible by group_size=128: .*MLX"),
    ("nvfp4", 16, 200, r"nvfp4 takes whole groups along K: K=200 is not divisible by group_size=16: "
                       r"NVFP4's producers .*MLX.*compressed-tensors"),
    ("mxfp4", 32, 97, r"mxfp4 packs 2 values per byte along K: K=97 must be a multiple of 2"),
    ("nvfp4", 16, 97, r"nvfp4 packs 2 values per byte along K: K=97"),
])
def test_whole_group_formats_refuse_a_partial_group_naming_the_rule(kind, G, K, rule):
    """The formats whose producers quantize whole groups only (int4: AWQ,
    MLX affine, compressed-tensors groups; nvfp4: MLX, compressed-tensors)
    refuse a K the group does not divide, naming the format, K and the
    producers' rule; 4-bit codes refuse an odd K (two per byte)."""
    w = np.random.default_rng(K).standard_normal((2, K, 32)).astype(np.float32)
    ex = nbx.Experts(w, w, np.swapaxes(w, 1, 2).copy())
    with pytest.raises(ValueError, match=rule):
        nbx.quantize(ex, kind, group_size=G)
    assert not formats.get(kind).partial_groups or K % 2


def test_partial_groups_is_the_specs_field():
    """FormatSpec::partial_groups, exported: the formats whose producers make
    a partial last block (fp8, mxfp4, mxfp8) and those that do not."""
    got = {s["name"]: s["partial_groups"] for s in contract.FORMAT_SPECS}
    assert got == {"dense": False, "int8": False, "int4": False, "mxfp4": True, "fp8": True, "mxfp8": True,
                   "nvfp4": False}
    assert all(formats.get(n).partial_groups == got[n] for n in formats.names())
    assert formats.get("fp8").part_shape("scale", 200, 5, 128) == (2, 5)
    assert formats.get("mxfp4").part_shape("scale", 70, 5, 32) == (3, 5)
    assert formats.get("int4").part_shape("scale", 256, 5, 128) == (2, 5)


def test_the_handlers_refuse_a_partial_group_of_a_whole_group_format():
    """The C++ weight decoder (every handler's): mxfp4's parts read as nvfp4
    (the same parts; groups of 16, whole only) with H = 200 are refused,
    naming the format, the group and K; as mxfp4 they run."""
    x, w, ids, ex = make_problem(3, 4, 4, 2, 200, 70)
    q = nbx.quantize(ex, "mxfp4")
    jax.block_until_ready(_raw_cpu(x, w, ids, q))
    for target in ("forward", "metal_forward"):
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=r"nvfp4 group size 16 must divide H=200 and I=70 \(nvfp4 takes whole groups "
                                 r"along K; got K=200\)"):
            jax.block_until_ready(_raw_cpu(x, w, ids, q, target=target,
                                           format=np.int32(contract.FORMAT_CODES["nvfp4"]),
                                           group_size=np.int64(16)))
