"""The Metal kernels (xla_ffi/metal/kernels/*.metal) executed on Linux: the
same source compiled as C++ through the MSL emulation (metal/msl_emulation.h)
and launched on the simulated device, each threadgroup's 128 threads real
and concurrent (issue #16, first kernel: the expert GEMMs).  Checked against
a float64 reference; outputs NaN-poisoned so that unwritten rows show.
Nothing here ran on Apple hardware or through Apple's Metal compiler."""
from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

import jax_nbx as nbx

from conftest import NP_ACT

F = nbx._registry.ffi_module()
BM = 32
KERNELS = pathlib.Path(__file__).resolve().parent.parent / "xla_ffi" / "metal" / "kernels"


pytestmark = pytest.mark.usefixtures("metal_sim")  # conftest.py: the simulated device


def ptr(a: np.ndarray) -> int:
    assert a.flags.c_contiguous
    return int(a.ctypes.data)


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


def problem(seed, T, E, k, H, I):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    gate = (rng.standard_normal((E, H, I)) / np.sqrt(H)).astype(np.float32)
    up = (rng.standard_normal((E, H, I)) / np.sqrt(H)).astype(np.float32)
    down = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    return x, gate, up, down, ids, w


def table_of(gate, up, down):
    E = gate.shape[0]
    ranges = [(ptr(m) + e * m[e].nbytes, m[e].nbytes) for m in (gate, up, down) for e in range(E)]
    return F.metal_table(ranges)


def run_moe(x, gate, up, down, ids, w, activation="swiglu", drop_barrier=False, resident=True):
    """The MoE block through the two kernel launches (the combine in numpy)."""
    T, H = x.shape
    E, _, I = gate.shape
    k = ids.shape[1]
    row_slot, tile_expert = order_slots(ids, E)
    P = row_slot.size
    row_tok = np.where(row_slot >= 0, row_slot // k, -1).astype(np.int32)
    table = table_of(gate, up, down)
    act = 0 if activation == "swiglu" else 1
    h = np.full((P, I), np.nan, np.float32)
    zero_w = np.zeros(P, np.float32)
    F.metal_run_moe_gemm(ptr(x), ptr(row_tok), ptr(tile_expert), table, ptr(zero_w), ptr(h),
                         H, I, E, 0, act, H, P, drop_barrier, resident)
    row_self = np.where(row_slot >= 0, np.arange(P), -1).astype(np.int32)
    row_w = np.where(row_slot >= 0, w.reshape(-1)[np.maximum(row_slot, 0)], 0).astype(np.float32)
    o = np.full((P, H), np.nan, np.float32)
    F.metal_run_moe_gemm(ptr(h), ptr(row_self), ptr(tile_expert), table, ptr(row_w), ptr(o),
                         I, H, E, 1, act, I, P, drop_barrier, resident)
    valid = row_slot >= 0
    assert np.all(np.isfinite(h[valid])) and np.all(np.isfinite(o[valid])), "unwritten rows"
    assert np.all(np.isnan(o[~valid])), "padding rows were stored"
    y = np.zeros((T, H), np.float64)
    np.add.at(y, row_tok[valid], o[valid].astype(np.float64))
    return y


def reference(x, gate, up, down, ids, w, activation="swiglu"):
    """float64, one slot at a time (the op's definition; conftest.np_moe's math)."""
    act = NP_ACT[activation]
    x, gate, up, down = (a.astype(np.float64) for a in (x, gate, up, down))
    y = np.zeros_like(x)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            y[t] += w[t, j] * ((act(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e])
    return y


@pytest.mark.parametrize("T,E,k,H,I", [(1, 1, 1, 17, 9), (3, 4, 4, 8, 16), (33, 4, 2, 45, 70),
                                       (40, 6, 2, 33, 129)])
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_expert_gemms_match_float64(T, E, k, H, I, activation):
    x, gate, up, down, ids, w = problem(T * 31 + H, T, E, k, H, I)
    y = run_moe(x, gate, up, down, ids, w, activation)
    ref = reference(x, gate, up, down, ids, w, activation)
    assert np.max(np.abs(y - ref)) / np.max(np.abs(ref)) < 1e-5
    assert F.metal_sim_take_violations() == []


def test_a_missing_barrier_shows_as_a_wrong_result():
    x, gate, up, down, ids, w = problem(1, 33, 4, 2, 45, 70)
    ref = reference(x, gate, up, down, ids, w)
    with pytest.raises(AssertionError):  # NaN from unwritten threadgroup memory, or wrong values
        y = run_moe(x, gate, up, down, ids, w, drop_barrier=True)
        assert np.max(np.abs(y - ref)) / np.max(np.abs(ref)) < 1e-5


def test_weights_not_made_resident_fail_the_launch():
    x, gate, up, down, ids, w = problem(2, 5, 2, 1, 16, 8)
    with pytest.raises(ValueError, match="no resident buffer or pin covers"):
        run_moe(x, gate, up, down, ids, w, resident=False)
    assert any("not made resident" in v for v in F.metal_sim_take_violations())


@pytest.mark.parametrize("S,E", [(1, 1), (7, 3), (66, 4), (300, 8), (1000, 5)])
def test_ordering_kernels_match_the_cpu_planner(S, E):
    """moe_order.metal (count, offsets, scatter: no atomics) gives exactly the
    CPU planner's order (cpu/slots.h OrderSlots): by expert, stable in slot,
    each expert padded to 32 rows; ids outside [0, E) left out."""
    rng = np.random.default_rng(S + E)
    ids = rng.integers(-1, E + 1, S).astype(np.int32)       # some outside [0, E)
    ids[: S // 3] = E - 1                                      # skew
    count, off, row_slot, slot_row = F.metal_order_slots(ids.tolist(), E, BM)
    expert_off, real_end, ref_rows, ref_slot_row = F.plan_slots(ids.tolist(), 0, S, E, BM)
    assert count == [int(np.sum(ids == e)) for e in range(E)]
    assert off == list(expert_off)
    assert row_slot == list(ref_rows) and -7 not in row_slot   # every row written
    assert slot_row == list(ref_slot_row)


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
            builtins = re.findall(r"\[\[(\w+)\]\]", params)
            assert builtins[-4:] == ["threadgroup_position_in_grid", "thread_index_in_threadgroup",
                                     "simdgroup_index_in_threadgroup", "thread_index_in_simdgroup"]
