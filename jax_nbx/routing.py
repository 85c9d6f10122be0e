"""Routing: router logits to (top-k weights, top-k expert ids), and router losses.

Every routing function takes the router's logits ``[..., E]`` (any float
dtype; computed in float32) and returns ``(topk_weights [..., k] float32,
topk_ids [..., k] int32)``, ready for ``fused_moe``; with ``return_probs=True``
a third value, the router's full ``[..., E]`` float32 probabilities (or
scores) as the model defines them, for the losses below.

The rules follow Hugging Face ``transformers`` 5.x (``src/transformers/models/
<model>/modeling_<model>.py``; the commits read are named per function):

================================  ==============================================  =======================
rule                              families                                        function
================================  ==============================================  =======================
softmax -> top-k [-> renorm]      Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2        :func:`route`
top-k on logits -> softmax of k   Granite-MoE, gpt-oss (router bias)              :func:`route_topk_softmax`
sigmoid, bias for choice, groups  DeepSeek-V3 (and the V3-style GLM-4.5-MoE)      :func:`route_sigmoid`
top-k on logits -> sigmoid        Llama-4 (weight scales the expert's *input*)    :func:`route_topk_sigmoid`
================================  ==============================================  =======================

Ties: every choice is made by ``jax.lax.top_k``, so among equal values the
lower index comes first (experts, and groups in grouped top-k). PyTorch's
``topk`` leaves the order of ties unspecified, so where the scores tie exactly
a model may pick another expert of equal score.

Gradients flow from the weights to the logits (and to ``route_topk_softmax``'s
``bias``) wherever the model differentiates them; the choice of experts is
discrete and has none.

Losses: :func:`load_balancing_loss` (Switch / Mixtral), :func:`router_z_loss`
(ST-MoE) and :func:`expert_counts`.
"""
from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["route", "route_topk_softmax", "route_sigmoid", "route_topk_sigmoid",
           "load_balancing_loss", "router_z_loss", "expert_counts"]


# ---------------------------------------------------------------- validation

def _logits(logits, name: str = "logits") -> jax.Array:
    logits = jnp.asarray(logits)
    if logits.ndim < 1:
        raise ValueError(f"{name} must have shape [..., E]; got shape {logits.shape}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(f"{name} must be a float array; got dtype {logits.dtype}")
    if logits.shape[-1] < 1:
        raise ValueError(f"{name} must have at least one expert on its last axis; got shape {logits.shape}")
    return logits


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool | np.bool_)


def _k(k, E: int, shape) -> int:
    if not _is_int(k) or not 1 <= k <= E:
        raise ValueError(f"k must be an int in [1, E={E}] for logits of shape {shape}; got k={k!r}")
    return int(k)


def _expert_vector(v, name: str, E: int, shape) -> jax.Array:
    v = jnp.asarray(v)
    if not jnp.issubdtype(v.dtype, jnp.floating):
        raise TypeError(f"{name} must be a float array; got dtype {v.dtype}")
    if v.shape != (E,):
        raise ValueError(f"{name} must have shape (E,) = ({E},) for logits of shape {shape}; got shape {v.shape}")
    return v.astype(jnp.float32)


def _scale(v, name: str) -> float:
    if not isinstance(v, numbers.Real) or isinstance(v, bool | np.bool_) or not np.isfinite(float(v)):
        raise TypeError(f"{name} must be a finite Python/NumPy number (a static model constant); got {v!r}")
    return float(v)


def _groups(n_group, topk_group, k: int, E: int, shape, min_group: int) -> tuple[int, int]:
    if not _is_int(n_group) or n_group < 1 or E % n_group:
        raise ValueError(f"n_group must be a positive int that divides the number of experts E={E} "
                         f"(logits of shape {shape}); got n_group={n_group!r}")
    n_group = int(n_group)
    if not _is_int(topk_group) or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be an int in [1, n_group={n_group}]; got topk_group={topk_group!r}")
    topk_group = int(topk_group)
    size = E // n_group
    if n_group > 1 and size < min_group:
        raise ValueError(f"n_group={n_group} leaves groups of E/n_group={size} expert(s); the group score needs "
                         f"at least {min_group} (logits of shape {shape})")
    if n_group > 1 and k > topk_group * size:
        raise ValueError(f"k={k} exceeds the topk_group*E/n_group = {topk_group}*{size} = {topk_group * size} "
                         f"experts left by group selection (n_group={n_group}, topk_group={topk_group})")
    return n_group, topk_group


