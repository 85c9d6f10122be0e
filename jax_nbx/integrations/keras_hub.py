"""keras-hub's MoE models through the fused op, in one call.

``patch_moe(model)`` makes every sparse MoE block of a keras-hub model (a
``CausalLM`` or its backbone) run its routed experts through
`jax_nbx.fused_moe`, in place; ``unpatch_moe(model)`` puts the blocks' own
calls back.  The blocks each keras-hub family ships and what their patched
call follows: `jax_nbx.integrations.keras_hub_blocks` (and docs/keras_hub.md).

Without options nothing about the model's state changes: the same variables,
the same objects in the same order, so checkpoints, ``fit`` and optimizer
state keep working; only the blocks' ``call`` is replaced (an attribute of
each block instance).  Options:

- ``implementation``, ``max_workspace_bytes``, ``precision``: passed to every
  `fused_moe` call.
- ``format`` (and ``group_size``): the routed experts quantized into a
  `jax_nbx.quantize` format ("int8", "int4", "mxfp4", "fp8", "mxfp8",
  "nvfp4").  As Keras' own ``Model.quantize`` does, the float expert
  variables are removed from the model and non-trainable variables holding
  the codes and scales take their place (so the float copy is freed); gpt-oss's
  expert biases stay float and trainable.  Such a patch cannot be undone.
- ``lora_rank`` (``lora_alpha``, ``lora_projections``, ``seed``): LoRA
  adapters on the routed experts (`jax_nbx.LoRA`, initialised as PEFT does:
  B = 0), added as trainable variables; the experts they adapt are frozen
  (``trainable=False``; `unpatch_moe` restores the flag).  `lora_of` reads
  them back, per decoder layer, for `jax_nbx.loaders.to_peft`.

Keras must run on the JAX backend (``KERAS_BACKEND=jax``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ..lora import PROJECTIONS, LoRA
from ..ops import fused_moe
from ..quantization import quantize
from .keras_hub_blocks import KINDS, BlockKind, activation_of, kind_of

__all__ = ["patch_moe", "unpatch_moe", "patched_blocks", "lora_of", "SUPPORTED"]

#: keras-hub's sparse MoE block classes that `patch_moe` patches, by family.
SUPPORTED = {k.family: cls for cls, k in KINDS.items()}

_STATE = "_nbx_patch"


@dataclasses.dataclass(eq=False)
class _Patch:
    """One patched block: its kind, the options of its fused_moe calls, its quantized or LoRA variables."""
    kind: BlockKind
    layer: int
    options: dict
    activation: Any
    k: int | None = None                # Gemma4: the router's top-k (the block itself has none)
    quant: tuple | None = None          # (treedef, [variables]) of the quantized experts
    lora: tuple | None = None           # ({projection: (A variable, B variable)}, scale)
    frozen: list = dataclasses.field(default_factory=list)   # (variable, its trainable flag before)

    def experts(self, block):
        if self.quant is None:
            return self.kind.experts(block)
        treedef, vs = self.quant
        q = jax.tree_util.tree_unflatten(treedef, [v.value for v in vs])
        b = self.kind.biases_split(block)
        return type(q)(q.gate, q.up, q.down, **b) if b else q

    def moe(self, block, x2, w, ids, *, shared=None):
        lora = None
        if self.lora is not None:
            pairs, scale = self.lora
            lora = LoRA(**{p: (a.value, b.value) for p, (a, b) in pairs.items()}, scale=scale)
        return fused_moe(x2, w, ids, self.experts(block), activation=self.activation, shared_experts=shared,
                         lora=lora, **self.options)


def _keras():
    try:
        import keras
    except ImportError as e:  # pragma: no cover - the extra is missing
        raise ImportError("jax_nbx.integrations.keras_hub needs keras and keras-hub "
                          "(pip install 'jax_nbx[keras]')") from e
    if keras.backend.backend() != "jax":
        raise RuntimeError(f"patch_moe: Keras runs on the {keras.backend.backend()!r} backend; the fused op is a "
                           "JAX call (set KERAS_BACKEND=jax before Keras is first imported)")
    return keras


def _backbone(model):
    bb = getattr(model, "backbone", model)
    if not hasattr(bb, "transformer_layers"):
        raise TypeError(f"patch_moe: model must be a keras-hub CausalLM or its Backbone; got {type(model).__name__}")
    return bb


def _looks_moe(layer) -> bool:
    n = type(layer).__name__
    return n.endswith(("SparseMoeBlock", "MoEBlock", "MoeBlock"))


def _blocks(model):
    """(decoder layer index, block, kind, the decoder layer) of every sparse MoE block, refusing
    MoE-looking blocks of a kind not patched."""
    out = []
    for i, dec in enumerate(_backbone(model).transformer_layers):
        for layer in dec._flatten_layers(include_self=False):
            kind = kind_of(layer)
            if kind is not None:
                out.append((i, layer, kind, dec))
            elif _looks_moe(layer):
                raise ValueError(f"patch_moe: decoder layer {i} has the MoE block {type(layer).__name__} "
                                 f"({type(layer).__module__}), which jax_nbx does not patch; patched: "
                                 f"{sorted(KINDS)}")
    return out


def patched_blocks(model) -> list:
    """The blocks of ``model`` patched by `patch_moe`, in decoder order."""
    return [b for _, b, _, _ in _blocks(model) if _STATE in vars(b)]


def _variable(keras, block, name: str, value, *, trainable: bool, autocast: bool):
    v = keras.Variable(np.asarray(value), trainable=trainable, autocast=autocast, name=name)
    block._tracker.unlock()
    try:
        setattr(block, name, v)
    finally:
        block._tracker.lock()
    return v


_QUANTIZE_EXPERTS = 8   # experts quantized at a time: the transient float copies stay a few experts' worth


def _quantize_stacked(ex, fmt: str, group_size):
    """`quantize` of stacked experts, ``_QUANTIZE_EXPERTS`` at a time (every format quantizes each
    expert on its own, so the codes and scales are the same as in one call), concatenated."""
    E = ex.down.shape[0]
    parts = []
    for lo in range(0, E, _QUANTIZE_EXPERTS):
        chunk = jax.tree.map(lambda a: a[lo:lo + _QUANTIZE_EXPERTS], ex)
        leaves, treedef = jax.tree_util.tree_flatten(quantize(chunk, fmt, group_size=group_size))
        parts.append([np.asarray(a) for a in leaves])
    return treedef, [np.concatenate(col) if len(parts) > 1 else col[0] for col in zip(*parts)]


def _quantize(keras, block, p: _Patch, fmt: str, group_size):
    own = p.kind.owner_of(block)
    ex = p.kind.experts(block, [np.asarray(getattr(own, n).value) for n in p.kind.weights])  # no copy (.numpy() made 3)
    if ex.fusion is not None:   # quantize takes experts without biases: the weights alone
        ex = type(ex).fused(ex.gate_up, ex.down, fusion=ex.fusion)
    treedef, leaves = _quantize_stacked(ex, fmt, group_size)
    vs = [_variable(keras, own, f"nbx_q{j}", a, trainable=False, autocast=False) for j, a in enumerate(leaves)]
    own._tracker.unlock()
    try:
        for n in p.kind.weights:   # as Keras' Model.quantize: the float variables leave the model
            delattr(own, n)
    finally:
        own._tracker.lock()
    p.quant = (treedef, vs)


def _add_lora(keras, block, p: _Patch, rank, alpha, projections, seed: int):
    own = p.kind.owner_of(block)
    E = block.num_experts
    ex = p.kind.experts(block)
    H = ex.down.shape[-1]
    I = ex.down.shape[-2]
    init = LoRA.init(jax.random.PRNGKey(seed + p.layer), E, H, I, rank, projections=projections, alpha=alpha)
    pairs = {}
    for name in init.projections:
        a, b = init.pair(name)
        pairs[name] = (_variable(keras, own, f"nbx_lora_{name}_a", a, trainable=True, autocast=True),
                       _variable(keras, own, f"nbx_lora_{name}_b", b, trainable=True, autocast=True))
    p.lora = (pairs, init.scale(init.projections[0]))
    for n in p.kind.weights:   # the adapted experts are frozen, as PEFT freezes its base
        v = getattr(own, n)
        p.frozen.append((v, v.trainable))
        v.trainable = False


def patch_moe(model, *, implementation: str | None = None, max_workspace_bytes: int | str | None = None,
              precision: str | None = None, format: str | None = None, group_size: int | None = None,
              lora_rank: int | None = None, lora_alpha: float | None = None,
              lora_projections: Sequence[str] = PROJECTIONS, seed: int = 0):
    """Make every sparse MoE block of a keras-hub model run its routed experts through `fused_moe`.

    Args:
      model: a keras-hub ``CausalLM`` or ``Backbone`` of a family in `SUPPORTED`, built.
      implementation, max_workspace_bytes, precision: `fused_moe`'s, for every block.
      format, group_size: quantize the routed experts (see the module's docstring).
      lora_rank, lora_alpha, lora_projections, seed: LoRA adapters on the routed experts.

    Returns the model, patched in place.  Raises ValueError naming the block for an MoE block
    jax_nbx does not patch, a block already patched, a model without an MoE block, or an option
    out of range; RuntimeError if Keras is not on the JAX backend.
    """
    keras = _keras()
    blocks = _blocks(model)
    if not blocks:
        raise ValueError(f"patch_moe: {type(model).__name__} has no sparse MoE block of the families patched "
                         f"({', '.join(SUPPORTED)})")
    for _, b, _, _ in blocks:
        if _STATE in vars(b):
            raise ValueError(f"patch_moe: block {b.path!r} is already patched (unpatch_moe first)")
    if lora_rank is not None and (not isinstance(lora_rank, int | np.integer) or isinstance(lora_rank, bool)
                                  or lora_rank < 1):
        raise ValueError(f"patch_moe: lora_rank must be a positive int; got {lora_rank!r}")
    options = {k: v for k, v in (("implementation", implementation), ("max_workspace_bytes", max_workspace_bytes),
                                 ("precision", precision)) if v is not None}
    done = []
    try:
        for i, b, kind, dec in blocks:
            p = _Patch(kind, i, options, activation_of(kind, b))
            if kind.family == "gemma4":
                p.k = int(dec.moe_router.num_experts_per_token)
            if format is not None:
                _quantize(keras, b, p, format, group_size)
            if lora_rank is not None:
                _add_lora(keras, b, p, int(lora_rank), lora_alpha, tuple(lora_projections), seed)
            _install(b, p)
            done.append(b)
    except Exception:
        for b in done:
            if vars(b)[_STATE].quant is None:
                _uninstall(b)
        raise
    _recompile(model)
    return model


def _recompile(model) -> None:
    """Drop the functions Keras compiled before the patch (predict, fit, evaluate, generate), so that
    its next call traces the blocks' new calls (Keras keeps them until ``compile`` otherwise)."""
    for name in ("train_function", "test_function", "predict_function", "generate_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)


def _install(block, p: _Patch) -> None:
    def call(*args, **kwargs):
        return p.kind.call(block, p, *args, **kwargs)
    call.__signature__ = _signature(block)
    vars(block)[_STATE] = p
    vars(block)["call"] = call


def _signature(block):
    import inspect
    return inspect.signature(type(block).call.__get__(block))


def _uninstall(block) -> None:
    p = vars(block).pop(_STATE)
    vars(block).pop("call", None)
    own = p.kind.owner_of(block)
    if p.lora is not None:
        own._tracker.unlock()
        try:
            for name in p.lora[0]:
                delattr(own, f"nbx_lora_{name}_a")
                delattr(own, f"nbx_lora_{name}_b")
        finally:
            own._tracker.lock()
    for v, flag in p.frozen:
        v.trainable = flag


def unpatch_moe(model):
    """Put the original calls of every block `patch_moe` patched back (their LoRA variables removed,
    their experts' trainable flags restored); returns the model.  Raises ValueError for a model
    with no patched block, or one whose experts were quantized (the float weights are gone)."""
    _keras()
    blocks = patched_blocks(model)
    if not blocks:
        raise ValueError(f"unpatch_moe: no block of {type(model).__name__} is patched")
    quant = [b.path for b in blocks if vars(b)[_STATE].quant is not None]
    if quant:
        raise ValueError(f"unpatch_moe: the experts of {quant} were quantized by patch_moe(format=...) and their "
                         "float weights removed; a quantized patch cannot be undone (rebuild the model)")
    for b in blocks:
        _uninstall(b)
    _recompile(model)
    return model


def lora_of(model) -> dict[int, LoRA]:
    """The LoRA adapters `patch_moe(lora_rank=...)` added, by decoder layer index, as concrete
    `jax_nbx.LoRA` values (for `jax_nbx.loaders.to_peft`)."""
    out = {}
    for b in patched_blocks(model):
        p = vars(b)[_STATE]
        if p.lora is None:
            continue
        pairs, scale = p.lora
        out[p.layer] = LoRA(**{n: (jax.numpy.asarray(a.numpy()), jax.numpy.asarray(bv.numpy()))
                               for n, (a, bv) in pairs.items()}, scale=scale)
    if not out:
        raise ValueError(f"lora_of: no block of {type(model).__name__} carries LoRA adapters "
                         "(patch_moe(model, lora_rank=...))")
    return out
