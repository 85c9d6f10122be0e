"""`fused_moe`: the public op, its validation, and the FFI call."""
from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from . import _abi, _registry, cpu, memory, metal
from .activations import Activation, as_activation
from .cpu import planned_workers
from .experts import _CHILDREN as _EXPERT_CHILDREN
from .experts import FLOAT_DTYPES, Experts, SharedExperts, WeightLayout
from .quant import QuantizedWeight, is_quantized, quant_format, weight_groups
from .reference import moe_reference

__all__ = ["fused_moe", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("ffi", "xla", "metal")


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


def _validate_experts(experts: Experts) -> tuple[int, int, int]:
    """Shapes and dtypes of stacked or per-expert weights (and biases) in the
    experts' layout; returns (E, H, I), read off the first weight (gate, or
    gate_up when fused)."""
    names = experts.weight_names()
    if not experts.is_plain:
        for n in names:
            if isinstance(_first(getattr(experts, n)), QuantizedWeight):
                raise TypeError(f"quantized experts take the plain layout only (gate, up [E, H, I], "
                                f"down [E, I, H], no biases); got {_layout_desc(experts)}"
                                f"{', with biases' if experts.has_bias else ''}")
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


def _validate(x, topk_weights, topk_ids, experts: Experts, activation: str | Activation,
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
    E, H, I = _validate_experts(experts)
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


def _narrow_ids(ids, E: int):
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


def _ids_as_int32(ids, E: int) -> jax.Array:
    """`_narrow_ids` as a JAX array."""
    return jnp.asarray(_narrow_ids(ids, E))


def _check_slots(T: int, k: int) -> None:
    """T * k slots within the handlers' int32 indices (`_abi.MAX_SLOTS`)."""
    if T * k > _abi.MAX_SLOTS:
        raise ValueError(f"T * k = {T} * {k} = {T * k} slots exceed the FFI handlers' limit of "
                         f"{_abi.MAX_SLOTS} (they index slots with int32); split the tokens over "
                         "several calls")


# XLA status codes that begin a handler's error text (absl::StatusCode names)
_STATUS_CODES = ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "INTERNAL", "FAILED_PRECONDITION",
                 "OUT_OF_RANGE", "UNIMPLEMENTED", "UNKNOWN", "UNAVAILABLE", "ABORTED",
                 "DEADLINE_EXCEEDED", "DATA_LOSS", "NOT_FOUND", "ALREADY_EXISTS",
                 "PERMISSION_DENIED", "CANCELLED", "UNAUTHENTICATED")


def _as_runtime_error(err: BaseException) -> BaseException:
    """A handler's run-time error as the type the docs promise: a refusal as
    `DeviceOOMError`, any other status as ``JaxRuntimeError``.  JAX's C++
    dispatch fast path (taken once a jitted call of the same signature has
    succeeded) raises a failed status as a plain ``ValueError`` with the same
    text (jax-ml/jax#34083); a ``ValueError`` whose text starts with a status
    code is that, and is retyped.  Any other error is returned untouched."""
    oom = memory.as_device_oom(err)
    if oom is not err:
        return oom
    if type(err) is ValueError and str(err).split(":", 1)[0] in _STATUS_CODES:
        return jax.errors.JaxRuntimeError(str(err))
    return err


def _resolve_implementation(implementation: str | None, quantized: bool = False,
                            plain: bool = True) -> str:
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None; got {implementation!r}")
    platform = jax.default_backend()
    has_handler = _registry.has_handler(platform)
    if implementation == "metal":
        if platform != "cpu":
            raise ValueError(f"implementation='metal' runs under JAX's CPU client; the default "
                             f"backend is {platform!r}")
        if not metal.available():
            raise ValueError("implementation='metal': no Metal device is active "
                             f"({metal.unavailable_reason()})")
        return implementation
    if implementation is None:
        # macOS on Apple silicon: Metal for the plain layout (the others: the CPU handler)
        if platform == "cpu" and not quantized and plain and metal.is_default():
            return "metal"
        return "ffi" if has_handler else "xla"
    if implementation == "ffi" and not has_handler:
        raise ValueError(f"implementation='ffi': jax_nbx has no handler for platform {platform!r} "
                         f"(handlers: {_registry.platforms()}); use implementation='xla'")
    return implementation


def plan_band_tokens(T: int, k: int, E: int, H: int, I: int,
                     max_workspace_bytes: int | None = None, backward: bool = False,
                     bf16_dot: bool = False) -> int:
    """Tokens per band so that one band's workspace fits the CPU budget
    (or ``max_workspace_bytes``); equal-sized bands.  ``backward=True``: the
    bands of the CPU backward handler (its workspace holds ``2H + 3I``
    float32 values per slot).  Raises DeviceOOMError with the advice when a
    single token does not fit."""
    if backward:
        workspace = memory.fused_moe_backward_workspace_bytes
    else:
        workspace = functools.partial(memory.fused_moe_workspace_bytes, bf16_dot=bf16_dot)
    return memory.plan_bands(lambda t: workspace(t, k, E, H, I), T, H, "cpu", max_workspace_bytes,
                             f"({'backward, ' if backward else ''}E={E} k={k} H={H} I={I})")


def _poisoned_call(target: str, outs, operands, attrs):
    """The tests' twin of a handler: one NaN-filled input per result after
    the operands, aliased to it, so that an element the handler leaves
    unwritten shows (registered by `_registry.register_testing`)."""
    twins = [jnp.full(o.shape, jnp.nan, o.dtype) for o in outs]
    call = jax.ffi.ffi_call(target, outs, vmap_method="sequential",
                            input_output_aliases={len(operands) + i: i for i in range(len(outs))})
    return call(*operands, *twins, **attrs)


def _native_layout(weights, lists: bool) -> WeightLayout:
    """The views of plain (gate, up, down) weights, from the arrays."""
    g = weights[0]
    d = weights[2 * (len(weights) // 3) if lists else 2]
    return WeightLayout.plain(H=int(d.shape[-1]), I=int(g.shape[-1]))


def _split_arrays(arrays, layout: WeightLayout):
    """(weights, biases) of the handlers' operands: the weight groups (2 when
    fused, else 3; one array or E each), then 3 biases when ``layout.bias``."""
    nb = 3 if layout.bias else 0
    weights = arrays[:len(arrays) - nb]
    return weights, arrays[len(arrays) - nb:]


def _num_experts(weights, layout: WeightLayout, lists: bool) -> int:
    groups = 2 if layout.fused else 3
    return len(weights) // groups if lists else int(weights[0].shape[0])


def _ffi_forward(x, w, ids, *arrays, activation: str | Activation, band_tokens: int,
                 poison: bool = False, platform: str = "cpu", lists: bool = False,
                 skip_outside: bool = False, layout: WeightLayout | None = None,
                 bf16_dot: bool = False):
    """The raw FFI call on 2-D inputs (no batching rule, no derivative).

    ``arrays``: the weights as `Experts.flat` gives them (groups gate, up,
    down, or gate_up, down when ``layout.fused``; each one stacked array or,
    with ``lists=True``, E per-expert arrays; dense or `QuantizedWeight`),
    then with ``layout.bias`` the three float32 biases of
    `Experts.handler_biases`.  ``layout`` (`WeightLayout`; None: the plain
    layout read off the arrays) says how the handler reads each expert's
    matrices in place.  They reach the handler as the contract's buffer groups
    (`jax_nbx._abi`: weights, then scales, then zeros), read in place.
    ``band_tokens`` > 0 cuts the tokens into bands of that many (0: one band).
    ``poison=True`` (tests, CPU) hands the handler an output buffer filled with
    NaN, so any row it fails to write shows.  ``platform="gpu"``: the CUDA handler.
    ``skip_outside``: slots whose id is outside ``[0, E)`` are skipped, not an error.
    ``bf16_dot``: ``precision="bfloat16"`` (CPU: the bfloat16 dot-product kernels).
    """
    _check_slots(*ids.shape)  # (a vmapped batch folds into the tokens: checked again here)
    activation = as_activation(activation)
    if layout is None:
        layout = _native_layout(arrays, lists)
    if platform == "metal" and poison:
        raise ValueError("the Metal path has no poisoned test twin")
    if platform == "metal" and not layout.native:
        raise ValueError(f"the {platform} handler reads the plain layout only (no biases, no fused or "
                         "transposed weights)")
    if bf16_dot and platform != "cpu":
        raise ValueError(f"precision='bfloat16' runs on the CPU handler only (this call: {platform})")
    if platform == "gpu":
        from . import _cuda

        return _cuda.forward(x, w, ids, *arrays, activation=activation,
                             band_tokens=band_tokens, lists=lists, skip_outside=skip_outside,
                             layout=layout)
    weights, biases = _split_arrays(arrays, layout)
    if layout.native:
        groups, E, _, quant, _, _ = weight_groups(weights, lists)
        bufs = [b for g in groups for b in (g if lists else g[:1])]
    else:
        E, quant, bufs = _num_experts(weights, layout, lists), None, list(weights)
    bufs += [b.astype(jnp.float32) for b in biases]
    attrs = dict(**activation.attrs(), **layout.attrs(),
                 band_tokens=np.int64(band_tokens), max_workers=np.int64(planned_workers()),
                 skip_outside=bool(skip_outside), num_experts=np.int64(E),
                 format=np.int32(_abi.FORMAT_CODES[quant[0] if quant else None]),
                 stacked=not lists, group_size=np.int64(quant[1] if quant else 0),
                 bf16_dot=bool(bf16_dot))
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if poison:
        (y,) = _poisoned_call(_abi.TARGET_FORWARD_POISONED, [out], [x, w, ids, *bufs], attrs)
        return y
    target = _abi.TARGET_METAL_FORWARD if platform == "metal" else _abi.TARGET_FORWARD
    call = jax.ffi.ffi_call(target, out, vmap_method="sequential")
    return call(x, w, ids, *bufs, **attrs)


def _ffi_backward(dy, x, w, ids, *arrays, activation: str | Activation, band_tokens: int,
                  lists: bool = False, skip_outside: bool = False, poison: bool = False,
                  layout: WeightLayout | None = None):
    """The CPU backward handler on 2-D inputs: returns ``(dx, dw, dweights)``
    with ``dweights`` in ``arrays``' order (`_ffi_forward`'s operands: the
    weights' gradients in their dtypes and layouts, then with ``layout.bias``
    the three float32 bias gradients).  The handler accumulates in float32
    (cast here once).  ``poison=True`` (tests): every result buffer starts
    NaN-filled."""
    activation = as_activation(activation)
    if layout is None:
        layout = _native_layout(arrays, lists)
    weights, biases = _split_arrays(arrays, layout)
    biases = [b.astype(jnp.float32) for b in biases]
    E = _num_experts(weights, layout, lists)
    outs = ([jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, jnp.float32)]
            + [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (*weights, *biases)])
    attrs = dict(**activation.attrs(), **layout.attrs(),
                 band_tokens=np.int64(band_tokens), max_workers=np.int64(planned_workers()),
                 skip_outside=bool(skip_outside), num_experts=np.int64(E), stacked=not lists)
    operands = [dy.astype(x.dtype), x, w, ids, *weights, *biases]
    if poison:
        dx, dw, *dws = _poisoned_call(_abi.TARGET_BACKWARD_POISONED, outs, operands, attrs)
    else:
        call = jax.ffi.ffi_call(_abi.TARGET_BACKWARD, outs, vmap_method="sequential")
        dx, dw, *dws = call(*operands, **attrs)
    return dx, dw, [d.astype(a.dtype) for d, a in zip(dws, arrays)]


def _weight_grads(experts: Experts, dws) -> Experts:
    """The handlers' weight gradients (`Experts.flat` order) as an `Experts`
    pytree like ``experts`` (bias leaves None)."""
    per = experts.num_experts if experts.is_list else 1
    names = experts.weight_names()
    children = {n: (list(dws[i * per:(i + 1) * per]) if experts.is_list else dws[i])
                for i, n in enumerate(names)}
    return Experts.tree_unflatten((experts.layout, experts.fusion),
                                  [children.get(n) for n in _EXPERT_CHILDREN])


def _bias_grads(experts: Experts, dbiases) -> Experts | None:
    """The handlers' float32 bias gradients mapped back through
    `Experts.handler_biases` onto ``experts``' own bias leaves (fused, lists,
    dtypes); weight leaves None."""
    bias_names = [n for n in _EXPERT_CHILDREN if n.endswith("_bias")]
    leaves = {n: getattr(experts, n) for n in bias_names}

    def biases(b):
        e = Experts.tree_unflatten((experts.layout, experts.fusion),
                                   [b.get(n) if n in b else getattr(experts, n) for n in _EXPERT_CHILDREN])
        return e.handler_biases()

    present = {n: v for n, v in leaves.items() if v is not None}
    _, vjp = jax.vjp(biases, present)
    (d,) = vjp(tuple(dbiases))
    return Experts.tree_unflatten((experts.layout, experts.fusion), [d.get(n) for n in _EXPERT_CHILDREN])


@functools.cache
def _ffi_op(activation: Activation, band_tokens: int, platform: str = "cpu", lists: bool = False,
            skip_outside: bool = False, max_workspace_bytes: int | str | None = None,
            layout: WeightLayout | None = None, bf16_dot: bool = False):
    """The FFI op on 2-D inputs with a batching rule and a derivative (on the
    CPU the backward is its own handler; on CUDA, dense experts, the CUDA
    backward handler; elsewhere the reference's VJP)."""
    raw = functools.partial(_ffi_forward, activation=activation, band_tokens=band_tokens,
                            platform=platform, lists=lists, skip_outside=skip_outside, layout=layout,
                            bf16_dot=bf16_dot)

    @custom_vmap
    def forward(x, w, ids, *weights):
        return raw(x, w, ids, *weights)

    @forward.def_vmap
    def _batch(axis_size, in_batched, x, w, ids, *weights):
        # Experts shared across the batch: the batch is just more tokens.
        args = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
                for a, b in zip((x, w, ids), in_batched[:3])]
        if not any(jax.tree.leaves(in_batched[3:])):  # weights may be QuantizedWeight pytrees
            xb, wb, ib = args
            B, T, H = xb.shape
            k = wb.shape[-1]  # (not -1: an empty batch has nothing to infer it from)
            y = forward(xb.reshape(B * T, H), wb.reshape(B * T, k), ib.reshape(B * T, k), *weights)
            return y.reshape(B, T, H), True
        # Experts differ per batch element: one call per element.
        ex = [jax.tree.map(lambda a, b: a if b else jnp.broadcast_to(a, (axis_size,) + a.shape), wt, bt)
              for wt, bt in zip(weights, in_batched[3:])]
        return jax.lax.map(lambda a: forward(*a), (*args, *ex)), True

    @jax.custom_vjp
    def op(x, w, ids, experts):
        return forward(x, w, ids, *experts.flat(), *experts.handler_biases())

    def op_fwd(x, w, ids, experts):
        return op(x, w, ids, experts), (x, w, ids, experts)

    def op_bwd(res, g):
        x, w, ids, experts = res
        if is_quantized(experts):  # quantized weights are frozen: dx and dw only
            _, vjp = jax.vjp(lambda x_, w_: moe_reference(x_, w_, ids, experts, activation), x, w)
            dx, dw = vjp(g)
            return dx, dw, None, None
        if platform in ("cpu", "gpu"):
            T, H = x.shape
            flat = experts.flat()
            if platform == "cpu":
                band = plan_band_tokens(T, ids.shape[1], experts.num_experts, H, experts.intermediate,
                                        max_workspace_bytes, backward=True)
                backward = _ffi_backward
            else:  # the CUDA backward (dense experts; not yet run on a GPU)
                from . import _cuda

                band = _cuda.plan_backward_band_tokens(T, ids.shape[1], experts.num_experts, H,
                                                       experts.intermediate, experts.dtype,
                                                       max_workspace_bytes)
                backward = _cuda.backward
            dx, dw, dws = backward(g, x, w, ids, *flat, *experts.handler_biases(),
                                   activation=activation, band_tokens=band, lists=lists,
                                   skip_outside=skip_outside, layout=layout)
            dexperts = _weight_grads(experts, dws[:len(flat)])
            if experts.has_bias:
                dbias = _bias_grads(experts, dws[len(flat):])
                dexperts = Experts.tree_unflatten(
                    (experts.layout, experts.fusion),
                    [getattr(dexperts, n) if getattr(dexperts, n) is not None else getattr(dbias, n)
                     for n in _EXPERT_CHILDREN])
            return dx, dw, None, dexperts
        _, vjp = jax.vjp(lambda x_, w_, e_: moe_reference(x_, w_, ids, e_, activation), x, w, experts)
        dx, dw, dexperts = vjp(g)
        return dx, dw, None, dexperts

    op.defvjp(op_fwd, op_bwd)
    return op


def fused_moe(
    x: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    experts: Experts,
    *,
    activation: Literal["swiglu", "geglu", "geglu_erf", "swiglu_clamped"] | Activation = "swiglu",
    implementation: Literal["ffi", "xla", "metal"] | None = None,
    max_workspace_bytes: int | str | None = None,
    ids_outside: Literal["error", "skip"] = "error",
    weights_on: Literal["output", "input"] = "output",
    shared_experts: SharedExperts | None = None,
    precision: Literal["float32", "bfloat16"] | None = None,
) -> jax.Array:
    """The MoE feed-forward block: route each token to its k experts, run each
    expert's gated MLP on the tokens it received, add the results back
    weighted by the router.

    ``y[t] = sum_j topk_weights[t, j] * mlp_{topk_ids[t, j]}(x[t])`` with
    ``mlp_e(v) = (act(v @ gate[e]) * (v @ up[e])) @ down[e]``.

    Args:
      x: ``[..., H]`` activations, float32, bfloat16 or float16.
      topk_weights: ``[..., k]`` routed weights (any float dtype; used as float32).
      topk_ids: ``[..., k]`` expert ids in ``[0, E)`` (any integer dtype).
        On the FFI path an id outside the range raises at run time
        (``INVALID_ARGUMENT`` naming the position and the id); the "xla"
        path drops such slots.
      experts: `Experts` with ``gate, up [E, H, I]`` and ``down [E, I, H]``,
        or lists of E per-expert arrays (read in place, never stacked), or
        in the checkpoint's layout (``layout="out_in"``, `Experts.fused`
        gate||up concatenated or interleaved; read in place by the CPU
        handler, never transposed into a copy) with optional gate, up and
        down biases (the CPU handler, the CUDA kernels and the "xla" path;
        the Metal handler takes the plain layout without biases and says so), dense
        or quantized (`jax_nbx.quantize`: int8, int4 in groups; quantized
        weights are frozen: no gradient flows to them).
      activation: the experts' gated unit (`jax_nbx.activations`): ``"swiglu"``
        (silu gate), ``"geglu"`` (tanh-approximated gelu gate), ``"geglu_erf"``
        (exact gelu gate), ``"swiglu_clamped"`` (gpt-oss), or an
        ``Activation("swiglu_clamped", alpha=..., limit=...)`` with its parameters.
      implementation: ``"ffi"`` (jax_nbx's handler for the current platform:
        the CPU handler, or on a CUDA GPU the Triton kernels launched by the
        CUDA handler), ``"xla"`` (the pure-JAX reference, every platform), or
        ``None``: ``"metal"`` on macOS on Apple silicon when Metal is active
        (`jax_nbx.metal.is_default`; dense experts), else ``"ffi"`` where a
        handler exists for ``jax.default_backend()``, else ``"xla"``.
        ``"metal"``: the Metal handler on the active Metal device
        (`jax_nbx.metal`: Metal kernels for the expert GEMMs, a decode variant
        for T*k <= 16 slots, float32/bfloat16/float16 x and dense weights;
        gradients from the reference's VJP until a Metal backward exists; on
        Linux only the simulated device, ``JAX_NBX_METAL=sim``).  On CUDA, 16-bit weights run on tensor cores: x and
        the intermediate are rounded to the weights' dtype before each
        product (float32 accumulation).
      max_workspace_bytes: cap on the handler's workspace for this call
        (bytes or ``"512MiB"``) instead of the account's headroom (of
        ``cpu:0``, or ``cuda:0`` on the CUDA path).  The tokens
        are cut into bands whose workspace fits; results are bit-identical
        whatever the bands.  The plan is made at trace time (shapes are
        static) and kept by ``jax.jit``.
      ids_outside: what an id outside ``[0, E)`` means on the FFI path:
        ``"error"`` (default: the call fails naming it) or ``"skip"`` (the
        slot contributes nothing: expert parallelism, where ids of experts
        held elsewhere are out of the local range; `jax_nbx.sharded_moe`).
        The "xla" path always skips them.

      weights_on: where the routed weight applies: ``"output"`` (default:
        ``w * mlp(x)``) or ``"input"`` (Llama-4: ``mlp(w * x)``; the op runs
        on one scaled row per slot, ``T*k`` rows of x's size, every path).
        Only the k routed experts run: transformers' Llama-4 feeds every
        expert ``0 * x`` besides, which adds nothing for its bias-free
        experts but would add ``mlp(0)`` for experts with biases.
      shared_experts: `SharedExperts` run on every token in the same call
        and added (DeepSeek, Qwen2-MoE with its sigmoid gate, Llama-4); they
        take the same ``activation`` and ``implementation``, and run as one
        more pass of the same handler over the tokens (its own experts, E=S).
      precision: the CPU handler's arithmetic, in the spirit of
        ``jax.lax.Precision``: ``"float32"`` (every product in float32, x and
        the intermediate kept in float32) or ``"bfloat16"`` (x and the
        intermediate ``act(x@gate) * (x@up)`` rounded to bfloat16, each sum
        taken over pairs of products as the x86 instruction VDPBF16PS does:
        float32 fused multiply-adds, the odd row of a pair first, denormals
        flushed; `jax_nbx.cpu.dot_kernels` says whether the instruction
        (``"avx512_bf16"``), the same arithmetic on float32 FMAs (``"fma"``:
        AVX2/AVX-512 CPUs without it, about the float32 path's speed) or its
        scalar emulation (``"emulated"``, far slower) runs; all three give
        the same bits where the instruction does what Intel documents).
        ``None`` (default): ``"bfloat16"`` where x is bfloat16, the experts
        (shared ones included) can take it and the CPU has the instruction
        (`jax_nbx.cpu.bf16_dot_by_default`, read when the call is traced; not
        yet run on such a CPU, see the README's status table), else
        ``"float32"``.  Error: about one bfloat16 rounding of x and of the
        intermediate, i.e. a relative ``~2**-8`` per element against the
        float32 arithmetic, the rounding HF transformers' bfloat16 models
        do.  For dense bfloat16 experts stored by rows (``layout="in_out"``,
        not interleaved), on the CPU handler.  Decode streams experts of at
        most 6 rows (the fma kernels, on the instruction's CPUs too) with
        the bits the packed kernels give; with the emulation every expert
        packs.  Gradients are those of the float32 arithmetic (the roundings
        pass gradients through unchanged).

    Returns:
      ``y`` with x's shape and dtype; accumulation is float32.

    Works eagerly, under ``jax.jit``, ``jax.vmap`` (experts shared across the
    batch fold into the token axis; per-element experts run one call per
    element) and ``jax.grad``: gradients flow to x, topk_weights and the
    experts (lists get lists of gradients), never to topk_ids.  On the CPU
    the backward is a fused handler that saves nothing but the op's inputs
    (it recomputes the gate and up projections) and plans its own bands
    against the same budget; quantized experts are frozen (dx and
    d(topk_weights) only, from the reference's VJP), and the CUDA path
    differentiates the "xla" reference.

    Raises:
      ValueError / TypeError at trace time for mismatched shapes, ranks,
      dtypes, ``k > E`` or an unknown activation/implementation.
      `jax_nbx.DeviceOOMError` at trace time when one token's workspace does
      not fit, and eagerly when the account refuses at run time (under jit
      the refusal is a ``JaxRuntimeError`` whose text carries the same
      advice; ``jax_nbx.memory.last_refusal()`` has the record).
    """
    x = jnp.asarray(x)
    topk_weights = jnp.asarray(topk_weights)
    # host ids stay numpy until they are narrowed (_ids_as_int32): JAX with x64
    # off would wrap 64-bit values into int32 on the way in
    if not isinstance(topk_ids, (jax.Array, jax.core.Tracer)):
        topk_ids = np.asarray(topk_ids)
    if isinstance(experts, Experts):
        experts = jax.tree.map(jnp.asarray, experts)
    if ids_outside not in ("error", "skip"):
        raise ValueError(f"ids_outside must be 'error' or 'skip'; got {ids_outside!r}")
    if weights_on not in ("output", "input"):
        raise ValueError(f"weights_on must be 'output' or 'input'; got {weights_on!r}")
    if shared_experts is not None and not isinstance(shared_experts, SharedExperts):
        raise TypeError("shared_experts must be a jax_nbx.SharedExperts or None; got "
                        f"{type(shared_experts).__name__}")
    E, H, I, k = _validate(x, topk_weights, topk_ids, experts, activation, ids_outside == "skip")
    activation = as_activation(activation)
    impl = _resolve_implementation(implementation, is_quantized(experts), experts.is_plain)
    if precision is None:
        bf16_dot = _bf16_dot_by_default(x.dtype, impl, experts, shared_experts)
    else:
        bf16_dot = _bf16_dot(precision, impl, experts)
        if shared_experts is not None and bf16_dot:
            _bf16_dot(precision, impl, shared_experts.experts, "shared_experts")
    run = functools.partial(_routed, activation=activation, implementation=implementation,
                            max_workspace_bytes=max_workspace_bytes, ids_outside=ids_outside,
                            bf16_dot=bf16_dot)

    lead = x.shape[:-1]
    T = int(np.prod(lead, dtype=np.int64))
    if T == 0:
        return jnp.zeros(x.shape, x.dtype)
    x2 = x.reshape(T, H)
    w2 = topk_weights.reshape(T, k).astype(jnp.float32)
    ids2 = _ids_as_int32(topk_ids, E).reshape(T, k)
    if weights_on == "input":  # one row per slot, scaled by its weight; unit weights
        xs = (x2[:, None, :].astype(jnp.float32) * w2[:, :, None]).astype(x.dtype).reshape(T * k, H)
        y = run(xs, jnp.ones((T * k, 1), jnp.float32), ids2.reshape(T * k, 1), experts, impl, E, H, I, 1)
        y = y.reshape(T, k, H).astype(jnp.float32).sum(axis=1).astype(x.dtype)
    else:
        y = run(x2, w2, ids2, experts, impl, E, H, I, k)
    if shared_experts is not None:
        y = y.astype(jnp.float32) + _shared(x2, shared_experts, run, activation, implementation)
        y = y.astype(x.dtype)
    return y.reshape(x.shape)


def _ffi_platform() -> str:
    """The handler platform ``implementation="ffi"`` reaches from the default
    backend: "gpu" (the CUDA handler) or "cpu"."""
    return "gpu" if jax.default_backend() == "gpu" else "cpu"


def _bf16_dot(precision, impl: str, experts, what: str = "experts") -> bool:
    """Whether ``precision`` asks for the bfloat16 dot-product kernels;
    ValueError where they cannot run (names the argument and the value)."""
    if precision is None or precision == "float32":
        return False
    if precision != "bfloat16":
        raise ValueError(f"precision must be None, 'float32' or 'bfloat16'; got {precision!r}")
    why = _why_no_bf16_dot(impl, experts, what)
    if why:
        raise ValueError(f"precision='bfloat16' {why}")
    return True


def _why_no_bf16_dot(impl: str, experts, what: str) -> str:
    """Why the bfloat16 dot-product kernels cannot run these experts ("" when
    they can), worded to follow "precision='bfloat16' "."""
    platform = _ffi_platform()
    if impl != "ffi" or platform != "cpu":
        return ("runs on the CPU handler only (implementation='ffi' on the CPU); this call resolves "
                f"to implementation={impl!r} on {platform!r}")
    if is_quantized(experts) or np.dtype(experts.dtype) != np.dtype(jnp.bfloat16):
        kind = "quantized" if is_quantized(experts) else np.dtype(experts.dtype).name
        return f"needs dense bfloat16 {what}; these are {kind}"
    if experts.layout != "in_out" or experts.fusion == "interleaved":
        return (f"reads {what} stored by rows (layout='in_out', not interleaved); these have "
                f"layout={experts.layout!r}, fusion={experts.fusion!r}")
    return ""


def _bf16_dot_by_default(x_dtype, impl: str, experts, shared_experts) -> bool:
    """``precision=None``: the bfloat16 dot-product kernels where x is
    bfloat16, every expert (shared ones included) can run them, and the CPU
    runs them on the instruction (`cpu.bf16_dot_by_default`, read when the
    call is traced); float32 arithmetic everywhere else (the fma kernels are
    not faster than it, the emulation far slower)."""
    if np.dtype(x_dtype) != np.dtype(jnp.bfloat16):
        return False
    groups = [experts] + ([shared_experts.experts] if shared_experts is not None else [])
    if any(not isinstance(e, Experts) or _why_no_bf16_dot(impl, e, "experts") for e in groups):
        return False
    return cpu.bf16_dot_by_default()


def _shared(x2, shared: SharedExperts, run, activation: Activation, implementation) -> jax.Array:
    """The shared experts' float32 output on 2-D x: every token to each of the
    S experts with weight 1, or Qwen2-MoE's ``sigmoid(x @ gate.T)``."""
    ex = shared.experts
    if not isinstance(ex, Experts):
        raise TypeError(f"shared_experts.experts must be a jax_nbx.Experts; got {type(ex).__name__}")
    ex = jax.tree.map(jnp.asarray, ex)
    T, H = x2.shape
    try:
        S, Hs, Is = _validate_experts(ex)
    except (TypeError, ValueError) as e:
        raise type(e)(f"shared_experts: {e}") from None
    if Hs != H:
        raise ValueError(f"shared_experts have hidden size {Hs}; x's is {H}")
    w = jnp.ones((T, S), jnp.float32)
    if shared.gate is not None:
        g = jnp.asarray(shared.gate)
        if g.shape not in ((H,), (1, H)):
            raise ValueError(f"shared_experts.gate has shape {g.shape}; expected (1, {H}) (nn.Linear(H, 1)) "
                             f"or ({H},)")
        w = w * jax.nn.sigmoid(x2.astype(jnp.float32) @ g.reshape(H).astype(jnp.float32))[:, None]
    ids = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (T, S))
    impl = _resolve_implementation(implementation, is_quantized(ex), ex.is_plain)
    return run(x2, w, ids, ex, impl, S, H, Is, S).astype(jnp.float32)


