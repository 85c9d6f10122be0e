"""Invariants of the CPU handlers' slot planner (xla_ffi/common/slots.cc), on its
own: random routings with ids out of range, bands, paddings and expert-major
groups; checked against a plain Python statement of what the plan must be."""
from __future__ import annotations

import numpy as np
import pytest

from support import ffi_testing

T = ffi_testing.load()  # jax_nbx._ffi_testing: the planner's test bindings
pytestmark = [pytest.mark.fast, pytest.mark.sanitize, pytest.mark.arm64]


def _expected_order(ids, s0, s1, E):
    """In-range slots of [s0, s1) by expert, stable in the slot index."""
    return [s for e in range(E) for s in range(s0, s1) if ids[s] == e]


def _check_plan(ids, s0, s1, E, pad, plan, order):
    expert_off, real_end, row_slot, slot_row = (np.asarray(a) for a in plan)
    assert expert_off[0] == 0 and np.all(np.diff(expert_off) >= 0)
    assert len(row_slot) == expert_off[-1]
    got = []
    for e in range(E):
        lo, end, hi = expert_off[e], real_end[e], expert_off[e + 1]
        assert (hi - lo) % pad == 0 and hi - end < pad and lo <= end <= hi
        assert np.all(row_slot[end:hi] == -1), "padding rows are marked -1"
        rows = row_slot[lo:end]
        assert np.all(np.asarray(ids)[rows] == e), "a row holds another expert's slot"
        got += rows.tolist()
    assert got == order
    for i, r in enumerate(slot_row):  # the inverse map
        s = s0 + i
        if r >= 0:
            assert row_slot[r] == s
        else:
            assert s not in order


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pad", [1, 6, 12])
def test_band_plans(seed, pad):
    rng = np.random.default_rng(seed)
    E = int(rng.integers(1, 40))
    S = int(rng.integers(0, 300))
    ids = rng.integers(-2, E + 2, S).astype(np.int32)  # a few out of range (skipped)
    s0 = int(rng.integers(0, S + 1))
    s1 = int(rng.integers(s0, S + 1))
    plan = T.plan_slots(ids.tolist(), s0, s1, E, pad)
    _check_plan(ids, s0, s1, E, pad, plan, _expected_order(ids, s0, s1, E))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pad", [1, 6, 12])
def test_expert_major_groups_cover_the_call_once(seed, pad):
    """Groups of at most max_rows padded rows, in (expert, slot) order, split an
    expert only at a multiple of pad, and together take every slot once."""
    rng = np.random.default_rng(100 + seed)
    E = int(rng.integers(1, 20))
    S = int(rng.integers(1, 400))
    ids = rng.integers(-1, E + 1, S).astype(np.int32)
    if seed % 2:  # skewed: most slots on one expert (groups split it)
        ids[rng.random(S) < 0.7] = 0
    max_rows = int(rng.integers(pad, 5 * pad + 60)) // pad * pad
    total = T.count_slots(ids.tolist(), E)
    assert total == [int(np.sum(ids == e)) for e in range(E)]
    order, frm = [], (0, 0)
    while frm[0] < E:
        to = T.next_group(total, pad, max_rows, *frm)
        assert to > frm, "a group makes progress"
        assert to[1] % pad == 0
        expert_off, real_end, row_slot, _ = T.plan_slots(ids.tolist(), 0, S, E, pad, *frm, *to)
        assert expert_off[-1] <= max_rows
        order += [r for r in row_slot if r >= 0]
        frm = to
    assert order == _expected_order(ids, 0, S, E)


@pytest.mark.parametrize("chunk_rows", [1, 6, 96, 1000])
def test_chunks_tile_the_real_rows(chunk_rows):
    rng = np.random.default_rng(chunk_rows)
    E, pad = 9, 6
    ids = rng.integers(0, E, 500).astype(np.int32)
    expert_off, real_end, _, _ = T.plan_slots(ids.tolist(), 0, 500, E, pad)
    chunk_rows = max(chunk_rows // pad, 1) * pad  # the forward's: whole m-panels
    expert, begin, end, cap = T.cut_chunks(expert_off, real_end, chunk_rows)
    assert len(expert) <= cap
    covered = {e: [] for e in range(E)}
    for e, b, n in zip(expert, begin, end):
        assert 0 < n - b <= chunk_rows and (b - expert_off[e]) % pad == 0
        covered[e] += list(range(b, n))
    for e in range(E):
        assert covered[e] == list(range(expert_off[e], real_end[e]))
