"""The CUDA path's backward kernels and launch program (`plan.build_backward`),
run by Triton's interpreter (TRITON_INTERPRET=1) on the CPU: the same program
(kernels, grids, arguments, pointer tables of absolute addresses, the
gradients' tables included) the CUDA handler executes, checked against an
analytic float64 gradient written here, with every output poisoned (NaN)
first."""
from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton", reason="the CUDA path's kernels need Triton (pip install jax_nbx[gpu])")

import ml_dtypes  # noqa: E402

from jax_nbx.backends.cuda import plan

from support import triton_interpret as interpret  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F32, F16 = np.dtype("float32"), np.dtype("float16")
# max |grad - ref| / max |ref| per output.  16-bit weights: x, dy and every
# intermediate go through the tensor cores in the weights' dtype.
TOL = {F32: 1e-5, BF16: 2e-2, F16: 4e-3}
ALPHA, LIMIT = 1.702, 7.0  # swiglu_clamped's defaults (gpt-oss)


def glu_and_partials(g, u, act):
    """(glu(g, u), d/dg, d/du) in float64; a clamp passes no gradient outside
    its range (bounds included inside)."""
    if act == 0:  # silu(g) u
        s = 1.0 / (1.0 + np.exp(-g))
        f, df = g * s, s + g * s * (1.0 - s)
        return f * u, df * u, f
    if act == 1:  # gelu (tanh) g u
        c, b = math.sqrt(2.0 / math.pi), 0.044715
        th = np.tanh(c * (g + b * g ** 3))
        f = 0.5 * g * (1.0 + th)
        df = 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th ** 2) * c * (1.0 + 3.0 * b * g ** 2)
        return f * u, df * u, f
    if act == 3:  # gelu (erf) g u
        cdf = 0.5 * (1.0 + np.vectorize(math.erf)(g / math.sqrt(2.0)))
        f = g * cdf
        df = cdf + g * np.exp(-0.5 * g ** 2) / math.sqrt(2.0 * math.pi)
        return f * u, df * u, f
    g_in, u_in = g <= LIMIT, np.abs(u) <= LIMIT  # clamped swiglu
    gc, uc = np.minimum(g, LIMIT), np.clip(u, -LIMIT, LIMIT)
    s = 1.0 / (1.0 + np.exp(-ALPHA * gc))
    f, df = gc * s, s + ALPHA * gc * s * (1.0 - s)
    return f * (uc + 1.0), np.where(g_in, df * (uc + 1.0), 0.0), np.where(u_in, f, 0.0)


def np_grad64(x, w, ids, gate, up, down, dy, act=0, biases=None):
    """Analytic float64 gradient of sum(dy * y), y_t = sum_j w_tj mlp_e(x_t),
    mlp_e(x) = glu(x G_e + bg_e, x U_e + bu_e) D_e + bd_e: (dx,
    d(topk_weights), dgate, dup, ddown) and with ``biases`` (bg, bu, bd) also
    (dbg, dbu, dbd).  Slots with ids outside [0, E) contribute nothing."""
    E, H, I = gate.shape
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    G, U, D = (a.astype(np.float64) for a in (gate, up, down))
    bg, bu, bd = ((np.zeros((E, I)), np.zeros((E, I)), np.zeros((E, H))) if biases is None
                  else (np.asarray(b, np.float64) for b in biases))
    dx, dw = np.zeros_like(x64), np.zeros(ids.shape)
    dG, dU, dD = np.zeros_like(G), np.zeros_like(U), np.zeros_like(D)
    dbg, dbu, dbd = np.zeros_like(bg), np.zeros_like(bu), np.zeros_like(bd)
    for e in range(E):
        t, j = np.nonzero(ids == e)
        if len(t) == 0:
            continue
        xs, dys, ws = x64[t], dy64[t], w[t, j].astype(np.float64)[:, None]
        a, da_dg, da_du = glu_and_partials(xs @ G[e] + bg[e], xs @ U[e] + bu[e], act)
        da = dys @ D[e].T                      # d loss / d a, before the routing weight
        dw[t, j] = np.sum(a * da, axis=1) + dys @ bd[e]
        dg, du = ws * da * da_dg, ws * da * da_du
        dG[e], dU[e], dD[e] = xs.T @ dg, xs.T @ du, (ws * a).T @ dys
        dbg[e], dbu[e], dbd[e] = dg.sum(0), du.sum(0), (ws * dys).sum(0)
        np.add.at(dx, t, dg @ G[e].T + du @ U[e].T)
    return (dx, dw, dG, dU, dD) + (() if biases is None else (dbg, dbu, dbd))


