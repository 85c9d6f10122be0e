"""The Metal kernels (xla_ffi/metal/kernels/*.metal) executed on Linux: the
same source compiled as C++ through the MSL emulation (tests/native/metal/msl_emulation.h)
and launched on the simulated device, each threadgroup's 128 threads real
and concurrent (issue #16, first kernel: the expert GEMMs).  Checked against
a float64 reference; outputs NaN-poisoned so that unwritten rows show.
Nothing here ran on Apple hardware or through Apple's Metal compiler."""
from __future__ import annotations

import math
import pathlib
import re

import ml_dtypes
import numpy as np
import pytest

import jax_nbx as nbx
from jax_nbx.formats.minifloat import as_bytes

from conftest import np_glu
from support import ffi_testing

F = ffi_testing.load()  # jax_nbx._ffi_testing: the kernels through the MSL emulation
BM = 32
KERNELS = pathlib.Path(__file__).resolve().parents[2] / "xla_ffi" / "metal" / "kernels"
EMULATION = pathlib.Path(__file__).resolve().parents[1] / "native" / "metal"  # the MSL emulation (test-only)


pytestmark = [pytest.mark.usefixtures("metal_sim"), pytest.mark.sanitize]  # conftest.py: the simulated device


def region(a: np.ndarray) -> tuple[int, int]:
    assert a.flags.c_contiguous
    return int(a.ctypes.data), int(a.nbytes)


