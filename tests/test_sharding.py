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
    y1 = nbx.fused_moe(x, w, ids, lists, ids_outside="skip", max_workspace_bytes="1MB")
    np.testing.assert_array_equal(np.asarray(y0.astype(jnp.float32)), np.asarray(y1.astype(jnp.float32)))
    with pytest.raises(ValueError, match="ids_outside must be 'error' or 'skip'"):
        nbx.fused_moe(x, w, ids, ex, ids_outside="drop")


SCRIPT = textwrap.dedent("""
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
    def loss_ref(x, w, ex):
        return jnp.sum(nbx.fused_moe(x, w, ids, ex) ** 2)
    y_ref = nbx.fused_moe(x, w, ids, ex)
    g_ref = jax.grad(loss_ref, argnums=(0, 1, 2))(x, w, ex)
    for shape in ((8, 1), (4, 2), (2, 4)):
        mesh = jax.make_mesh(shape, ("expert", "data"))
        tok = NamedSharding(mesh, P("data", None))
        exs = NamedSharding(mesh, P("expert", None, None))
        xs, ws, ids_s = (jax.device_put(a, tok) for a in (x, w, ids))
        ex_s = jax.tree.map(lambda a: jax.device_put(a, exs), ex)
        f = jax.jit(lambda x, w, i, e: nbx.sharded_moe(x, w, i, e, mesh))
        y = f(xs, ws, ids_s, ex_s)
        err = float(jnp.max(jnp.abs(y - y_ref)) / jnp.max(jnp.abs(y_ref)))
        assert err < 1e-5, (shape, err)
        g = jax.jit(jax.grad(lambda x, w, e: jnp.sum(nbx.sharded_moe(x, w, ids_s, e, mesh) ** 2),
                             argnums=(0, 1, 2)))(xs, ws, ex_s)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
            gerr = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
            assert gerr < 1e-4, (shape, gerr)
        print("mesh", shape, "ok", err)
""")


def test_sharded_moe_on_8_host_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("ok") == 3, r.stdout


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
