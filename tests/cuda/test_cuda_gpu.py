"""The CUDA handler on a real GPU (skipped where JAX has no CUDA device or
jax_nbx was built without the CUDA handler).  benchmarks/gpu_check.sh runs
these on a GPU machine; the kernels themselves are also checked on the CPU
by tests/cuda/test_triton_interpret.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx
from jax_nbx import _registry

from conftest import make_problem, np_moe, rel_err

pytestmark = pytest.mark.skipif(not _registry.has_handler("gpu"),
                                reason="no CUDA device with jax_nbx's CUDA handler here")

# 16-bit weights run on tensor cores: x and the intermediate are rounded to the weights' dtype
GPU_TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 4e-3}


@pytest.mark.parametrize("T,E,k,H,I", [(1, 8, 2, 129, 99), (33, 5, 3, 130, 66), (222, 16, 4, 257, 130),
                                       (1024, 64, 8, 512, 256)])
@pytest.mark.parametrize("wd", ["float32", "bfloat16", "float16"])
def test_cuda_matches_float64(T, E, k, H, I, wd):
    x, w, ids, ex = make_problem(T * 7 + E, T, E, k, H, I, jnp.dtype(wd), jnp.dtype(wd))
    y = jax.jit(lambda *a: nbx.fused_moe(*a, implementation="ffi"))(x, w, ids, ex)
    assert bool(jnp.all(jnp.isfinite(y)))
    assert rel_err(y, np_moe(x, w, ids, ex)) < GPU_TOL[wd]


def test_cuda_bands_identical():
    x, w, ids, ex = make_problem(3, 300, 16, 4, 256, 128, jnp.bfloat16, jnp.bfloat16)
    y0 = nbx.fused_moe(x, w, ids, ex, implementation="ffi")
    y1 = nbx.fused_moe(x, w, ids, ex, implementation="ffi", max_workspace_bytes="1MB")
    # every row is computed by the same kernels whatever the band: identical
    assert bool(jnp.all(y0 == y1))


def test_cuda_bad_id_names_the_slot():
    x, w, ids, ex = make_problem(4, 40, 8, 2, 64, 32, jnp.bfloat16, jnp.bfloat16)
    ids = ids.at[17, 1].set(11)
    with pytest.raises(Exception, match=r"topk_ids\[17, 1\] = 11 is outside \[0, 8\)"):
        nbx.fused_moe(x, w, ids, ex, implementation="ffi").block_until_ready()


def test_cuda_deferred_id_check_fails_the_next_call(monkeypatch):
    """JAX_NBX_CUDA_CHECK_IDS=deferred: a call with a bad id returns (its slot
    skipped); the next call on the device fails naming that slot and id."""
    monkeypatch.setenv("JAX_NBX_CUDA_CHECK_IDS", "deferred")
    x, w, ids, ex = make_problem(4, 5, 4, 2, 64, 32, jnp.bfloat16, jnp.bfloat16)
    f = jax.jit(lambda *a: nbx.fused_moe(*a, implementation="ffi"))
    bad = ids.at[2, 1].set(9)
    jax.block_until_ready(f(x, w, bad, ex))  # no error here
    import time
    time.sleep(0.1)  # the asynchronous copy lands
    with pytest.raises(Exception, match=r"topk_ids\[2, 1\] = 9 is outside \[0, 4\) in an earlier call"):
        jax.block_until_ready(f(x, w, ids, ex))
    jax.block_until_ready(f(x, w, ids, ex))  # reported once: the next call runs


@pytest.mark.parametrize("T", [1, 3, 300])  # decode (T*k <= 16) and the prefill path
def test_cuda_graph_launches_match_plain_launches(monkeypatch, T):
    """JAX_NBX_CUDA_GRAPHS=1 runs the same kernels as one CUDA graph: the same
    bits as plain launches, call after call with new inputs (each call
    updates the cached graph's arguments)."""
    x, w, ids, ex = make_problem(8 + T, T, 16, 4, 256, 130, jnp.bfloat16, jnp.bfloat16)
    inputs = [(x * (i + 1), w, jnp.roll(ids, i, axis=0), ex) for i in range(3)]

    def run():  # traced anew each time: the environment is read when a call is traced
        f = jax.jit(lambda *a: nbx.fused_moe(*a, implementation="ffi"))
        ys = [f(*a) for a in inputs]
        dx = jax.grad(lambda x: nbx.fused_moe(x, w, ids, ex, implementation="ffi").astype(jnp.float32).sum())(x)
        return ys, dx

    monkeypatch.delenv("JAX_NBX_CUDA_GRAPHS", raising=False)
    ys0, dx0 = run()
    monkeypatch.setenv("JAX_NBX_CUDA_GRAPHS", "1")
    ys1, dx1 = run()
    for y0, y1 in zip(ys0, ys1):
        assert bool(jnp.all(y0 == y1))
    assert bool(jnp.all(dx0 == dx1))


def test_cuda_tables_cached():
    x, w, ids, ex = make_problem(5, 16, 8, 2, 64, 32, jnp.bfloat16, jnp.bfloat16)
    f = jax.jit(lambda *a: nbx.fused_moe(*a, implementation="ffi"))
    f(x, w, ids, ex).block_until_ready()
    before = nbx.tables.stats("cuda")
    f(x, w, ids, ex).block_until_ready()
    after = nbx.tables.stats("cuda")
    assert after["hits"] > before["hits"] and after["entries"] >= 1
    assert nbx.memory.stats()["cuda:0"]["live_by_tag"].get("tables", 0) == after["bytes"]


def test_cuda_grad_and_vmap():
    x, w, ids, ex = make_problem(6, 16, 4, 2, 64, 32, jnp.float32, jnp.float32)
    g = jax.grad(lambda x: nbx.fused_moe(x, w, ids, ex, implementation="ffi").sum())(x)
    gr = jax.grad(lambda x: nbx.fused_moe(x, w, ids, ex, implementation="xla").sum())(x)
    assert rel_err(g, np.asarray(gr, np.float64)) < 1e-4
    xb = jnp.stack([x, 2 * x])
    yb = jax.vmap(lambda x: nbx.fused_moe(x, w, ids, ex, implementation="ffi"))(xb)
    assert rel_err(yb[1], np_moe(2 * x, w, ids, ex)) < 1e-4


def test_cuda_lists_equal_stacked():
    x, w, ids, ex = make_problem(8, 100, 6, 2, 128, 64, jnp.bfloat16, jnp.bfloat16)
    lists = nbx.Experts(*([a[e] for e in range(6)] for a in (ex.gate, ex.up, ex.down)))
    y0 = nbx.fused_moe(x, w, ids, ex, implementation="ffi")
    y1 = nbx.fused_moe(x, w, ids, lists, implementation="ffi")
    assert bool(jnp.all(y0 == y1))


@pytest.mark.parametrize("kind,G", [("int8", None), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("T", [2, 300])
def test_cuda_quantized_matches_dequantized(kind, G, T):
    x, w, ids, ex = make_problem(9, T, 8, 2, 256, 128, jnp.bfloat16, jnp.float32)
    q = nbx.quantize(ex, kind, group_size=G, scale_dtype=jnp.bfloat16)
    y = nbx.fused_moe(x, w, ids, q, implementation="ffi")
    assert rel_err(y, np_moe(x, w, ids, nbx.dequantize(q, jnp.float32))) < 3e-2


@pytest.mark.parametrize("T", [1, 33])
@pytest.mark.parametrize("lists", [False, True], ids=["stacked", "lists"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("name", ["plain", "out_in", "concat", "interleaved", "concat_out_in",
                                  "interleaved_out_in"])
def test_cuda_reads_every_layout_with_biases(name, bias, lists, T):
    """Checkpoint layouts read in place through the views, with biases
    (tests/support/layouts.py's arrays, built with numpy), against float64."""
    from support.layouts import canonical, np_block, stored

    rng = np.random.default_rng(T * 13 + len(name) + 2 * bias + lists)
    E, k, H, I = 6, 2, 45, 19
    G, U, D, bg, bu, bd = canonical(rng, E, H, I, bias)
    ex = stored(name, G, U, D, bg, bu, bd, lists=lists)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(T)]), jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (T, k)), jnp.float32)
    y = jax.jit(lambda *a: nbx.fused_moe(*a, implementation="ffi"))(x, w, ids, ex)
    assert bool(jnp.all(jnp.isfinite(y)))
    assert rel_err(y, np_block(x, w, ids, G, U, D, bg, bu, bd)) < GPU_TOL["float32"]


def test_cuda_gpt_oss_bf16_and_its_gradient():
    """Interleaved bf16 gate_up with biases and the clamped SwiGLU; the
    gradient (the CUDA backward: x, dy and intermediates rounded to bf16 on
    tensor cores) against the "xla" path's."""
    from support.layouts import canonical, np_block, stored

    rng = np.random.default_rng(5)
    E, k, H, I, T = 8, 2, 64, 32, 40
    G, U, D, bg, bu, bd = canonical(rng, E, H, I, True)
    ex = stored("interleaved", G, U, D, bg, bu, bd, dtype=jnp.bfloat16)
    Gb, Ub, Db = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in (G, U, D))
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(T)]), jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (T, k)), jnp.float32)
    act = "swiglu_clamped"
    y = nbx.fused_moe(x, w, ids, ex, activation=act, implementation="ffi")
    assert rel_err(y, np_block(x, w, ids, Gb, Ub, Db, bg, bu, bd, act=act)) < GPU_TOL["bfloat16"]
    f = lambda impl: lambda x: nbx.fused_moe(x, w, ids, ex, activation=act, implementation=impl).sum()  # noqa: E731
    assert rel_err(jax.grad(f("ffi"))(x), np.asarray(jax.grad(f("xla"))(x), np.float64)) < GPU_TOL["bfloat16"]


