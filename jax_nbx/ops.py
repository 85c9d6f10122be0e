"""`fused_moe`: the public op.  It validates the arguments
(`jax_nbx.validation`), describes the pass as a `backends.Problem`, lets the
backend registry choose who runs it (`jax_nbx.backends`), plans the bands
and calls the backend through the op's transformations
(`jax_nbx.transforms`)."""
from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from . import _env, backends, cpu, memory
from .activations import Activation, as_activation
from .backends.cpu import why_no_bf16_dot
from .experts import Experts, SharedExperts
from .lora import LoRA, validate_lora
from .prepack import PackedExperts
from .transforms import op
from .validation import check_slots, ids_as_int32, validate, validate_experts

__all__ = ["fused_moe", "resolve", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = backends.IMPLEMENTATIONS

# XLA status codes that begin a handler's error text (absl::StatusCode names)
_STATUS_CODES = ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "INTERNAL", "FAILED_PRECONDITION",
                 "OUT_OF_RANGE", "UNIMPLEMENTED", "UNKNOWN", "UNAVAILABLE", "ABORTED",
                 "DEADLINE_EXCEEDED", "DATA_LOSS", "NOT_FOUND", "ALREADY_EXISTS",
                 "PERMISSION_DENIED", "CANCELLED", "UNAUTHENTICATED")


def as_runtime_error(err: BaseException) -> BaseException:
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


