"""Expert parallelism: `ids_outside="skip"` on one device, and `sharded_moe`
on 8 host devices (a subprocess: the device count is fixed at JAX's start)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from conftest import TOL, make_problem, np_moe, rel_err


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_ids_outside_skip_drops_those_slots(impl):
    x, w, ids, ex = make_problem(1, 40, 6, 2, 33, 20)
    ids = ids.at[3, 0].set(9).at[5].set(-1)  # token 5: every slot elsewhere
    y = nbx.fused_moe(x, w, ids, ex, implementation=impl, ids_outside="skip")
    ok = (np.asarray(ids) >= 0) & (np.asarray(ids) < 6)
    ref = np_moe(x, w * ok, np.where(ok, np.asarray(ids), 0), ex)
    assert rel_err(y, ref) < TOL["f32"]
    assert np.all(np.asarray(y[5]) == 0)


def test_ids_outside_skip_with_bands_and_lists():
    x, w, ids, ex = make_problem(2, 50, 6, 2, 40, 24, jnp.bfloat16, jnp.bfloat16)
    ids = ids - 3  # half the slots elsewhere
    lists = nbx.Experts(*([a[e] for e in range(6)] for a in (ex.gate, ex.up, ex.down)))
    y0 = nbx.fused_moe(x, w, ids, ex, ids_outside="skip")
    # a budget that holds a band of 25 of the 50 tokens (relative: the per-worker part grows with cores)
    # (bf16 x: the default runs the dot kernels where the CPU has the instruction)
    cap = nbx.memory.fused_moe_workspace_bytes(25, 2, 6, 40, 24, bf16_dot=nbx.cpu.bf16_dot_by_default())
    y1 = nbx.fused_moe(x, w, ids, lists, ids_outside="skip", max_workspace_bytes=cap)
    np.testing.assert_array_equal(np.asarray(y0.astype(jnp.float32)), np.asarray(y1.astype(jnp.float32)))
    with pytest.raises(ValueError, match="ids_outside must be 'error' or 'skip'"):
        nbx.fused_moe(x, w, ids, ex, ids_outside="drop")


# The problem on 8 host devices (x, w, ids, ex): the start of every script below.
SETUP = textwrap.dedent("""
    import contextlib
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_nbx as nbx
    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.default_rng(0)
    T, E, k, H, I = 32, 16, 4, 40, 24
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    ex = nbx.Experts(*(jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), jnp.float32)
                       for s in ((E, H, I), (E, H, I), (E, I, H))))
    w, ids = nbx.route(jnp.asarray(rng.standard_normal((T, E)), jnp.float32), k)
