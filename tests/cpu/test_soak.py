"""A short multi-threaded soak (issue #14): 4 threads call a jitted forward
(traced afresh every 50 calls, while the others run) and a jitted gradient,
of several shapes, under a budget that forces bands and lets only one band's
workspace live at a time, so that calls wait for one another in the account.
Every result is bit-identical to the same call run alone, nothing is refused,
the peak stays within the budget, and the account is back to zero live bytes
at the end.

``JAX_NBX_SOAK_CALLS`` runs more calls per thread (CI: the default, 500)."""
from __future__ import annotations

import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx
from jax_nbx import memory

from conftest import make_problem

pytestmark = pytest.mark.sanitize

THREADS = 4
CALLS = int(os.environ.get("JAX_NBX_SOAK_CALLS", "500"))
SHAPES = [(1, 8, 2, 64, 96), (33, 8, 2, 65, 129), (256, 6, 3, 64, 128)]  # T, E, k, H, I


def test_threads_wait_for_one_another_and_agree_bit_for_bit():
    probs = [make_problem(s, *shape, x_dtype=dt) for s, (shape, dt) in
             enumerate(zip(SHAPES, (jnp.float32, jnp.bfloat16, jnp.float32)))]
    grad = jax.grad(lambda x, w, ids, ex: jnp.sum(nbx.fused_moe(x, w, ids, ex).astype(jnp.float32) ** 2),
                    argnums=(0, 1, 3))
    fwd, grad_alone = jax.jit(nbx.fused_moe), jax.jit(grad)
    expected = [(np.asarray(fwd(*p).astype(jnp.float32)),
                 [np.asarray(a.astype(jnp.float32)) for a in jax.tree.leaves(grad_alone(*p))]) for p in probs]
    # a budget of a third of the largest workspace (at least one token of each): bands in the
    # large shape's calls, and room for one call's band at a time, so concurrent calls wait
    biggest = max(max(memory.fused_moe_workspace_bytes(T, k, E, H, I),
                      memory.fused_moe_backward_workspace_bytes(T, k, E, H, I))
                  for T, E, k, H, I in SHAPES)
    smallest_token = max(max(memory.fused_moe_workspace_bytes(1, k, E, H, I),
                             memory.fused_moe_backward_workspace_bytes(1, k, E, H, I))
                         for T, E, k, H, I in SHAPES)
    before = memory.budget()
    memory.set_budget(max(biggest // 3, smallest_token))
    memory.release_cached()
    refusals = memory.stats()["cpu:0"]["refusals"]
    try:
        # traced under the small budget: the plans cut the large shapes into bands
        f, g = jax.jit(lambda *a: nbx.fused_moe(*a)), jax.jit(lambda *a: grad(*a))
        memory.reset_peak()
        errors, mismatches, calls = [], [], [0] * THREADS

        def worker(n):
            rng = np.random.default_rng(n)
            try:
                fn = f
                for c in range(CALLS):
                    i = int(rng.integers(len(probs)))
                    if c % 50 == 49:  # a fresh trace while the other threads hold workspace: planned
                        fn = jax.jit(lambda *a: nbx.fused_moe(*a))  # from the budget, not the moment
                    if c % 5 == 4:
                        got = [np.asarray(a.astype(jnp.float32)) for a in jax.tree.leaves(g(*probs[i]))]
                        same = all(np.array_equal(a, b) for a, b in zip(got, expected[i][1]))
                    else:
                        same = np.array_equal(np.asarray(fn(*probs[i]).astype(jnp.float32)), expected[i][0])
                    if not same:
                        mismatches.append((n, c, i))
                    calls[n] += 1
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        start = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        s = memory.stats()["cpu:0"]
        print(f"soak: {sum(calls)} calls from {THREADS} threads in {time.perf_counter() - start:.1f} s; "
              f"peak {s['peak']} of a {s['budget']} budget")
        assert not errors, errors[:1]
        assert not mismatches, mismatches[:5]
        assert sum(calls) == THREADS * CALLS
        assert s["refusals"] == refusals
        assert s["live"] == 0 and 0 < s["peak"] <= s["budget"]
        T, E, k, H, I = SHAPES[-1]
        # the largest shape ran in bands, forward and backward
        assert nbx.planning.plan_band_tokens(T, k, E, H, I) < T
        assert nbx.planning.plan_band_tokens(T, k, E, H, I, backward=True) < T
    finally:
        memory.set_budget(before)
        memory.release_cached()
