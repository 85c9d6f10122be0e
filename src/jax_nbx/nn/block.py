"""The MoE block as a function of its parameters: the router, the routed
experts (one `fused_moe` call, shared experts included), and the router
losses.  The Flax NNX and Equinox layers (`jax_nbx.nn.nnx_moe`,
`jax_nbx.nn.eqx_moe`) hold the parameters and call `moe_block`; the
checkpoint loader (`jax_nbx.loaders`) returns `MoEParams`.

Neither Flax nor Equinox is imported here.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..activations import Activation, as_activation
from ..experts import FUSIONS, LAYOUTS, Experts, SharedExperts
from ..ops import fused_moe
from ..routing import (
    expert_counts,
    load_balancing_loss,
    route,
    route_sigmoid,
    route_topk_sigmoid,
    route_topk_softmax,
    router_z_loss,
)

__all__ = ["MoEConfig", "MoEParams", "RouterAux", "ROUTINGS", "init_params", "moe_block", "partition_specs",
           "read_hf_config"]

ROUTINGS = ("softmax", "softmax_topk", "sigmoid", "topk_sigmoid")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The shape and rules of one MoE block (hashable: a static argument).

    Args:
      hidden_size: H.  intermediate_size: I of each routed expert.
      num_experts: E.  top_k: k experts per token.
      routing: ``"softmax"`` (softmax, top-k, optional renormalization:
        Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2; `jax_nbx.route`),
        ``"softmax_topk"`` (top-k of the logits, softmax over the k: Granite,
        gpt-oss; `jax_nbx.route_topk_softmax`), ``"sigmoid"`` (DeepSeek-V3:
        `jax_nbx.route_sigmoid`, with ``correction_bias``) or
        ``"topk_sigmoid"`` (Llama-4: `jax_nbx.route_topk_sigmoid`).
      norm_topk_prob: renormalize the k weights ("softmax", "sigmoid").
      routed_scaling_factor, n_group, topk_group: as in `jax_nbx.route` /
        `jax_nbx.route_sigmoid` (group-limited top-k).
      router_bias: the router has a bias (gpt-oss).
      correction_bias: DeepSeek-V3's ``e_score_correction_bias`` (a buffer,
        not trained by gradient).
      expert_bias: the experts' projections have biases (gpt-oss).
      fusion: the layout of experts the layer *creates*: ``None`` (separate
        gate and up) or ``"concat"``/``"interleaved"`` (`Experts.fused`).
      layout: ``"out_in"`` (``nn.Linear``'s, the default: Hugging Face
        checkpoints) or ``"in_out"``; for created experts (loaded ones keep
        the checkpoint's).
      activation: the gated unit (`jax_nbx.activations`).
      shared_intermediate_size: width of the always-on shared expert (0:
        none; DeepSeek's ``n_shared_experts * moe_intermediate_size``,
        Qwen2-MoE's ``shared_expert_intermediate_size``).
      shared_gate: Qwen2-MoE's sigmoid ``shared_expert_gate``.
      weights_on: ``"output"`` or ``"input"`` (Llama-4), as in `fused_moe`.
      initializer_range: std of the normal initialization of every weight
        (transformers' ``_init_weights``: ``normal(0, initializer_range)``,
        biases zero).
      implementation, max_workspace_bytes: passed to `fused_moe`.
      mesh, expert_axis, data_axis, dispatch: with a ``mesh``, the routed
        experts run through `jax_nbx.sharded_moe` (stacked plain experts,
        E sharded over ``expert_axis``; see `partition_specs`).
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    routing: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    router_bias: bool = False
    correction_bias: bool = False
    expert_bias: bool = False
    fusion: str | None = None
    layout: str = "out_in"
    activation: str | Activation = "swiglu"
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    weights_on: str = "output"
    initializer_range: float = 0.02
    implementation: str | None = None
    max_workspace_bytes: int | str | None = None
    mesh: Any = None
    expert_axis: str = "expert"
    data_axis: str | None = "data"
    dispatch: str = "psum"

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MoEConfig.{name} must be a positive integer; got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"MoEConfig.routing must be one of {ROUTINGS}; got {self.routing!r}")
        if self.fusion is not None and self.fusion not in FUSIONS:
            raise ValueError(f"MoEConfig.fusion must be None or one of {FUSIONS}; got {self.fusion!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"MoEConfig.layout must be one of {LAYOUTS}; got {self.layout!r}")
        if self.weights_on not in ("output", "input"):
            raise ValueError(f"MoEConfig.weights_on must be 'output' or 'input'; got {self.weights_on!r}")
        if self.shared_intermediate_size < 0:
            raise ValueError(f"MoEConfig.shared_intermediate_size must be >= 0; got {self.shared_intermediate_size}")
        if self.shared_gate and not self.shared_intermediate_size:
            raise ValueError("MoEConfig.shared_gate needs a shared expert (shared_intermediate_size > 0)")
        if self.correction_bias and self.routing != "sigmoid":
            raise ValueError(f"MoEConfig.correction_bias is DeepSeek-V3's, for routing='sigmoid'; "
                             f"got routing={self.routing!r}")
        as_activation(self.activation)  # raises naming an unknown activation

    @classmethod
    def from_hf(cls, config: dict | str | os.PathLike, **overrides) -> MoEConfig:
        """The block of a Hugging Face ``config.json`` (a dict, the file, or
        its folder): Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite-MoE,
        DeepSeek-V2/V3, gpt-oss (read from transformers 5.24.0's
        ``configuration_*.py``); ``overrides`` replace fields (e.g.
        ``implementation=``)."""
        config = read_hf_config(config)
        c = config.get("text_config", config)
        mt = c.get("model_type", "")
        g = c.get
        kw: dict[str, Any] = dict(hidden_size=g("hidden_size"), top_k=g("num_experts_per_tok"),
                                  initializer_range=g("initializer_range", 0.02))
        if mt == "mixtral":
            kw.update(intermediate_size=g("intermediate_size"), num_experts=g("num_local_experts"))
        elif mt in ("qwen3_moe", "qwen2_moe", "olmoe"):
            kw.update(intermediate_size=g("moe_intermediate_size", g("intermediate_size")),
                      num_experts=g("num_experts"), norm_topk_prob=bool(g("norm_topk_prob", mt != "olmoe")))
            if mt == "qwen2_moe" and g("shared_expert_intermediate_size"):
                kw.update(shared_intermediate_size=g("shared_expert_intermediate_size"), shared_gate=True)
        elif mt in ("deepseek_v2", "deepseek_v3"):
            kw.update(intermediate_size=g("moe_intermediate_size"), num_experts=g("n_routed_experts"),
                      routed_scaling_factor=float(g("routed_scaling_factor", 1.0)),
                      shared_intermediate_size=(g("n_shared_experts") or 0) * g("moe_intermediate_size"))
            if mt == "deepseek_v3":
                kw.update(routing="sigmoid", correction_bias=True, norm_topk_prob=bool(g("norm_topk_prob", True)),
                          n_group=g("n_group", 1) or 1, topk_group=g("topk_group", 1) or 1)
            else:  # transformers' DeepSeek-V2 does not renormalize (jax_nbx.route's docstring)
                kw.update(norm_topk_prob=False)
                if g("topk_method") == "group_limited_greedy":
                    kw.update(n_group=g("n_group", 1), topk_group=g("topk_group", 1))
        elif mt == "granitemoe":
            kw.update(intermediate_size=g("intermediate_size"), num_experts=g("num_local_experts"),
                      routing="softmax_topk", fusion="concat")
        elif mt == "gpt_oss":
            kw.update(intermediate_size=g("intermediate_size"), num_experts=g("num_local_experts"),
                      routing="softmax_topk", router_bias=True, expert_bias=True, fusion="interleaved",
                      layout="in_out",
                      activation=Activation("swiglu_clamped", alpha=1.702, limit=float(g("swiglu_limit", 7.0))))
        else:
            raise ValueError(f"MoEConfig.from_hf: model_type {mt!r} is not one of mixtral, qwen2_moe, qwen3_moe, "
                             "olmoe, deepseek_v2, deepseek_v3, granitemoe, gpt_oss; build MoEConfig directly")
        kw.update(overrides)
        return cls(**kw)


class MoEParams(NamedTuple):
    """The parameters of one MoE block (a pytree).

    router: ``[E, H]`` (``nn.Linear`` layout: logits = ``x @ router.T``).
    experts: `Experts` (any layout, stacked or lists, dense or quantized).
    router_bias: ``[E]`` or None.  correction_bias: ``[E]`` or None (a
    buffer: `moe_block` stops its gradient).  shared: `SharedExperts` or None.
    """

    router: Any
    experts: Experts
    router_bias: Any = None
    correction_bias: Any = None
    shared: SharedExperts | None = None


class RouterAux(NamedTuple):
    """The block's auxiliary outputs (float32 scalars and ``[E]`` counts):
    the load-balancing loss (`jax_nbx.load_balancing_loss`), the router
    z-loss (`jax_nbx.router_z_loss`) and the slots routed to each expert."""

    load_balancing_loss: jax.Array
    router_z_loss: jax.Array
    expert_counts: jax.Array


def read_hf_config(config: dict | str | os.PathLike) -> dict:
    """A Hugging Face ``config.json`` as a dict: given as one, as the file, or as its folder."""
    if isinstance(config, dict):
        return config
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return json.load(f)


def _normal(key, shape, std, dtype):
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


def _init_experts(key, n: int, H: int, I: int, config: MoEConfig, dtype, lists: bool, bias: bool) -> Experts:
    std = config.initializer_range
    kg, ku, kd = jax.random.split(key, 3)
    out_in = config.layout == "out_in"

    def mat(k, rows, cols):  # one projection [rows (in), cols (out)] stored per layout
        shape = (cols, rows) if out_in else (rows, cols)
        if lists:
            return [_normal(kk, shape, std, dtype) for kk in jax.random.split(k, n)]
        return _normal(k, (n,) + shape, std, dtype)

    def zeros(m):
        return [jnp.zeros((m,), jnp.float32) for _ in range(n)] if lists else jnp.zeros((n, m), jnp.float32)

    down = mat(kd, I, H)
    if config.fusion is None:
        b = dict(gate_bias=zeros(I), up_bias=zeros(I), down_bias=zeros(H)) if bias else {}
        return Experts(mat(kg, H, I), mat(ku, H, I), down, layout=config.layout, **b)
    b = dict(gate_up_bias=zeros(2 * I), down_bias=zeros(H)) if bias else {}
    return Experts.fused(mat(kg, H, 2 * I), down, fusion=config.fusion, layout=config.layout, **b)


def init_params(config: MoEConfig, key: jax.Array, dtype=jnp.float32, *, lists: bool = False) -> MoEParams:
    """Fresh parameters: every weight ``normal(0, initializer_range)`` in
    ``dtype``, biases zero (float32), as transformers' ``_init_weights``.
    ``lists``: the routed experts as per-expert lists (else stacked)."""
    E, H, I = config.num_experts, config.hidden_size, config.intermediate_size
    kr, ke, ks, kg = jax.random.split(key, 4)
    router = _normal(kr, (E, H), config.initializer_range, dtype)
    experts = _init_experts(ke, E, H, I, config, dtype, lists, config.expert_bias)
    shared = None
    if config.shared_intermediate_size:
        sconf = dataclasses.replace(config, fusion=None)
        sh = _init_experts(ks, 1, H, config.shared_intermediate_size, sconf, dtype, False, False)
        gate = _normal(kg, (1, H), config.initializer_range, dtype) if config.shared_gate else None
        shared = SharedExperts(sh, gate)
    return MoEParams(router, experts,
                     router_bias=jnp.zeros((E,), jnp.float32) if config.router_bias else None,
                     correction_bias=jnp.zeros((E,), jnp.float32) if config.correction_bias else None,
                     shared=shared)


def _route(config: MoEConfig, logits: jax.Array, correction_bias):
    k = config.top_k
    if config.routing == "softmax":
        return route(logits, k, normalize=config.norm_topk_prob, n_group=config.n_group,
                     topk_group=config.topk_group, routed_scaling_factor=config.routed_scaling_factor,
                     return_probs=True)
    if config.routing == "softmax_topk":
        return route_topk_softmax(logits, k, return_probs=True)
    if config.routing == "sigmoid":
        cb = None if correction_bias is None else jax.lax.stop_gradient(correction_bias)
        return route_sigmoid(logits, k, correction_bias=cb, n_group=config.n_group, topk_group=config.topk_group,
                             normalize=config.norm_topk_prob, routed_scaling_factor=config.routed_scaling_factor,
                             return_probs=True)
    return route_topk_sigmoid(logits, k, return_probs=True)


def moe_block(params: MoEParams, x: jax.Array, config: MoEConfig, *,
              mask: jax.Array | None = None) -> tuple[jax.Array, RouterAux]:
    """``(y, aux)`` of one MoE block on ``x [..., H]``: router logits
    (float32), routing by ``config.routing``, then one `fused_moe` call
    (shared experts in the same call) or, with ``config.mesh``,
    `jax_nbx.sharded_moe` plus the shared experts.

    ``mask`` (``x.shape[:-1]``, 1 = real token) keeps padding out of the
    router losses; padded tokens are still computed (their rows are the
    caller's to ignore)."""
    H = config.hidden_size
    if x.shape[-1:] != (H,):
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [..., hidden_size={H}]")
    E = config.num_experts
    if tuple(params.router.shape) != (E, H):
        raise ValueError(f"params.router has shape {tuple(params.router.shape)}; expected (num_experts={E}, "
                         f"hidden_size={H}) (nn.Linear layout)")
    logits = jnp.einsum("...h,eh->...e", x.astype(jnp.float32), params.router.astype(jnp.float32))
    if params.router_bias is not None:
        logits = logits + params.router_bias.astype(jnp.float32).reshape((1,) * (logits.ndim - 1) + (E,))
    w, ids, probs = _route(config, logits, params.correction_bias)
    kw = dict(activation=config.activation, implementation=config.implementation)
    if config.mesh is None:
        y = fused_moe(x, w, ids, params.experts, weights_on=config.weights_on, shared_experts=params.shared,
                      max_workspace_bytes=config.max_workspace_bytes, **kw)
    else:
        from ..sharding import sharded_moe
        if config.weights_on != "output":
            raise ValueError("MoEConfig.mesh: sharded_moe takes weights_on='output' only")
        lead = x.shape[:-1]
        x2, w2, ids2 = x.reshape(-1, H), w.reshape(-1, w.shape[-1]), ids.reshape(-1, ids.shape[-1])
        y = sharded_moe(x2, w2, ids2, params.experts, config.mesh, expert_axis=config.expert_axis,
                        data_axis=config.data_axis, dispatch=config.dispatch, **kw).reshape(lead + (H,))
        if params.shared is not None:  # the shared experts alone: weight 1 on each of the S experts
            S = params.shared.experts.num_experts
            ones = jnp.ones(lead + (S,), jnp.float32)
            sid = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), lead + (S,))
            ys = fused_moe(x, ones, sid, params.shared.experts, **kw)
            if params.shared.gate is not None:
                gate = params.shared.gate.reshape(1, H).astype(jnp.float32)
                ys = (ys.astype(jnp.float32) * jax.nn.sigmoid(x.astype(jnp.float32) @ gate.T)).astype(x.dtype)
            y = y + ys
    aux = RouterAux(load_balancing_loss(probs, ids, mask=mask), router_z_loss(logits, mask=mask),
                    expert_counts(ids, E, mask=mask))
    return y, aux


def partition_specs(params: MoEParams, config: MoEConfig) -> MoEParams:
    """A pytree of `jax.sharding.PartitionSpec` like ``params``: the routed
    experts' leading E axis over ``config.expert_axis`` (what
    `jax_nbx.sharded_moe` expects), everything else replicated.  Stacked
    experts only (per-expert lists cannot be split over devices as one axis)."""
    P = jax.sharding.PartitionSpec
    if params.experts.is_list:
        raise ValueError("partition_specs: per-expert lists cannot be sharded over an expert axis; stack them")
    ex = jax.tree.map(lambda a: P(config.expert_axis, *([None] * (a.ndim - 1))), params.experts)
    rep = jax.tree.map(lambda a: P(), params._replace(experts=None))
    return rep._replace(experts=ex)
