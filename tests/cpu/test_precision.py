"""fused_moe(..., precision="bfloat16") on the CPU handler: the bfloat16
dot-product kernels (xla_ffi/cpu/kernels/kernels_dot.h) through the op.

The float64 reference follows Hugging Face transformers' bfloat16 experts
(e.g. `modeling_mixtral.py` MixtralBlockSparseTop2MLP / `modeling_qwen3_moe.py`
Qwen3MoeMLP: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with x, the
weights and the intermediate all bfloat16): x rounded to bfloat16, g and u
summed exactly, the intermediate rounded to bfloat16, then the down sum,
the routed weight and the sum over the k slots.  The kernels sum in float32
(one rounding per product), so the bound is float32's relative to
sum |a * w|, plus, for an intermediate whose float32 value sits so near a
bfloat16 rounding boundary that its float32 error could flip the rounding,
one bfloat16 step of that element's contribution.

precision=None takes the dot kernels for bfloat16 x where the CPU runs them
on the instruction (test_default_precision_follows_the_instruction).

The tests run on every dot-kernel kind this CPU has
(`jax_nbx.cpu.supported_dot_kernels()`): the emulated instruction everywhere,
the fma kernels on x86-64 with AVX2 or AVX-512, the instruction itself where
the CPU has avx512_bf16.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from conftest import f64, make_problem, np_glu
from support.handlers import ffi_forward as _ffi_forward

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU handler's precision")


def _bf16(a):
    """float64 values rounded to the nearest bfloat16 (even on ties), as float64."""
    return np.asarray(jnp.asarray(np.asarray(a, np.float32), jnp.bfloat16).astype(jnp.float32), np.float64)


def _tie_distance(h):
    """(distance from each element to the nearest bfloat16 rounding boundary,
    the bfloat16 step there)."""
    _, e = np.frexp(np.abs(h))
    ulp = np.ldexp(1.0, e - 8)  # bfloat16: 8 significant bits
    r = np.abs(h) / ulp
    return np.abs(r - np.floor(r) - 0.5) * ulp, ulp


def np_moe_bf16(x, w, ids, ex: nbx.Experts, activation="swiglu"):
    """(y, tol): the float64 reference of precision="bfloat16" and its bound."""
    x, w, ids = _bf16(f64(x)), f64(w), np.asarray(ids)
    G, U, D = f64(ex.gate), f64(ex.up), f64(ex.down)
    bias = [None if b is None else f64(b) for b in (ex.gate_bias, ex.up_bias, ex.down_bias)]
    T, H = x.shape
    y, mag, flip = np.zeros((T, H)), np.zeros((T, H)), np.zeros((T, H))
    for e in range(G.shape[0]):
        t_idx, j_idx = np.nonzero(ids == e)
        if t_idx.size == 0:
            continue
        a = x[t_idx]
        g, u = a @ G[e], a @ U[e]
        gm, um = np.abs(a) @ np.abs(G[e]), np.abs(a) @ np.abs(U[e])
        if bias[0] is not None:
            g, u = g + bias[0][e], u + bias[1][e]
        h64 = np_glu(g, u, activation)[0]
        h = _bf16(h64)
        # an intermediate's float32 error: 2e-6 of its sums' magnitudes carried
        # through glu, plus the float32 activation's own; nearer a boundary
        # than that, it may round either way
        herr = 2e-6 * 1.2 * (gm * (np.abs(u) + 1.0) + um * (np.abs(g) + 1.0)) + 1e-6 * np.abs(h64)
        dist, step = _tie_distance(h64)
        maybe = dist <= herr
        wt = w[t_idx, j_idx][:, None]
        out = h @ D[e]
        if bias[2] is not None:
            out = out + bias[2][e]
        np.add.at(y, t_idx, wt * out)
        np.add.at(mag, t_idx, np.abs(wt) * (np.abs(h) @ np.abs(D[e]) + 1e-30))
        np.add.at(flip, t_idx, np.abs(wt) * ((maybe * step) @ np.abs(D[e])))
    return y, 4e-6 * mag + flip + 1e-30


def _run(x, w, ids, ex, **kw):
    return nbx.fused_moe(x, w, ids, ex, implementation="ffi", precision="bfloat16", **kw)


def _check(y, x, w, ids, ex, activation="swiglu"):
    ref, tol = np_moe_bf16(x, w, ids, ex, activation)
    yd = f64(y)
    assert np.all(np.isfinite(yd))
    if y.dtype == jnp.bfloat16:  # the output's own rounding
        tol = tol + np.abs(ref) * 2.0**-8
    bad = np.abs(yd - ref) > tol
    assert not bad.any(), (f"{bad.sum()} of {bad.size} outside the bound; worst "
                           f"{np.max(np.abs(yd - ref) / tol):.3g} x tol")


@pytest.fixture(params=nbx.cpu.supported_dot_kernels())
def dot_kernels(request):
    """Each dot-kernel kind this CPU runs (the emulation always)."""
    nbx.cpu.set_dot_kernels(request.param)
    yield nbx.cpu.dot_kernels()
    nbx.cpu.set_dot_kernels("auto")


@pytest.mark.parametrize("T,E,k,H,I", [(1, 8, 2, 129, 99), (33, 5, 3, 130, 66), (222, 16, 4, 257, 130)])
@pytest.mark.parametrize("xd", ["float32", "bfloat16"])
def test_matches_float64(dot_kernels, T, E, k, H, I, xd):
    x, w, ids, ex = make_problem(T * 7 + H, T, E, k, H, I, jnp.dtype(xd), jnp.bfloat16)
    _check(_run(x, w, ids, ex), x, w, ids, ex)


@pytest.mark.parametrize("activation", ["geglu", "geglu_erf", "swiglu_clamped"])
def test_activations(dot_kernels, activation):
    x, w, ids, ex = make_problem(5, 40, 8, 2, 64, 48, jnp.float32, jnp.bfloat16)
    _check(_run(x, w, ids, ex, activation=activation), x, w, ids, ex, activation)


def test_every_row_written_and_bands_identical(dot_kernels):
    """Poisoned output (NaN until written); one band and bands of 7 tokens
    give the same bits; every expert runs the packed kernels whatever its rows."""
    x, w, ids, ex = make_problem(11, 61, 6, 3, 72, 40, jnp.bfloat16, jnp.bfloat16)
    run = lambda band: _ffi_forward(x, w, ids, *ex.flat(), activation="swiglu",  # noqa: E731
                                    band_tokens=band, poison=True, bf16_dot=True)
    y0, y7 = run(0), run(7)
    assert bool(jnp.all(jnp.isfinite(y0.astype(jnp.float32))))
    assert bool(jnp.all(y0 == y7))
    _check(y0, x, w, ids, ex)


@pytest.mark.parametrize("xd", ["float32", "bfloat16"])
def test_decode_tokens_match_the_batch(dot_kernels, xd):
    """A token alone (its experts stream, where the dot kernels stream: fma)
    gets the bits it gets in a batch of 90 (its experts pack), for plain,
    biased and concatenated gate||up experts."""
    x, w, ids, ex = make_problem(31, 90, 4, 2, 136, 75, jnp.dtype(xd), jnp.bfloat16)
    rng = np.random.default_rng(5)
    b = [jnp.asarray(rng.standard_normal(s) * 0.1, jnp.bfloat16) for s in ((4, 75), (4, 75), (4, 136))]
    variants = [ex, nbx.Experts(ex.gate, ex.up, ex.down, gate_bias=b[0], up_bias=b[1], down_bias=b[2]),
                nbx.Experts.fused(jnp.concatenate([ex.gate, ex.up], axis=-1), ex.down)]
    for e in variants:
        y = _run(x, w, ids, e)
        for t in (0, 1, 57):
            yt = _run(x[t:t + 1], w[t:t + 1], ids[t:t + 1], e)
            assert bool(jnp.all(yt[0] == y[t])), (dot_kernels, t)
    _check(y, x, w, ids, ex)  # (the last variant: fused gate||up, the same values)


def test_biases_concat_and_lists():
    x, w, ids, ex = make_problem(12, 20, 6, 2, 48, 40, jnp.float32, jnp.bfloat16)
    rng = np.random.default_rng(3)
    b = [jnp.asarray(rng.standard_normal(s) * 0.1, jnp.bfloat16) for s in ((6, 40), (6, 40), (6, 48))]
    exb = nbx.Experts(ex.gate, ex.up, ex.down, gate_bias=b[0], up_bias=b[1], down_bias=b[2])
    _check(_run(x, w, ids, exb), x, w, ids, exb)
    fused = nbx.Experts.fused(jnp.concatenate([ex.gate, ex.up], axis=-1), ex.down)
    assert bool(jnp.all(_run(x, w, ids, fused) == _run(x, w, ids, ex)))
    lists = nbx.Experts(list(ex.gate), list(ex.up), list(ex.down))
    assert bool(jnp.all(_run(x, w, ids, lists) == _run(x, w, ids, ex)))


def test_close_to_float32_and_jit_and_grad():
    x, w, ids, ex = make_problem(4, 20, 8, 2, 64, 32, jnp.float32, jnp.bfloat16)
    y = jax.jit(lambda *a: _run(*a))(x, w, ids, ex)
    y32 = nbx.fused_moe(x, w, ids, ex, implementation="ffi")
    assert float(jnp.max(jnp.abs(y - y32))) < 2e-2 * float(jnp.max(jnp.abs(y32)))
    # gradients: the float32 arithmetic's (the roundings pass them through)
    g = jax.grad(lambda x: _run(x, w, ids, ex).sum())(x)
    g32 = jax.grad(lambda x: nbx.fused_moe(x, w, ids, ex, implementation="ffi").sum())(x)
    assert bool(jnp.all(g == g32))


def test_fma_kernels_give_the_emulation_bits():
    """The fma kernels (float32 fused multiply-adds under MXCSR DAZ|FTZ) and
    the emulation give the same bits through the op, banded and not, float32
    and bfloat16 x.  Skipped where the CPU has no fma kernels (not x86-64, or
    no AVX2)."""
    if "fma" not in nbx.cpu.supported_dot_kernels() or nbx.cpu.isa_families()["dot"] == "generic":
        pytest.skip("no fma dot kernels on this CPU (or the generic blocking, which has none)")
    for seed, xd in ((21, jnp.float32), (22, jnp.bfloat16)):
        x, w, ids, ex = make_problem(seed, 45, 8, 3, 131, 70, xd, jnp.bfloat16)
        ys = {}
        for name in ("fma", "emulated"):
            nbx.cpu.set_dot_kernels(name)
            try:
                assert nbx.cpu.dot_kernels() == name
                ys[name] = [_ffi_forward(x, w, ids, *ex.flat(), activation="swiglu", band_tokens=band,
                                         bf16_dot=True) for band in (0, 8)]
            finally:
                nbx.cpu.set_dot_kernels("auto")
        for a, b in zip(ys["fma"], ys["emulated"]):
            assert bool(jnp.all(a == b))
        _check(ys["fma"][0], x, w, ids, ex)


def test_emulation_agrees_with_the_instruction():
    """Where the CPU has avx512_bf16, the instruction and its emulation agree
    through the op within float32 rounding of the same sums (their bits are
    compared by benchmarks/isa.py's prefill-bf16dot row, not asserted: the
    SDM documents the arithmetic, and no CPU with the instruction has run
    this yet).  Skipped elsewhere:
    only the emulation runs."""
    if nbx.cpu.dot_kernels() != "avx512_bf16":
        pytest.skip("no avx512_bf16 on this CPU")
    x, w, ids, ex = make_problem(9, 50, 8, 2, 130, 66, jnp.float32, jnp.bfloat16)
    y = _run(x, w, ids, ex)
    nbx.cpu.set_dot_kernels("emulated")
    try:
        ye = _run(x, w, ids, ex)
    finally:
        nbx.cpu.set_dot_kernels("auto")
    _check(y, x, w, ids, ex)
    _check(ye, x, w, ids, ex)
    _, tol = np_moe_bf16(x, w, ids, ex)
    assert np.all(np.abs(f64(y) - f64(ye)) <= 2 * tol)


def test_errors_name_the_argument():
    x, w, ids, ex = make_problem(6, 4, 4, 2, 16, 8, jnp.float32, jnp.bfloat16)
    with pytest.raises(ValueError, match="precision must be None, 'float32', 'bfloat16' or 'int8'; got 'tf32'"):
        nbx.fused_moe(x, w, ids, ex, precision="tf32")
    with pytest.raises(ValueError, match="'xla' cannot run this call: precision='bfloat16' runs on the CPU"):
        nbx.fused_moe(x, w, ids, ex, implementation="xla", precision="bfloat16")
    x32, w32, ids32, ex32 = make_problem(6, 4, 4, 2, 16, 8, jnp.float32, jnp.float32)
    with pytest.raises(ValueError, match="dense bfloat16 experts; these are float32"):
        _run(x32, w32, ids32, ex32)
    with pytest.raises(ValueError, match="dense bfloat16 experts; these are quantized"):
        _run(x, w, ids, nbx.quantize(ex, "int8"))
    inter = nbx.Experts.fused(jnp.stack([ex.gate, ex.up], axis=-1).reshape(4, 16, 16), ex.down,
                              fusion="interleaved")
    with pytest.raises(ValueError, match="stored by rows.*fusion='interleaved'"):
        _run(x, w, ids, inter)
    tr = nbx.Experts(jnp.swapaxes(ex.gate, 1, 2), jnp.swapaxes(ex.up, 1, 2), jnp.swapaxes(ex.down, 1, 2),
                     layout="out_in")
    with pytest.raises(ValueError, match="stored by rows.*layout='out_in'"):
        _run(x, w, ids, tr)
    y = nbx.fused_moe(x, w, ids, ex, implementation="ffi", precision="float32")
    assert bool(jnp.all(y == nbx.fused_moe(x, w, ids, ex, implementation="ffi")))


def test_default_precision_follows_the_instruction(monkeypatch):
    """precision=None is float32 arithmetic unless x is bfloat16, every expert
    (shared ones included) can take the dot kernels, and they run on the
    instruction (``dot_kernels() == "avx512_bf16"``, read at trace time).
    Here the instruction is reported while the fma or emulated kernels run
    (the same documented bits), so the rule itself is checked on any CPU."""
    x, w, ids, ex = make_problem(41, 19, 6, 2, 72, 40, jnp.bfloat16, jnp.bfloat16)

    def run(x, ex, precision=None, **kw):
        return nbx.fused_moe(x, w, ids, ex, implementation="ffi", precision=precision, **kw)

    f32, dot = run(x, ex, "float32"), run(x, ex, "bfloat16")
    assert not bool(jnp.all(f32 == dot))  # (the two arithmetics differ on this problem)
    real = nbx.cpu.dot_kernels()
    assert nbx.cpu.bf16_dot_by_default() == (real == "avx512_bf16")
    assert bool(jnp.all(run(x, ex) == (dot if real == "avx512_bf16" else f32)))

    monkeypatch.setattr(nbx.cpu, "dot_kernels", lambda: "avx512_bf16")
    assert nbx.cpu.bf16_dot_by_default()
    assert bool(jnp.all(run(x, ex) == dot))
    assert bool(jnp.all(jax.jit(run)(x, ex) == dot))
    # float32 x, float32 experts, experts stored by columns, float32 shared
    # experts: float32 arithmetic, and no error
    x32 = x.astype(jnp.float32)
    assert bool(jnp.all(run(x32, ex) == run(x32, ex, "float32")))
    ex32 = jax.tree.map(lambda a: a.astype(jnp.float32), ex)
    assert bool(jnp.all(run(x, ex32) == run(x, ex32, "float32")))
    tr = nbx.Experts(*(jnp.swapaxes(a, 1, 2) for a in (ex.gate, ex.up, ex.down)), layout="out_in")
    assert bool(jnp.all(run(x, tr) == run(x, tr, "float32")))
    shared32 = nbx.SharedExperts(nbx.Experts(ex32.gate[:1], ex32.up[:1], ex32.down[:1]))
    assert bool(jnp.all(run(x, ex, shared_experts=shared32)
                        == run(x, ex, "float32", shared_experts=shared32)))
    shared = nbx.SharedExperts(nbx.Experts(ex.gate[:1], ex.up[:1], ex.down[:1]))
    assert bool(jnp.all(run(x, ex, shared_experts=shared) == run(x, ex, "bfloat16", shared_experts=shared)))
    # another implementation: the default never raises
    y = nbx.fused_moe(x, w, ids, ex, implementation="xla")
    assert float(jnp.max(jnp.abs(y.astype(jnp.float32) - f32.astype(jnp.float32)))) < 0.1


def test_handler_refuses_what_python_would():
    """The handler checks again (the raw call bypasses fused_moe's checks)."""
    x, w, ids, ex = make_problem(6, 4, 4, 2, 16, 8, jnp.float32, jnp.float32)
    with pytest.raises(Exception, match="precision='bfloat16' needs dense bfloat16 weights"):
        jax.block_until_ready(_ffi_forward(x, w, ids, *ex.flat(), activation="swiglu", band_tokens=0,
                                           bf16_dot=True))


def test_workspace_plan_counts_the_pairs():
    """The plan and the handler use one formula: a cap that fits 5 tokens'
    bands with the pairs' scratch runs in bands, and gives the same bits."""
    from jax_nbx import memory
    x, w, ids, ex = make_problem(13, 23, 6, 2, 200, 150, jnp.bfloat16, jnp.bfloat16)
    base = memory.fused_moe_workspace_bytes(0, 2, 6, 200, 150)
    dot = memory.fused_moe_workspace_bytes(0, 2, 6, 200, 150, bf16_dot=True)
    assert dot > base
    cap = memory.fused_moe_workspace_bytes(5, 2, 6, 200, 150, bf16_dot=True)
    assert bool(jnp.all(_run(x, w, ids, ex, max_workspace_bytes=cap) == _run(x, w, ids, ex)))
