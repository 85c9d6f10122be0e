"""Expert parallelism: `sharded_moe` runs `fused_moe` with the experts split
over one mesh axis and the tokens over another.

Each device holds E/n experts (a slice of the stacked arrays).  Two ways to
bring tokens and experts together (``dispatch``):

* ``"psum"`` (default): tokens are split over the data axis only (replicated
  over the expert axis).  Each device runs the op on its tokens with the ids
  shifted by its first expert's global index; slots whose expert lives on
  another device fall outside ``[0, E/n)`` and are skipped
  (``fused_moe(..., ids_outside="skip")``: no work, no error).  The partial
  outputs are summed over the expert axis (``psum``).
* ``"all_to_all"``: tokens are split over both axes.  Each device packs its
  slots into one send buffer per expert-axis destination (the device holding
  the slot's expert), ``all_to_all`` sends x rows, local ids and routed
  weights there, each device runs the op on what it received (one slot per
  row, k=1), a second ``all_to_all`` brings the weighted outputs back, and
  each token sums its k slots in slot order.

Forward and backward (the op's own custom VJP; ``all_to_all`` and the
gathers are differentiable) run eagerly and under ``jax.jit``, on any mesh:
a classic `jax.sharding.Mesh` (Auto axes) or `jax.make_mesh`'s (Explicit
axes), inside ``jax.set_mesh`` or not, in one process or in several (JAX's
multi-controller runtime: ``jax.distributed.initialize`` in every process,
one mesh over every process's devices, global arrays in and out).
"""
from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .activations import Activation
from .expert_store import store_of
from .experts import Experts
from .ops import fused_moe
from .quantization import is_quantized, quant_format
from .validation import narrow_ids

__all__ = ["sharded_moe"]


