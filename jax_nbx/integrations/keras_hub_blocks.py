"""What each sparse MoE block of keras-hub 0.32 computes, written as a call
that runs its routed experts through one `jax_nbx.fused_moe`.

One `BlockKind` per keras-hub class.  Each patched call follows the block's
own ``call`` in ``keras_hub/src/models/<family>/`` (the file named per kind):
the same router layer, the same routing rule (`jax_nbx.routing`), the same
shared expert and its sigmoid gate, the same auxiliary loss (keras-hub's own
``compute_load_balancing_loss``, from the block's module), the same outputs.
Only the experts' einsum over *every* expert (keras-hub's dense formulation)
is replaced by the fused op over the k routed ones.  The experts' variables
are read where they are (``[E, H, I]``, keras-hub's fused ``gate||up``
``[E, H, 2I]``: `Experts.fused`, concatenated, or interleaved for gpt-oss),
never copied into another layout.  Keras is imported by the caller
(`jax_nbx.integrations.keras_hub`); nothing here imports it at module load.
"""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..activations import Activation
from ..experts import Experts, SharedExperts
from ..routing import route, route_topk_softmax

__all__ = ["BlockKind", "KINDS", "kind_of"]


@dataclasses.dataclass(frozen=True)
class BlockKind:
    """One keras-hub sparse MoE block class.

    family: keras-hub's model folder.  source: the file whose ``call`` the patched call follows.
    owner: the attribute of the block holding the experts' variables (``""``: the block itself).
    weights: the owner's attributes of the routed experts' weights, in `Experts` order
      (gate, up, down; or gate_up, down when ``fusion`` is set).  biases: likewise, of their biases.
    fusion: None, "concat" or "interleaved" (`Experts.fused`).
    call: ``call(block, state, *args, **kwargs)``, the block's call with the routed experts given by
      ``state.moe(block, x2, weights, ids, shared=...)``.
    """
    family: str
    source: str
    owner: str
    weights: tuple[str, ...]
    fusion: str | None
    call: Callable[..., Any]
    biases: tuple[str, ...] = ()

    def owner_of(self, block):
        return getattr(block, self.owner) if self.owner else block

    def experts(self, block, arrays: list | None = None) -> Experts:
        """The block's routed experts as `Experts`, read from its variables' current values (or
        from ``arrays`` in the order of ``weights``)."""
        own = self.owner_of(block)
        w = arrays if arrays is not None else [_value(getattr(own, n)) for n in self.weights]
        b = [_value(getattr(own, n)) for n in self.biases]
        if self.fusion is None:
            return Experts(*w)
        return Experts.fused(w[0], w[1], fusion=self.fusion, gate_up_bias=b[0] if b else None,
                             down_bias=b[1] if b else None)

    def biases_split(self, block) -> dict:
        """The biases as `Experts`' gate_bias / up_bias / down_bias (for quantized experts, which
        hold the projections apart)."""
        if not self.biases:
            return {}
        own = self.owner_of(block)
        gu, d = (_value(getattr(own, n)) for n in self.biases)
        half = gu.shape[-1] // 2
        if self.fusion == "interleaved":
            g, u = gu[..., 0::2], gu[..., 1::2]
        else:
            g, u = gu[..., :half], gu[..., half:]
        return {"gate_bias": g, "up_bias": u, "down_bias": d}


def _value(v):
    """A Keras variable's value as the running computation sees it (inside `jit`/`grad`: the traced
    value; under a mixed-precision policy: cast to the compute dtype, as keras-hub's own call reads it)."""
    return getattr(v, "value", v)


def _dense_kernel(layer):
    return _value(layer.kernel)


def _flat(block, h):
    return jnp.reshape(h, (-1, block.hidden_dim))


def _aux(block, router_logits, attention_mask, coefficient: float):
    """keras-hub's own load-balancing loss, from the block's module, added as the block adds it."""
    loss = sys.modules[type(block).__module__].compute_load_balancing_loss(
        router_logits=router_logits, num_experts=block.num_experts, top_k=block.top_k,
        attention_mask=attention_mask)
    block.add_loss(coefficient * loss)


