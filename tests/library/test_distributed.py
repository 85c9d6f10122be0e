"""`sharded_moe` across processes: JAX's multi-controller runtime
(``jax.distributed.initialize`` on loopback, gloo collectives on the CPU),
2 processes x 4 host devices, against the unsharded op."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

BODY = textwrap.dedent("""
    import jax
    port, pid = sys.argv[1], int(sys.argv[2])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # (the default in jax 0.10)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, initialization_timeout=60)
    import re
    import jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_nbx as nbx
    assert jax.process_count() == 2 and len(jax.local_devices()) == 4 and len(jax.devices()) == 8
    # the same problem on both processes (numpy, one seed); the reference is the
    # unsharded op on this process's first device
    rng = np.random.default_rng(0)
    T, E, k, H, I = 32, 16, 4, 40, 24
    x = rng.standard_normal((T, H)).astype(np.float32)
    ex = nbx.Experts(*((rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32)
                       for s in ((E, H, I), (E, H, I), (E, I, H))))
    w, ids = (np.asarray(a) for a in nbx.route(jnp.asarray(rng.standard_normal((T, E)), jnp.float32), k))
    def loss_of(moe):  # (ids an argument: a jitted function cannot close over a global array)
        return lambda x, w, e, i: jnp.sum(moe(x, w, i, e) ** 2)
    y_ref = np.asarray(nbx.fused_moe(x, w, ids, ex))
    g_ref = [np.asarray(a) for a in jax.tree.leaves(
        jax.grad(loss_of(nbx.fused_moe), argnums=(0, 1, 2))(x, w, ex, ids))]

    def check(a, ref, tol, what):  # this process's shards of a global array
        assert not a.is_fully_addressable
        for s in a.addressable_shards:
            err = float(np.max(np.abs(np.asarray(s.data) - ref[s.index])) / np.max(np.abs(ref)))
            assert err < tol, (pid, what, s.index, err)

    # (data, expert) = (2, 4) with the expert axis across the processes (each
    # expert group holds 2 devices of each: psum and all_to_all cross them),
    # then jax.make_mesh's (2, 4) (Explicit axes; data across the processes)
    devs = np.array(jax.devices()).reshape(4, 2).T
    assert {d.process_index for d in devs[0]} == {0, 1}
    meshes = {"expert across": jax.sharding.Mesh(devs, ("data", "expert")),
              "make_mesh": jax.make_mesh((2, 4), ("data", "expert"))}
    for name, mesh in meshes.items():
        def glob(a, spec):  # a global array from the same host array on each process
            return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])
        xg, wg = glob(x, P("data", None)), glob(w, P("data", None))
        ids_g = glob(ids, P("data", None))
        exg = nbx.Experts(*(glob(a, P("expert", None, None)) for a in (ex.gate, ex.up, ex.down)))
        for dispatch in ("psum", "all_to_all"):
            def moe(x, w, i, e):
                return nbx.sharded_moe(x, w, i, e, mesh, dispatch=dispatch)
            check(moe(xg, wg, ids_g, exg), y_ref, 1e-5, (name, dispatch, "eager"))
            check(jax.jit(moe)(xg, wg, ids_g, exg), y_ref, 1e-5, (name, dispatch, "jit"))
            check(moe(x, w, ids, ex), y_ref, 1e-5, (name, dispatch, "numpy"))  # the same on each
            g = jax.jit(jax.grad(loss_of(moe), argnums=(0, 1, 2)))(xg, wg, exg, ids_g)
            for a, b, what in zip(jax.tree.leaves(g), g_ref, ("dx", "dw", "dgate", "dup", "ddown")):
                check(a, b, 1e-4, (name, dispatch, what))
            print(pid, name, dispatch, "ok", flush=True)
    # an id outside [0, E) that only process 1's devices hold: both processes fail (none hangs)
    bad = ids.copy()
    bad[21, 2] = 20
    bad = glob(bad, P("data", None))
    holders = [d for d, i in bad.sharding.devices_indices_map(bad.shape).items() if 21 in range(T)[i[0]]]
    assert {d.process_index for d in holders} == {1}, holders
    for dispatch in ("psum", "all_to_all"):
        try:
            jax.jit(lambda x, w, i, e: nbx.sharded_moe(x, w, i, e, mesh, dispatch=dispatch))(
                xg, wg, bad, exg).block_until_ready()
            raise AssertionError("id 20 accepted")
        except jax.errors.JaxRuntimeError as e:
            assert re.search(r"topk_ids\\[\\d+, 2\\] = 20 is outside \\[0, 16\\)", str(e)), str(e)[:2000]
        print(pid, "bad id", dispatch, "ok", flush=True)
    jax.distributed.shutdown()
""")
# A worker that fails exits at once (os._exit): its atexit would otherwise wait
# in jax.distributed's shutdown barrier for the other process, which may be
# waiting for it in a collective.
WORKER = ("import os, sys, traceback\n\n\ndef main():\n" + textwrap.indent(BODY, "    ")
          + textwrap.dedent("""

    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
"""))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sharded_moe_two_processes(tmp_path):
    """Two processes of 4 host devices each, one mesh of the 8: both dispatches,
    eagerly and under jit, forward and gradients (x, topk_weights, experts)
    against the unsharded op (and forward from the same numpy inputs in each
    process), on a classic Mesh whose expert axis crosses the
    processes and on jax.make_mesh's; an out-of-range id fails both processes.
    Bounded: both are killed after 240 s, or 10 s after one fails."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    port = _free_port()
    logs = [(open(tmp_path / f"out{i}", "w+"), open(tmp_path / f"err{i}", "w+")) for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(port), str(i)], env=env,
                              stdout=o, stderr=e, text=True) for i, (o, e) in enumerate(logs)]
    deadline, failed_at = time.monotonic() + 240, None
    try:
        while time.monotonic() < deadline:
            rcs = [p.poll() for p in procs]
            if None not in rcs:
                break
            if failed_at is None and any(rc not in (None, 0) for rc in rcs):
                failed_at = time.monotonic()  # the other may wait for it: 10 s more at most
            if failed_at is not None and time.monotonic() > failed_at + 10:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    out, err = ([(f.seek(0), f.read())[1] for f in fs] for fs in zip(*logs))
    report = "".join(f"\n--- process {i}: rc {p.returncode}\n{out[i][-2000:]}--- stderr\n{err[i][-4000:]}"
                     for i, p in enumerate(procs))
    assert all(p.returncode == 0 for p in procs), report
    assert all(o.count(" ok") == 6 for o in out), report
