"""The handlers' per-worker scratch is sized to the problem: a tiny problem
needs a tiny workspace and runs under a tiny budget (it used to take about
2 MB for one token at any size), and a large one is capped by the blocking."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx
from jax_nbx import memory

from conftest import TOL, make_problem, np_moe, rel_err

pytestmark = [pytest.mark.sanitize, pytest.mark.arm64]

E, K, H, I = 8, 2, 64, 96
WEIGHT_BYTES = E * 3 * H * I * 4  # all experts, float32


def test_tiny_problem_needs_a_small_workspace():
    one = memory.fused_moe_workspace_bytes(1, K, E, H, I)
    # packed K-blocks of the tile and partial sums per worker: less than the
    # experts' weights, and small next to the old fixed ~2 MB
    assert one < WEIGHT_BYTES // 2, one
    assert memory.fused_moe_backward_workspace_bytes(1, K, E, H, I) < WEIGHT_BYTES // 2
    # the fixed part (tokens=0) is the scratch and per-expert arrays: here, with H and
    # I within one K-block, no partial sums at all
    assert memory.fused_moe_workspace_bytes(0, K, E, H, I) < WEIGHT_BYTES // 3


def test_scratch_grows_with_h_and_i_up_to_the_blocking():
    fixed = [memory.fused_moe_workspace_bytes(0, K, E, n, n) for n in (32, 64, 128, 129, 2048, 8192)]
    assert fixed == sorted(fixed)
    # past one tile and one K-block the scratch stops growing (OLMoE vs Mixtral widths)
    big = [memory.fused_moe_workspace_bytes(0, 2, 8, h, i) for h, i in ((2048, 1024), (4096, 14336))]
    assert big[0] == big[1]


@pytest.mark.parametrize("T", [1, 4, 33])
def test_tiny_problem_runs_under_a_tiny_budget(T):
    x, w, ids, ex = make_problem(T, T, E, K, H, I)
    budget = max(memory.fused_moe_workspace_bytes(1, K, E, H, I), 200_000)
    old = memory.budget()
    memory.release_cached()
    memory.set_budget(budget)
    try:
        memory.reset_peak()
        y = nbx.fused_moe(x, w, ids, ex)
        assert 0 < memory.stats()["cpu:0"]["peak"] <= budget
    finally:
        memory.set_budget(old)
    assert bool(jnp.all(jnp.isfinite(y)))
    assert rel_err(y, np_moe(x, w, ids, ex)) < TOL["f32"]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(nbx.fused_moe(x, w, ids, ex)))
