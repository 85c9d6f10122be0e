"""A Qwen3-MoE decoder in Flax NNX whose MoE blocks are `jax_nbx.fused_moe`
calls, with Hugging Face checkpoint I/O and greedy generation with a KV cache.

Written from transformers' ``models/qwen3_moe/modeling_qwen3_moe.py``
(commit 00d4b3d2, the file jax_nbx's routing cites): ``Qwen3MoeRMSNorm``,
``Qwen3MoeAttention`` (q/k/v/o without bias, grouped-query attention,
``q_norm``/``k_norm`` over head_dim per head *before* RoPE,
``rotate_half`` RoPE with ``rope_theta``, causal, scaling
``head_dim**-0.5``), ``Qwen3MoeSparseMoeBlock`` (softmax, top-k,
``norm_topk_prob``; SwiGLU experts), ``Qwen3MoeDecoderLayer`` (pre-norm,
two residuals), ``Qwen3MoeModel`` (embedding, layers, final norm) and
``Qwen3MoeForCausalLM`` (``lm_head``, tied when ``tie_word_embeddings``).
Every layer is sparse (``decoder_sparse_step=1``, no ``mlp_only_layers``),
no sliding window, no RoPE scaling: what the released Qwen3-MoE
checkpoints use; other configs are refused by name.

    from jax_nbx.models import qwen3_moe as q3
    model = q3.Qwen3MoeForCausalLM(q3.Qwen3MoeConfig(), rngs=flax.nnx.Rngs(0))
    q3.save_hf(model, "ckpt")                       # config.json + model.safetensors
    model = q3.load_hf("ckpt")                      # MoE blocks via jax_nbx.loaders.load_moe
    tokens = q3.generate(model, prompt_ids, max_new_tokens=16)

``moe=`` picks the MoE implementation: ``"fused"`` (`jax_nbx.nn.NNXMoE`,
one `jax_nbx.fused_moe` call per block), or the two XLA baselines
``"dense"`` (every expert on every token, weighted by a dense ``[T, E]``
combine matrix) and ``"ragged_dot"`` (slots sorted by expert, three
`jax.lax.ragged_dot`).  The baselines hold a stacked ``[E, H, I]`` copy of
the same experts (`with_moe` makes it once), the routing is the same
`jax_nbx.route`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..checkpoint_files import CheckpointFiles, check_value, config_value
from ..loaders import CheckpointError, load_moe, map_moe, safetensors_files
from ..nn.block import MoEConfig, hf_config_path, read_hf_config
from ..nn.nnx_moe import NNXMoE
from .moe_baselines import BASELINES, _stacked_in_out, moe_dense, moe_ragged_dot  # noqa: F401  (q3.moe_dense ...)

__all__ = ["Qwen3MoeConfig", "Qwen3MoeForCausalLM", "MOE_IMPLEMENTATIONS", "with_moe", "init_cache",
           "prefill", "decode_step", "generate", "hf_state_dict", "save_hf", "load_hf"]

MOE_IMPLEMENTATIONS = ("fused", "dense", "ragged_dot")


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig:
    """A Qwen3-MoE model's shape, with transformers' ``Qwen3MoeConfig`` field
    names (``configuration_qwen3_moe.py``).  The default is a small model for
    tests and examples (about 2.3 M parameters)."""

    vocab_size: int = 512
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    moe_intermediate_size: int = 64
    num_experts: int = 16
    num_experts_per_tok: int = 4
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts",
                     "num_experts_per_tok", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Qwen3MoeConfig.{name} must be a positive integer; got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"Qwen3MoeConfig.num_attention_heads={self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"Qwen3MoeConfig.head_dim must be even (rotate_half); got {self.head_dim}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"Qwen3MoeConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"num_experts={self.num_experts}")

    def to_hf_dict(self, torch_dtype: str = "float32") -> dict:
        """The ``config.json`` of this model (``model_type`` ``"qwen3_moe"``)."""
        d = dataclasses.asdict(self)
        d.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_act="silu",
                 attention_bias=False, attention_dropout=0.0, decoder_sparse_step=1, mlp_only_layers=[],
                 intermediate_size=self.moe_intermediate_size * self.num_experts_per_tok,
                 rope_scaling=None, use_sliding_window=False, sliding_window=None,
                 output_router_logits=False, router_aux_loss_coef=0.001, use_cache=True,
                 torch_dtype=torch_dtype)
        return d

    @classmethod
    def from_hf(cls, config: dict | str | os.PathLike) -> Qwen3MoeConfig:
        """From a ``config.json`` (a dict, the file or its folder); refuses,
        naming the field, what this model does not implement.  Raises
        `jax_nbx.loaders.CheckpointError` (a ValueError) naming the file (when
        given one) and the field whose value cannot be read (a string or a
        negative number for a size, ...)."""
        where = "Qwen3MoeConfig.from_hf" + ("" if isinstance(config, dict) else f": {hf_config_path(config)}")
        config = read_hf_config(config)
        if config.get("model_type") != "qwen3_moe":
            raise CheckpointError(f"{where}: model_type is {config.get('model_type')!r}, not 'qwen3_moe'")
        # transformers 5.24 writes num_local_experts (its attribute_map's name for num_experts) and
        # rope_theta inside rope_parameters: the field -> the key it is read from
        config, names = dict(config), {}
        if "num_local_experts" in config:
            if config.setdefault("num_experts", config["num_local_experts"]) != config["num_local_experts"]:
                raise CheckpointError(f"{where}: num_experts={config['num_experts']!r} and num_local_experts="
                                      f"{config['num_local_experts']!r} disagree")
            names["num_experts"] = "num_local_experts"
        rope = config_value(config, "rope_parameters", where, "dict", {}, nullable=True)
        if "rope_theta" in rope and "rope_theta" not in config:
            config["rope_theta"], names["rope_theta"] = rope["rope_theta"], "rope_parameters.rope_theta"
        unsupported = {
            "rope_parameters": rope.get("rope_type", "default") != "default",
            "mlp_only_layers": bool(config.get("mlp_only_layers")),
            "decoder_sparse_step": config.get("decoder_sparse_step", 1) != 1,
            "use_sliding_window": bool(config.get("use_sliding_window")),
            "rope_scaling": bool(config.get("rope_scaling")),
            "attention_bias": bool(config.get("attention_bias")),
            "hidden_act": config.get("hidden_act", "silu") != "silu",
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            what = ", ".join(f"{k}={config[k]!r}" for k in bad)
            raise CheckpointError(f"{where}: unsupported setting(s) {what} (implemented: every layer sparse, "
                                  "SwiGLU, plain RoPE, no bias, no sliding window)")
        kw = {}
        for f in dataclasses.fields(cls):
            if f.name in config and not (f.name == "head_dim" and config[f.name] is None):
                kind, checks = _FIELD_KINDS.get(f.name, ("int", {"minimum": 1}))
                kw[f.name] = check_value(config[f.name], names.get(f.name, f.name), where, kind, **checks)
        if "head_dim" not in kw:  # transformers' Qwen3MoeConfig: hidden_size // num_attention_heads
            kw["head_dim"] = (kw.get("hidden_size", cls.hidden_size)
                              // kw.get("num_attention_heads", cls.num_attention_heads))
        try:
            return cls(**kw)
        except ValueError as err:
            raise CheckpointError(f"{where}: {err}") from err

    def moe_config(self, implementation: str | None = None) -> MoEConfig:
        """The `MoEConfig` of every MoE block."""
        return MoEConfig(hidden_size=self.hidden_size, intermediate_size=self.moe_intermediate_size,
                         num_experts=self.num_experts, top_k=self.num_experts_per_tok, routing="softmax",
                         norm_topk_prob=self.norm_topk_prob, initializer_range=self.initializer_range,
                         implementation=implementation)


# config.json's fields other than the positive integer sizes: (check_value kind, checks)
_FIELD_KINDS = {"norm_topk_prob": ("bool", {}), "tie_word_embeddings": ("bool", {}),
                "rms_norm_eps": ("number", {"positive": True}), "rope_theta": ("number", {"positive": True}),
                "initializer_range": ("number", {})}


# --- layers ---------------------------------------------------------------------------------

def _normal(rngs: nnx.Rngs | None, shape, std, dtype):
    if rngs is None:  # a placeholder that the loader replaces
        return jnp.zeros(shape, dtype)
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)


class Linear(nnx.Module):
    """``nn.Linear`` without bias: ``weight [out, in]``, ``y = x @ weight.T``."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs | None, std: float, dtype,
                 weight=None):
        self.weight = nnx.Param(_normal(rngs, (out_features, in_features), std, dtype) if weight is None
                                else weight)

    def __call__(self, x):
        return jnp.einsum("...i,oi->...o", x, self.weight[...].astype(x.dtype))


