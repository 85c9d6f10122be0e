"""Trace-time validation of `fused_moe`'s arguments: shapes, dtypes, layouts,
formats and ids, each error naming the argument and the value."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import contract
from .activations import Activation, as_activation
from .experts import FLOAT_DTYPES, Experts
from .formats import QuantizedWeight

__all__ = ["validate", "validate_experts", "narrow_ids", "ids_as_int32", "check_slots"]


def _dtype_names() -> str:
    return ", ".join(str(d) for d in FLOAT_DTYPES)


def _validate_quantized(experts: Experts, names) -> None:
    """All projections (and every expert of a list) dense, or all quantized
    alike; each quantized array fits its format."""
    def first(a):
        return a[0] if isinstance(a, (list, tuple)) and len(a) else a

    quant = [isinstance(first(getattr(experts, n)), QuantizedWeight) for n in names]
    if any(quant) and not all(quant):
        kinds = ", ".join(f"{n}: {'quantized' if q else 'dense'}" for n, q in zip(names, quant))
        raise TypeError(f"mixed dense and quantized experts ({kinds}); quantize every projection alike")
    ref = None
    for n in names:
        a = getattr(experts, n)
        items = list(enumerate(a)) if isinstance(a, (list, tuple)) else [(None, a)]
        for e, item in items:
            where = f"experts.{n}" if e is None else f"experts.{n}[{e}]"
            if isinstance(item, QuantizedWeight) != quant[0]:
                raise TypeError(f"mixed dense and quantized experts: {n} expert {e} is "
                                f"{'quantized' if not quant[0] else 'dense'}, expert 0 "
                                f"{'quantized' if quant[0] else 'dense'}")
            if quant[0]:
                item.validate(where)
                if ref is None:
                    ref = (item.kind, item.group_size)
                elif (item.kind, item.group_size) != ref:
                    raise ValueError(f"{where} is {item.kind} (group_size {item.group_size}); other "
                                     f"projections are {ref[0]} (group_size {ref[1]}): quantize every "
                                     "projection alike")


def _per_expert_shapes(experts: Experts, E: int, H: int, I: int) -> dict[str, tuple[int, ...]]:
    """Each weight and bias attribute's per-expert shape in the experts' layout."""
    t = experts.layout == "out_in"
    shapes = {"down": (H, I) if t else (I, H)}
    if experts.is_fused:
        shapes["gate_up"] = (2 * I, H) if t else (H, 2 * I)
        shapes["gate_up_bias"] = (2 * I,)
    else:
        shapes["gate"] = shapes["up"] = (I, H) if t else (H, I)
        shapes["gate_bias"] = shapes["up_bias"] = (I,)
    shapes["down_bias"] = (H,)
    return shapes


def _layout_desc(experts: Experts) -> str:
    return (f"layout={experts.layout!r}" + (f", fusion={experts.fusion!r}" if experts.is_fused else ""))


def validate_experts(experts: Experts) -> tuple[int, int, int]:
    """Shapes and dtypes of stacked or per-expert weights (and biases) in the
    experts' layout; returns (E, H, I), read off the first weight (gate, or
    gate_up when fused)."""
    names = experts.weight_names()
    quantized = [_first(getattr(experts, n)) for n in names]
    quantized = next((q for q in quantized if isinstance(q, QuantizedWeight)), None)
    if quantized is not None and (experts.layout != "in_out" or experts.is_fused):
        raise TypeError(f"quantized experts take the plain layout only (gate, up [E, H, I], "
                        f"down [E, I, H]; biases allowed); got {_layout_desc(experts)}")
    _validate_quantized(experts, names)
    is_list = [isinstance(getattr(experts, n), (list, tuple)) for n in names]
    if any(is_list) and not all(is_list):
        kinds = ", ".join(f"{n}: {'list' if b else 'array'}" for n, b in zip(names, is_list))
        raise TypeError(f"experts.{', experts.'.join(names)} must all be stacked arrays or all "
                        f"lists of per-expert arrays; got {kinds}")
    lists = all(is_list)
    for n in names:
        a = getattr(experts, n)
        if lists:
            if len(a) == 0:
                raise ValueError(f"experts.{n} is an empty list; expected one array per expert")
            if getattr(a[0], "ndim", None) != 2:
                raise ValueError(f"experts.{n}[0] must be a 2-D array; got shape {getattr(a[0], 'shape', None)}")
        elif getattr(a, "ndim", None) != 3:
            raise ValueError(f"experts.{n} must be a 3-D array; got shape {getattr(a, 'shape', None)}")
        if np.dtype(_first(a).dtype) not in FLOAT_DTYPES:
            raise TypeError(f"experts.{n}{'[0]' if lists else ''} has dtype {_first(a).dtype}; "
                            f"expected one of {_dtype_names()}")
    dtypes = [np.dtype(_first(getattr(experts, n)).dtype) for n in names]
    if len(set(dtypes)) > 1:
        raise TypeError(f"experts.{', experts.'.join(names)} must share one dtype; got "
                        f"{', '.join(map(str, dtypes))}")
    first = getattr(experts, names[0])
    E = len(first) if lists else int(first.shape[0])
    if E == 0:
        raise ValueError(f"experts.{names[0]} holds no expert (E=0, shape {tuple(first.shape)}); fused_moe "
                         "needs at least one")
    rows, cols = (int(d) for d in (first[0] if lists else first).shape[-2:])
    if experts.layout == "out_in":
        rows, cols = cols, rows  # [H, I] or [H, 2I] as x @ W
    if experts.is_fused and cols % 2:
        form = "[2I, H]" if experts.layout == "out_in" else "[H, 2I]"
        raise ValueError(f"experts.gate_up has shape {tuple((first[0] if lists else first).shape)}; with "
                         f"{_layout_desc(experts)} each expert's is {form}, whose 2I axis ({cols}) must be even")
    H, I = rows, cols // 2 if experts.is_fused else cols
    want = _per_expert_shapes(experts, E, H, I)
    for n in names + ("gate_bias", "up_bias", "down_bias", "gate_up_bias"):
        a = getattr(experts, n)
        if a is None:
            continue
        if n not in want:
            raise ValueError(f"experts.{n} does not belong to {_layout_desc(experts)} experts")
        bias = n.endswith("_bias")
        if isinstance(a, (list, tuple)):
            if len(a) != E:
                raise ValueError(f"experts.{n} has {len(a)} experts; experts.{names[0]} has {E}")
            arrays = list(enumerate(a))
        else:
            arrays = [(None, a)]
        for e, arr in arrays:
            where = f"experts.{n}" if e is None else f"{n} expert {e}"
            shape = tuple(arr.shape)
            expect = want[n] if e is not None else (E,) + want[n]
            if e is not None and shape != tuple(a[0].shape):
                raise ValueError(f"{where} has shape {shape}, expert 0 {tuple(a[0].shape)}")
            if shape != expect:
                raise ValueError(f"{where} has shape {shape}; expected {expect} for E={E}, H={H}, "
                                 f"I={I} ({_layout_desc(experts)})")
            dt = np.dtype(arr.dtype)
            if dt not in FLOAT_DTYPES:
                raise TypeError(f"{where} has dtype {arr.dtype}; expected one of {_dtype_names()}")
            if not bias and dt != dtypes[0]:
                raise TypeError(f"{where} has dtype {dt}, expert 0 {dtypes[0]}")
    return E, H, I


def _first(a):
    return a[0] if isinstance(a, (list, tuple)) and len(a) else a


def validate(x, topk_weights, topk_ids, experts: Experts, activation: str | Activation,
              local_experts: bool = False) -> tuple[int, int, int, int]:
    """Trace-time checks; returns (E, H, I, k).  ``local_experts``: the
    experts are one shard of more (ids outside are skipped), so k may exceed E."""
    if not isinstance(experts, Experts):
        raise TypeError(f"experts must be a jax_nbx.Experts; got {type(experts).__name__}")
    as_activation(activation)  # names the bad name or parameter
    if x.ndim < 1:
        raise ValueError(f"x must have shape [..., H]; got shape {x.shape}")
    if np.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; expected one of {_dtype_names()}")
    E, H, I = validate_experts(experts)
    if x.shape[-1] != H:
        raise ValueError(f"x has shape {x.shape}; its last axis must be the experts' hidden size H={H}")
    if topk_ids.ndim != x.ndim:
        raise ValueError(f"topk_ids has shape {topk_ids.shape}; expected {x.shape[:-1] + ('k',)} "
                         "(x's leading dims, then k)")
    k = topk_ids.shape[-1]
    if topk_ids.shape != x.shape[:-1] + (k,):
        raise ValueError(f"topk_ids has shape {topk_ids.shape}; expected {x.shape[:-1] + (k,)} "
                         "(x's leading dims, then k)")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights has shape {topk_weights.shape}; expected topk_ids' shape {topk_ids.shape}")
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise TypeError(f"topk_ids has dtype {topk_ids.dtype}; expected an integer dtype")
    if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
        raise TypeError(f"topk_weights has dtype {topk_weights.dtype}; expected a float dtype")
    if k < 1 or (k > E and not local_experts):
        raise ValueError(f"k={k} (last axis of topk_ids {topk_ids.shape}) must be in [1, E={E}]")
    return E, H, I, k


def narrow_ids(ids, E: int):
    """topk_ids as int32: every id in [-1, E] keeps its value and any other
    becomes -1 or E, so an id out of range stays out of range (refused by
    name, or skipped) and never wraps into a valid expert.  Wider or unsigned
    ids are clamped first, in numpy for host arrays (before JAX could wrap
    them; numpy in, numpy out), in JAX for traced ones; unsigned ids are
    clamped from 0, not -1 (which an unsigned dtype would read as its
    largest value)."""
    dt = np.dtype(ids.dtype)
    host = isinstance(ids, np.ndarray)
    if dt.itemsize >= 4 and dt != np.int32:  # int64, uint32, uint64
        lo = 0 if np.issubdtype(dt, np.unsignedinteger) else -1
        ids = np.clip(ids, lo, E) if host else jnp.clip(ids, lo, E)
    return ids.astype(np.int32) if host else ids.astype(jnp.int32)


def ids_as_int32(ids, E: int) -> jax.Array:
    """`narrow_ids` as a JAX array."""
    return jnp.asarray(narrow_ids(ids, E))


def check_slots(T: int, k: int) -> None:
    """T * k slots within the handlers' int32 indices (`contract.MAX_SLOTS`)."""
    if T * k > contract.MAX_SLOTS:
        raise ValueError(f"T * k = {T} * {k} = {T * k} slots exceed the FFI handlers' limit of "
                         f"{contract.MAX_SLOTS} (they index slots with int32); split the tokens over "
                         "several calls")
