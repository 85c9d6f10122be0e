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

from .. import checkpoint_files as files
from ..activations import Activation, as_activation
from ..experts import FUSIONS, LAYOUTS, Experts, SharedExperts
from ..lora import PROJECTIONS, LoRA
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

__all__ = ["MoEConfig", "MoEParams", "RouterAux", "ROUTINGS", "HF_DEFAULTS", "init_params", "init_lora", "moe_block",
           "partition_specs", "read_hf_config"]

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
        its folder; a ``text_config`` inside is read instead): Mixtral,
        Qwen2-MoE, Qwen3-MoE, OLMoE, Granite-MoE, DeepSeek-V2/V3, gpt-oss,
        Llama-4 (``llama4_text``), as transformers 5.24.0's
        ``configuration_*.py`` and ``modeling_*.py`` define them.

        A key the file leaves out takes its config class's default (what
        transformers fills in; `HF_DEFAULTS`), and the other names of its
        class's ``attribute_map`` are read too (transformers 5.24 writes
        Qwen3-MoE's expert count as ``num_local_experts``, older files
        ``num_experts``).  ``hidden_act`` picks the gated unit (``silu`` ->
        ``"swiglu"``, ``gelu`` -> ``"geglu_erf"``, the tanh GELUs ->
        ``"geglu"``; gpt-oss's experts ignore it and use ``swiglu_alpha``,
        ``swiglu_limit``).  ``overrides`` replace fields (e.g.
        ``implementation=``).

        Raises `jax_nbx.loaders.CheckpointError` (a ValueError) naming the
        file (when given one) and the key whose value cannot be read (a
        missing count, a string for a number, an activation or
        ``topk_method`` jax_nbx does not have, a ``text_config`` that is not
        an object), the model_type it does not know, or a file that is not a
        JSON object."""
        path = None if isinstance(config, dict) else hf_config_path(config)
        where = f"MoEConfig.from_hf: {path or 'config.json'}"
        config = read_hf_config(config)
        c = files.config_value(config, "text_config", where, "dict", None, nullable=True) or config
        mt = files.config_value(c, "model_type", where, "str", "")
        if mt not in HF_DEFAULTS:
            raise files.CheckpointError(f"MoEConfig.from_hf: {path + ': ' if path else ''}model_type {mt!r} is not "
                                        f"one of {', '.join(HF_DEFAULTS)}; build MoEConfig directly")
        r = _HFReader(c, mt, f"{where} ({mt})" if path else f"MoEConfig.from_hf: {mt} config.json")
        kw: dict[str, Any] = dict(hidden_size=r.int("hidden_size"), top_k=r.int("num_experts_per_tok"),
                                  initializer_range=r.float("initializer_range"))
        if mt != "gpt_oss":  # GptOssExperts' gate ignores hidden_act
            kw.update(activation=r.activation())
        if mt in ("mixtral", "granitemoe", "gpt_oss", "llama4_text"):
            kw.update(intermediate_size=r.int("intermediate_size"), num_experts=r.int("num_local_experts"))
        if mt in ("qwen3_moe", "qwen2_moe"):
            kw.update(intermediate_size=r.int("moe_intermediate_size"), num_experts=r.int("num_local_experts")
                      if mt == "qwen3_moe" else r.int("num_experts"), norm_topk_prob=r.bool("norm_topk_prob"))
            if mt == "qwen2_moe":
                shared = r.int("shared_expert_intermediate_size", allow_zero=True)
                kw.update(shared_intermediate_size=shared, shared_gate=shared > 0)
        elif mt == "olmoe":
            kw.update(intermediate_size=r.int("intermediate_size"), num_experts=r.int("num_experts"),
                      norm_topk_prob=r.bool("norm_topk_prob"))
        elif mt in ("deepseek_v2", "deepseek_v3"):
            I = r.int("moe_intermediate_size")
            kw.update(intermediate_size=I, num_experts=r.int("n_routed_experts"),
                      routed_scaling_factor=r.float("routed_scaling_factor"),
                      shared_intermediate_size=r.int("n_shared_experts", allow_zero=True) * I)
            if mt == "deepseek_v3":
                kw.update(routing="sigmoid", correction_bias=True, norm_topk_prob=r.bool("norm_topk_prob"),
                          n_group=r.int("n_group"), topk_group=r.int("topk_group"))
            else:  # DeepseekV2TopkRouter never renormalizes (norm_topk_prob is not read by the model)
                kw.update(norm_topk_prob=False)
                method = r.get("topk_method")
                if method == "group_limited_greedy":
                    kw.update(n_group=r.int("n_group"), topk_group=r.int("topk_group"))
                elif method != "greedy":
                    r.fail("topk_method", method, "one DeepseekV2TopkRouter takes ('greedy', 'group_limited_greedy')")
        elif mt == "granitemoe":
            kw.update(routing="softmax_topk", fusion="concat")
        elif mt == "gpt_oss":
            kw.update(routing="softmax_topk", router_bias=True, expert_bias=True, fusion="interleaved",
                      layout="in_out", activation=Activation("swiglu_clamped", alpha=r.float("swiglu_alpha"),
                                                             limit=r.float("swiglu_limit")))
        elif mt == "llama4_text":  # Llama4TextMoe: a shared expert of the routed experts' width
            kw.update(routing="topk_sigmoid", weights_on="input", fusion="concat", layout="in_out",
                      shared_intermediate_size=kw["intermediate_size"])
        kw.update(overrides)
        try:
            return cls(**kw)
        except ValueError as err:
            raise files.CheckpointError(f"{r.where}: {err}") from err


# transformers 5.24.0's config classes (models/<family>/configuration_<family>.py): the default of
# every key MoEConfig.from_hf reads, as the class fills in a key that a config.json leaves out
# (checked against the classes' own to_json_file in tests/library/test_loader_fixtures.py).
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                    hidden_act="silu", initializer_range=0.02),
    "qwen2_moe": dict(hidden_size=2048, moe_intermediate_size=1408, num_experts=60, num_experts_per_tok=4,
                      norm_topk_prob=False, shared_expert_intermediate_size=5632, hidden_act="silu",
                      initializer_range=0.02),
    "qwen3_moe": dict(hidden_size=2048, moe_intermediate_size=768, num_local_experts=128, num_experts_per_tok=8,
                      norm_topk_prob=False, hidden_act="silu", initializer_range=0.02),
    "olmoe": dict(hidden_size=2048, intermediate_size=2048, num_experts=64, num_experts_per_tok=8,
                  norm_topk_prob=False, hidden_act="silu", initializer_range=0.02),
    "granitemoe": dict(hidden_size=4096, intermediate_size=11008, num_local_experts=8, num_experts_per_tok=2,
                       hidden_act="silu", initializer_range=0.02),
    "deepseek_v2": dict(hidden_size=4096, moe_intermediate_size=1407, n_routed_experts=64, num_experts_per_tok=None,
                        n_shared_experts=2, routed_scaling_factor=1.0, topk_method="greedy", n_group=None,
                        topk_group=None, hidden_act="silu", initializer_range=0.02),
    "deepseek_v3": dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
                        n_shared_experts=1, routed_scaling_factor=2.5, n_group=8, topk_group=4,
                        norm_topk_prob=True, hidden_act="silu", initializer_range=0.02),
    "gpt_oss": dict(hidden_size=2880, intermediate_size=2880, num_local_experts=128, num_experts_per_tok=4,
                    swiglu_alpha=1.702, swiglu_limit=7.0, initializer_range=0.02),
    "llama4_text": dict(hidden_size=5120, intermediate_size=8192, num_local_experts=16, num_experts_per_tok=1,
                        hidden_act="silu", initializer_range=0.02),
}
# Their attribute_map: another name a config.json may give the key (-> the class's attribute).
HF_ALIASES: dict[str, dict[str, str]] = {
    "mixtral": {"num_experts": "num_local_experts"},
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "olmoe": {"num_local_experts": "num_experts"},
    "deepseek_v2": {"num_experts": "n_routed_experts"},
    "deepseek_v3": {"num_local_experts": "n_routed_experts"},
    "gpt_oss": {"num_experts": "num_local_experts"},
}
# hidden_act -> the gated unit: transformers' ACT2FN (activations.py, 5.24.0): silu/swish
# nn.functional.silu; gelu/gelu_python the erf GELU; gelu_pytorch_tanh, gelu_python_tanh,
# gelu_new and gelu_fast the tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
HF_ACTIVATIONS: dict[str, str] = {
    "silu": "swiglu", "swish": "swiglu", "gelu": "geglu_erf", "gelu_python": "geglu_erf",
    "gelu_pytorch_tanh": "geglu", "gelu_python_tanh": "geglu", "gelu_new": "geglu", "gelu_fast": "geglu",
}


class _HFReader:
    """The keys of one family's config.json: its class's default where absent, its attribute_map's
    names read too, each value checked (`jax_nbx.checkpoint_files.check_value`: a CheckpointError
    naming the key; ``where``: the file)."""

    def __init__(self, c: dict, mt: str, where: str):
        self.c, self.mt, self.where = c, mt, where

    def fail(self, key: str, v, what: str):
        raise files.CheckpointError(f"{self.where}: {key}={v!r} is not {what}")

    def get(self, key: str):
        names = [key] + [a for a, k in HF_ALIASES.get(self.mt, {}).items() if k == key]
        present = [n for n in names if n in self.c]
        if len(present) > 1 and len({json.dumps(self.c[n]) for n in present}) > 1:
            raise files.CheckpointError(f"{self.where}: " + " and ".join(f"{n}={self.c[n]!r}" for n in present)
                                           + " disagree (the same attribute of its config class)")
        return self.c[present[0]] if present else HF_DEFAULTS[self.mt][key]

    def int(self, key: str, allow_zero: bool = False) -> int:
        return int(files.check_value(self.get(key), key, self.where, "int", minimum=0 if allow_zero else 1))

    def float(self, key: str) -> float:
        return float(files.check_value(self.get(key), key, self.where, "number"))

    def bool(self, key: str) -> bool:
        return bool(files.check_value(self.get(key), key, self.where, "bool"))

    def activation(self) -> str:
        v = self.get("hidden_act")
        if not isinstance(v, str) or v not in HF_ACTIVATIONS:
            self.fail("hidden_act", v, f"one jax_nbx's gated units compute (transformers' names "
                                       f"{', '.join(HF_ACTIVATIONS)})")
        return HF_ACTIVATIONS[v]


class MoEParams(NamedTuple):
    """The parameters of one MoE block (a pytree).

    router: ``[E, H]`` (``nn.Linear`` layout: logits = ``x @ router.T``).
    experts: `Experts` (any layout, stacked or lists, dense or quantized).
    router_bias: ``[E]`` or None.  correction_bias: ``[E]`` or None (a
    buffer: `moe_block` stops its gradient).  shared: `SharedExperts` or None.
    lora: `jax_nbx.LoRA` adapters on the routed experts or None (`init_lora`).
    """

    router: Any
    experts: Experts
    router_bias: Any = None
    correction_bias: Any = None
    shared: SharedExperts | None = None
    lora: LoRA | None = None


class RouterAux(NamedTuple):
    """The block's auxiliary outputs (float32 scalars and ``[E]`` counts):
    the load-balancing loss (`jax_nbx.load_balancing_loss`), the router
    z-loss (`jax_nbx.router_z_loss`) and the slots routed to each expert."""

    load_balancing_loss: jax.Array
    router_z_loss: jax.Array
    expert_counts: jax.Array


def hf_config_path(config: str | os.PathLike) -> str:
    """The ``config.json`` a path names: the file, or the one in the folder."""
    path = os.fspath(config)
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def read_hf_config(config: dict | str | os.PathLike) -> dict:
    """A Hugging Face ``config.json`` as a dict: given as one, as the file, or as its folder
    (`jax_nbx.checkpoint_files.read_json`: CheckpointError naming the file when it is not a JSON
    object, FileNotFoundError when it is not there)."""
    if isinstance(config, dict):
        return config
    return files.read_json(hf_config_path(config))


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


def init_lora(config: MoEConfig, key: jax.Array, rank: int, *, projections=PROJECTIONS,
              alpha: float | None = None, dtype=jnp.float32, lists: bool = False) -> LoRA:
    """Fresh adapters for the block's routed experts (`jax_nbx.LoRA.init`:
    ``B = 0``, so the block starts equal to its base)."""
    return LoRA.init(key, config.num_experts, config.hidden_size, config.intermediate_size, rank,
                     projections=projections, alpha=alpha, dtype=dtype, lists=lists)


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
                      max_workspace_bytes=config.max_workspace_bytes, lora=params.lora, **kw)
    else:
        from ..sharding import sharded_moe
        if params.lora is not None:
            raise ValueError("MoEConfig.mesh: sharded_moe does not take LoRA adapters yet (params.lora)")
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
