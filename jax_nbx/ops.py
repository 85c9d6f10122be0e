"""`fused_moe`: the public op, its validation, and the FFI call."""
from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from . import _abi, _registry, memory, metal
from .activations import Activation, as_activation
from .cpu import planned_workers
from .experts import FLOAT_DTYPES, Experts
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


def _validate_experts(experts: Experts) -> tuple[int, int, int]:
    """Shapes and dtypes of stacked or per-expert weights; returns (E, H, I)."""
    names = ("gate", "up", "down")
    _validate_quantized(experts, names)
    is_list = [isinstance(getattr(experts, n), (list, tuple)) for n in names]
    if any(is_list) and not all(is_list):
        kinds = ", ".join(f"{n}: {'list' if b else 'array'}" for n, b in zip(names, is_list))
        raise TypeError("experts.gate, experts.up and experts.down must all be stacked arrays or all "
                        f"lists of per-expert arrays; got {kinds}")
    if all(is_list):
        E = len(experts.gate)
        if E == 0:
            raise ValueError("experts.gate is an empty list; expected one array per expert")
        for n in names[1:]:
            if len(getattr(experts, n)) != E:
                raise ValueError(f"experts.{n} has {len(getattr(experts, n))} experts; experts.gate has {E}")
        for n in names:
            lst = getattr(experts, n)
            a0 = lst[0]
            if getattr(a0, "ndim", None) != 2:
                raise ValueError(f"experts.{n}[0] must be a 2-D array; got shape {getattr(a0, 'shape', None)}")
            if np.dtype(a0.dtype) not in FLOAT_DTYPES:
                raise TypeError(f"experts.{n}[0] has dtype {a0.dtype}; expected one of {_dtype_names()}")
            for e, a in enumerate(lst):
                if tuple(a.shape) != tuple(a0.shape):
                    raise ValueError(f"{n} expert {e} has shape {tuple(a.shape)}, expert 0 {tuple(a0.shape)}")
                if a.dtype != a0.dtype:
                    raise TypeError(f"{n} expert {e} has dtype {a.dtype}, expert 0 {a0.dtype}")
        H, I = experts.gate[0].shape
        if tuple(experts.up[0].shape) != (H, I):
            raise ValueError(f"experts.up[0] has shape {tuple(experts.up[0].shape)}; expected gate's {(H, I)} [H, I]")
        if tuple(experts.down[0].shape) != (I, H):
            raise ValueError(f"experts.down[0] has shape {tuple(experts.down[0].shape)}; expected {(I, H)} [I, H]")
        g, u, d = (np.dtype(getattr(experts, n)[0].dtype) for n in names)
        if not g == u == d:
            raise TypeError(f"experts.gate, experts.up and experts.down must share one dtype; got {g}, {u}, {d}")
        return E, H, I
    for name in names:
        a = getattr(experts, name)
        if getattr(a, "ndim", None) != 3:
            raise ValueError(f"experts.{name} must be a 3-D array; got shape {getattr(a, 'shape', None)}")
        if np.dtype(a.dtype) not in FLOAT_DTYPES:
            raise TypeError(f"experts.{name} has dtype {a.dtype}; expected one of {_dtype_names()}")
    E, H, I = experts.gate.shape
    if experts.up.shape != (E, H, I):
        raise ValueError(f"experts.up has shape {experts.up.shape}; expected gate's shape {(E, H, I)} [E, H, I]")
    if experts.down.shape != (E, I, H):
        raise ValueError(f"experts.down has shape {experts.down.shape}; expected {(E, I, H)} [E, I, H]")
    if experts.up.dtype != experts.gate.dtype or experts.down.dtype != experts.gate.dtype:
        raise TypeError("experts.gate, experts.up and experts.down must share one dtype; got "
                        f"{experts.gate.dtype}, {experts.up.dtype}, {experts.down.dtype}")
    return int(E), int(H), int(I)


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


def _resolve_implementation(implementation: str | None, quantized: bool = False) -> str:
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
        if platform == "cpu" and not quantized and metal.is_default():  # macOS on Apple silicon
            return "metal"
        return "ffi" if has_handler else "xla"
    if implementation == "ffi" and not has_handler:
        raise ValueError(f"implementation='ffi': jax_nbx has no handler for platform {platform!r} "
                         f"(handlers: {_registry.platforms()}); use implementation='xla'")
    return implementation