def fused_moe(
    x: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    experts: Experts | PackedExperts,
    *,
    activation: Literal["swiglu", "geglu", "geglu_erf", "swiglu_clamped"] | Activation = "swiglu",
    implementation: Literal["xla", "cpu", "cuda", "metal", "ffi"] | None = None,
    max_workspace_bytes: int | str | None = None,
    ids_outside: Literal["error", "skip"] = "error",
    weights_on: Literal["output", "input"] = "output",
    shared_experts: SharedExperts | None = None,
    precision: Literal["float32", "bfloat16", "int8"] | None = None,
    lora: LoRA | None = None,
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
        An id outside the range raises at run time naming the position and
        the id (``ids_outside``).
      experts: `Experts` with ``gate, up [E, H, I]`` and ``down [E, I, H]``,
        or lists of E per-expert arrays (read in place, never stacked), or
        in the checkpoint's layout (``layout="out_in"``, `Experts.fused`
        gate||up concatenated or interleaved; read in place by the CPU
        handler, never transposed into a copy) with optional gate, up and
        down biases (the CPU handler, the CUDA kernels and the "xla" path;
        the Metal handler takes the plain layout without biases and says so), dense
        or quantized (`jax_nbx.quantize`: int8, int4 in groups; quantized
        weights are frozen: no gradient flows to them).  Or a
        `jax_nbx.PackedExperts` (`jax_nbx.prepack`: dense experts whose
        weights were packed once for the CPU handler's kernels; the same
        bits, no per-call packing; CPU handler only, no ``lora``; the call's
        ``precision`` is the one they were packed for).
      activation: the experts' gated unit (`jax_nbx.activations`): ``"swiglu"``
        (silu gate), ``"geglu"`` (tanh-approximated gelu gate), ``"geglu_erf"``
        (exact gelu gate), ``"swiglu_clamped"`` (gpt-oss), or an
        ``Activation("swiglu_clamped", alpha=..., limit=...)`` with its parameters.
      implementation: the backend (`jax_nbx.backends`): ``"cpu"`` (the CPU
        handlers), ``"cuda"`` (on a CUDA GPU: Triton kernels launched by the
        CUDA handler; 16-bit weights run on tensor cores: x and the
        intermediate are rounded to the weights' dtype before each product,
        float32 accumulation), ``"metal"`` (the Metal handler on the active
        Metal device, `jax_nbx.metal`: dense experts in the plain layout;
        gradients from the reference's VJP; on Linux only the simulated
        device of the tests), ``"xla"`` (the pure-JAX reference, every
        platform), ``"ffi"`` (the handler of ``jax.default_backend()``:
        "cuda" on a CUDA GPU, else "cpu"), or ``None``: the first of
        metal (macOS on Apple silicon with Metal active), cuda, cpu, xla that
        can run the call.  A backend that cannot is refused with its reason
        (with None: every backend's reason).
      max_workspace_bytes: cap on the handler's workspace for this call
        (bytes or ``"512MiB"``) instead of the account's headroom (of
        ``cpu:0``, or ``cuda:0`` on the CUDA path).  The tokens
        are cut into bands whose workspace fits; results are bit-identical
        whatever the bands.  The plan is made at trace time (shapes are
        static) and kept by ``jax.jit``.
      ids_outside: what an id outside ``[0, E)`` means: ``"error"``
        (default: the call fails at run time naming the position and the
        id, on every backend -- the "xla" path checks the ids on the host
        first, eagerly and under ``jax.jit``) or ``"skip"`` (the slot
        contributes nothing: expert parallelism, where ids of experts held
        elsewhere are out of the local range; `jax_nbx.sharded_moe`).

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
        (`jax_nbx.cpu.bf16_dot_by_default`, read when the call is traced;
        docs/backends.md says where it has run), else
        ``"float32"``.  Error: about one bfloat16 rounding of x and of the
        intermediate, i.e. a relative ``~2**-8`` per element against the
        float32 arithmetic, the rounding HF transformers' bfloat16 models
        do.  For dense bfloat16 experts stored by rows (``layout="in_out"``,
        not interleaved), on the CPU handler.  Decode streams experts of at
        most 6 rows (the fma kernels, on the instruction's CPUs too) with
        the bits the packed kernels give; with the emulation every expert
        packs.  Gradients are those of the float32 arithmetic (the roundings
        pass gradients through unchanged).  ``"int8"``: int8 and int4
        experts on the CPU handler, x and the intermediate quantized to int8
        in blocks of 32 values along K (``d = max|v| / 127``, codes
        ``rint(v * 127 / max|v|)``), exact integer sums per block scaled in
        float32 (abi.h "int8 arithmetic"; every instruction set and every
        row count give the same bits).  Error: about half a code step
        (``d / 2``) per element of x and the intermediate; NaN or infinity in
        a block makes that row's outputs NaN.  Every expert streams (decode
        speed: docs/benchmarks.md); gradients as for ``"bfloat16"``.
      lora: `jax_nbx.LoRA` adapters on the routed experts' projections:
        ``x @ W + s * (x @ A) @ B`` for each adapted projection (before its
        bias), the base experts dense or quantized (QLoRA); ``jax.grad``
        gives the adapters' gradients (the experts, frozen, get none: their
        gradient GEMMs do not run).  On every backend: the CPU handler
        (every format; not with ``precision="bfloat16"``; fused backward),
        CUDA (ranks up to 64) and Metal (forward in their kernels,
        gradients from the reference's VJP), the "xla" reference
        (docs/lora.md).  The shared experts take none.

    Returns:
      ``y`` with x's shape and dtype; accumulation is float32.

    Works eagerly, under ``jax.jit``, ``jax.vmap`` (experts shared across the
    batch fold into the token axis; per-element experts run one call per
    element) and ``jax.grad``: gradients flow to x, topk_weights and the
    experts (lists get lists of gradients), never to topk_ids.  On the CPU
    the backward is a fused handler that saves nothing but the op's inputs
    (it recomputes the gate and up projections) and plans its own bands
    against the same budget; on CUDA dense experts take the CUDA backward
    handler (checked on an H200 once, 2026-12-04); Metal and the "xla" reference
    differentiate the reference; quantized experts are frozen (dx and
    d(topk_weights) only, from the reference's VJP) on every backend.

    Raises:
      ValueError / TypeError at trace time for mismatched shapes, ranks,
      dtypes, ``k > E``, an unknown activation, format or implementation,
      or a backend that cannot run the call (with its reason).
      `jax_nbx.DeviceOOMError` at trace time when one token's workspace does
      not fit, and eagerly when the account refuses at run time (under jit
      the refusal is a ``JaxRuntimeError`` whose text carries the same
      advice; ``jax_nbx.memory.last_refusal()`` has the record).
    """
    experts, packed, precision = _unpack(experts, precision, lora)
    x, topk_weights, topk_ids, experts, lora = _as_arrays(x, topk_weights, topk_ids, experts, lora)
    (backend, problem), shared = _resolve(x, topk_weights, topk_ids, experts, activation, implementation,
                                          max_workspace_bytes, ids_outside, weights_on, shared_experts,
                                          precision, lora, packed is not None)
    E, H, k = problem.E, problem.H, topk_ids.shape[-1]

    lead = x.shape[:-1]
    T = int(np.prod(lead, dtype=np.int64))
    if T == 0:
        return jnp.zeros(x.shape, x.dtype)
    x2 = x.reshape(T, H)
    w2 = topk_weights.reshape(T, k).astype(jnp.float32)
    ids2 = ids_as_int32(topk_ids, E).reshape(T, k)
    if weights_on == "input":  # one row per slot, scaled by its weight; unit weights
        xs = (x2[:, None, :].astype(jnp.float32) * w2[:, :, None]).astype(x.dtype).reshape(T * k, H)
        y = _run(backend, problem, xs, jnp.ones((T * k, 1), jnp.float32), ids2.reshape(T * k, 1), experts,
                 lora, packed)
        y = y.reshape(T, k, H).astype(jnp.float32).sum(axis=1).astype(x.dtype)
    else:
        y = _run(backend, problem, x2, w2, ids2, experts, lora, packed)
    if shared is not None:
        y = y.astype(jnp.float32) + _shared(x2, shared_experts, *shared)
        y = y.astype(x.dtype)
    return y.reshape(x.shape)


def _unpack(experts, precision, lora):
    """(experts, packed or None, precision) of a call: a `PackedExperts`
    gives its experts, itself and its precision (None takes it; another is a
    ValueError), and takes no LoRA adapters."""
    if not isinstance(experts, PackedExperts):
        return experts, None, precision
    if precision is not None and precision != experts.precision:
        raise ValueError(f"these experts were prepacked for precision={experts.precision!r}; the call "
                         f"asks for precision={precision!r} (prepack them for it, or pass None)")
    if lora is not None:
        raise ValueError("prepacked experts take no LoRA adapters (lora=): pass the Experts themselves")
    return experts.experts, experts, experts.precision


def _as_arrays(x, topk_weights, topk_ids, experts, lora=None):
    x = jnp.asarray(x)
    topk_weights = jnp.asarray(topk_weights)
    # host ids stay numpy until they are narrowed (ids_as_int32): JAX with x64
    # off would wrap 64-bit values into int32 on the way in
    if not isinstance(topk_ids, (jax.Array, jax.core.Tracer)):
        topk_ids = np.asarray(topk_ids)
    if isinstance(experts, Experts):
        experts = jax.tree.map(jnp.asarray, experts)
    if isinstance(lora, LoRA):
        lora = jax.tree.map(jnp.asarray, lora)
    return x, topk_weights, topk_ids, experts, lora


def _resolve(x, topk_weights, topk_ids, experts, activation, implementation, max_workspace_bytes,
             ids_outside, weights_on, shared_experts, precision, lora=None, prepacked=False):
    """Validates a call; ((backend, problem) of the routed experts' pass,
    (backend, problem) of the shared experts' or None)."""
    if ids_outside not in ("error", "skip"):
        raise ValueError(f"ids_outside must be 'error' or 'skip'; got {ids_outside!r}")
    if weights_on not in ("output", "input"):
        raise ValueError(f"weights_on must be 'output' or 'input'; got {weights_on!r}")
    if precision not in (None, "float32", "bfloat16", "int8"):
        raise ValueError(f"precision must be None, 'float32', 'bfloat16' or 'int8'; got {precision!r}")
    if shared_experts is not None and not isinstance(shared_experts, SharedExperts):
        raise TypeError("shared_experts must be a jax_nbx.SharedExperts or None; got "
                        f"{type(shared_experts).__name__}")
    if max_workspace_bytes is not None:  # read once, for every backend (the reference has no workspace)
        try:
            max_workspace_bytes = memory.parse_bytes(max_workspace_bytes)
        except (TypeError, ValueError) as e:
            raise type(e)(f"max_workspace_bytes: {e}") from None
    E, H, I, k = validate(x, topk_weights, topk_ids, experts, activation, ids_outside == "skip")
    lora_spec = None if lora is None else validate_lora(lora, E, H, I)
    activation = as_activation(activation)
    options = dict(skip_outside=ids_outside == "skip", max_workspace_bytes=max_workspace_bytes,
                   settings=_env.trace_settings())
    k_pass = 1 if weights_on == "input" else k
    problem = backends.Problem.of(experts, x.dtype, E, H, I, k_pass, activation,
                                  bf16_dot=precision == "bfloat16", int8_dot=precision == "int8",
                                  lora=lora_spec, prepacked=prepacked, **options)
    backend = backends.choose(implementation, problem)
    shared = _shared_pass(shared_experts, implementation, x.dtype, H, activation, precision, options)
    passes = [(backend, problem)] + ([shared] if shared is not None else [])
    if precision is None and _bf16_dot_by_default(x.dtype, passes):
        problem = problem.replace(bf16_dot=True)
        if shared is not None:
            shared = (shared[0], shared[1].replace(bf16_dot=True))
    return (backend, problem), shared


def resolve(x, topk_weights, topk_ids, experts: Experts, *, activation="swiglu", implementation=None,
            max_workspace_bytes=None, ids_outside="error", weights_on="output", shared_experts=None,
            precision=None, lora=None) -> tuple[backends.Backend, backends.Problem]:
    """What `fused_moe` with these arguments runs, without running it: the
    backend and the `backends.Problem` of the routed experts' pass (its
    ``bf16_dot`` says which arithmetic ``precision`` resolved to).  Raises
    what `fused_moe` raises at trace time."""
    experts, packed, precision = _unpack(experts, precision, lora)
    x, topk_weights, topk_ids, experts, lora = _as_arrays(x, topk_weights, topk_ids, experts, lora)
    routed, _ = _resolve(x, topk_weights, topk_ids, experts, activation, implementation,
                         max_workspace_bytes, ids_outside, weights_on, shared_experts, precision, lora,
                         packed is not None)
    return routed


def _shared_pass(shared: SharedExperts | None, implementation, x_dtype, H: int, activation: Activation,
                 precision, options) -> tuple[backends.Backend, backends.Problem] | None:
    """(backend, problem) of the shared experts' pass: every token to each of
    their S experts, chosen like the routed experts' (errors prefixed
    ``shared_experts:``)."""
    if shared is None:
        return None
    ex = shared.experts
    if not isinstance(ex, Experts):
        raise TypeError(f"shared_experts.experts must be a jax_nbx.Experts; got {type(ex).__name__}")
    ex = jax.tree.map(jnp.asarray, ex)
    try:
        S, Hs, Is = validate_experts(ex)
    except (TypeError, ValueError) as e:
        raise type(e)(f"shared_experts: {e}") from None
    if Hs != H:
        raise ValueError(f"shared_experts have hidden size {Hs}; x's is {H}")
    problem = backends.Problem.of(ex, x_dtype, S, H, Is, S, activation, bf16_dot=precision == "bfloat16",
                                  int8_dot=precision == "int8", **dict(options, skip_outside=False))
    try:
        return backends.choose(implementation, problem), problem
    except ValueError as e:
        raise ValueError(f"shared_experts: {e}") from None


def _bf16_dot_by_default(x_dtype, passes) -> bool:
    """``precision=None``: the CPU handler's bfloat16 dot-product kernels
    where x is bfloat16, every pass ((backend, problem): the routed experts',
    the shared experts') runs on the CPU handler with experts that can take
    them, and the CPU runs them on the instruction (`cpu.bf16_dot_by_default`,
    read when the call is traced); float32 arithmetic everywhere else (the
    fma kernels are not faster than it, the emulation far slower)."""
    if np.dtype(x_dtype) != np.dtype(jnp.bfloat16):
        return False
    if any(b.name != "cpu" or why_no_bf16_dot(p) for b, p in passes):
        return False
    return cpu.bf16_dot_by_default()


def _run(backend: backends.Backend, problem: backends.Problem, x2, w2, ids2, experts: Experts,
         lora: LoRA | None = None, packed: PackedExperts | None = None) -> jax.Array:
    """One pass of ``backend`` on 2-D inputs (validated; ``lora`` only on a
    backend that `takes_lora`, ``packed`` only on one that `takes_prepacked`,
    which `backends.choose` made sure of)."""
    T = x2.shape[0]
    if backend.traced_by_jax:
        extra = {} if lora is None else {"lora": lora}
        return backend.forward(problem, 0, x2, w2, ids2, experts, **extra)
    check_slots(T, problem.k)
    band = backend.plan(problem, T)
    try:
        y = op(backend, problem, band)(x2, w2, ids2, experts, lora, packed)
        if not isinstance(y, jax.core.Tracer):  # eager: surface a refusal here
            y.block_until_ready()
    except (jax.errors.JaxRuntimeError, ValueError) as e:  # eager errors may arrive as either
        err = as_runtime_error(e)
        if err is e:
            raise
        raise err from None
    return y


def _shared(x2, shared: SharedExperts, backend: backends.Backend, problem: backends.Problem) -> jax.Array:
    """The shared experts' float32 output on 2-D x: every token to each of the
    S experts with weight 1, or Qwen2-MoE's ``sigmoid(x @ gate.T)``."""
    ex = jax.tree.map(jnp.asarray, shared.experts)
    T, H = x2.shape
    S = problem.E
    w = jnp.ones((T, S), jnp.float32)
    if shared.gate is not None:
        g = jnp.asarray(shared.gate)
        if g.shape not in ((H,), (1, H)):
            raise ValueError(f"shared_experts.gate has shape {g.shape}; expected (1, {H}) (nn.Linear(H, 1)) "
                             f"or ({H},)")
        w = w * jax.nn.sigmoid(x2.astype(jnp.float32) @ g.reshape(H).astype(jnp.float32))[:, None]
    ids = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (T, S))
    return _run(backend, problem, x2, w, ids, ex).astype(jnp.float32)