class RMSNorm(nnx.Module):
    """``Qwen3MoeRMSNorm``: ``weight * (x / sqrt(mean(x^2) + eps))``, the
    normalization in float32."""

    def __init__(self, size: int, eps: float, dtype=jnp.float32, weight=None):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((size,), dtype) if weight is None else weight)

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        w = self.weight[...].astype(x.dtype).reshape((1,) * (x.ndim - 1) + (-1,))
        return w * x32.astype(x.dtype)


def _rope(positions, head_dim: int, theta: float):
    """(cos, sin) ``[T, head_dim]`` of positions ``[T]`` as ``Qwen3MoeRotaryEmbedding`` (float32)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


class Attention(nnx.Module):
    """``Qwen3MoeAttention`` with an optional static-length KV cache."""

    def __init__(self, c: Qwen3MoeConfig, *, rngs: nnx.Rngs | None, dtype):
        D, H = c.head_dim, c.hidden_size
        std = c.initializer_range
        self.c = c
        self.q_proj = Linear(H, c.num_attention_heads * D, rngs=rngs, std=std, dtype=dtype)
        self.k_proj = Linear(H, c.num_key_value_heads * D, rngs=rngs, std=std, dtype=dtype)
        self.v_proj = Linear(H, c.num_key_value_heads * D, rngs=rngs, std=std, dtype=dtype)
        self.o_proj = Linear(c.num_attention_heads * D, H, rngs=rngs, std=std, dtype=dtype)
        self.q_norm = RMSNorm(D, c.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(D, c.rms_norm_eps, dtype)

    def __call__(self, x, start, cache):
        """x ``[B, T, H]`` at positions ``start + arange(T)``; ``cache`` None or
        ``(k, v)`` ``[B, S, KV, D]`` (updated and returned)."""
        c = self.c
        B, T, _ = x.shape
        D, KV = c.head_dim, c.num_key_value_heads
        G = c.num_attention_heads // KV
        q = self.q_norm(self.q_proj(x).reshape(B, T, c.num_attention_heads, D))
        k = self.k_norm(self.k_proj(x).reshape(B, T, KV, D))
        v = self.v_proj(x).reshape(B, T, KV, D)
        qpos = start + jnp.arange(T, dtype=jnp.int32)
        cos, sin = _rope(qpos, D, c.rope_theta)
        cos, sin = cos[None, :, None, :].astype(x.dtype), sin[None, :, None, :].astype(x.dtype)  # [1, T, 1, D]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            ck, cv = cache
            ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, start, 0, 0))
            cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, start, 0, 0))
            cache, k, v = (ck, cv), ck.astype(x.dtype), cv.astype(x.dtype)
        kpos = jnp.arange(k.shape[1], dtype=jnp.int32)
        qg = q.reshape(B, T, KV, G, D)  # head h = kv * G + g reads kv head h // G (repeat_kv)
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (D ** -0.5)
        s = jnp.where((kpos[None, :] <= qpos[:, None])[None, None, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(x.dtype)
        o = jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(B, T, c.num_attention_heads * D)
        return self.o_proj(o), cache


class DecoderLayer(nnx.Module):
    """``Qwen3MoeDecoderLayer``: x + attn(norm(x)), then h + moe(norm(h))."""

    def __init__(self, c: Qwen3MoeConfig, moe: str, *, rngs: nnx.Rngs | None, dtype,
                 implementation: str | None = None, mlp: NNXMoE | None = None):
        self.moe = moe
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = Attention(c, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = mlp if mlp is not None else NNXMoE(c.moe_config(implementation), rngs=rngs,
                                                        param_dtype=dtype, lists=True)

    def __call__(self, x, start, cache):
        a, cache = self.self_attn(self.input_layernorm(x), start, cache)
        x = x + a
        h = self.post_attention_layernorm(x)
        if self.moe == "fused":
            y, _ = self.mlp(h)
        else:
            y = BASELINES[self.moe](self.mlp.params(), h, self.mlp.config)
        return x + y, cache


class Qwen3MoeForCausalLM(nnx.Module):
    """``Qwen3MoeForCausalLM`` in Flax NNX.

    Args:
      config: `Qwen3MoeConfig`.
      moe: ``"fused"`` (default), ``"dense"`` or ``"ragged_dot"`` (see the
        module docstring); the baselines stack the experts at construction.
      rngs: `nnx.Rngs` for the initialization (every weight
        ``normal(0, initializer_range)``, norms one, as transformers'
        ``_init_weights``); not needed when ``layers``/``weights`` are given.
      dtype: the parameters' dtype; activations follow it.
      implementation: `jax_nbx.fused_moe`'s (``None``, ``"ffi"``, ``"xla"``).

    ``model(ids [B, T])`` returns the logits ``[B, T, vocab]`` (float32) of a
    causal forward from position 0; `prefill`/`decode_step` use a KV cache.
    """

    def __init__(self, config: Qwen3MoeConfig, *, moe: str = "fused", rngs: nnx.Rngs | None = None,
                 dtype=jnp.float32, implementation: str | None = None, _weights: dict | None = None,
                 _mlps: list | None = None):
        if moe not in MOE_IMPLEMENTATIONS:
            raise ValueError(f"Qwen3MoeForCausalLM: moe must be one of {MOE_IMPLEMENTATIONS}; got {moe!r}")
        c = config
        self.config, self.moe = c, moe
        if _weights is None and rngs is None:
            raise ValueError("Qwen3MoeForCausalLM: pass rngs= to initialize (or use load_hf)")
        self.embed_tokens = nnx.Param(_normal(rngs, (c.vocab_size, c.hidden_size), c.initializer_range, dtype)
                                      if _weights is None else _weights["embed_tokens"])
        self.layers = nnx.List([DecoderLayer(c, moe, rngs=rngs, dtype=dtype, implementation=implementation,
                                             mlp=None if _mlps is None else _mlps[i])
                                for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.lm_head = None if c.tie_word_embeddings else Linear(
            c.hidden_size, c.vocab_size, rngs=rngs, std=c.initializer_range, dtype=dtype,
            weight=None if _weights is None else _weights["lm_head"])
        if moe != "fused":
            for layer in self.layers:
                layer.mlp = _baseline_mlp(layer.mlp)

    @property
    def dtype(self):
        return self.embed_tokens[...].dtype

    def forward(self, ids, start=0, cache=None):
        """(logits ``[B, T, vocab]`` float32, updated cache or None)."""
        ids = jnp.asarray(ids)
        if ids.ndim != 2:
            raise ValueError(f"ids must be [batch, tokens]; got shape {ids.shape}")
        x = jnp.take(self.embed_tokens[...], ids, axis=0)
        new_cache = []
        for i, layer in enumerate(self.layers):
            x, lc = layer(x, start, None if cache is None else cache[i])
            new_cache.append(lc)
        x = self.norm(x)
        head = self.embed_tokens[...] if self.lm_head is None else self.lm_head.weight[...]
        logits = jnp.einsum("bth,vh->btv", x, head.astype(x.dtype), preferred_element_type=jnp.float32)
        return logits, (None if cache is None else tuple(new_cache))

    def __call__(self, ids):
        return self.forward(ids)[0]


def _baseline_mlp(mlp: NNXMoE) -> NNXMoE:
    p = mlp.params()
    return NNXMoE(mlp.config, params=p._replace(experts=_stacked_in_out(p.experts)))


def with_moe(model: Qwen3MoeForCausalLM, moe: str, implementation: str | None = None) -> Qwen3MoeForCausalLM:
    """The same parameters under another MoE implementation (a new model
    sharing every non-MoE array; the baselines get a stacked ``in_out`` copy
    of the experts, ``"fused"`` the model's experts as they are)."""
    if moe not in MOE_IMPLEMENTATIONS:
        raise ValueError(f"with_moe: moe must be one of {MOE_IMPLEMENTATIONS}; got {moe!r}")
    new = nnx.clone(model)  # the graph copied; the arrays (immutable) shared
    new.moe = moe
    for layer in new.layers:
        layer.moe = moe
        cfg = dataclasses.replace(layer.mlp.config, implementation=implementation)
        p = layer.mlp.params()
        if moe != "fused":
            p = p._replace(experts=_stacked_in_out(p.experts))
        layer.mlp = NNXMoE(cfg, params=p)
    return new


# --- KV cache, prefill, decode, generate -------------------------------------------------------

def init_cache(model: Qwen3MoeForCausalLM, batch: int, length: int) -> tuple:
    """Zero K/V caches ``[batch, length, KV, head_dim]`` per layer."""
    c = model.config
    shape = (batch, length, c.num_key_value_heads, c.head_dim)
    return tuple((jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype))
                 for _ in range(c.num_hidden_layers))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _prefill(graphdef, state, ids, cache_len):
    model = nnx.merge(graphdef, state)
    return model.forward(ids, 0, init_cache(model, ids.shape[0], cache_len))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _decode(graphdef, state, token, pos, cache):
    logits, cache = nnx.merge(graphdef, state).forward(token[:, None], pos, cache)
    return logits[:, 0], cache