def problem(seed, T, E, k, H, I, xd, wd, routing="topk", scale=1.0):
    rng = np.random.default_rng(seed)
    x = (scale * rng.standard_normal((T, H))).astype(xd)
    gate = (rng.standard_normal((E, H, I)) / np.sqrt(H)).astype(wd)
    up = (rng.standard_normal((E, H, I)) / np.sqrt(H)).astype(wd)
    down = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(wd)
    if routing == "topk":
        ids = np.array([rng.permutation(E)[:k] for _ in range(T)], np.int32).reshape(T, k)
    elif routing == "one":  # every slot to the last expert (skewed)
        ids = np.full((T, k), E - 1, np.int32)
    else:  # independent draws, repeats allowed
        ids = rng.integers(0, E, (T, k)).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    dy = rng.standard_normal((T, H)).astype(xd)
    return x, w, ids, gate, up, down, dy


def run_backward(inputs, act=0, band=None, lists=False, grad_dtype=None):
    """Runs the backward program on ``inputs`` (x, w, ids, gate, up, down, dy);
    returns (err, dx, dw, [dgate, dup, ddown], program).  Every output starts
    NaN; the weight gradients (in the program's grad_dtype) are E per-expert
    arrays each with ``lists``."""
    x, w, ids, gate, up, down, dy = inputs
    (T, k), (E, H, I) = ids.shape, gate.shape
    wd = gate.dtype
    aligned = lists or (H * I * wd.itemsize) % 16 == 0
    prog = plan.build_backward(T, band or T, k, E, H, I, x.dtype, wd, act, w_aligned=aligned,
                               grad_dtype=grad_dtype)
    gd = np.dtype(ml_dtypes.bfloat16) if prog.grad_dtype == "bfloat16" else np.dtype(prog.grad_dtype)
    dx = np.full((T, H), np.nan, x.dtype)
    dw = np.full((T, k), np.nan, np.float32)
    grads = [np.full(a.shape, np.nan, gd) for a in (gate, up, down)]
    if lists:  # separate buffers, scattered in memory, for the weights and their gradients
        wl = [[np.array(a[e]) for e in range(E)] for a in (gate, up, down)]
        gl = [[np.array(g[e]) for e in range(E)] for g in grads]
        tables = interpret.pointer_tables(*wl, *gl)
        firsts = [ws[0] for ws in wl]
    else:
        tables = interpret.pointer_tables(gate, up, down, *grads)
        firsts = [gate, up, down]
    assert plan.backward_inputs(3) == plan.IN_GROUP0 + 3
    err = interpret.run(prog, [x, w, ids, *firsts, dy], [dx, dw], tables=tables)
    if lists:
        grads = [np.stack(g) for g in gl]
    return err, dx, dw, grads, prog