def sharded_moe(x: jax.Array, topk_weights: jax.Array, topk_ids: jax.Array, experts: Experts,
                mesh: Mesh, *, expert_axis: str = "expert", data_axis: str | None = "data",
                activation: Literal["swiglu", "geglu", "geglu_erf", "swiglu_clamped"] | Activation = "swiglu",
                implementation: Literal["ffi", "xla"] | None = None,
                dispatch: Literal["psum", "all_to_all"] = "psum",
                capacity_factor: float | None = None,
                ids_outside: Literal["error", "skip"] = "error") -> jax.Array:
    """`fused_moe` with experts sharded over ``expert_axis`` and tokens over ``data_axis``.

    Args:
      x: ``[T, H]``; T divisible by the size of ``data_axis`` (``"psum"``) or
        by the sizes of ``data_axis`` and ``expert_axis`` together
        (``"all_to_all"``).
      topk_weights, topk_ids: ``[T, k]`` (global expert ids in ``[0, E)``).
      experts: stacked `Experts` (``gate/up [E, H, I]``, ``down [E, I, H]``); E
        divisible by the size of ``expert_axis``.
      mesh: a `jax.sharding.Mesh` with those axes (``data_axis=None``: tokens
        not split over data): a classic ``Mesh(devices, names)`` (Auto
        axes) or `jax.make_mesh`'s (Explicit axes), over one process's
        devices or every process's (then pass global arrays, e.g. from
        ``jax.make_array_from_callback``, or the same host arrays in every
        process).  Inputs laid out otherwise (or not at all) are moved to
        the layouts below first (``jax.device_put``; their gradients come
        back in the inputs' layouts).
      activation, implementation: as in `fused_moe`.
      dispatch: how tokens meet their experts (n = size of ``expert_axis``,
        d = size of ``data_axis``, S = T·k/(d·n) slots per device):

        * ``"psum"``: tokens split over ``data_axis`` and replicated over
          ``expert_axis`` (each device holds T/d rows of x); every device
          runs its T/d tokens against its experts, skipping the other
          experts' slots, and the partial outputs ``[T/d, H]`` (float32) are
          all-reduced over ``expert_axis``.  Moves ~2·(n-1)/n · T/d · H · 4
          bytes per device.  Result ``[T, H]`` sharded over ``data_axis``.
        * ``"all_to_all"``: tokens split over ``(data_axis, expert_axis)``
          (each device holds T/(d·n) rows of x).  Each device sends, to each
          of the n devices of its expert axis, a buffer of C slots (x row,
          local expert id, routed weight): ``n·C`` rows of ``x.dtype`` out and
          the same back (the weighted outputs).  With the default C = S every
          slot fits whatever the routing (all slots to one device's experts
          included): nothing is dropped and the result is exact, but the
          buffers hold n·S = T·k/d rows, k times the rows the ``psum``
          reduces (most of them padding, which costs no expert work: padding
          carries an id outside the local range and weight 0 and is skipped).
          Result ``[T, H]`` sharded over ``(data_axis, expert_axis)``.
      capacity_factor: ``"all_to_all"`` only.  ``None`` (default): C = S,
        exact.  A number c > 0: C = min(S, ceil(c·S/n)) slots per
        (source, destination) pair, n·C ≈ c·S rows moved each way; the slots
        a device sends to one destination beyond the first C (in slot order:
        token, then its k slots) are dropped, i.e. contribute zero, as if
        their routed weight were 0 (their weight's gradient is 0 too).
      ids_outside: what a global id outside ``[0, E)`` means, as in
        `fused_moe`: ``"error"`` (default; refused on every backend) or ``"skip"`` (the slot contributes nothing, its
        weight's gradient is 0).  With ``"error"`` every device fails
        together at run time (eagerly and under ``jax.jit``: no device is
        left waiting in a collective) with the handler's
        ``INVALID_ARGUMENT`` naming the first such id in token order and its
        position in its device's block of tokens (``topk_ids[r, j]``: row r of
        the T/d rows a device holds for ``"psum"``, of the T/(d·n) for
        ``"all_to_all"``).  The check costs an all-gather of two integers from
        each device (and, on a GPU, reading one flag back to the host).

    Returns ``y [T, H]``: equal to the unsharded op up to the order of the
    float32 sum (over expert shards for ``"psum"``; over a token's k slots,
    each rounded to ``x.dtype`` first, for ``"all_to_all"``).  Inside
    ``jax.set_mesh`` with Explicit axes its type carries that sharding;
    otherwise it is laid out on ``mesh`` with Auto axes (outside a mesh
    context Explicit axes are used as Auto: JAX cannot differentiate arrays
    typed by a mesh that no context sets).  Eager calls run one jitted
    program per configuration, compiled once per shapes and layouts.
    """
    if ids_outside not in ("error", "skip"):
        raise ValueError(f"ids_outside must be 'error' or 'skip'; got {ids_outside!r}")
    if dispatch not in ("psum", "all_to_all"):
        raise ValueError(f"dispatch must be 'psum' or 'all_to_all'; got {dispatch!r}")
    if capacity_factor is not None:
        if dispatch != "all_to_all":
            raise ValueError("capacity_factor applies to dispatch='all_to_all' only")
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 (or None: exact); got {capacity_factor!r}")
    if not isinstance(experts, Experts):
        raise TypeError(f"sharded_moe takes a jax_nbx.Experts; got {type(experts).__name__} (prepacked "
                        "experts run unsharded on the CPU handler: jax_nbx.fused_moe)")
    if store_of(experts):
        raise TypeError("sharded_moe does not take mapped experts (jax_nbx.loaders.map_moe) yet: their "
                        "blocks live in this process's store, not in arrays a mesh can shard; run them "
                        "unsharded (jax_nbx.fused_moe) or load the experts (load_moe)")
    if experts.is_list:
        raise TypeError("sharded_moe takes stacked experts ([E, ...] arrays, sharded on E); "
                        "got per-expert lists")
    if not experts.is_plain:
        raise ValueError("sharded_moe takes plain experts (gate, up [E, H, I], down [E, I, H], no "
                         f"biases); got {experts!r}: checkpoint layouts and biases are not sharded yet")
    if is_quantized(experts):
        raise ValueError(f"sharded_moe takes dense experts; got quantized ones "
                         f"({quant_format(experts)[0]}): "
                         "sharding their codes and scales is not implemented yet (use fused_moe)")
    if x.ndim == 2 and x.shape[0] == 0:
        # No tokens: nothing to dispatch, and all_to_all's per-device blocks of
        # T/(d*n) rows would be reshapes of zero rows (a ZeroDivisionError in
        # jnp.reshape before); psum gives the same empty result.
        dispatch = "psum"
    for ax in (expert_axis, data_axis):
        if ax is not None and ax not in mesh.shape:
            raise ValueError(f"mesh has axes {tuple(mesh.shape)}; no axis {ax!r}")
    n = mesh.shape[expert_axis]
    E = experts.num_experts
    if E % n:
        raise ValueError(f"E={E} experts do not split over {n} devices of mesh axis {expert_axis!r}")
    if x.ndim != 2:
        raise ValueError(f"x must be [T, H]; got shape {x.shape}")
    if not isinstance(topk_ids, (jax.Array, jax.core.Tracer)):
        topk_ids = np.asarray(topk_ids)
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise TypeError(f"topk_ids has dtype {topk_ids.dtype}; expected an integer dtype")
    topk_ids = narrow_ids(topk_ids, E)  # numpy stays numpy: device_put lays it out on any mesh
    # as in fused_moe: ids outside [0, E) are refused on every backend
    check_ids = ids_outside == "error"
    d = mesh.shape[data_axis] if data_axis is not None else 1
    T = x.shape[0]
    if dispatch == "psum":
        if T % d:
            raise ValueError(f"T={T} tokens do not split over {d} devices of mesh axis {data_axis!r}")
        tok = P(data_axis, None)
    else:
        if T % (d * n):
            raise ValueError(f"T={T} tokens do not split over the {d}x{n} devices of mesh axes "
                             f"({data_axis!r}, {expert_axis!r}) (dispatch='all_to_all')")
        tok = P((data_axis, expert_axis) if data_axis is not None else expert_axis, None)
    ex_spec = Experts(P(expert_axis, None, None), P(expert_axis, None, None), P(expert_axis, None, None))
    mesh = _mesh_for_context(mesh)
    f = _sharded(mesh, expert_axis, data_axis, tok, dispatch, activation, implementation,
                 capacity_factor, check_ids)

    # inputs laid out otherwise (or not at all) are moved to the specs first:
    # device_put, which under a mesh of Explicit axes changes the arrays' types
    # as jax.reshard does, lays out Auto axes as well, and whose transpose
    # gives each cotangent its input's layout
    def place(a, spec):
        return jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))

    args = (place(x, tok), place(topk_weights, tok), place(topk_ids, tok),
            Experts(*(place(a, sp) for a, sp in zip((experts.gate, experts.up, experts.down),
                                                    (ex_spec.gate, ex_spec.up, ex_spec.down)))))
    return f(*args)