def _split(model):
    if isinstance(model, tuple):  # (graphdef, state), split once by the caller
        return model
    return nnx.split(model)


def prefill(model, ids, cache_len: int | None = None):
    """One jitted call: the prompt ``ids [B, T]`` through the model, its K/V
    written into a fresh cache of static length ``cache_len`` (default T).
    Returns (logits ``[B, T, vocab]`` float32, cache).  ``model`` may be
    ``nnx.split(model)`` (saves the split on every call)."""
    graphdef, state = _split(model)
    ids = jnp.asarray(ids, jnp.int32)
    if ids.ndim != 2:
        raise ValueError(f"prefill: ids must be [batch, tokens]; got shape {ids.shape}")
    cache_len = ids.shape[1] if cache_len is None else int(cache_len)
    if cache_len < ids.shape[1]:
        raise ValueError(f"prefill: cache_len={cache_len} is shorter than the prompt ({ids.shape[1]} tokens)")
    return _prefill(graphdef, state, ids, cache_len)


def decode_step(model, token, pos, cache):
    """One jitted call: ``token [B]`` at position ``pos`` (a scalar; one
    compilation for every position) attends to the cache's positions
    ``<= pos``.  Returns (logits ``[B, vocab]`` float32, cache); the cache
    passed in is donated (do not reuse it)."""
    graphdef, state = _split(model)
    return _decode(graphdef, state, jnp.asarray(token, jnp.int32), jnp.asarray(pos, jnp.int32), cache)