def _mlp_shared(mlp, gate_layer) -> SharedExperts:
    """keras-hub's shared expert (a gated MLP of three bias-free Dense layers, one expert here) and its
    sigmoid gate (a Dense(1) kernel [H, 1])."""
    ex = Experts(*(_dense_kernel(getattr(mlp, f"_feedforward_{n}_dense"))[None]
                   for n in ("gate", "intermediate", "output")))
    gate = None if gate_layer is None else jnp.reshape(_dense_kernel(gate_layer), (-1,))
    return SharedExperts(ex, gate)


# ----------------------------------------------------------------- families

def _softmax_routed(block, state, hidden_states, router, *, normalize: bool, coefficient: float, shared=None,
                    attention_mask=None, training=None, router_input=None):
    """The softmax-top-k blocks' call (`route`): the router on the flattened tokens (or on
    ``router_input(x)``), the routed experts (and ``shared``) through the op, keras-hub's aux loss
    in training; returns (out [B, S, H], router logits) as those blocks do."""
    B, S, _ = hidden_states.shape
    x2 = _flat(block, hidden_states)
    logits = router(x2 if router_input is None else router_input(x2))
    w, ids = route(logits, block.top_k, normalize=normalize)
    y = state.moe(block, x2, w, ids, shared=shared)
    if training:
        _aux(block, logits, attention_mask, coefficient)
    return jnp.reshape(y, (B, S, block.hidden_dim)), logits


def _mixtral_call(block, state, hidden_states, attention_mask=None, training=False):
    # keras_hub/src/models/mixtral/mixtral_decoder.py, MixtralSparseMoeBlock.call (router jitter in training)
    import keras
    jitter = block.router_jitter_noise

    def noisy(x2):
        return x2 * keras.ops.random.uniform(x2.shape, minval=1.0 - jitter, maxval=1.0 + jitter, dtype=x2.dtype)
    return _softmax_routed(block, state, hidden_states, block._sparse_feedforward_gate_dense, normalize=True,
                           coefficient=block.router_aux_loss_coef, attention_mask=attention_mask,
                           training=training, router_input=noisy if training and jitter > 0 else None)


def _qwen_call(block, state, hidden_states, attention_mask=None, training=None):
    # keras_hub/src/models/qwen_moe/qwen_moe_decoder.py, QwenSparseMoeBlock.call (Qwen2-MoE), and
    # keras_hub/src/models/qwen3_moe/qwen3_moe_decoder.py, Qwen3SparseMoeBlock.call (no shared expert)
    shared = None
    if hasattr(block, "shared_expert_dense"):
        shared = _mlp_shared(block.shared_expert_dense, block.shared_expert_gate_dense)
    return _softmax_routed(block, state, hidden_states, block._sparse_feedforward_gate_dense,
                           normalize=bool(block.norm_top_k_prob), coefficient=block.router_aux_loss_coefficient,
                           shared=shared, attention_mask=attention_mask, training=training)


def _qwen3_5_call(block, state, hidden_states, attention_mask=None, training=None):
    # keras_hub/src/models/qwen3_5_moe/qwen3_5_moe_decoder.py, Qwen3_5MoeSparseMoeBlock.call
    return _softmax_routed(block, state, hidden_states, block._router_gate, normalize=True,
                           coefficient=block.router_aux_loss_coefficient,
                           shared=_mlp_shared(block.shared_expert, block._shared_expert_gate),
                           attention_mask=attention_mask, training=training)


def _gpt_oss_call(block, state, hidden_states):
    # keras_hub/src/models/gpt_oss/gpt_oss_decoder.py, GptOssSparseMoeBlock.call and GptOssTopKRouter.call:
    # top-k of the router's logits (its Dense has a bias), softmax over the k; returns the [T, E] scores
    B, S, _ = hidden_states.shape
    x2 = _flat(block, hidden_states)
    logits = block.router.router_dense(x2)
    w, ids = route_topk_softmax(logits, block.top_k)
    scores = jnp.sum(jax.nn.one_hot(ids, block.num_experts, dtype=w.dtype) * w[..., None], axis=-2)
    y = state.moe(block, x2, w, ids)
    return jnp.reshape(y, (B, S, block.hidden_dim)), scores.astype(logits.dtype)