def order_slots(ids: np.ndarray, E: int):
    """Slots ordered by expert (stable in (t, j)), each expert padded to 32
    rows: (row_slot [P] (-1: padding), tile_expert [P/32])."""
    flat = ids.reshape(-1)
    rows, tiles = [], []
    for e in range(E):
        s = np.nonzero(flat == e)[0]
        if s.size == 0:
            continue
        n = -(-s.size // BM) * BM
        rows += list(s) + [-1] * (n - s.size)
        tiles += [e] * (n // BM)
    return np.asarray(rows, np.int32), np.asarray(tiles, np.int32)


CLAMPED = nbx.Activation("swiglu_clamped", alpha=1.702, limit=0.8)  # the clamps bite at these scales
WDTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


def problem(seed, T, E, k, H, I, wtype="f32"):
    rng = np.random.default_rng(seed)
    wd = WDTYPES[wtype]
    x = rng.standard_normal((T, H)).astype(np.float32)
    gate = (rng.standard_normal((E, H, I)) / np.sqrt(H)).astype(wd)
    up = (rng.standard_normal((E, H, I)) / np.sqrt(H)).astype(wd)
    down = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(wd)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    return x, gate, up, down, ids, w


def table_of(gate, up, down):
    E = gate.shape[0]
    ranges = [(int(m.ctypes.data) + e * m[e].nbytes, m[e].nbytes) for m in (gate, up, down) for e in range(E)]
    return F.metal_table(ranges)


def gemm(kind, a, row_src, experts, table, row_w, out, K, N, E, mode, act, rows, tile0=0, wtype="f32",
         drop_barrier=False, resident=True, fmt="dense", group=0):
    glu = nbx.activations.as_activation(act)
    F.metal_run_gemm(kind, [region(a), region(row_src), region(experts), region(row_w), region(out)], table,
                     (K, N, E, mode, glu.code, a.shape[1], tile0, glu.alpha, glu.limit), rows, wtype,
                     drop_barrier, resident, fmt, group)


def run_moe(x, gate, up, down, ids, w, activation="swiglu", drop_barrier=False, resident=True, wtype="f32",
            tiles_per_dispatch=None, quant=None):
    """The MoE block through the two GEMM dispatches (the combine in numpy);
    `tiles_per_dispatch`: the row tiles in several dispatches (tile0 ranges);
    `quant`: (table, format, group) of quantized experts (`quant_table`;
    gate, up, down then only give the shapes)."""
    T, H = x.shape
    E, _, I = gate.shape
    k = ids.shape[1]
    row_slot, tile_expert = order_slots(ids, E)
    P = row_slot.size
    row_tok = np.where(row_slot >= 0, row_slot // k, -1).astype(np.int32)
    table, fmt, group = quant or (table_of(gate, up, down), "dense", 0)
    act = activation
    h = np.full((P, I), np.nan, np.float32)
    row_self = np.where(row_slot >= 0, np.arange(P), -1).astype(np.int32)
    row_w = np.where(row_slot >= 0, w.reshape(-1)[np.maximum(row_slot, 0)], 0).astype(np.float32)
    o = np.full((P, H), np.nan, np.float32)
    step = tiles_per_dispatch or P // BM
    for t0 in range(0, P // BM, step):  # each range reads and writes its own rows only
        n = min(step, P // BM - t0)
        gemm("gemm", x, row_tok, tile_expert, table, row_w, h, H, I, E, 0, act, n, t0, wtype, drop_barrier,
             resident, fmt, group)
        gemm("gemm", h, row_self, tile_expert, table, row_w, o, I, H, E, 1, act, n, t0, wtype, drop_barrier,
             resident, fmt, group)
    valid = row_slot >= 0
    assert np.all(np.isfinite(h[valid])) and np.all(np.isfinite(o[valid])), "unwritten rows"
    assert np.all(np.isnan(o[~valid])), "padding rows were stored"
    y = np.zeros((T, H), np.float64)
    np.add.at(y, row_tok[valid], o[valid].astype(np.float64))
    return y


def run_decode(x, gate, up, down, ids, w, activation="swiglu", wtype="f32", quant=None):
    """The decode path: the GEMV dispatches on the slots as they come, then the combine kernel."""
    T, H = x.shape
    E, _, I = gate.shape
    k = ids.shape[1]
    S = T * k
    flat = ids.reshape(-1).astype(np.int32)
    inside = (flat >= 0) & (flat < E)
    row_tok = np.where(inside, np.arange(S) // k, -1).astype(np.int32)
    row_self = np.where(inside, np.arange(S), -1).astype(np.int32)
    row_e = np.where(inside, flat, -1).astype(np.int32)
    row_w = w.reshape(-1).astype(np.float32)
    table, fmt, group = quant or (table_of(gate, up, down), "dense", 0)
    act = activation
    h = np.full((S, I), np.nan, np.float32)
    o = np.full((S, H), np.nan, np.float32)
    gemm("gemv", x, row_tok, row_e, table, row_w, h, H, I, E, 0, act, S, 0, wtype, fmt=fmt, group=group)
    gemm("gemv", h, row_self, row_e, table, row_w, o, I, H, E, 1, act, S, 0, wtype, fmt=fmt, group=group)
    assert np.all(np.isfinite(o[inside])) and np.all(np.isnan(o[~inside])), "rows unwritten or skipped rows stored"
    y = np.full((T, H), np.nan, np.float32)
    F.metal_run_combine([region(o), region(row_self), region(y)], H, k, T)
    return y


def reference(x, gate, up, down, ids, w, activation="swiglu"):
    """float64, one slot at a time (the op's definition; conftest.np_moe's math)."""
    x, gate, up, down = (a.astype(np.float64) for a in (x, gate, up, down))
    y = np.zeros_like(x)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if 0 <= e < gate.shape[0]:  # outside: skipped
                y[t] += w[t, j] * (np_glu(x[t] @ gate[e], x[t] @ up[e], activation)[0] @ down[e])
    return y


GEMM_CASES = [(1, 1, 1, 17, 9), (3, 4, 4, 8, 16), (33, 4, 2, 45, 70), (40, 6, 2, 33, 129)]
# (case, activation) of the arm64 tier (the emulation under qemu is slow)
ARM64_GEMMS = {(GEMM_CASES[0], "swiglu"), (GEMM_CASES[1], "geglu_erf"), (GEMM_CASES[2], "swiglu")}


def _marks(arm64: bool, activation) -> list:
    """A case's tiers: arm64 where chosen; the sanitize tier leaves out the
    activations other than swiglu (the same loads and stores, only the
    epilogue's arithmetic differs: asan_skip)."""
    return ([pytest.mark.arm64] if arm64 else []) + ([] if str(activation) == "swiglu" else [pytest.mark.asan_skip])


@pytest.mark.parametrize("T,E,k,H,I,activation", [
    pytest.param(*c, a, id="T{}-E{}-k{}-H{}-I{}".format(*c) + f"-{a}",
                 marks=_marks((c, str(a)) in ARM64_GEMMS, a))
    for c in GEMM_CASES for a in ("swiglu", "geglu", "geglu_erf", CLAMPED)])
def test_expert_gemms_match_float64(T, E, k, H, I, activation):
    x, gate, up, down, ids, w = problem(T * 31 + H, T, E, k, H, I)
    y = run_moe(x, gate, up, down, ids, w, activation)
    ref = reference(x, gate, up, down, ids, w, activation)
    assert np.max(np.abs(y - ref)) / np.max(np.abs(ref)) < 1e-5
    assert F.metal_sim_take_violations() == []


@pytest.mark.parametrize("wtype", ["f16", "bf16"])
@pytest.mark.parametrize("T,E,k,H,I", [(1, 1, 1, 17, 9), (33, 4, 2, 45, 70), (40, 6, 2, 33, 129)])
def test_16_bit_weights_match_float64(T, E, k, H, I, wtype):
    """nbx_moe_gemm_f16 / _bf16: the weights widened exactly as they are loaded,
    float32 accumulation: the float64 reference of the same (rounded) weights."""
    x, gate, up, down, ids, w = problem(T + H + len(wtype), T, E, k, H, I, wtype)
    y = run_moe(x, gate, up, down, ids, w, wtype=wtype)
    ref = reference(x, gate, up, down, ids, w)
    assert np.max(np.abs(y - ref)) / np.max(np.abs(ref)) < 1e-5


def test_gemms_in_ranges_of_tiles_are_bit_identical():
    """A problem dispatched as several ranges of row tiles (tile0: how the
    handler keeps each command buffer short) gives the very same bits."""
    x, gate, up, down, ids, w = problem(5, 150, 3, 2, 33, 40)
    whole = run_moe(x, gate, up, down, ids, w)
    np.testing.assert_array_equal(run_moe(x, gate, up, down, ids, w, tiles_per_dispatch=1), whole)
    np.testing.assert_array_equal(run_moe(x, gate, up, down, ids, w, tiles_per_dispatch=2), whole)


GEMV_CASES = [(1, 1, 1, 17, 9), (1, 8, 2, 33, 129), (2, 4, 4, 40, 70), (3, 5, 3, 129, 31)]


@pytest.mark.parametrize("T,E,k,H,I,wtype,activation", [
    pytest.param(*c, wt, a, id="T{}-E{}-k{}-H{}-I{}".format(*c) + f"-{wt}-{a}",
                 marks=_marks((c, wt, str(a)) == (GEMV_CASES[2], "bf16", "swiglu"), a))
    for c in GEMV_CASES for wt in ("f32", "f16", "bf16") for a in ("swiglu", "geglu", "geglu_erf", CLAMPED)])
def test_decode_gemv_and_combine_match_float64(T, E, k, H, I, wtype, activation):
    """The decode path (nbx_moe_gemv_*: K split over 4 simdgroups, then
    nbx_moe_combine), the last slot's id out of range: skipped, nothing stored."""
    x, gate, up, down, ids, w = problem(T * 7 + I, T, E, k, H, I, wtype)
    if ids.size > 1:
        ids[-1, -1] = E  # outside [0, E): a skipped slot
    y = run_decode(x, gate, up, down, ids, w, activation, wtype)
    ref = reference(x, gate, up, down, ids, w, activation)
    assert np.all(np.isfinite(y))
    assert np.max(np.abs(y - ref)) / np.max(np.abs(ref)) < 1e-5


def quant_table(q: nbx.Experts):
    """The pointer table of quantized experts as the handler builds it: each
    part's GPU address per projection and expert, [part][gate, up, down][E]
    (abi.h's buffer groups); the host arrays are returned to be kept alive."""
    parts = nbx.formats.get(q.down.kind).parts
    arrays = [np.ascontiguousarray(np.asarray(as_bytes(getattr(getattr(q, proj), part))))
              for part in parts for proj in ("gate", "up", "down")]
    ranges = [(int(a.ctypes.data) + e * a[e].nbytes, a[e].nbytes) for a in arrays for e in range(a.shape[0])]
    return F.metal_table(ranges), arrays


@pytest.mark.arm64
def test_weight_readers_are_the_format_specs():
    """kernels/weights.metal (through the emulation) against xla_ffi/formats/:
    E2M1, E4M3 and E8M0 for every code, then every format's reader, every
    type of its float part and every group size, on parts of random bits,
    each weight bit for bit the registry's scalar reference (NaN as NaN); a
    part one byte short refused (the readers' extents are the parts')."""
    checked, bad = F.metal_check_weight_readers(7)
    assert bad == []
    assert checked > 15000  # 16 + 2 * 256 codes, then every reader's weights


# (format, group, scale dtype, H, I): H, I multiples of the group; int8 and
# nvfp4 leave partial 32-column tiles (H, I not multiples of 32)
QUANT_CASES = [("int8", None, np.float32, 33, 40), ("int4", 32, ml_dtypes.bfloat16, 32, 64),
               ("mxfp4", 32, np.float32, 64, 32), ("fp8", 32, ml_dtypes.bfloat16, 64, 32),
               ("mxfp8", 32, np.float32, 32, 64), ("nvfp4", 16, np.float32, 16, 48)]


@pytest.mark.parametrize("fmt,G,sd,H,I", [pytest.param(*c, id=f"{c[0]}-G{c[1]}-{np.dtype(c[2]).name}-H{c[3]}-I{c[4]}")
                                          for c in QUANT_CASES])
def test_quantized_gemms_and_gemvs_match_float64(fmt, G, sd, H, I):
    """nbx_moe_gemm_<format>* (T = 33: partial row tiles) and
    nbx_moe_gemv_<format>* (T = 1, and T = 3 with a skipped slot), the
    weights read in place through the table of their parts and decoded in
    the kernels' loads: the float64 MoE block on the weights as Python's
    format module dequantizes them (jax_nbx.formats), outputs NaN-poisoned."""
    E, k = 4, 2
    x, gate, up, down, ids, w = problem(H + I, 33, E, k, H, I)
    q = nbx.quantize(nbx.Experts(gate, up, down), fmt, group_size=G, scale_dtype=sd)
    wtype = "f32" if q.down.format.compute_part is None or np.dtype(sd) == np.float32 else "bf16"
    table, keep = quant_table(q)
    dq = nbx.dequantize(q, dtype=np.float32)
    deq = [np.asarray(getattr(dq, n), np.float64) for n in ("gate", "up", "down")]
    quant = (table, fmt, G or 0)
    y = run_moe(x, *deq, ids, w, quant=quant, wtype=wtype)
    ref = reference(x, *deq, ids, w)
    assert np.max(np.abs(y - ref)) / np.max(np.abs(ref)) < 1e-5
    for T in (1, 3):
        xd, idd, wd = x[:T], ids[:T].copy(), w[:T]
        if T > 1:
            idd[-1, -1] = E  # outside [0, E): a skipped slot
        y = run_decode(xd, *deq, idd, wd, quant=quant, wtype=wtype)
        ref = reference(xd, *deq, idd, wd)
        assert np.all(np.isfinite(y))
        assert np.max(np.abs(y - ref)) / np.max(np.abs(ref)) < 1e-5
    assert F.metal_sim_take_violations() == []
    del keep


def test_a_quantized_kernel_refuses_a_group_size_its_format_does_not_take():
    x, gate, up, down, ids, w = problem(3, 1, 2, 1, 64, 64)
    q = nbx.quantize(nbx.Experts(gate, up, down), "int4", group_size=32)
    table, keep = quant_table(q)
    with pytest.raises(ValueError, match="group size it does not take"):
        run_decode(x, gate, up, down, ids, w, quant=(table, "int4", 0))
    del keep


@pytest.mark.arm64
def test_combine_sums_each_token_in_slot_order():
    """y[t] = ((o[r0] + o[r1]) + o[r2]) in float32, j in order, skipped rows
    left out: bit for bit, whatever order the rows lie in."""
    rng = np.random.default_rng(3)
    T, k, H = 9, 3, 130
    o = (rng.standard_normal((T * k, H)) * 10.0 ** rng.integers(-4, 5, (T * k, 1))).astype(np.float32)
    slot_row = rng.permutation(T * k).astype(np.int32)
    slot_row[[4, 10, 11]] = -1  # skipped slots (token 3 keeps two, token 1 one)
    y = np.full((T, H), np.nan, np.float32)
    F.metal_run_combine([region(o), region(slot_row), region(y)], H, k, T)
    ref = np.zeros((T, H), np.float32)
    for t in range(T):
        for j in range(k):
            r = slot_row[t * k + j]
            if r >= 0:
                ref[t] = ref[t] + o[r]
    np.testing.assert_array_equal(y, ref)


@pytest.mark.parametrize("kernel,threads,tg,blocks,match", [
    ("nbx_no_such_kernel", 128, 0, [0], "has no kernel 'nbx_no_such_kernel'"),
    ("nbx_moe_combine", 128, 4, [0, 0, 0], "takes 4 buffer arguments; got 3"),
    ("nbx_moe_combine", 128, 4, [0, 0, 0, 8], "parameter block of 12 bytes; got 8"),
    ("nbx_moe_combine", 128, 4, [0, 0, 12, 12], "argument 2 must be a live buffer"),
    ("nbx_moe_combine", 100, 4, [0, 0, 0, 12], "multiple of 32"),
    ("nbx_moe_combine", 128, 65536, [0, 0, 0, 12], "at most 32 KiB"),
])
def test_dispatches_that_do_not_fit_the_kernel_are_refused(kernel, threads, tg, blocks, match):
    """What Metal checks when it encodes, the simulated device refuses before anything runs."""
    before = F.metal_command_buffers()
    with pytest.raises(ValueError, match=match):
        F.metal_commit(kernel, threads, tg, blocks)
    assert F.metal_command_buffers() == before


@pytest.mark.arm64
def test_a_missing_barrier_shows_as_a_wrong_result():
    x, gate, up, down, ids, w = problem(1, 33, 4, 2, 45, 70)
    ref = reference(x, gate, up, down, ids, w)
    with pytest.raises(AssertionError):  # NaN from unwritten threadgroup memory, or wrong values
        y = run_moe(x, gate, up, down, ids, w, drop_barrier=True)
        assert np.max(np.abs(y - ref)) / np.max(np.abs(ref)) < 1e-5


@pytest.mark.arm64
def test_weights_not_made_resident_fail_the_launch():
    x, gate, up, down, ids, w = problem(2, 5, 2, 1, 16, 8)
    with pytest.raises(ValueError, match="no resident buffer or pin covers"):
        run_moe(x, gate, up, down, ids, w, resident=False)
    assert any("not made resident" in v for v in F.metal_sim_take_violations())


@pytest.mark.parametrize("S,E,k", [pytest.param(1, 1, 1, marks=pytest.mark.arm64),
                                   pytest.param(7, 3, 7, marks=pytest.mark.arm64),
                                   pytest.param(66, 4, 2, marks=pytest.mark.arm64), (300, 8, 3), (1000, 5, 8)])
def test_ordering_kernels_match_the_cpu_planner(S, E, k):
    """moe_order.metal (count, offsets, scatter: no atomics) gives exactly the
    CPU planner's order (common/slots.h OrderSlots): by expert, stable in slot,
    each expert padded to 32 rows; ids outside [0, E) left out.  Then
    nbx_prepare_rows, over the bound on the rows (the host never reads P):
    each row's token, itself and weight, and each tile's expert, -1 / 0 past
    the rows in use."""
    rng = np.random.default_rng(S + E)
    ids = rng.integers(-1, E + 1, S).astype(np.int32)       # some outside [0, E)
    ids[: S // 3] = E - 1                                      # skew
    wts = rng.uniform(0.1, 1.0, S).astype(np.float32)
    count, off, row_slot, slot_row, row_tok, row_self, row_w, tile_expert = F.metal_order_slots(
        ids.tolist(), E, BM, k, wts.tolist())
    expert_off, real_end, ref_rows, ref_slot_row = F.plan_slots(ids.tolist(), 0, S, E, BM)
    assert count == [int(np.sum(ids == e)) for e in range(E)]
    assert off == list(expert_off)
    assert row_slot == list(ref_rows) and -7 not in row_slot   # every row written
    assert slot_row == list(ref_slot_row)
    P, rows = off[E], len(row_tok)
    assert rows % BM == 0 and P <= rows
    ref_slot = np.full(rows, -1)
    ref_slot[:P] = row_slot
    assert row_tok == [s // k if s >= 0 else -1 for s in ref_slot]
    assert row_self == [r if s >= 0 else -1 for r, s in enumerate(ref_slot)]
    np.testing.assert_array_equal(np.asarray(row_w, np.float32), np.where(ref_slot >= 0, wts[ref_slot], 0))
    ref_tiles = [next(e for e in range(E) if off[e] <= t * BM < off[e + 1]) if t * BM < P else -1
                 for t in range(rows // BM)]
    assert tile_expert == ref_tiles


@pytest.mark.arm64
def test_kernel_sources_keep_to_the_emulated_subset():
    """Constructs outside the subset msl_emulation.h documents are refused."""
    allowed_attrs = {"buffer", "threadgroup_position_in_grid", "thread_index_in_threadgroup",
                     "simdgroup_index_in_threadgroup", "thread_index_in_simdgroup", "threadgroup"}
    banned = [r"\batomic_", r"\bsimd_shuffle", r"\bsimd_sum\b", r"\bthreadgroup\s+\w+\s+\w+\s*\[",
              r"#include\s*<(?!metal_stdlib>)", r"\btexture\d", r"\bsampler\b", r"\bquad_"]
    sources = sorted(KERNELS.glob("*.metal"))
    assert sources
    for path in sources:
        text = path.read_text()
        for attr in re.findall(r"\[\[\s*(\w+)", text):
            assert attr in allowed_attrs, f"{path.name}: attribute [[{attr}]] is outside the subset"
        for pat in banned:
            assert not re.search(pat, text), f"{path.name}: {pat} is outside the emulated subset"
        for m in re.finditer(r"kernel void \w+\((.*?)\)\s*\{", text, re.S):
            params = m.group(1)
            assert params.count("NBX_THREADGROUP(0)") == 1, f"{path.name}: one threadgroup parameter"
            builtins = re.findall(r"\[\[(\w+)\]\]", params)
            assert builtins[-4:] == ["threadgroup_position_in_grid", "thread_index_in_threadgroup",
                                     "simdgroup_index_in_threadgroup", "thread_index_in_simdgroup"]


def kernel_names_in_sources() -> set[str]:
    names = set()
    for path in KERNELS.glob("*.metal"):
        text = path.read_text()
        macros = set(re.findall(r"#define (\w+)\(NAME, \w+\)", text))
        names |= {n for n in re.findall(r"kernel void (\w+)\(", text) if n != "NAME"}
        for mac in macros:
            names |= set(re.findall(rf"^{mac}\((\w+),", text, re.M))
    return names


def test_the_emulated_library_is_the_metal_sources():
    """Every kernel in kernels/*.metal is in the emulated library, and nothing
    else (but the test-only variant without a barrier); the Apple library
    source CMake embeds lists the same files (prelude.metal names the order)."""
    names = set(F.metal_kernel_names())
    assert {n for n in names if "__" not in n} == kernel_names_in_sources()
    assert names - kernel_names_in_sources() == {"nbx_moe_gemm_f32__drop_barrier"}
    order = re.search(r"CMake embeds\s+//\s*(.*?) in that order", (KERNELS / "prelude.metal").read_text(), re.S)
    listed = re.findall(r"[\w.]+\.(?:metal|h)", order.group(1))
    emulated = re.findall(r'#include "metal/kernels/([\w.]+)"',
                          (EMULATION / "emulated_kernels.cc").read_text().split("kernels_drop_barrier")[0])
    assert listed == ["params.h"] + [f for f in emulated if f.endswith(".metal")]
    assert set(listed) == {"params.h"} | {p.name for p in KERNELS.glob("*.metal")}


def test_the_embedded_library_source_is_the_kernel_files_in_order():
    """What the Apple device hands newLibraryWithSource: params.h and the
    .metal files, byte for byte, in prelude.metal's order."""
    src = F.metal_library_source()
    parts = re.split(r"^// ---- ([\w.]+)\n", src, flags=re.M)
    assert parts[0] == ""
    names, texts = parts[1::2], parts[2::2]
    assert names[0] == "params.h" and set(names) == {"params.h"} | {p.name for p in KERNELS.glob("*.metal")}
    for name, text in zip(names, texts, strict=True):
        assert text == (KERNELS / name).read_text(), name


@pytest.mark.arm64
def test_nbx_erf_is_within_2e_7_of_erf():
    """Metal has no erf: prelude.metal's nbx_erf (through the emulation, as
    the exact-GELU kernels use it) against math.erf on a dense grid: absolute
    error < 2e-7 (measured 1.5e-7), relative < 3e-7 where |x| < 0.5 (the series)."""
    xs = np.concatenate([np.linspace(-6, 6, 40001), [0.0, 1e-30, -1e-8, 1e-3, 0.4999999, 30.0, -30.0]])
    xs = xs.astype(np.float32)
    got = np.asarray(F.metal_erf(xs.tolist()), np.float64)
    ref = np.array([math.erf(float(v)) for v in xs])
    assert np.max(np.abs(got - ref)) < 2e-7
    small = (np.abs(xs) < 0.5) & (xs != 0)
    assert np.max(np.abs(got - ref)[small] / np.abs(ref[small])) < 3e-7
    assert got[xs == 0].tolist() == [0.0]