def generate(model, prompt_ids, max_new_tokens: int, *, return_logits: bool = False):
    """Greedy decoding with a KV cache of static length ``T + max_new_tokens``:
    `prefill` once, then `decode_step` per token.  ``prompt_ids`` ``[T]`` or
    ``[B, T]``; returns the new tokens ``[max_new_tokens]`` (or ``[B, n]``),
    and with ``return_logits`` the logits each token was chosen from
    (``[n, vocab]`` / ``[B, n, vocab]``)."""
    ids = np.asarray(prompt_ids)
    single = ids.ndim == 1
    ids = ids[None] if single else ids
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1; got {max_new_tokens}")
    T = ids.shape[1]
    limit = model.config.max_position_embeddings
    if T + max_new_tokens > limit:
        raise ValueError(f"generate: {T} + {max_new_tokens} tokens exceed max_position_embeddings={limit}")
    split = nnx.split(model)
    logits, cache = prefill(split, ids, T + max_new_tokens)
    step = logits[:, -1]
    toks, outs = [], []
    for i in range(max_new_tokens):
        tok = jnp.argmax(step, axis=-1).astype(jnp.int32)
        toks.append(tok)
        outs.append(step)
        if i + 1 < max_new_tokens:
            step, cache = decode_step(split, tok, T + i, cache)
    tokens = np.stack([np.asarray(t) for t in toks], axis=1)
    lg = np.stack([np.asarray(s) for s in outs], axis=1)
    if single:
        tokens, lg = tokens[0], lg[0]
    return (tokens, lg) if return_logits else tokens