def _routed(x2, w2, ids2, experts: Experts, impl: str, E: int, H: int, I: int, k: int, *,
            activation: Activation, implementation, max_workspace_bytes, ids_outside: str,
            bf16_dot: bool = False) -> jax.Array:
    """One pass of the chosen implementation on 2-D inputs (validated)."""
    T = x2.shape[0]
    if impl != "xla":
        _check_slots(T, k)
    if impl == "metal" and is_quantized(experts):  # (the handler checks again at run time)
        raise ValueError("quantized experts are not supported on the Metal path yet")
    if impl == "xla":
        return moe_reference(x2, w2, ids2, experts, activation)
    platform = _ffi_platform()
    if impl == "metal":
        platform = "metal"
    if platform == "metal" and not experts.is_plain:
        what = [w for w, on in (("biases", experts.has_bias),
                                (f"layout={experts.layout!r}", experts.layout != "in_out"),
                                (f"fusion={experts.fusion!r}", experts.is_fused)) if on]
        raise ValueError("the Metal handler takes plain experts "
                         f"(gate, up [E, H, I], down [E, I, H], no biases); these have {', '.join(what)}: "
                         "use implementation='xla' or the CPU handler")
    if impl == "metal":
        band = memory.plan_bands(
            lambda t: int(_registry.ffi_module().metal_forward_workspace_bytes(t, k, E, H, I)),
            T, H, "metal", max_workspace_bytes, f"(Metal, E={E} k={k} H={H} I={I})")
    elif platform == "gpu":
        from . import _cuda

        band = _cuda.plan_band_tokens(T, k, E, H, I, experts.dtype, max_workspace_bytes,
                                      quant_format(experts))
    else:
        band = plan_band_tokens(T, k, E, H, I, max_workspace_bytes, bf16_dot=bf16_dot)
    layout = experts.weight_layout()
    try:
        y = _ffi_op(activation, band, platform, experts.is_list, ids_outside == "skip",
                    max_workspace_bytes, layout, bf16_dot)(x2, w2, ids2, experts)
        if not isinstance(y, jax.core.Tracer):  # eager: surface a refusal here
            y.block_until_ready()
    except (jax.errors.JaxRuntimeError, ValueError) as e:  # eager errors may arrive as either
        err = _as_runtime_error(e)
        if err is e:
            raise
        raise err from None
    return y