def _gemma4_call(block, state, x, dispatch_weights):
    # keras_hub/src/models/gemma4/gemma4_moe.py, Gemma4MoEBlock.call: the router (Gemma4Router) runs
    # outside the block and hands it [T, E] dispatch weights with k non-zero entries per row; the
    # block scales each expert's output by its per_expert_scale.  The k entries are found again by
    # top-k (an entry the router chose but rounded to 0 contributes 0 either way), and the scale is
    # folded into the weights: sum_j w_j s_{e_j} mlp_{e_j}(x) is the block's sum.
    w, ids = jax.lax.top_k(dispatch_weights.astype(jnp.float32), state.k)
    scale = _value(block.per_expert_scale).astype(jnp.float32)
    return state.moe(block, x, w * scale[ids], ids).astype(x.dtype)


KINDS: dict[str, BlockKind] = {
    "MixtralSparseMoeBlock": BlockKind(
        "mixtral", "mixtral/mixtral_decoder.py", "expert_bank",
        ("_expert_feedforward_gate_dense", "_expert_feedforward_intermediate_dense",
         "_expert_feedforward_output_dense"), None, _mixtral_call),
    "QwenSparseMoeBlock": BlockKind(
        "qwen_moe", "qwen_moe/qwen_moe_decoder.py", "expert_bank",
        ("_expert_feedforward_gate_dense", "_expert_feedforward_output_dense"), "concat", _qwen_call),
    "Qwen3SparseMoeBlock": BlockKind(
        "qwen3_moe", "qwen3_moe/qwen3_moe_decoder.py", "expert_bank",
        ("_expert_feedforward_gate_dense", "_expert_feedforward_output_dense"), "concat", _qwen_call),
    "Qwen3_5MoeSparseMoeBlock": BlockKind(
        "qwen3_5_moe", "qwen3_5_moe/qwen3_5_moe_decoder.py", "expert_bank",
        ("_expert_feedforward_gate_dense", "_expert_feedforward_output_dense"), "concat", _qwen3_5_call),
    "GptOssSparseMoeBlock": BlockKind(
        "gpt_oss", "gpt_oss/gpt_oss_decoder.py", "experts", ("gate_up_proj", "down_proj"), "interleaved",
        _gpt_oss_call, biases=("gate_up_proj_bias", "down_proj_bias")),
    "Gemma4MoEBlock": BlockKind(
        "gemma4", "gemma4/gemma4_moe.py", "", ("gate_proj", "up_proj", "down_proj"), None, _gemma4_call),
}


def kind_of(block) -> BlockKind | None:
    """The `BlockKind` of a keras-hub layer (matched on its class and module), or None."""
    k = KINDS.get(type(block).__name__)
    if k is None or not type(block).__module__.startswith(f"keras_hub.src.models.{k.family}."):
        return None
    return k


def activation_of(kind: BlockKind, block) -> Activation | str:
    """The experts' gated unit, checked against what keras-hub's experts compute."""
    import keras
    if kind.family == "gpt_oss":
        ex = block.experts
        return Activation("swiglu_clamped", alpha=float(ex.alpha), limit=float(ex.limit))
    if kind.family == "gemma4":
        return "geglu"  # keras.activations.gelu(approximate=True) on the gate
    if kind.family == "qwen3_5_moe":
        return "swiglu"  # ops.silu on the gate
    act = kind.owner_of(block).activation
    if act is not keras.activations.silu:
        raise ValueError(f"patch_moe: {type(block).__name__} {block.name!r} has experts with activation "
                         f"{getattr(act, '__name__', act)!r}; keras-hub's presets use silu, the only one patched")
    return "swiglu"