@pytest.mark.parametrize("lists", [False, True], ids=["stacked", "lists"])
@pytest.mark.parametrize("wd", ["float32", "bfloat16"])
def test_cuda_backward_every_gradient(wd, lists):
    """The CUDA backward (nbx_fused_moe_bwd_cuda): dx, d(topk_weights) and
    every weight gradient against jax.grad of the "xla" path; forced into
    bands, dx and d(topk_weights) identical bit for bit.  Written without a
    GPU (the kernels were checked under Triton's interpreter only)."""
    T, E, k, H, I = 200, 8, 2, 130, 66
    x, w, ids, ex = make_problem(9, T, E, k, H, I, jnp.float32, jnp.dtype(wd))
    if lists:
        ex = nbx.Experts(*([a[e] for e in range(E)] for a in (ex.gate, ex.up, ex.down)))
    ct = jnp.asarray(np.random.default_rng(1).standard_normal((T, H)), jnp.float32)

    def grads(impl, **kw):
        f = lambda x, w, ex: jnp.sum(ct * nbx.fused_moe(x, w, ids, ex, implementation=impl, **kw))  # noqa: E731
        return jax.jit(jax.grad(f, (0, 1, 2)))(x, w, ex)

    got, ref = grads("ffi"), grads("xla")
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32))))
        assert rel_err(g, np.asarray(r.astype(jnp.float32), np.float64)) < GPU_TOL[wd]
    banded = grads("ffi", max_workspace_bytes="256KB")
    for a, b in zip(jax.tree.leaves(got)[:2], jax.tree.leaves(banded)[:2]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