def plan_band_tokens(T: int, k: int, E: int, H: int, I: int,
                     max_workspace_bytes: int | None = None, backward: bool = False) -> int:
    """Tokens per band so that one band's workspace fits the CPU budget
    (or ``max_workspace_bytes``); equal-sized bands.  ``backward=True``: the
    bands of the CPU backward handler (its workspace holds ``2H + 3I``
    float32 values per slot).  Raises DeviceOOMError with the advice when a
    single token does not fit."""
    workspace = (memory.fused_moe_backward_workspace_bytes if backward
                 else memory.fused_moe_workspace_bytes)
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


def _ffi_forward(x, w, ids, *weights, activation: str | Activation, band_tokens: int,
                 poison: bool = False, platform: str = "cpu", lists: bool = False,
                 skip_outside: bool = False):
    """The raw FFI call on 2-D inputs (no batching rule, no derivative).

    ``weights``: (gate, up, down) stacked, or with ``lists=True`` the E gate
    arrays, then the E up, then the E down arrays (`Experts.flat`); each dense
    or a `QuantizedWeight`.  They reach the handler as the contract's buffer
    groups (`jax_nbx._abi`: gate, up, down, then scales, then zeros), each one
    stacked buffer or E per-expert buffers, read in place.
    ``band_tokens`` > 0 cuts the tokens into bands of that many (0: one band).
    ``poison=True`` (tests, CPU) hands the handler an output buffer filled with
    NaN, so any row it fails to write shows.  ``platform="gpu"``: the CUDA handler.
    ``skip_outside``: slots whose id is outside ``[0, E)`` are skipped, not an error.
    """
    _check_slots(*ids.shape)  # (a vmapped batch folds into the tokens: checked again here)
    activation = as_activation(activation)
    if platform == "metal" and poison:
        raise ValueError("the Metal path has no poisoned test twin")
    if platform == "gpu":
        from . import _cuda

        return _cuda.forward(x, w, ids, *weights, activation=activation,
                             band_tokens=band_tokens, lists=lists, skip_outside=skip_outside)
    groups, E, _, quant, _, _ = weight_groups(weights, lists)
    bufs = [b for g in groups for b in (g if lists else g[:1])]
    attrs = dict(**activation.attrs(),
                 band_tokens=np.int64(band_tokens), max_workers=np.int64(planned_workers()),
                 skip_outside=bool(skip_outside), num_experts=np.int64(E),
                 format=np.int32(_abi.FORMAT_CODES[quant[0] if quant else None]),
                 stacked=not lists, group_size=np.int64(quant[1] if quant else 0))
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if poison:
        (y,) = _poisoned_call(_abi.TARGET_FORWARD_POISONED, [out], [x, w, ids, *bufs], attrs)
        return y
    target = _abi.TARGET_METAL_FORWARD if platform == "metal" else _abi.TARGET_FORWARD
    call = jax.ffi.ffi_call(target, out, vmap_method="sequential")
    return call(x, w, ids, *bufs, **attrs)


def _ffi_backward(dy, x, w, ids, *weights, activation: str | Activation, band_tokens: int,
                  lists: bool = False, skip_outside: bool = False, poison: bool = False):
    """The CPU backward handler on 2-D inputs: returns ``(dx, dw, dweights)``
    with ``dweights`` in ``weights``' order (`Experts.flat`) and dtypes.  The
    handler accumulates the weight gradients in float32 (cast here once).
    ``poison=True`` (tests): every result buffer starts NaN-filled."""
    activation = as_activation(activation)
    E = len(weights) // 3 if lists else int(weights[0].shape[0])
    outs = ([jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, jnp.float32)]
            + [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in weights])
    attrs = dict(**activation.attrs(),
                 band_tokens=np.int64(band_tokens), max_workers=np.int64(planned_workers()),
                 skip_outside=bool(skip_outside), num_experts=np.int64(E), stacked=not lists)
    operands = [dy.astype(x.dtype), x, w, ids, *weights]
    if poison:
        dx, dw, *dws = _poisoned_call(_abi.TARGET_BACKWARD_POISONED, outs, operands, attrs)
    else:
        call = jax.ffi.ffi_call(_abi.TARGET_BACKWARD, outs, vmap_method="sequential")
        dx, dw, *dws = call(*operands, **attrs)
    return dx, dw, [d.astype(a.dtype) for d, a in zip(dws, weights)]