""")

SCRIPT = SETUP + textwrap.dedent("""
    def relerr(a, b):
        return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    def reference(ids, w=w):
        y = nbx.fused_moe(x, w, ids, ex)
        g = jax.grad(lambda x, w, ex: jnp.sum(nbx.fused_moe(x, w, ids, ex) ** 2), argnums=(0, 1, 2))(x, w, ex)
        return y, g
    # skewed routing: every slot goes to the experts of the last expert-axis device
    def skewed(n):
        e_local = E // n
        return jnp.asarray(E - e_local + (np.arange(T)[:, None] + np.arange(k)) % e_local, jnp.int32)
    refs = {"random": reference(ids)}
    for shape in ((8, 1), (4, 2), (2, 4)):
        mesh = jax.make_mesh(shape, ("expert", "data"))
        tok = NamedSharding(mesh, P("data", None))
        exs = NamedSharding(mesh, P("expert", None, None))
        xs, ws = (jax.device_put(a, tok) for a in (x, w))
        ex_s = jax.tree.map(lambda a: jax.device_put(a, exs), ex)
        sk = skewed(shape[0])
        refs["skewed"] = reference(sk)
        for dispatch, routing in (("psum", "random"), ("all_to_all", "random"), ("all_to_all", "skewed")):
            ids_s = jax.device_put(ids if routing == "random" else sk, tok)
            y_ref, g_ref = refs[routing]
            f = jax.jit(lambda x, w, i, e: nbx.sharded_moe(x, w, i, e, mesh, dispatch=dispatch))
            y = f(xs, ws, ids_s, ex_s)
            err = relerr(y, y_ref)
            assert err < 1e-5, (shape, dispatch, routing, err)
            if routing == "skewed" and shape != (8, 1):
                print("mesh", shape, dispatch, routing, "ok", err)
                continue  # gradients of skewed routing: on 8x1 only (CI time)
            g = jax.jit(jax.grad(lambda x, w, e: jnp.sum(nbx.sharded_moe(x, w, ids_s, e, mesh,
                                                                          dispatch=dispatch) ** 2),
                                 argnums=(0, 1, 2)))(xs, ws, ex_s)
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
                gerr = relerr(a, b)
                assert gerr < 1e-4, (shape, dispatch, routing, gerr)
            print("mesh", shape, dispatch, routing, "ok", err)
    # capacity_factor: per device (a chunk of T/8 tokens) and destination, slots past
    # the first C (slot order) are dropped = weight 0
    mesh = jax.make_mesh((4, 2), ("expert", "data"))
    n, t = 4, T // 8
    for cf in (0.5, 1.0):
        C = max(1, min(t * k, int(np.ceil(cf * t * k / n))))
        dest = np.asarray(ids).reshape(8, t * k) // (E // n)
        keep = np.zeros_like(dest, bool)
        for c in range(8):
            for j in range(n):
                keep[c, np.flatnonzero(dest[c] == j)[:C]] = True
        keep = keep.reshape(T, k)
        assert not keep.all()
        y_ref, g_ref = reference(ids, w * keep)
        y = jax.jit(lambda x, w, i, e: nbx.sharded_moe(x, w, i, e, mesh, dispatch="all_to_all",
                                                       capacity_factor=cf))(x, w, ids, ex)
        assert relerr(y, y_ref) < 1e-5, (cf, relerr(y, y_ref))
        print("capacity_factor", cf, "ok", int((~keep).sum()), "dropped")
    try:
        nbx.sharded_moe(x[:28], w[:28], ids[:28], ex, mesh, dispatch="all_to_all")
        raise AssertionError("T=28 on 8 devices accepted")
    except ValueError as e:
        assert "T=28 tokens do not split over the 2x4 devices" in str(e), e
    for dispatch in ("psum", "all_to_all"):  # no tokens: an empty result, no error
        y0 = nbx.sharded_moe(x[:0], w[:0], ids[:0], ex, mesh, dispatch=dispatch)
        assert y0.shape == (0, x.shape[1]) and y0.dtype == x.dtype, (dispatch, y0.shape, y0.dtype)
    print("T=0 ok")
""")


def test_sharded_moe_on_8_host_devices():
    """psum and all_to_all dispatch vs the unsharded op (forward and gradients) on meshes
    8x1, 4x2, 2x4; all_to_all with every slot on one device's experts (nothing dropped);
    capacity_factor's drops; T=0 (an empty result on both dispatches).  One subprocess for
    all of it."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count(" ok") == 12, r.stdout


def _run_8(script: str, *args: str, timeout: int = 600) -> str:
    """``script`` (arguments ``args``) in a subprocess with 8 host devices; its stdout."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


# The problem, its unsharded reference (forward and gradients w.r.t. x,
# topk_weights and the experts) and a comparison; shared by the scripts below.
PROBLEM = SETUP + textwrap.dedent("""
    def loss_of(moe, ids):
        return lambda x, w, e: jnp.sum(moe(x, w, ids, e) ** 2)
    y_ref = nbx.fused_moe(x, w, ids, ex)
    g_ref = jax.grad(loss_of(nbx.fused_moe, ids), argnums=(0, 1, 2))(x, w, ex)
    def relerr(a, b):
        a, b = np.asarray(a), np.asarray(b)
        return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