def _bcast_last(v: jax.Array, ndim: int) -> jax.Array:
    """A [E] vector shaped to add to a [..., E] array of rank ``ndim`` (no implicit rank promotion)."""
    return v.reshape((1,) * (ndim - 1) + v.shape)


# ---------------------------------------------------------------- choice helpers

def _group_mask(choice: jax.Array, n_group: int, topk_group: int, group_score: str) -> jax.Array:
    """Experts of the ``topk_group`` best groups (bool ``[..., E]``); a group's
    score is its largest choice score ("max", DeepSeek-V2) or the sum of its
    two largest ("top2", DeepSeek-V3). Ties between groups: lower index first."""
    lead, E = choice.shape[:-1], choice.shape[-1]
    grouped = choice.reshape(lead + (n_group, E // n_group))
    if group_score == "max":
        gscore = jnp.max(grouped, axis=-1)
    else:
        gscore = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, gidx = jax.lax.top_k(gscore, topk_group)
    gsel = jnp.sum(jax.nn.one_hot(gidx, n_group, dtype=jnp.int32), axis=-2) > 0  # [..., n_group]
    return jnp.repeat(gsel, E // n_group, axis=-1)


def _choose(choice: jax.Array, k: int, n_group: int, topk_group: int, group_score: str) -> jax.Array:
    """The k expert ids by descending ``choice`` (no gradient), within the best groups."""
    choice = jax.lax.stop_gradient(choice)
    if n_group > 1:
        choice = jnp.where(_group_mask(choice, n_group, topk_group, group_score), choice, -jnp.inf)
    return jax.lax.top_k(choice, k)[1].astype(jnp.int32)


def _out(weights, ids, probs, return_probs: bool):
    return (weights, ids, probs) if return_probs else (weights, ids)


# ---------------------------------------------------------------- routing rules

def route(logits: jax.Array, k: int, *, normalize: bool = True, n_group: int = 1, topk_group: int = 1,
          routed_scaling_factor: float = 1.0, return_probs: bool = False):
    """Softmax top-k routing: ``p = softmax(logits)``, the k largest ``p``,
    optionally renormalized to sum to 1, times ``routed_scaling_factor``.

    Families (``transformers`` 5.x):

    - Mixtral (``modeling_mixtral.py``, ``MixtralSparseMoeBlock``; commit
      00d4b3d2): ``normalize=True``.
    - Qwen3-MoE (``modeling_qwen3_moe.py``, ``Qwen3MoeSparseMoeBlock``; commit
      00d4b3d2) and Qwen2-MoE's router, the same rule: ``normalize=norm_topk_prob``.
    - OLMoE (``modeling_olmoe.py``, ``OlmoeSparseMoeBlock``; commit 00dcc6dd):
      ``normalize=False``.
    - DeepSeek-V2 (``modeling_deepseek_v2.py``,
      ``DeepseekV2Moe.route_tokens_to_experts``; commit 0233e509):
      ``normalize=False``, ``routed_scaling_factor``, and for
      ``topk_method="group_limited_greedy"`` ``n_group``/``topk_group``
      (``topk_method="greedy"``: leave them at 1). transformers does not apply
      the config's ``norm_topk_prob`` there; DeepSeek's own code does
      (``normalize=norm_topk_prob`` then).

    Group-limited top-k (``n_group > 1``): the experts form ``n_group``
    contiguous groups of ``E/n_group``; a group's score is its largest
    probability; only the experts of the ``topk_group`` best groups can be
    chosen. (transformers fills the others' probabilities with 0.0, we with
    -inf: the same choice, since probabilities are positive, unless one
    underflows to exactly 0.)

    Args:
      logits: ``[..., E]`` router logits, any float dtype (softmax in float32,
        as the models compute it).
      k: experts per token, ``1 <= k <= E`` (and ``<= topk_group*E/n_group``).
      normalize: renormalize the k chosen probabilities to sum to 1.
      n_group, topk_group: group-limited top-k; ``n_group`` divides E.
      routed_scaling_factor: multiplies the weights (after renormalizing).
      return_probs: also return ``softmax(logits)`` ``[..., E]`` float32 (what
        :func:`load_balancing_loss` takes).

    Returns:
      ``(topk_weights [..., k] float32, topk_ids [..., k] int32)`` in
      descending order of probability (ties: lower index first), or
      ``(topk_weights, topk_ids, probs)``.
    """
    logits = _logits(logits)
    E = logits.shape[-1]
    k = _k(k, E, logits.shape)
    n_group, topk_group = _groups(n_group, topk_group, k, E, logits.shape, min_group=1)
    scale = _scale(routed_scaling_factor, "routed_scaling_factor")
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    ids = _choose(probs, k, n_group, topk_group, "max")
    weights = jnp.take_along_axis(probs, ids, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if scale != 1.0:
        weights = weights * scale
    return _out(weights, ids, probs, return_probs)


def route_topk_softmax(logits: jax.Array, k: int, *, bias: jax.Array | None = None, return_probs: bool = False):
    """Top-k on the logits, then a softmax over the k chosen logits.

    Families (``transformers`` 5.x):

    - Granite-MoE (``modeling_granitemoe.py``, ``GraniteMoeTopKGating``;
      commit c7a438e9): ``logits = x @ router.T``.
    - gpt-oss (``modeling_gpt_oss.py``, ``GptOssTopKRouter``; commit 00d4b3d2):
      its router is a linear layer with a bias; pass ``bias=router.bias``
      (``[E]``, trained: the gradient reaches it) or add it to the logits
      yourself — the same.

    Mathematically this equals :func:`route` with ``normalize=True`` on the
    same logits (the softmax over the k largest logits is the renormalized
    top-k of the full softmax); rounding differs in the last bits. transformers
    casts the weights to the hidden states' dtype (Granite) or computes the
    softmax in the logits' dtype (gpt-oss in bf16); here everything is float32.

    Args:
      logits: ``[..., E]`` router logits, any float dtype.
      k: experts per token, ``1 <= k <= E``.
      bias: optional ``[E]`` router bias added to the logits (gpt-oss).
      return_probs: also return ``softmax(logits + bias)`` over all E experts
        ``[..., E]`` float32 — what transformers' ``load_balancing_loss_func``
        computes from these models' router logits.

    Returns:
      ``(topk_weights [..., k] float32, topk_ids [..., k] int32)`` in
      descending order of logit (ties: lower index first), or with ``probs``.
    """
    logits = _logits(logits)
    E = logits.shape[-1]
    k = _k(k, E, logits.shape)
    z = logits.astype(jnp.float32)
    if bias is not None:
        z = z + _bcast_last(_expert_vector(bias, "bias", E, logits.shape), z.ndim)
    ids = _choose(z, k, 1, 1, "max")
    weights = jax.nn.softmax(jnp.take_along_axis(z, ids, axis=-1), axis=-1)
    probs = jax.nn.softmax(z, axis=-1) if return_probs else None
    return _out(weights, ids, probs, return_probs)


def route_sigmoid(logits: jax.Array, k: int, *, correction_bias: jax.Array | None = None, n_group: int = 1,
                  topk_group: int = 1, normalize: bool = True, routed_scaling_factor: float = 1.0,
                  return_probs: bool = False):
    """DeepSeek-V3 routing: sigmoid scores; experts chosen by score +
    ``correction_bias`` within the best groups; weights from the unbiased
    scores, renormalized, times ``routed_scaling_factor``.

    Follows ``transformers``' DeepSeek-V3 (``modeling_deepseek_v3.py``,
    ``DeepseekV3TopkRouter`` / ``DeepseekV3MoE.route_tokens_to_experts``; read at
    commit 000c33fd of ``modular_deepseek_v3.py`` and in its later form, where
    the router does it all, as mirrored at 8b-is/transformers 6162a92b and in
    transformers' ``modeling_glm4_moe_lite.py`` 0205eec1):

    1. ``s = sigmoid(logits)`` (float32; the model computes its router logits
       in float32: ``x.astype(float32) @ W.astype(float32).T``).
    2. ``c = s + correction_bias`` (``e_score_correction_bias``; a buffer, no
       gradient: it only moves the choice).
    3. Grouped top-k (``n_group > 1``): ``E/n_group`` contiguous experts per
       group; group score = sum of the group's two largest ``c``; the
       ``topk_group`` best groups stay, the other experts are masked out
       (-inf, as transformers' later router does; its earlier
       ``route_tokens_to_experts`` filled 0.0 instead, which differs only when
       a biased score in a kept group is below 0, i.e. ``correction_bias`` <
       ``-s``); then the k largest ``c``.
    4. ``w = s[ids]``; ``normalize`` (``norm_topk_prob``): ``w / (sum(w) + 1e-20)``;
       then ``w * routed_scaling_factor``.

    Args:
      logits: ``[..., E]`` router logits, any float dtype.
      k: experts per token, ``1 <= k <= topk_group*E/n_group``.
      correction_bias: optional ``[E]`` ``e_score_correction_bias``.
      n_group, topk_group: grouped top-k; ``n_group`` divides E into groups of
        at least 2 experts (the group score sums two); ``1 <= topk_group <= n_group``.
      normalize: ``norm_topk_prob`` (DeepSeek-V3: True).
      routed_scaling_factor: ``routed_scaling_factor`` (DeepSeek-V3: 2.5).
      return_probs: also return the unbiased scores ``sigmoid(logits)``
        ``[..., E]`` float32 (transformers' DeepSeek-V3 trains without an
        auxiliary loss; these are the scores its routing uses).

    Returns:
      ``(topk_weights [..., k] float32, topk_ids [..., k] int32)`` in
      descending order of the *biased* choice score (not of the weight; ties:
      lower index first), or with the scores. transformers uses
      ``topk(sorted=False)``: its order of the k is unspecified.
    """
    logits = _logits(logits)
    E = logits.shape[-1]
    k = _k(k, E, logits.shape)
    n_group, topk_group = _groups(n_group, topk_group, k, E, logits.shape, min_group=2)
    scale = _scale(routed_scaling_factor, "routed_scaling_factor")
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores
    if correction_bias is not None:
        cb = _expert_vector(correction_bias, "correction_bias", E, logits.shape)
        choice = scores + _bcast_last(jax.lax.stop_gradient(cb), scores.ndim)
    ids = _choose(choice, k, n_group, topk_group, "top2")
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    if scale != 1.0:
        weights = weights * scale
    return _out(weights, ids, scores, return_probs)


def route_topk_sigmoid(logits: jax.Array, k: int, *, return_probs: bool = False):
    """Llama-4 routing: top-k on the logits, weight = sigmoid of each chosen logit.

    Follows ``transformers``' Llama-4 (``modeling_llama4.py``, ``Llama4Router``
    and ``Llama4TextMoe``; commit 000c33fd; Llama-4 uses k = 1). **In Llama-4
    the weight multiplies the expert's input**, not its output:
    ``y = sum_j expert_{ids_j}(w_j * x)`` (plus the shared expert), whereas
    ``fused_moe`` computes ``sum_j w_j * expert_{ids_j}(x)`` by default; pass
    ``weights_on="input"`` for Llama-4's form::

        w, ids = nbx.route_topk_sigmoid(x @ W.T, k=1)             # [T, 1]
        y = nbx.fused_moe(x, w, ids, experts, weights_on="input",
                          shared_experts=nbx.SharedExperts(shared))

    Args:
      logits: ``[..., E]`` router logits, any float dtype (sigmoid in float32;
        transformers takes it in float32 and casts back to the logits' dtype).
      k: experts per token, ``1 <= k <= E``.
      return_probs: also return ``sigmoid(logits)`` for all E experts
        ``[..., E]`` float32 (``Llama4Router``'s ``router_scores`` equal these
        at the chosen experts and 0 elsewhere).

    Returns:
      ``(topk_weights [..., k] float32, topk_ids [..., k] int32)`` in
      descending order of logit (ties: lower index first), or with the scores.
    """
    logits = _logits(logits)
    E = logits.shape[-1]
    k = _k(k, E, logits.shape)
    z = logits.astype(jnp.float32)
    ids = _choose(z, k, 1, 1, "max")
    weights = jax.nn.sigmoid(jnp.take_along_axis(z, ids, axis=-1))
    probs = jax.nn.sigmoid(z) if return_probs else None
    return _out(weights, ids, probs, return_probs)


# ---------------------------------------------------------------- losses

def _ids(topk_ids, E: int, name: str = "topk_ids") -> jax.Array:
    dt = getattr(topk_ids, "dtype", None)
    if isinstance(topk_ids, np.ndarray) and dt.kind in "iu" and dt.itemsize >= 4 and dt != np.int32:
        # host ids wider than int32 (or unsigned): clamp to [-1, E] before JAX (x64 off) could wrap
        # one into range; out-of-range ids stay out of range
        topk_ids = np.clip(topk_ids, 0 if dt.kind == "u" else -1, E).astype(np.int32)
    topk_ids = jnp.asarray(topk_ids)
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array; got dtype {topk_ids.dtype}")
    if topk_ids.ndim < 1:
        raise ValueError(f"{name} must have shape [..., k]; got shape {topk_ids.shape}")
    return topk_ids


def _mask(mask, lead: tuple, what: str) -> jax.Array:
    """The token mask as float32 of shape ``lead`` (broadcast like NumPy)."""
    if mask is None:
        return jnp.ones(lead, jnp.float32)
    mask = jnp.asarray(mask)
    if not any(jnp.issubdtype(mask.dtype, t) for t in (jnp.bool_, jnp.integer, jnp.floating)):
        raise TypeError(f"mask must be a bool, integer or float array; got dtype {mask.dtype}")
    try:
        ok = np.broadcast_shapes(mask.shape, lead) == tuple(lead)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"mask of shape {mask.shape} does not broadcast to the token shape {tuple(lead)} of {what}")
    return jnp.broadcast_to(mask.astype(jnp.float32), lead)


def _slot_counts(ids: jax.Array, E: int, m: jax.Array) -> jax.Array:
    """Per expert, the sum of the token mask ``m`` over the slots routed to it
    (ids outside [0, E) count for nothing); ``[E]`` in ``m``'s dtype."""
    info = jnp.iinfo(ids.dtype)  # compare in the ids' own dtype: nothing wraps into range
    valid = (ids >= 0) if info.min < 0 else jnp.ones(ids.shape, jnp.bool_)
    if E <= info.max:
        valid = valid & (ids < E)
    flat = jnp.where(valid, ids.astype(jnp.int32), E).reshape(-1)
    wts = jnp.broadcast_to(m.reshape(m.shape + (1,)), ids.shape).reshape(-1)
    return jnp.bincount(flat, weights=wts, length=E + 1)[:E]


def load_balancing_loss(probs: jax.Array, topk_ids: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    """Switch-Transformer / Mixtral auxiliary load-balancing loss,
    ``E * sum_e f_e * P_e``.

    As ``transformers``' ``load_balancing_loss_func`` (``modeling_mixtral.py``,
    commit 00d4b3d2; the same function in Qwen2/3-MoE, OLMoE, Granite-MoE,
    gpt-oss): over the (unmasked) tokens, ``f_e`` = number of the tokens'
    top-k slots routed to expert e / number of tokens, and ``P_e`` = mean
    router probability of e. With ``f_e`` counted over all k slots the loss is
    k when the routing is perfectly balanced (the Switch paper's k = 1 form).
    Differentiable through ``probs`` (``P_e``), not through the counts.

    transformers takes the router logits of all layers concatenated on the
    token axis and chooses ``f_e``'s experts as the top-k of their softmax;
    here ``f_e`` counts the ids the model actually routed to (the same ids for
    the softmax and top-k-then-softmax rules). Several layers: stack them on a
    leading axis (``[L, ..., E]``), which is transformers' concatenation.

    Args:
      probs: ``[..., E]`` router probabilities (``return_probs=True`` of a
        routing function, or ``jax.nn.softmax(logits)``).
      topk_ids: ``[..., k]`` expert ids of the same tokens; ids outside
        ``[0, E)`` are not counted.
      mask: optional token mask (1/True = real token, 0 = padding) that
        broadcasts to ``probs.shape[:-1]`` — e.g. an attention mask ``[B, S]``
        for probs ``[L, B, S, E]``; padding tokens count in neither ``f`` nor
        ``P``. All tokens masked: NaN (as transformers).

    Returns:
      A float32 scalar.
    """
    probs = _logits(probs, "probs")
    lead, E = probs.shape[:-1], probs.shape[-1]
    topk_ids = _ids(topk_ids, E)
    if topk_ids.shape[:-1] != lead:
        raise ValueError(f"topk_ids of shape {topk_ids.shape} must have the token shape {lead} of probs "
                         f"(shape {probs.shape}) followed by k")
    m = _mask(mask, lead, f"probs (shape {probs.shape})")
    n = jnp.sum(m)
    p = probs.astype(jnp.float32)
    P = jnp.sum((p * m.reshape(lead + (1,))).reshape(-1, E), axis=0) / n
    f = jax.lax.stop_gradient(_slot_counts(topk_ids, E, m) / n)
    return E * jnp.sum(f * P)


def router_z_loss(logits: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    """ST-MoE router z-loss: the mean over tokens of ``logsumexp(logits)**2``.

    As ``transformers``' ``router_z_loss_func``
    (``modeling_switch_transformers.py``, commit 00dcc6dd), over every leading
    axis (layers stacked on a leading axis included); computed in float32;
    differentiable in the logits.

    Args:
      logits: ``[..., E]`` router logits, any float dtype.
      mask: optional token mask broadcasting to ``logits.shape[:-1]``; the mean
        is then over the unmasked tokens.

    Returns:
      A float32 scalar.
    """
    logits = _logits(logits)
    lead = logits.shape[:-1]
    m = _mask(mask, lead, f"logits (shape {logits.shape})")
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return jnp.sum(lse * lse * m) / jnp.sum(m)


def expert_counts(topk_ids: jax.Array, num_experts: int, *, mask: jax.Array | None = None) -> jax.Array:
    """Tokens' slots per expert: ``counts[e]`` = number of entries of
    ``topk_ids`` equal to e (ids outside ``[0, num_experts)`` are not counted;
    with ``mask``, only the slots of unmasked tokens). int32 ``[num_experts]``;
    no gradient (an integer count). Cheap: one scatter-add, no one-hot.

    Args:
      topk_ids: ``[..., k]`` expert ids, any integer dtype (NumPy int64/uint64
        beyond int32 are clamped on the host first, so none wraps into range
        when JAX's x64 is off).
      num_experts: E.
      mask: optional token mask broadcasting to ``topk_ids.shape[:-1]``
        (nonzero/True = count the token).
    """
    if not _is_int(num_experts) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int; got num_experts={num_experts!r}")
    E = int(num_experts)
    topk_ids = _ids(topk_ids, E)
    lead = topk_ids.shape[:-1]
    m = _mask(mask, lead, f"topk_ids (shape {topk_ids.shape})")
    return _slot_counts(topk_ids, E, (m != 0).astype(jnp.int32)).astype(jnp.int32)
