"""The CUDA path's Triton kernels and launch program, run by Triton's
interpreter (TRITON_INTERPRET=1) on the CPU: the same program (kernels,
grids, arguments, pointer tables of absolute addresses) the CUDA handler
executes, checked against the float64 reference with the output poisoned."""
from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton", reason="the CUDA path's kernels need Triton (pip install jax_nbx[gpu])")

import ml_dtypes  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from jax_nbx.backends.cuda import kernels, plan  # noqa: E402

from support import triton_interpret as interpret  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F32, F16 = np.dtype("float32"), np.dtype("float16")
# max |y - ref| / max |ref|.  16-bit weights run on tensor cores on the GPU: x
# and the intermediate are rounded to the weights' dtype, so the bound is the
# weights' dtype's, whatever x's.
TOL = {F32: 1e-5, BF16: 1.5e-2, F16: 3e-3}


def _glu(g, u, act):
    """glu(g, u) of the activation code (swiglu_clamped with gpt-oss's alpha 1.702, limit 7)."""
    if act == 1:
        return 0.5 * g * (1.0 + np.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3))) * u
    if act == 3:
        return 0.5 * g * (1.0 + np.vectorize(math.erf)(g / np.sqrt(2.0))) * u
    if act == 2:
        gc, uc = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
        return gc / (1.0 + np.exp(-1.702 * gc)) * (uc + 1.0)
    return g / (1.0 + np.exp(-g)) * u