""")

MESH_SCRIPT = PROBLEM + textwrap.dedent("""
    import sys
    kind = sys.argv[1]
    if kind == "classic":      # Auto axes: what most JAX code builds
        mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "expert"))
    else:                      # jax.make_mesh: Explicit axes
        mesh = jax.make_mesh((2, 4), ("data", "expert"))
    ctx = jax.set_mesh(mesh) if kind == "make_mesh+set_mesh" else contextlib.nullcontext()
    with ctx:
        for dispatch in ("psum", "all_to_all"):
            for jit in (False, True):
                moe = lambda x, w, i, e: nbx.sharded_moe(x, w, i, e, mesh, dispatch=dispatch)
                fwd, grad = moe, jax.grad(loss_of(moe, ids), argnums=(0, 1, 2))
                if jit:
                    fwd, grad = jax.jit(fwd), jax.jit(grad)
                err = relerr(fwd(x, w, ids, ex), y_ref)
                assert err < 1e-5, (kind, dispatch, jit, err)
                g = grad(x, w, ex)
                for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
                    assert relerr(a, b) < 1e-4, (kind, dispatch, jit, relerr(a, b))
                print(kind, dispatch, "jit" if jit else "eager", "ok", err)
        if kind != "make_mesh+set_mesh":
            # inputs already laid out on the mesh (by device_put), eagerly and under jit
            tok = NamedSharding(mesh, P("data", None))
            xs, ws, ids_s = (jax.device_put(a, tok) for a in (x, w, ids))
            ex_s = jax.device_put(ex, NamedSharding(mesh, P("expert", None, None)))
            for jit in (False, True):
                moe = lambda x, w, i, e: nbx.sharded_moe(x, w, i, e, mesh)
                err = relerr((jax.jit(moe) if jit else moe)(xs, ws, ids_s, ex_s), y_ref)
                assert err < 1e-5, (kind, "placed", jit, err)
                print(kind, "placed inputs", "jit" if jit else "eager", "ok", err)
""")


@pytest.mark.parametrize("kind", ["classic", "make_mesh", "make_mesh+set_mesh"])
def test_sharded_moe_on_any_mesh(kind):
    """On a 2x4 (data, expert) mesh built as `jax.sharding.Mesh` (Auto axes), as
    `jax.make_mesh` (Explicit axes) used outside any mesh context, and as
    `jax.make_mesh` inside `jax.set_mesh`: both dispatches, eagerly and under
    jit, forward and gradients (x, topk_weights, experts) against the unsharded
    op; outside set_mesh also with inputs already placed on the mesh."""
    out = _run_8(MESH_SCRIPT, kind)
    assert out.count(" ok ") == (4 if kind == "make_mesh+set_mesh" else 6), out


IDS_SCRIPT = PROBLEM + textwrap.dedent(r"""
    import re
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "expert"))
    bad_ids = {v: ids.at[21, 2].set(v) for v in (20, -1)}
    # the handler names the position in the device's block of tokens: 16 rows a
    # device for psum (split over data), 4 for all_to_all (over data and expert)
    row = {"psum": 21 % 16, "all_to_all": 21 % 4}
    for dispatch in ("psum", "all_to_all"):
        for jit in (False, True):
            moe = lambda x, w, i, e, **kw: nbx.sharded_moe(x, w, i, e, mesh, dispatch=dispatch, **kw)
            f = jax.jit(moe, static_argnames="ids_outside") if jit else moe
            for v, bad in bad_ids.items():
                try:
                    f(x, w, bad, ex).block_until_ready()
                    raise AssertionError(f"id {v} accepted ({dispatch}, jit={jit})")
                except (jax.errors.JaxRuntimeError, ValueError) as e:
                    want = rf"topk_ids\[{row[dispatch]}, 2\] = {v} is outside \[0, 16\)"
                    assert re.search(want, str(e)), (dispatch, jit, str(e)[:2000])
            assert relerr(f(x, w, ids, ex), y_ref) < 1e-5  # and the next call runs
            # "skip": the slot contributes nothing, as fused_moe's skip (gradients too)
            bad = bad_ids[20]
            y = f(x, w, bad, ex, ids_outside="skip")
            assert relerr(y, nbx.fused_moe(x, w, bad, ex, ids_outside="skip")) < 1e-5
            skip = lambda moe: (lambda x, w, i, e: moe(x, w, i, e, ids_outside="skip"))
            g = jax.grad(loss_of(skip(moe), bad), argnums=(0, 1, 2))
            g = (jax.jit(g) if jit else g)(x, w, ex)
            g0 = jax.grad(loss_of(skip(nbx.fused_moe), bad), argnums=(0, 1, 2))(x, w, ex)
            assert float(g[1][21, 2]) == 0.0
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
                assert relerr(a, b) < 1e-4, (dispatch, jit, relerr(a, b))
            print(dispatch, "jit" if jit else "eager", "ok")
    # 64-bit ids are narrowed as fused_moe narrows them: 2**32 + 1 stays out of range
    big = np.asarray(ids, np.int64)
    big[21, 2] = 2 ** 32 + 1
    for dispatch in ("psum", "all_to_all"):
        try:
            nbx.sharded_moe(x, w, big, ex, mesh, dispatch=dispatch).block_until_ready()
            raise AssertionError("2**32 + 1 accepted")
        except (jax.errors.JaxRuntimeError, ValueError) as e:
            assert re.search(r"topk_ids\[\d+, 2\] = 16 is outside \[0, 16\)", str(e)), str(e)[:2000]
        # the "xla" implementation refuses them too, as fused_moe's does
        try:
            nbx.sharded_moe(x, w, big, ex, mesh, dispatch=dispatch, implementation="xla").block_until_ready()
            raise AssertionError("2**32 + 1 accepted by the xla implementation")
        except (jax.errors.JaxRuntimeError, ValueError) as e:
            assert re.search(r"topk_ids\[\d+, 2\] = 16 is outside \[0, 16\)", str(e)), str(e)[:2000]
        print(dispatch, "int64 ok")