@functools.cache
def _ffi_op(activation: Activation, band_tokens: int, platform: str = "cpu", lists: bool = False,
            skip_outside: bool = False, max_workspace_bytes: int | str | None = None):
    """The FFI op on 2-D inputs with a batching rule and a derivative (on the
    CPU the backward is its own handler; elsewhere the reference's VJP)."""
    raw = functools.partial(_ffi_forward, activation=activation, band_tokens=band_tokens,
                            platform=platform, lists=lists, skip_outside=skip_outside)

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
        return forward(x, w, ids, *experts.flat())

    def op_fwd(x, w, ids, experts):
        return op(x, w, ids, experts), (x, w, ids, experts)

    def op_bwd(res, g):
        x, w, ids, experts = res
        if is_quantized(experts):  # quantized weights are frozen: dx and dw only
            _, vjp = jax.vjp(lambda x_, w_: moe_reference(x_, w_, ids, experts, activation), x, w)
            dx, dw = vjp(g)
            return dx, dw, None, None
        if platform == "cpu":
            T, H = x.shape
            band = plan_band_tokens(T, ids.shape[1], experts.num_experts, H, experts.intermediate,
                                    max_workspace_bytes, backward=True)
            dx, dw, dws = _ffi_backward(g, x, w, ids, *experts.flat(), activation=activation,
                                        band_tokens=band, lists=lists, skip_outside=skip_outside)
            return dx, dw, None, jax.tree.unflatten(jax.tree.structure(experts), dws)
        _, vjp = jax.vjp(lambda x_, w_, e_: moe_reference(x_, w_, ids, e_.stacked(), activation),
                         x, w, experts)
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
        or lists of E per-expert arrays (read in place, never stacked), dense
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
    E, H, I, k = _validate(x, topk_weights, topk_ids, experts, activation, ids_outside == "skip")
    activation = as_activation(activation)
    impl = _resolve_implementation(implementation, is_quantized(experts))

    lead = x.shape[:-1]
    T = int(np.prod(lead, dtype=np.int64))
    if T == 0:
        return jnp.zeros(x.shape, x.dtype)
    if impl != "xla":
        _check_slots(T, k)
    if impl == "metal" and is_quantized(experts):  # (the handler checks again at run time)
        raise ValueError("quantized experts are not supported on the Metal path yet")
    x2 = x.reshape(T, H)
    w2 = topk_weights.reshape(T, k).astype(jnp.float32)
    ids2 = _ids_as_int32(topk_ids, E).reshape(T, k)

    if impl == "xla":
        y = moe_reference(x2, w2, ids2, experts.stacked(), activation)
        return y.reshape(x.shape)
    platform = "gpu" if jax.default_backend() == "gpu" else "cpu"
    if impl == "metal":
        platform = "metal"
        band = memory.plan_bands(
            lambda t: int(_registry.ffi_module().metal_forward_workspace_bytes(t, k, E, H, I)),
            T, H, "metal", max_workspace_bytes, f"(Metal, E={E} k={k} H={H} I={I})")
    elif platform == "gpu":
        from . import _cuda

        band = _cuda.plan_band_tokens(T, k, E, H, I, experts.dtype, max_workspace_bytes,
                                      quant_format(experts))
    else:
        band = plan_band_tokens(T, k, E, H, I, max_workspace_bytes)
    try:
        y = _ffi_op(activation, band, platform, experts.is_list, ids_outside == "skip",
                    max_workspace_bytes)(x2, w2, ids2, experts)
        if not isinstance(y, jax.core.Tracer):  # eager: surface a refusal here
            y.block_until_ready()
    except (jax.errors.JaxRuntimeError, ValueError) as e:  # eager errors may arrive as either
        err = _as_runtime_error(e)
        if err is e:
            raise
        raise err from None
    return y.reshape(x.shape)