def np_moe64(x, w, ids, gate, up, down, act=0):
    """Float64 reference, written here independently of the kernels."""
    x64 = x.astype(np.float64)
    y = np.zeros_like(x64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            g = x64[t] @ gate[e].astype(np.float64)
            u = x64[t] @ up[e].astype(np.float64)
            y[t] += w[t, j] * (_glu(g, u, act) @ down[e].astype(np.float64))
    return y


def problem(seed, T, E, k, H, I, xd, wd, routing="topk"):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(xd)
    gate = (rng.standard_normal((E, H, I)) / np.sqrt(H)).astype(wd)
    up = (rng.standard_normal((E, H, I)) / np.sqrt(H)).astype(wd)
    down = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(wd)
    if routing == "topk":
        ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    elif routing == "one":  # every slot to the last expert (skewed)
        ids = np.full((T, k), E - 1, np.int32)
    else:  # independent draws, repeats allowed
        ids = rng.integers(0, E, (T, k)).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    return x, w, ids, gate, up, down


def run(T, E, k, H, I, xd, wd, act=0, band=None, routing="topk", seed=0, ids=None):
    x, w, ids0, gate, up, down = problem(seed, T, E, k, H, I, xd, wd, routing)
    ids = ids0 if ids is None else ids
    aligned = (H * I * np.dtype(wd).itemsize) % 16 == 0
    prog = plan.build(T, band or T, k, E, H, I, xd, wd, act, w_aligned=aligned)
    y = np.full((T, H), np.nan, xd)  # poisoned: an unwritten row shows
    err = interpret.run(prog, [x, w, ids, gate, up, down], y)
    return y, err, (x, w, ids, gate, up, down), prog


def rel_err(y, ref):
    return float(np.max(np.abs(y.astype(np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30))


CASES = [  # T, E, k, H, I, x dtype, w dtype, activation (0 swiglu, 1 geglu, 2 swiglu_clamped, 3 geglu_erf)
    (1, 4, 2, 33, 20, F32, F32, 0),          # decode path, odd H
    (1, 8, 8, 64, 48, BF16, BF16, 1),        # decode, k = E
    (1, 8, 2, 300, 200, F32, F32, 0),        # decode with the K axis split into chunks
    (3, 5, 3, 40, 24, F16, F16, 0),
    (33, 5, 3, 40, 24, F32, F32, 1),         # prefill path
    (33, 6, 2, 129, 99, F32, F32, 0),        # H, I not multiples of any block; unaligned experts
    (40, 6, 2, 40, 24, F32, BF16, 0),        # x f32, weights bf16
    (40, 6, 2, 40, 24, BF16, BF16, 1),
    (22, 3, 1, 17, 9, F16, F16, 0),
    (222, 8, 2, 32, 16, BF16, BF16, 0),      # T = 222
    (70, 1, 1, 32, 16, F32, F32, 0),         # E = 1
    (1, 4, 2, 33, 20, F32, F32, 2),          # decode, gpt-oss's clamped swiglu
    (33, 6, 2, 40, 24, F32, F32, 3),         # prefill, exact-erf geglu
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-E{}-k{}-H{}-I{}-x{}-w{}-a{}".format(
    *c[:5], np.dtype(c[5]).name, np.dtype(c[6]).name, c[7]))
def test_program_matches_float64(case):
    T, E, k, H, I, xd, wd, act = case
    y, err, inputs, prog = run(T, E, k, H, I, xd, wd, act, seed=sum(case[:5]))
    assert err == plan.ERR_NONE
    assert np.all(np.isfinite(y.astype(np.float32))), "unwritten (poisoned) rows"
    assert rel_err(y, np_moe64(*inputs, act=act)) < TOL[np.dtype(wd)]


@pytest.mark.parametrize("routing", ["one", "any"])
def test_skewed_and_repeated_routing(routing):
    y, err, inputs, _ = run(48, 6, 3, 40, 24, F32, F32, routing=routing, seed=3)
    assert err == plan.ERR_NONE
    assert rel_err(y, np_moe64(*inputs)) < TOL[F32]


def test_bands_are_bit_identical():
    y0, _, _, p0 = run(50, 6, 2, 40, 24, BF16, BF16, seed=4)
    y1, _, _, p1 = run(50, 6, 2, 40, 24, BF16, BF16, band=16, seed=4)
    assert len(p1.launches) > len(p0.launches)  # several bands really ran
    assert p1.workspace_bytes < p0.workspace_bytes
    np.testing.assert_array_equal(y0.view(np.uint16), y1.view(np.uint16))


@pytest.mark.parametrize("T", [3, 40], ids=["decode", "prefill"])
def test_per_expert_lists_read_through_the_table(T):
    """Experts as separate arrays (scattered in memory): the table holds each
    array's own address; results equal the stacked experts' bit for bit."""
    E, k, H, I = 5, 2, 40, 24
    x, w, ids, gate, up, down = problem(8, T, E, k, H, I, BF16, BF16)
    lists = [[np.array(a[e]) for e in range(E)] for a in (gate, up, down)]  # separate buffers
    prog = plan.build(T, T, k, E, H, I, BF16, BF16, 0)
    y_stacked = np.full((T, H), np.nan, BF16)
    interpret.run(prog, [x, w, ids, gate, up, down], y_stacked)
    y_lists = np.full((T, H), np.nan, BF16)
    tables = interpret.pointer_tables(*lists)
    err = interpret.run(prog, [x, w, ids, lists[0][0], lists[1][0], lists[2][0]], y_lists, tables=tables)
    assert err == plan.ERR_NONE
    np.testing.assert_array_equal(y_stacked.view(np.uint16), y_lists.view(np.uint16))


@pytest.mark.parametrize("T", [5, 40], ids=["decode", "prefill"])
def test_bad_expert_id_is_reported_never_read(T):
    E, k = 4, 2
    x, w, ids, gate, up, down = problem(5, T, E, k, 32, 16, F32, F32)
    ids[T // 2, 1] = E + 7
    ids[T - 1, 0] = -3
    prog = plan.build(T, T, k, E, 32, 16, F32, F32, 0)
    y = np.full((T, 32), np.nan, np.float32)
    err = interpret.run(prog, [x, w, ids, gate, up, down], y)
    assert err == (T // 2) * k + 1  # the first bad slot; the handler names topk_ids[t, j] from it


@pytest.mark.parametrize("T", [5, 40], ids=["decode", "prefill"])
def test_skipped_expert_id_contributes_nothing(T):
    """With the check off (ids_outside="skip": sharded_moe's psum dispatch) a
    slot with a bad id adds nothing to its token: the prefill path's gemm2
    never writes its row, so the combine must leave it out (it used to add
    unwritten workspace)."""
    E, k = 4, 2
    x, w, ids, gate, up, down = problem(5, T, E, k, 32, 16, F32, F32)
    ids[T // 2, 1] = E + 7
    prog = plan.build(T, T, k, E, 32, 16, F32, F32, 0)
    y = np.full((T, 32), np.nan, np.float32)
    interpret.run(prog, [x, w, ids, gate, up, down], y)
    w0, ids0 = w.copy(), ids.copy()
    w0[T // 2, 1], ids0[T // 2, 1] = 0.0, 0  # the same slot, weighted 0
    assert rel_err(y, np_moe64(x, w0, ids0, gate, up, down)) < TOL[F32]


def test_decode_and_prefill_paths_agree(monkeypatch):
    monkeypatch.setenv("JAX_NBX_CUDA_DECODE_SLOTS", "0")
    y_pre, _, inputs, p = run(6, 5, 2, 40, 24, F32, F32, seed=6)
    assert any(ln.kernel.name == "gemm1" for ln in p.launches)
    monkeypatch.setenv("JAX_NBX_CUDA_DECODE_SLOTS", "64")
    y_dec, _, _, p = run(6, 5, 2, 40, 24, F32, F32, seed=6)
    assert any(ln.kernel.name == "decode1" for ln in p.launches)
    ref = np_moe64(*inputs)
    assert rel_err(y_pre, ref) < TOL[F32] and rel_err(y_dec, ref) < TOL[F32]


def test_plan_bounds():
    # padding every expert's group to BM never needs more blocks than max_mblocks
    rng = np.random.default_rng(0)
    for _ in range(200):
        E, BM = int(rng.integers(1, 70)), int(rng.choice([16, 32, 64, 128]))
        n = int(rng.integers(1, 3000))
        counts = np.bincount(rng.integers(0, E, n), minlength=E)
        assert int(np.sum(-(-counts // BM))) <= plan.max_mblocks(n, E, BM)
    # workspace grows with the band and is what the program's offsets fit in
    sizes = [plan.band_workspace(t, 8, 64, 2048, 1024, BF16) for t in (1, 16, 256, 1024)]
    assert sizes == sorted(sizes)
    prog = plan.build(300, 100, 8, 64, 256, 128, BF16, BF16, 0)
    for ln in prog.launches:
        for a in ln.args:
            if a.kind == plan.ARG_WORKSPACE:
                assert 0 <= a.offset < prog.workspace_bytes
    enc = prog.encode()
    assert enc.dtype == np.int64 and len(enc) == sum(5 + 3 * len(ln.args) for ln in prog.launches)


def test_tuned_config_file_lookup(tmp_path, monkeypatch):
    f = tmp_path / "cfg.json"
    c = {"BM": 32, "BN": 32, "BK": 64, "num_warps": 4, "num_stages": 3}
    f.write_text('{"64,2048,1024,bf16": {"16": [%s, %s], "4096": [%s, %s]}}' % ((str(c).replace("'", '"'),) * 4))
    monkeypatch.setenv("JAX_NBX_TRITON_CONFIGS", str(f))
    c1, c2 = plan.gemm_configs(100, 64, 2048, 1024, BF16, None)
    assert (c1.BM, c1.BN, c2.BK) == (32, 32, 64)
    # a shape the file lacks falls back to the defaults
    d1, _ = plan.gemm_configs(100, 8, 4096, 14336, BF16, None)
    assert d1 == plan._default_gemm_configs(100 / 8, BF16)[0]


def test_kernels_compile_to_cubins():
    """Ahead-of-time compilation for sm_90 needs no GPU (Triton ships ptxas):
    plain experts, a fused interleaved layout with biases (views as
    constexprs), and each byte-coded format's tile dequantization (bf16 and
    float32 products, decode and prefill).  Run in a fresh process: this one
    interprets the kernels."""
    import subprocess
    import sys

    code = """
import numpy as np, ml_dtypes
from jax_nbx.backends.cuda import plan, compile as C
bf = np.dtype(ml_dtypes.bfloat16)
from jax_nbx.experts import WeightLayout
from jax_nbx.lora import LoRASpec
lora = LoRASpec((("gate", 16, 0.5), ("up", 3, 1.0), ("down", 64, 2.0)), False)
# gpt-oss's interleaved gate_up [E, H, 2I] with biases, decode and prefill kernels
gpt_oss = WeightLayout((0, 64, 2, 1, 64, 2, 0, 64, 1), 32, True, True)
for prog in (plan.build(40, 40, 2, 6, 64, 32, bf, bf, 0),
             plan.build(1, 1, 2, 6, 64, 32, bf, bf, 2, layout=gpt_oss),
             plan.build(40, 40, 2, 6, 64, 32, bf, bf, 2, layout=gpt_oss),
             plan.build(40, 40, 2, 6, 64, 32, bf, np.float32, 2, quant=("mxfp4", 32)),
             plan.build(1, 1, 2, 6, 64, 32, bf, np.float32, 0, quant=("nvfp4", 16)),
             plan.build(40, 40, 2, 6, 64, 32, bf, bf, 0, quant=("fp8", 32)),
             plan.build(1, 1, 2, 6, 64, 32, np.float32, np.float32, 0, quant=("mxfp8", 32)),
             # LoRA adapters (tf32x3 products on bf16 weights; ieee on float32)
             plan.build(40, 40, 2, 6, 64, 32, bf, bf, 0, lora=lora),
             plan.build(1, 1, 2, 6, 64, 32, np.float32, np.float32, 0, lora=lora),
             plan.build(40, 40, 2, 6, 64, 32, bf, bf, 0, quant=("int4", 32), lora=lora)):
    blob, table = C.pack(prog, 90)
    assert table.shape == (len(prog.kernels()), len(C.KERNEL_FIELDS)), table.shape
    for row in table:
        name = bytes(blob[row[0]:row[0] + row[1]]).decode()
        assert bytes(blob[row[2]:row[2] + 4]) == b"\\x7fELF" and name, name
    print("compiled", len(table))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "compiled" in r.stdout


QCASES = [  # T, kind, group, scale dtype, lists, x dtype
    (2, "int8", 0, F32, False, F32), (40, "int8", 0, BF16, False, F32), (40, "int8", 0, F32, True, F32),
    (2, "int4", 32, F32, True, F32), (40, "int4", 32, F32, False, F32), (40, "int4", 64, BF16, True, F32),
    (2, "int4", 128, BF16, False, F32), (40, "int4", 128, F32, False, F32),
    (1, "mxfp4", 32, F32, False, F32), (40, "mxfp4", 32, F32, True, BF16),
    (1, "nvfp4", 16, F32, True, F32), (40, "nvfp4", 16, F32, False, BF16),
    (1, "fp8", 128, BF16, True, F32), (40, "fp8", 32, F32, False, F32),
    (1, "mxfp8", 32, F32, False, BF16), (40, "mxfp8", 32, F32, True, F32)]


@pytest.mark.parametrize("T,kind,G,sd,lists,xd", QCASES, ids=lambda v: str(v))
def test_quantized_experts_dequantized_in_kernel(T, kind, G, sd, lists, xd):
    """Experts of every format, dequantized tile by tile in the kernels (the
    same formats as `jax_nbx.quantize`), against float64 on the dequantized
    weights; T=1 and 2 take the decode kernels, 40 the prefill ones."""
    import jax
    import jax.numpy as jnp

    import jax_nbx as nbx

    E, k, H, I = 5, 2, 128, 256 if G != 128 else 128
    x, w, ids, gate, up, down = problem(11, T, E, k, H, I, xd, F32)
    ex = nbx.Experts(jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down))
    q = nbx.quantize(ex, kind, group_size=G, scale_dtype=jnp.dtype(sd))
    d = nbx.dequantize(q, jnp.float32)
    from jax_nbx.backends.handler_calls import weight_groups

    if lists:
        q = nbx.Experts(*([jax.tree.map(lambda a: a[e], getattr(q, n)) for e in range(E)]
                          for n in ("gate", "up", "down")))
    # the CUDA path's own grouping of the buffers (gate, up, down, scales, mins)
    groups, E2, I2, quant, dt, _ = weight_groups(q.flat(), lists)
    assert (E2, I2, quant) == (E, I, (kind, G))
    groups = [[np.asarray(a) for a in g] if lists else np.asarray(g[0]) for g in groups]
    prog = plan.build(T, T, k, E, H, I, xd, dt, 0, quant=(kind, G))
    y = np.full((T, H), np.nan, xd)
    firsts = [g[0] if lists else g for g in groups]
    err = interpret.run(prog, [x, w, ids, *firsts], y, tables=interpret.pointer_tables(*groups))
    assert err == plan.ERR_NONE
    assert np.all(np.isfinite(y))
    ref = np_moe64(x, w, ids, np.asarray(d.gate), np.asarray(d.up), np.asarray(d.down))
    # bf16 products (bf16 scales, or bf16 x for the byte-scaled formats): x,
    # the tile and the intermediate are rounded to bf16 (and the interpreter
    # truncates where the GPU rounds), hence 2x the dense bound
    pd = plan.products_dtype(xd, dt, quant)
    assert rel_err(y, ref) < (TOL[F32] if pd == F32 and xd == F32 else 2 * TOL[BF16])


@triton.jit
def _decode_codes(codes, out, N: tl.constexpr):
    c = tl.load(codes + tl.arange(0, N))
    tl.store(out + tl.arange(0, N), kernels._e2m1(c & 15))
    tl.store(out + N + tl.arange(0, N), kernels._e4m3(c))
    tl.store(out + 2 * N + tl.arange(0, N), kernels._e8m0(c))


def test_minifloat_decoders_are_the_references():
    """Every E2M1, E4M3 and E8M0 code decoded by the kernels' helpers equals
    ml_dtypes' value (NaN codes NaN), through a kernel under the interpreter."""
    codes = np.arange(256, dtype=np.int32)
    out = np.full(3 * 256, -1.0, np.float32)
    _decode_codes[(1,)](interpret._HostTensor(codes.ctypes.data, "*i32"),
                 interpret._HostTensor(out.ctypes.data, "*fp32"), 256)
    u8 = codes.astype(np.uint8)
    want = [(u8 & 15).view(ml_dtypes.float4_e2m1fn), u8.view(ml_dtypes.float8_e4m3fn),
            u8.view(ml_dtypes.float8_e8m0fnu)]
    for got, ref in zip((out[:256], out[256:512], out[512:]), want):
        ref = ref.astype(np.float32)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
        ok = ~np.isnan(ref)
        assert np.array_equal(got[ok].view(np.uint32), ref[ok].view(np.uint32))


# --------------------------------------------------------------------------- layouts and biases

def run_experts(ex, x, w, ids, act=0):
    """Runs the program of `Experts` ``ex`` (any layout, stacked or lists,
    with or without biases) as the CUDA path builds it: the weight groups'
    first buffers then the float32 biases as inputs, one pointer table per
    weight group (each expert's whole array), the views as constexprs."""
    layout = ex.weight_layout()
    E, H, I = ex.num_experts, ex.hidden, ex.intermediate
    flat = [np.asarray(a) for a in ex.flat()]  # kept alive: the tables hold their addresses
    biases = [np.asarray(b, np.float32) for b in ex.handler_biases()]
    n_groups = 2 if layout.fused else 3
    groups = [flat[g * E:(g + 1) * E] for g in range(n_groups)] if ex.is_list else flat
    firsts = [g[0] for g in groups] if ex.is_list else flat
    aligned = ex.is_list or all(a[0].nbytes % 16 == 0 for a in flat)
    T, k = ids.shape
    prog = plan.build(T, T, k, E, H, I, x.dtype, flat[0].dtype, act, w_aligned=aligned, layout=layout)
    y = np.full((T, H), np.nan, x.dtype)  # poisoned: an unwritten row shows
    err = interpret.run(prog, [x, w, ids, *firsts, *biases], y, tables=interpret.pointer_tables(*groups))
    return y, err, prog


def _layout_problem(name, bias, lists, T, xd=F32, wd=F32, seed=0):
    import jax.numpy as jnp

    from support.layouts import canonical, stored

    E, k, H, I = 5, 2, 21, 13  # odd H and I: multiples of no block, unaligned experts
    rng = np.random.default_rng(seed)
    G, U, D, bg, bu, bd = canonical(rng, E, H, I, bias)
    if wd != F32:  # the reference on the weights as stored
        G, U, D = (a.astype(wd).astype(np.float32) for a in (G, U, D))
    ex = stored(name, G, U, D, bg, bu, bd, lists=lists, dtype=jnp.dtype(wd))
    x = rng.standard_normal((T, H)).astype(xd)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    return ex, x, w, ids, (G, U, D, bg, bu, bd)


LAYOUT_NAMES = ("plain", "out_in", "concat", "interleaved", "concat_out_in", "interleaved_out_in")


@pytest.mark.parametrize("T", [1, 33], ids=["decode", "prefill"])
@pytest.mark.parametrize("lists", [False, True], ids=["stacked", "lists"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_program_reads_every_layout_in_place(name, bias, lists, T):
    """Every checkpoint layout (tests/support/layouts.py's, built with numpy from
    canonical G, U, D), read in place through the views, with and without
    biases, stacked and per-expert, on the decode (T=1) and prefill kernels,
    against float64 on the canonical weights."""
    from support.layouts import np_block

    ex, x, w, ids, canon = _layout_problem(name, bias, lists, T, seed=LAYOUT_NAMES.index(name) * 8 + T)
    y, err, prog = run_experts(ex, x, w, ids)
    assert any(ln.kernel.name == ("decode1" if T == 1 else "gemm1") for ln in prog.launches)
    assert err == plan.ERR_NONE
    assert np.all(np.isfinite(y)), "unwritten (poisoned) rows"
    assert rel_err(y, np_block(x, w, ids, *canon)) < TOL[F32]


@pytest.mark.parametrize("T", [1, 33], ids=["decode", "prefill"])
def test_bf16_interleaved_with_biases(T):
    """gpt-oss's experts: interleaved gate_up [E, H, 2I] in bfloat16 with
    biases and the clamped SwiGLU, x in bfloat16."""
    from support.layouts import np_block

    ex, x, w, ids, canon = _layout_problem("interleaved", True, False, T, BF16, BF16, seed=40 + T)
    y, err, _ = run_experts(ex, x, w, ids, act=2)
    assert err == plan.ERR_NONE
    assert np.all(np.isfinite(y.astype(np.float32)))
    assert rel_err(y, np_block(x.astype(np.float32), w, ids, *canon, act="swiglu_clamped")) < TOL[BF16]


def test_layout_bias_inputs_follow_the_weight_groups():
    """The biases are the inputs after the weight groups' (abi.h); without
    biases no input past the groups is named."""
    ex, *_ = _layout_problem("concat_out_in", True, False, 1)
    for T in (1, 40):
        prog = plan.build(T, T, 2, 5, 21, 13, F32, F32, 0, layout=ex.weight_layout())
        used = {a.index for ln in prog.launches for a in ln.args if a.kind == plan.ARG_INPUT}
        assert {plan.IN_GROUP0 + 2 + j for j in range(3)} <= used  # gate_up, down, then 3 biases
        tables = {a.index for ln in prog.launches for a in ln.args if a.kind == plan.ARG_TABLE}
        assert tables == {0, 1}
        plain = plan.build(T, T, 2, 5, 21, 13, F32, F32, 0)
        used = {a.index for ln in plain.launches for a in ln.args if a.kind == plan.ARG_INPUT}
        assert max(used) < plan.IN_GROUP0 + 3


def test_views_the_kernels_cannot_take_are_refused_by_name():
    ex, *_ = _layout_problem("interleaved", False, False, 1)
    lay = ex.weight_layout()
    with pytest.raises(ValueError, match="int8 experts in the plain layout only"):
        plan.build(4, 4, 2, 5, 21, 13, F32, F32, 0, quant=("int8", 0), layout=lay)
    v = list(lay.views)
    v[4] = 3  # up's stride_k differs from gate's
    with pytest.raises(ValueError, match="gate and up views must share their strides"):
        plan.build(4, 4, 2, 5, 21, 13, F32, F32, 0, layout=lay._replace(views=tuple(v)))
    with pytest.raises(ValueError, match="views must hold 9 values; got 3"):
        plan.build(4, 4, 2, 5, 21, 13, F32, F32, 0, layout=lay._replace(views=tuple(v[:3])))


def test_cuda_forward_groups_match_the_handlers_inputs():
    """`_cuda`'s grouping of experts in any layout (no GPU needed): the weight
    groups (gate_up, down when fused), the biases after them, and a program
    the handler's decoder accepts with exactly those inputs."""
    import jax_nbx as nbx
    from jax_nbx import contract
    from jax_nbx.backends.cuda import calls as _cuda

    from support import ffi_testing

    ffi = ffi_testing.load()  # jax_nbx._ffi_testing: the CUDA handler's decoder
    for name, lists in (("interleaved", False), ("concat_out_in", True), ("out_in", False)):
        ex, *_ = _layout_problem(name, True, lists, 1)
        lay = ex.weight_layout()
        groups, biases, E, wd, _ = _cuda._view_groups(ex.flat() + ex.handler_biases(), lay, lists)
        assert len(groups) == (2 if ex.is_fused else 3) and len(biases) == contract.NUM_BIASES and E == 5
        assert all(len(g) == (E if lists else 1) for g in groups)
        assert groups[-1][0] is ex.flat()[-1 if not lists else E * (len(groups) - 1)]
        prog = plan.build(40, 40, 2, E, 21, 13, F32, wd, 0, layout=lay)
        n_in = contract.IN_GROUP0 + len(groups) + len(biases)
        args = (len(prog.kernels()), n_in, len(groups), prog.workspace_bytes)
        ffi.decode_program(prog.encode(), *args)
        with pytest.raises(ValueError, match="bad input index"):
            ffi.decode_program(prog.encode(), args[0], n_in - 1, *args[2:])
    G, U, D, *_ = _layout_problem("plain", False, False, 1)[4]
    q = nbx.quantize(nbx.Experts(G, U, D), "int8")
    with pytest.raises(ValueError, match="quantized experts in the plain layout only"):
        _cuda._view_groups(q.flat(), ex.weight_layout()._replace(bias=False), False)


@pytest.mark.parametrize("quant", [None, ("int8", 0), ("int4", 32), ("mxfp4", 32), ("fp8", 32), ("mxfp8", 32),
                                   ("nvfp4", 16)])
def test_quantized_decode_is_the_same_three_launches_as_bf16(quant):
    """#56: decode's fixed cost per call is its launches; a quantized decode must not pay more of them
    than bf16's: decode1 -> decode2 -> combine (the split-K partials of both GEMMs, then their sum in a
    fixed order -- fewer would need atomics, which the bit-for-bit sums across bands forbid), on the
    same grids, at OLMoE's decode shape (T 1, k 8, E 64, H 2048, I 1024)."""
    bf = np.dtype("bfloat16") if hasattr(np, "bfloat16") else __import__("ml_dtypes").bfloat16
    kw = {} if quant is None else {"quant": quant if quant[0] != "int8" else ("int8", 0)}
    prog = plan.build(1, 1, 8, 64, 2048, 1024, bf, bf if quant is None or quant[0] in ("int8", "int4", "fp8")
                      else np.float32, 0, **kw)
    names = [ln.kernel.name for ln in prog.launches]
    assert names == ["decode1", "decode2", "combine"], names
    dense = plan.build(1, 1, 8, 64, 2048, 1024, bf, bf, 0)
    assert [ln.grid for ln in prog.launches] == [ln.grid for ln in dense.launches]   # the same programs


def test_decode_path_is_three_launches_with_a_check_word_per_slot():
    """Decode: decode1 -> decode2 (the gated unit formed from decode1's
    partials) -> combine, no fill launch: decode1 writes each slot's check
    word.  Prefill: one word, filled first."""
    prog = plan.build(3, 3, 2, 5, 40, 24, F32, F32, 0)
    assert [ln.kernel.name for ln in prog.launches] == ["decode1", "decode2", "combine"]
    assert prog.err_words == 6
    pre = plan.build(40, 40, 2, 5, 40, 24, F32, F32, 0)
    assert pre.err_words == 1 and pre.launches[0].kernel.name == "fill_i32"
    # every word written (the interpreter's workspace starts poisoned: an
    # unwritten word would read as a negative slot), several bands included
    for T, band in ((3, 3), (7, 2)):
        x, w, ids, gate, up, down = problem(11, T, 5, 2, 40, 24, F32, F32)
        p = plan.build(T, band, 2, 5, 40, 24, F32, F32, 0)
        assert p.launches[0].kernel.name == "decode1" and p.err_words == T * 2
        y = np.full((T, 40), np.nan, np.float32)
        assert interpret.run(p, [x, w, ids, gate, up, down], y) == plan.ERR_NONE
        assert rel_err(y, np_moe64(x, w, ids, gate, up, down)) < TOL[F32]
        ids[T - 1, 1] = -1
        ids[1, 0] = 9
        assert interpret.run(p, [x, w, ids, gate, up, down], y) == 2  # the smallest bad slot


@pytest.mark.parametrize("value, mode", [(None, "sync"), ("1", "sync"), ("on", "sync"), ("deferred", "deferred"),
                                         ("Deferred", "deferred"), ("0", "off"), ("off", "off")])
def test_id_check_modes_from_the_environment(monkeypatch, value, mode):
    from jax_nbx import _env, contract
    from jax_nbx.backends.cuda import calls as _cuda
    if value is None:
        monkeypatch.delenv("JAX_NBX_CUDA_CHECK_IDS", raising=False)
    else:
        monkeypatch.setenv("JAX_NBX_CUDA_CHECK_IDS", value)
    assert _env.cuda_check_ids() == mode
    codes = {"sync": contract.ID_CHECK_SYNC, "deferred": contract.ID_CHECK_DEFERRED, "off": contract.ID_CHECK_OFF}
    assert _cuda.check_ids_mode() == codes[mode]
    assert _cuda.check_ids_mode(skip_outside=True) == contract.ID_CHECK_OFF


def test_id_check_mode_refuses_other_values(monkeypatch):
    from jax_nbx import _env
    monkeypatch.setenv("JAX_NBX_CUDA_CHECK_IDS", "later")
    with pytest.raises(ValueError, match="JAX_NBX_CUDA_CHECK_IDS.*deferred"):
        _env.cuda_check_ids()


@pytest.mark.parametrize("value, on", [(None, False), ("0", False), ("off", False), ("1", True), ("yes", True)])
def test_graph_mode_from_the_environment(monkeypatch, value, on):
    """JAX_NBX_CUDA_GRAPHS reaches every CUDA handler as the `graph` attribute."""
    from jax_nbx import _env
    from jax_nbx.backends.cuda import calls as _cuda
    from jax_nbx.backends.cuda import compile as C
    if value is None:
        monkeypatch.delenv("JAX_NBX_CUDA_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("JAX_NBX_CUDA_GRAPHS", value)
    assert _env.cuda_graphs() is on
    monkeypatch.setattr(C, "pack", lambda prog, cc: (np.zeros(1, np.uint8), np.zeros((1, 7), np.int64)))
    monkeypatch.setattr(_cuda, "compute_capability", lambda dev: (9, 0))
    attrs = _cuda._program_attrs(plan.build(1, 1, 2, 4, 32, 16, F32, F32, 0), None, True, 4, False)
    assert attrs["graph"] is on


def test_graph_mode_refuses_other_values(monkeypatch):
    from jax_nbx import _env
    monkeypatch.setenv("JAX_NBX_CUDA_GRAPHS", "maybe")
    with pytest.raises(ValueError, match="JAX_NBX_CUDA_GRAPHS"):
        _env.cuda_graphs()


def test_no_tokens_leaves_a_clean_check_word():
    prog = plan.build(0, 0, 2, 5, 40, 24, F32, F32, 0)
    assert prog.err_words == 1 and [ln.kernel.name for ln in prog.launches] == ["fill_i32"]
    y = np.zeros((0, 40), np.float32)
    x, w, ids, gate, up, down = problem(1, 1, 5, 2, 40, 24, F32, F32)
    assert interpret.run(prog, [x[:0], w[:0], ids[:0], gate, up, down], y) == plan.ERR_NONE