# --- Hugging Face checkpoints ---------------------------------------------------------------

def hf_state_dict(model: Qwen3MoeForCausalLM) -> dict[str, Any]:
    """Every parameter under its transformers name, in transformers' layout
    (``nn.Linear`` ``[out, in]``; experts per expert).  Works on a model
    whose Params hold gradients too (``nnx.merge(graphdef, grads)``)."""
    d: dict[str, Any] = {"model.embed_tokens.weight": model.embed_tokens[...],
                         "model.norm.weight": model.norm.weight[...]}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        at = layer.self_attn
        d[p + "input_layernorm.weight"] = layer.input_layernorm.weight[...]
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            d[f"{p}self_attn.{n}.weight"] = getattr(at, n).weight[...]
        d[p + "self_attn.q_norm.weight"] = at.q_norm.weight[...]
        d[p + "self_attn.k_norm.weight"] = at.k_norm.weight[...]
        d[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight[...]
        mp = layer.mlp.params()
        d[p + "mlp.gate.weight"] = mp.router
        ex = mp.experts
        for e in range(ex.num_experts):
            for n, a in (("gate_proj", ex.gate), ("up_proj", ex.up), ("down_proj", ex.down)):
                w = a[e]
                if ex.layout == "in_out":
                    w = jnp.swapaxes(w, -1, -2)
                d[f"{p}mlp.experts.{e}.{n}.weight"] = w
    if model.lm_head is not None:
        d["lm_head.weight"] = model.lm_head.weight[...]
    return d


def save_hf(model: Qwen3MoeForCausalLM, folder: str | os.PathLike, *, shards: int = 1) -> list[str]:
    """Writes ``config.json`` and the weights under transformers' names:
    ``model.safetensors``, or with ``shards > 1`` ``model-0000i-of-0000n.safetensors``
    and ``model.safetensors.index.json`` (layers split between the files).
    Returns the files written."""
    from safetensors.flax import save_file
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    sd = {k: jnp.asarray(v) for k, v in hf_state_dict(model).items()}
    dtype = {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.bfloat16): "bfloat16",
             jnp.dtype(jnp.float16): "float16"}.get(jnp.dtype(model.dtype), str(jnp.dtype(model.dtype)))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(model.config.to_hf_dict(dtype), f, indent=2)
    names = list(sd)
    if shards <= 1:
        path = os.path.join(folder, "model.safetensors")
        save_file(sd, path, metadata={"format": "pt"})
        return [os.path.join(folder, "config.json"), path]
    parts: list[dict] = [{} for _ in range(shards)]
    for j, n in enumerate(names):  # contiguous runs of names per file
        parts[min(j * shards // len(names), shards - 1)][n] = sd[n]
    files, wmap = [], {}
    for j, part in enumerate(parts):
        fname = f"model-{j + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, os.path.join(folder, fname), metadata={"format": "pt"})
        files.append(os.path.join(folder, fname))
        wmap.update({n: fname for n in part})
    total = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in sd.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=2)
    return [os.path.join(folder, "config.json"), *files, os.path.join(folder, "model.safetensors.index.json")]


def load_hf(folder: str | os.PathLike, *, moe: str = "fused", implementation: str | None = None,
            dtype=None, experts: str = "copied", resident_bytes: int | str | None = None) -> Qwen3MoeForCausalLM:
    """The model of a Hugging Face Qwen3-MoE checkpoint folder (``config.json``
    plus ``model.safetensors`` or the shards of ``model.safetensors.index.json``).

    The attention, norms, embedding and head are read here with
    ``safetensors``; each layer's MoE block with
    `jax_nbx.loaders.load_moe` (router ``[E, H]`` and per-expert
    ``[out, in]`` lists, read in place).  ``dtype`` casts every weight
    (default: as stored).  Raises `jax_nbx.loaders.CheckpointError`
    naming the file and a missing, mis-shaped or non-float tensor, or what
    is malformed in config.json, the index or a safetensors header (every
    tensor is checked against the config before the model is built).

    ``experts="mapped"`` leaves each layer's routed experts in the files
    (`jax_nbx.loaders.map_moe`, ``resident_bytes`` per layer; they keep
    their stored dtype, frozen, on the "cpu" backend with ``moe="fused"``);
    ``"copied"`` (default) reads them (`load_moe`)."""
    if experts not in ("copied", "mapped"):
        raise ValueError(f"load_hf: experts must be 'copied' or 'mapped'; got {experts!r}")
    if experts == "mapped" and moe != "fused":
        raise ValueError(f"load_hf: experts='mapped' runs with moe='fused' (the op); got moe={moe!r}")
    folder = os.fspath(folder)
    c = Qwen3MoeConfig.from_hf(folder)
    files, wmap, _ = safetensors_files(folder)
    source = os.path.join(folder, "model.safetensors.index.json") if wmap is not None else folder
    reader = CheckpointFiles(files, wmap, source, framework="flax")

    def get(name, shape):  # shape and dtype checked from the header before the tensor is read
        t = reader.get(name, float_only=True, shape=shape)
        return t if dtype is None else t.astype(dtype)

    H, D = c.hidden_size, c.head_dim
    qd, kvd = c.num_attention_heads * D, c.num_key_value_heads * D
    try:  # every tensor read (and checked against the config) before the model is built
        weights = {"embed_tokens": get("model.embed_tokens.weight", (c.vocab_size, H)),
                   "lm_head": None if c.tie_word_embeddings else get("lm_head.weight", (c.vocab_size, H)),
                   "norm": get("model.norm.weight", (H,))}
        layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            t = {n: get(p + n + ".weight", (H,)) for n in ("input_layernorm", "post_attention_layernorm")}
            for n, shape in (("q_proj", (qd, H)), ("k_proj", (kvd, H)), ("v_proj", (kvd, H)), ("o_proj", (H, qd)),
                             ("q_norm", (D,)), ("k_norm", (D,))):
                t[n] = get(f"{p}self_attn.{n}.weight", shape)
            layers.append(t)
    finally:
        reader.close()
    mcfg = c.moe_config(implementation)
    mlps = []
    for i in range(c.num_hidden_layers):
        p = (map_moe(folder, layer=i, config=mcfg, resident_bytes=resident_bytes) if experts == "mapped"
             else load_moe(folder, layer=i, config=mcfg, progress=False))
        if dtype is not None:
            p = jax.tree.map(lambda a: a.astype(dtype), p)
        mlps.append(NNXMoE(mcfg, params=p))
    model = Qwen3MoeForCausalLM(c, moe="fused", dtype=dtype or weights["embed_tokens"].dtype,
                                _weights=weights, _mlps=mlps, rngs=None)
    model.norm.weight = nnx.Param(weights["norm"])
    for layer, t in zip(model.layers, layers):
        at = layer.self_attn
        layer.input_layernorm.weight = nnx.Param(t["input_layernorm"])
        layer.post_attention_layernorm.weight = nnx.Param(t["post_attention_layernorm"])
        for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            getattr(at, n).weight = nnx.Param(t[n])
    return model if moe == "fused" else with_moe(model, moe, implementation)
