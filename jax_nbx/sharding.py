"""Expert parallelism: `sharded_moe` runs `fused_moe` with the experts split
over one mesh axis and the tokens over another.

Each device holds E/n experts (a slice of the stacked arrays) and its share of
the tokens.  It runs the op on its tokens with the ids shifted by its first
expert's global index; slots whose expert lives on another device fall
outside ``[0, E/n)`` and are skipped (``fused_moe(..., ids_outside="skip")``:
no work, no error).  The partial outputs are summed over the expert axis
(``psum``).  Forward and backward (the op's own custom VJP) run under
``jax.jit`` with ``NamedSharding`` inputs.
"""
from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from .experts import Experts
from .ops import fused_moe

__all__ = ["sharded_moe"]


def sharded_moe(x: jax.Array, topk_weights: jax.Array, topk_ids: jax.Array, experts: Experts,
                mesh: Mesh, *, expert_axis: str = "expert", data_axis: str | None = "data",
                activation: Literal["swiglu", "geglu"] = "swiglu",
                implementation: Literal["ffi", "xla"] | None = None) -> jax.Array:
    """`fused_moe` with experts sharded over ``expert_axis`` and tokens over ``data_axis``.

    Args:
      x: ``[T, H]``; T divisible by the size of ``data_axis``.
      topk_weights, topk_ids: ``[T, k]`` (global expert ids in ``[0, E)``).
      experts: stacked `Experts` (``gate/up [E, H, I]``, ``down [E, I, H]``); E
        divisible by the size of ``expert_axis``.
      mesh: a `jax.sharding.Mesh` with those axes (``data_axis=None``: tokens
        replicated).
      activation, implementation: as in `fused_moe`.

    Returns ``y [T, H]`` sharded over ``data_axis``: equal to the unsharded op
    up to the order of the float32 sum over expert shards.  With a mesh of
    explicit axes (`jax.make_mesh`'s default), reduce or differentiate the
    result under ``jax.jit`` inside ``with jax.set_mesh(mesh):``.
    """
    if experts.is_list:
        raise TypeError("sharded_moe takes stacked experts ([E, ...] arrays, sharded on E); "
                        "got per-expert lists")
    for ax in (expert_axis, data_axis):
        if ax is not None and ax not in mesh.shape:
            raise ValueError(f"mesh has axes {tuple(mesh.shape)}; no axis {ax!r}")
    n = mesh.shape[expert_axis]
    E = experts.num_experts
    if E % n:
        raise ValueError(f"E={E} experts do not split over {n} devices of mesh axis {expert_axis!r}")
    if x.ndim != 2:
        raise ValueError(f"x must be [T, H]; got shape {x.shape}")
    d = mesh.shape[data_axis] if data_axis is not None else 1
    if x.shape[0] % d:
        raise ValueError(f"T={x.shape[0]} tokens do not split over {d} devices of mesh axis {data_axis!r}")
    e_local = E // n
    tok = P(data_axis, None)
    ex_spec = Experts(P(expert_axis, None, None), P(expert_axis, None, None), P(expert_axis, None, None))

    def local(x, w, ids, ex):
        e0 = jax.lax.axis_index(expert_axis) * e_local
        y = fused_moe(x, w, ids - e0.astype(ids.dtype), ex, activation=activation,
                      implementation=implementation, ids_outside="skip")
        return jax.lax.psum(y.astype(jnp.float32), expert_axis).astype(x.dtype)

    f = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, ex_spec), out_specs=tok,
                      check_vma=False)
    # inputs laid out otherwise (or not at all) are resharded to the specs first
    def place(a, spec):
        return jax.reshard(a, jax.sharding.NamedSharding(mesh, spec))

    args = (place(x, tok), place(topk_weights, tok), place(topk_ids, tok),
            Experts(*(place(a, sp) for a, sp in zip((experts.gate, experts.up, experts.down),
                                                    (ex_spec.gate, ex_spec.up, ex_spec.down)))))
    return f(*args)