""")


def test_sharded_moe_ids_outside():
    """An id outside [0, E) is refused at run time, naming the id (and its
    position in the device's block of tokens), eagerly and under jit, both
    dispatches, and the next call runs; ids_outside="skip" drops those slots
    exactly as fused_moe's skip (forward and gradients); 64-bit ids are
    narrowed without wrapping into range; implementation="xla" refuses them too."""
    out = _run_8(IDS_SCRIPT)
    assert out.count(" ok") == 6, out


def test_sharded_moe_errors():
    import jax

    x, w, ids, ex = make_problem(3, 8, 6, 2, 16, 8)
    mesh = jax.make_mesh((1,), ("expert",))
    with pytest.raises(ValueError, match="no axis 'data'"):
        nbx.sharded_moe(x, w, ids, ex, mesh)
    lists = nbx.Experts(*([a[e] for e in range(6)] for a in (ex.gate, ex.up, ex.down)))
    with pytest.raises(TypeError, match="stacked experts"):
        nbx.sharded_moe(x, w, ids, lists, mesh, data_axis=None)
    y = nbx.sharded_moe(x, w, ids, ex, mesh, data_axis=None)
    assert rel_err(y, np_moe(x, w, ids, ex)) < TOL["f32"]
    y = nbx.sharded_moe(x, w, ids, ex, mesh, data_axis=None, dispatch="all_to_all")
    assert rel_err(y, np_moe(x, w, ids, ex)) < TOL["f32"]
    assert nbx.sharded_moe(x[:0], w[:0], ids[:0], ex, mesh, data_axis=None).shape == (0, 16)
    with pytest.raises(ValueError, match="dispatch must be 'psum' or 'all_to_all'; got 'alltoall'"):
        nbx.sharded_moe(x, w, ids, ex, mesh, data_axis=None, dispatch="alltoall")
    with pytest.raises(ValueError, match="capacity_factor applies to dispatch='all_to_all' only"):
        nbx.sharded_moe(x, w, ids, ex, mesh, data_axis=None, capacity_factor=1.0)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        nbx.sharded_moe(x, w, ids, ex, mesh, data_axis=None, dispatch="all_to_all", capacity_factor=0)
    with pytest.raises(ValueError, match="ids_outside must be 'error' or 'skip'; got 'drop'"):
        nbx.sharded_moe(x, w, ids, ex, mesh, data_axis=None, ids_outside="drop")
    with pytest.raises(TypeError, match="topk_ids has dtype float32; expected an integer dtype"):
        nbx.sharded_moe(x, w, ids.astype(jnp.float32), ex, mesh, data_axis=None)


def test_sharded_moe_refuses_quantized_experts_by_name():
    """Quantized experts are not sharded (their scales are [E, N], not [E, K, N]):
    a ValueError saying so, not device_put's rank error."""
    import jax

    x, w, ids, ex = make_problem(3, 8, 4, 2, 64, 32)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "expert"))
    with pytest.raises(ValueError, match=r"sharded_moe takes dense experts; got quantized ones \(int8\)"):
        nbx.sharded_moe(x, w, ids, nbx.quantize(ex, "int8"), mesh)