def rel_err(y, ref):
    return float(np.max(np.abs(y.astype(np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30))


def check(out, ref, tol):
    err, dx, dw, grads, _ = out
    assert err == plan.ERR_NONE
    names = ("dx", "dtopk_weights", "dgate", "dup", "ddown")
    for name, got, want in zip(names, (dx, dw, *grads), ref):
        assert np.all(np.isfinite(got.astype(np.float32))), f"{name}: unwritten (poisoned) elements"
        assert rel_err(got, want) < tol, (name, rel_err(got, want))


CASES = [  # T, E, k, H, I, x dtype, w dtype, activation (0 swiglu, 1 geglu, 2 swiglu_clamped, 3 geglu_erf)
    (1, 4, 2, 33, 20, F32, F32, 0),          # one token, odd H
    (33, 5, 3, 40, 24, F32, F32, 1),         # geglu (tanh)
    (33, 6, 2, 37, 29, F32, F32, 3),         # geglu (erf); H, I multiples of no block
    (33, 6, 2, 21, 13, F32, F32, 2),         # clamped swiglu, x scaled so that the clamps bite
    (40, 6, 2, 40, 24, F32, BF16, 0),        # x f32, weights bf16
    (40, 6, 2, 40, 24, BF16, BF16, 1),
    (22, 3, 1, 17, 9, F16, F16, 0),
    (222, 8, 2, 32, 16, BF16, BF16, 0),      # T = 222
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-E{}-k{}-H{}-I{}-x{}-w{}-a{}".format(
    *c[:5], np.dtype(c[5]).name, np.dtype(c[6]).name, c[7]))
def test_backward_matches_float64(case):
    T, E, k, H, I, xd, wd, act = case
    inputs = problem(sum(case[:5]), T, E, k, H, I, xd, wd, scale=4.0 if act == 2 else 1.0)
    if act == 2:  # the clamps really bite on both sides
        x, _, ids, gate, up, *_ = inputs
        gs = np.einsum("th,tjhi->tji", x.astype(np.float64), gate[ids].astype(np.float64))
        us = np.einsum("th,tjhi->tji", x.astype(np.float64), up[ids].astype(np.float64))
        assert (gs > LIMIT).any() and (np.abs(us) > LIMIT).any()
    ref = np_grad64(*inputs, act=act)
    check(run_backward(inputs, act), ref, TOL[np.dtype(wd)])


@pytest.mark.parametrize("routing", ["one", "any"])
def test_skewed_and_repeated_routing(routing):
    inputs = problem(3, 48, 6, 3, 24, 20, F32, F32, routing)
    check(run_backward(inputs), np_grad64(*inputs), TOL[F32])


def test_per_expert_lists_equal_stacked_bit_for_bit():
    inputs = problem(8, 40, 5, 2, 40, 24, BF16, BF16)
    _, dx0, dw0, g0, _ = run_backward(inputs)
    err, dx1, dw1, g1, _ = run_backward(inputs, lists=True)
    assert err == plan.ERR_NONE
    np.testing.assert_array_equal(dx0.view(np.uint16), dx1.view(np.uint16))
    np.testing.assert_array_equal(dw0.view(np.uint32), dw1.view(np.uint32))
    for a, b in zip(g0, g1):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_bands_bit_identical_for_dx_and_dtopk_weights():
    inputs = problem(4, 50, 6, 2, 40, 24, F32, F32)
    _, dx0, dw0, g0, p0 = run_backward(inputs)
    err, dx1, dw1, g1, p1 = run_backward(inputs, band=16)
    assert err == plan.ERR_NONE
    assert len(p1.launches) > len(p0.launches)  # several bands really ran
    assert p1.workspace_bytes < p0.workspace_bytes
    assert [ln.kernel.name for ln in p1.launches].count("bwd_dw") == 4
    np.testing.assert_array_equal(dx0.view(np.uint32), dx1.view(np.uint32))
    np.testing.assert_array_equal(dw0.view(np.uint32), dw1.view(np.uint32))
    # weight gradients: summed band after band (deterministic; another grouping of the sum)
    ref = np_grad64(*inputs)
    for a, b, r in zip(g0, g1, ref[2:]):
        assert rel_err(a, r) < TOL[F32] and rel_err(b, r) < TOL[F32]


@pytest.mark.parametrize("T", [1, 33])
def test_bad_expert_id_is_reported_never_read(T):
    E, k = 4, 2
    x, w, ids, gate, up, down, dy = problem(5, T, E, k, 24, 20, F32, F32)
    ids[T // 2, 1] = E + 7
    ids[T - 1, 0] = -3 if T > 1 else ids[T - 1, 0]
    err, dx, dw, grads, _ = run_backward((x, w, ids, gate, up, down, dy))
    assert err == (T // 2) * k + 1  # the first bad slot; the handler names topk_ids[t, j] from it
    # the bad slots are skipped: no dx contribution, d(topk_weight) 0, the rest exact
    ref = np_grad64(x, w, ids, gate, up, down, dy)
    assert dw[T // 2, 1] == 0.0
    for got, want in zip((dx, dw, *grads), ref):
        assert np.all(np.isfinite(got)) and rel_err(got, want) < TOL[F32]


def test_no_tokens_gives_zero_weight_gradients():
    x, w, ids, gate, up, down, dy = problem(2, 0, 3, 2, 17, 9, F32, F32)
    err, dx, dw, grads, _ = run_backward((x, w, ids, gate, up, down, dy))
    assert err == plan.ERR_NONE and dx.shape == (0, 17) and dw.shape == (0, 2)
    for g in grads:
        np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("wd", [BF16, np.dtype("float16")], ids=["bf16", "f16"])
def test_one_band_writes_16bit_gradients_rounded_once(wd):
    """One band, 16-bit weights: bwd_dw stores the weights' dtype (the cast XLA
    would make on a float32 copy, fused): the float32 program's gradients
    rounded once, bit for bit.  Several bands stay float32."""
    inputs = problem(12, 33, 6, 2, 40, 24, wd, wd)
    *_, g16, p16 = run_backward(inputs)
    *_, g32, p32 = run_backward(inputs, grad_dtype="float32")
    assert np.dtype(p16.grad_dtype) == wd and p32.grad_dtype == "float32"
    for a, b in zip(g16, g32):
        assert a.dtype == wd and b.dtype == np.float32
        np.testing.assert_array_equal(a.view(np.uint16), b.astype(wd).view(np.uint16))
    assert run_backward(inputs, band=16)[-1].grad_dtype == "float32"
    with pytest.raises(ValueError, match="grad_dtype"):
        plan.build_backward(33, 16, 2, 6, 40, 24, wd, wd, 0, grad_dtype=wd)


def test_workspace_offsets_and_encoding():
    prog = plan.build_backward(300, 100, 8, 64, 256, 128, BF16, BF16, 0)
    for ln in prog.launches:
        for a in ln.args:
            if a.kind == plan.ARG_WORKSPACE:
                assert 0 <= a.offset < prog.workspace_bytes
            if a.kind == plan.ARG_OUTPUT:
                assert a.index in (plan.OUT_DX, plan.OUT_DTW)
            if a.kind == plan.ARG_TABLE:
                assert 0 <= a.index < 6  # weights' 3 groups, then their gradients'
    sizes = [plan.backward_band_workspace(t, 8, 64, 2048, 1024, BF16) for t in (1, 16, 256, 1024)]
    assert sizes == sorted(sizes)
    assert prog.workspace_bytes == plan.backward_band_workspace(100, 8, 64, 256, 128, BF16, call_tokens=300)
    enc = prog.encode()
    assert len(enc) == sum(5 + 3 * len(ln.args) for ln in prog.launches)


def test_backward_kernels_compile_to_cubins():
    """Ahead-of-time compilation of every backward kernel for sm_90 (no GPU
    needed), float32, float16 and bfloat16 weights, banded (the accumulating
    bwd_dw too), plain and gpt-oss's interleaved layout with biases.  Run in
    a fresh process: this one interprets the kernels."""
    import subprocess
    import sys

    code = """
import numpy as np, ml_dtypes
from jax_nbx.backends.cuda import plan, compile as C
bf = np.dtype(ml_dtypes.bfloat16)
from jax_nbx.experts import WeightLayout
gpt_oss = WeightLayout((0, 64, 2, 1, 64, 2, 0, 64, 1), 32, True, True)  # interleaved gate_up, biases
for wd, act, lay in ((np.float32, 2, None), (bf, 0, None), (np.float16, 3, None), (bf, 2, gpt_oss)):
    prog = plan.build_backward(80, 40, 2, 6, 64, 32, wd, wd, act, layout=lay)
    blob, table = C.pack(prog, 90)
    names = {k.name for k, _, _ in prog.kernels()}
    assert {"bwd_gemm1", "bwd_dtw", "bwd_dx", "combine_slots", "bwd_dw", "expert_ranges"} <= names
    for row in table:
        assert bytes(blob[row[2]:row[2] + 4]) == b"\\x7fELF"
    print("compiled", len(table))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("compiled") == 4


@pytest.mark.parametrize("lists,bias", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["stacked", "lists", "stacked-interleaved-bias", "lists-interleaved-bias"])
def test_cuda_backward_call_matches_the_handlers_contract(lists, bias, monkeypatch):
    """`_cuda.backward` without a GPU (device, compiler and ffi_call stubbed):
    its operands (x, w, ids, the groups' buffers, dy), results (dx, dw, the
    float32 gradients in `Experts.flat` order, the workspace) and attributes
    are what `nbx_fused_moe_bwd_cuda` decodes, and its program passes the
    handler's decoder with those inputs, 2 outputs and 2G tables."""
    import types

    import jax
    import jax.numpy as jnp

    import jax_nbx as nbx
    from jax_nbx import _registry, contract
    from jax_nbx.backends.cuda import calls as _cuda
    from jax_nbx.backends.cuda import compile as C

    E, k, H, I, T = 5, 2, 24, 20, 9
    x, w, ids, gate, up, down, dy = problem(1, T, E, k, H, I, F32, BF16)
    ex = nbx.Experts(jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down))
    if lists:
        ex = nbx.Experts(*([a[e] for e in range(E)] for a in (ex.gate, ex.up, ex.down)))
    if bias:  # gpt-oss's experts: interleaved gate_up [E, H, 2I] with biases
        from support.layouts import stored

        r = np.random.default_rng(2)
        ex = stored("interleaved", gate.astype(np.float32), up.astype(np.float32),
                    down.astype(np.float32), r.standard_normal((E, I)), r.standard_normal((E, I)),
                    r.standard_normal((E, H)), lists=lists, dtype=jnp.bfloat16)
    seen = {}

    def fake_call(target, outs, vmap_method):
        def call(*operands, **attrs):
            seen.update(target=target, outs=outs, operands=operands, attrs=attrs)
            return [jnp.zeros(o.shape, o.dtype) for o in outs]
        return call

    monkeypatch.setattr(_cuda, "_device", lambda i=0: types.SimpleNamespace(device_kind="test",
                                                                             compute_capability="9.0"))
    monkeypatch.setattr(C, "pack", lambda prog, cc: (np.zeros(1, np.uint8),
                                                     np.zeros((len(prog.kernels()), 7), np.int64)))
    monkeypatch.setattr(jax.ffi, "ffi_call", fake_call)
    arrays = (*ex.flat(), *ex.handler_biases())
    dx, dw, dws = _cuda.backward(jnp.asarray(dy), jnp.asarray(x), jnp.asarray(w), jnp.asarray(ids),
                                 *arrays, activation=nbx.Activation("swiglu"), band_tokens=4,
                                 lists=lists, layout=ex.weight_layout())
    assert seen["target"] == contract.TARGET_CUDA_BACKWARD
    n_groups = len(ex.flat()) // (E if lists else 1)
    nb = 3 if bias else 0
    ops, outs, attrs = seen["operands"], seen["outs"], seen["attrs"]
    assert len(ops) == 3 + len(arrays) + 1 and ops[-1].shape == (T, H)
    assert [o.shape for o in outs[2:-1]] == [a.shape for a in arrays]
    assert all(o.dtype == np.float32 for o in outs[1:-1]) and outs[0].dtype == x.dtype  # 3 bands
    assert attrs["grad_f32"] is True
    assert attrs["groups"] == n_groups and attrs["stacked"] == (not lists)
    assert attrs["has_bias"] == bias
    assert [d.dtype for d in dws] == [a.dtype for a in arrays]
    # the program addresses exactly those operands (weights' first buffers, the biases, then dy),
    # dx, dw (and the bias gradients), the weights' and the gradients' tables
    n_in = contract.IN_GROUP0 + n_groups + nb + 1
    from support import ffi_testing

    ffi, decoder = _registry.ffi_module(), ffi_testing.load()  # the product's module, the test module
    args = (attrs["kernels"].size // 7, n_in, 2 * n_groups, int(attrs["workspace_bytes"]), 2 + nb)
    decoder.decode_program(attrs["program"], *args)
    if bias:
        with pytest.raises(ValueError, match="bad output index"):
            decoder.decode_program(attrs["program"], *args[:-1], 2)
    assert contract.TARGET_CUDA_BACKWARD in ffi.cuda_handlers() or not ffi.has_cuda


LAYOUT_NAMES = ("plain", "out_in", "concat", "interleaved", "concat_out_in", "interleaved_out_in")


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("lists", [False, True], ids=["stacked", "lists"])
@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_every_layout_read_and_written_in_place(name, lists, bias):
    """Every checkpoint layout (tests/support/layouts.py's), with and without
    biases, stacked and per-expert: the weights read through their views,
    the float32 gradients written through the same views into buffers shaped
    like the weights (fused gate_up: one gradient buffer), the bias gradients
    as the handler's three [E, I], [E, I], [E, H] outputs, against the
    float64 gradient on canonical weights rearranged the same way (a
    permutation)."""
    _layout_case(name, lists, bias)


def _layout_case(name, lists, bias, band=None):
    from support.layouts import canonical, stored

    E, k, H, I, T = 5, 2, 21, 13, 33
    rng = np.random.default_rng(LAYOUT_NAMES.index(name) + 10 * bias)
    G, U, D, *B = canonical(rng, E, H, I, bias)
    ex = stored(name, G, U, D, *B, lists=lists)
    x = rng.standard_normal((T, H)).astype(np.float32)
    dy = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    layout = ex.weight_layout()
    flat = [np.asarray(a) for a in ex.flat()]
    grads = [np.full(a.shape, np.nan, np.float32) for a in flat]
    n_groups = 2 if layout.fused else 3
    per = E if lists else 1
    def group(arrs):
        return [arrs[g * per:(g + 1) * per] for g in range(n_groups)] if lists else arrs
    aligned = lists or all(a[0].nbytes % 16 == 0 for a in flat)
    prog = plan.build_backward(T, band or T, k, E, H, I, F32, F32, 0, w_aligned=aligned, layout=layout)
    dx = np.full((T, H), np.nan, np.float32)
    dw = np.full((T, k), np.nan, np.float32)
    biases = [np.asarray(b, np.float32) for b in ex.handler_biases()]
    dbiases = [np.full(b.shape, np.nan, np.float32) for b in biases]
    firsts = [flat[g * per] for g in range(n_groups)]
    err = interpret.run(prog, [x, w, ids, *firsts, *biases, dy], [dx, dw, *dbiases],
                        tables=interpret.pointer_tables(*group(flat), *group(grads)))
    assert err == plan.ERR_NONE
    ref = np_grad64(x, w, ids, G, U, D, dy, biases=biases if bias else None)
    want = [np.asarray(a, np.float64) for a in stored(name, *ref[2:5], lists=lists).flat()]
    for got, r in zip((dx, dw, *grads, *dbiases), (*ref[:2], *want, *ref[5:])):
        assert np.all(np.isfinite(got)), "unwritten (poisoned) elements"
        assert rel_err(got, r) < TOL[F32]
    return dx, dw, grads, dbiases


def test_biases_banded():
    """Bias gradients accumulate band after band like the weights'; dx and
    d(topk_weights) stay bit-identical."""
    dx0, dw0, *_ = _layout_case("interleaved", False, True)
    dx1, dw1, *_ = _layout_case("interleaved", False, True, band=8)
    np.testing.assert_array_equal(dx0.view(np.uint32), dx1.view(np.uint32))
    np.testing.assert_array_equal(dw0.view(np.uint32), dw1.view(np.uint32))