@functools.lru_cache(maxsize=64)
def _sharded(mesh: Mesh, expert_axis: str, data_axis: str | None, tok: P, dispatch: str,
             activation: str, implementation: str | None, capacity_factor: float | None,
             check_ids: bool):
    """The jitted shard_map of one configuration (kept: eager calls of the same
    configuration reuse its compilations; under an outer jit it is inlined)."""
    n = mesh.shape[expert_axis]
    ex_spec = Experts(P(expert_axis, None, None), P(expert_axis, None, None), P(expert_axis, None, None))

    all_axes = (expert_axis,) if data_axis is None else (data_axis, expert_axis)
    tok_axes = tuple(a for a in (tok[0] if isinstance(tok[0], tuple) else (tok[0],)) if a is not None)
    blocks = math.prod(mesh.shape[a] for a in tok_axes)   # token blocks (of t rows each)

    def checked(ids, E):
        """``ids`` once every one is found in ``[0, E)``; else every device fails
        together (none is left waiting in a collective for one that failed),
        naming the first bad id (in token order) and its place in its
        device's block of tokens.  The devices share their first bad slot (a
        small all_gather); only when there is one, each runs a fused_moe call
        with ``ids_outside="error"`` on a block holding that id (zero inputs,
        E experts of size 1x1) and the backend refuses it.  The ids depend on
        that branch, so that no compiler drops the check."""
        t, kk = ids.shape
        if t * kk == 0:
            return ids
        none = blocks * t * kk
        block = jax.lax.axis_index(tok_axes) if tok_axes else 0
        flat = block * (t * kk) + jnp.arange(t * kk, dtype=jnp.int32).reshape(t, kk)
        bad = (ids < 0) | (ids >= E)
        first = jnp.min(jnp.where(bad, flat, none), initial=none)
        lowest = jnp.iinfo(jnp.int32).min
        value = jnp.max(jnp.where(flat == first, ids, lowest), initial=lowest)
        pairs = jax.lax.all_gather(jnp.stack([first, value]), all_axes).reshape(-1, 2)
        first, value = pairs[jnp.argmin(pairs[:, 0])]

        def refuse(ids):
            one = jnp.zeros((t, kk), jnp.int32).at[(first // kk) % t, first % kk].set(value)
            probe = Experts(*(jnp.zeros((E, 1, 1), jnp.float32),) * 3)
            y = fused_moe(jnp.zeros((t, 1), jnp.float32), jnp.zeros((t, kk), jnp.float32), one, probe)
            return jnp.where(jnp.all(y == 0), ids, -1)

        return jax.lax.cond(first < none, refuse, lambda ids: ids, ids)

    def local_psum(x, w, ids, ex):
        e_local = ex.num_experts
        if check_ids:
            ids = checked(ids, e_local * n)
        e0 = jax.lax.axis_index(expert_axis) * e_local
        y = fused_moe(x, w, ids - e0.astype(ids.dtype), ex, activation=activation,
                      implementation=implementation, ids_outside="skip")
        return jax.lax.psum(y.astype(jnp.float32), expert_axis).astype(x.dtype)

    def local_all_to_all(x, w, ids, ex):
        e_local = ex.num_experts
        E = e_local * n
        if check_ids:
            ids = checked(ids, E)
        t, k = ids.shape
        S = t * k
        C = S if capacity_factor is None else max(1, min(S, math.ceil(capacity_factor * S / n)))
        ids = ids.reshape(S).astype(jnp.int32)
        w = w.reshape(S)
        valid = (ids >= 0) & (ids < E)     # ids outside [0, E) (when not refused): skipped
        dest = jnp.where(valid, ids // e_local, 0)             # expert-axis index holding the expert
        onehot = ((dest[:, None] == jnp.arange(n, dtype=jnp.int32)[None, :]) & valid[:, None])
        pos = jnp.take_along_axis(jnp.cumsum(onehot.astype(jnp.int32), axis=0), dest[:, None],
                                  axis=1)[:, 0] - 1
        keep = valid & (pos < C)                               # pos < C always when C = S
        # slot filling (dest, pos) of the send buffers; empty places hold S (a padding slot)
        src = jnp.full((n, C), S, jnp.int32).at[dest, jnp.where(keep, pos, C)].set(
            jnp.arange(S, dtype=jnp.int32), mode="drop")
        pad = src == S
        send_x = jnp.take(x, jnp.minimum(src // k, t - 1), axis=0)              # [n, C, H]
        send_x = jnp.where(pad[..., None], jnp.zeros((), x.dtype), send_x)
        send_w = jnp.where(pad, jnp.zeros((), w.dtype), jnp.take(w, jnp.minimum(src, S - 1)))
        send_id = jnp.where(pad, e_local, jnp.take(ids - dest * e_local, jnp.minimum(src, S - 1)))
        def a2a(a):
            return jax.lax.all_to_all(a, expert_axis, 0, 0, tiled=True)

        recv_x, recv_w, recv_id = a2a(send_x), a2a(send_w), a2a(send_id)      # [n, C, ...] by source
        out = fused_moe(recv_x.reshape(n * C, -1), recv_w.reshape(n * C, 1),
                        recv_id.reshape(n * C, 1), ex, activation=activation,
                        implementation=implementation, ids_outside="skip")
        back = a2a(out.reshape(n, C, -1))                                     # [n, C, H] by destination
        per_slot = back[dest, jnp.clip(pos, 0, C - 1)]                        # [S, H]
        per_slot = jnp.where(keep[:, None], per_slot.astype(jnp.float32), 0.0)
        return per_slot.reshape(t, k, -1).sum(axis=1).astype(x.dtype)

    local = local_psum if dispatch == "psum" else local_all_to_all
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, ex_spec), out_specs=tok,
                                 check_vma=False))


def _mesh_for_context(mesh: Mesh) -> Mesh:
    """``mesh`` as shard_map should see it here.  Outside any mesh context
    (``jax.set_mesh``) the mesh's Explicit axes become Auto: arrays typed by
    an Explicit mesh that no context sets cannot be differentiated (JAX asks
    for ``jax.set_mesh``), so the result is laid out, not typed, as with a
    classic `jax.sharding.Mesh`.  Inside a context the mesh is used as given."""
    AxisType = jax.sharding.AxisType
    if not jax.sharding.get_abstract_mesh().empty or AxisType.Explicit not in mesh.axis_types:
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))

