"""The CUDA backend's calls: plan, compile and call the CUDA handlers.

The handler (``nbx_fused_moe_fwd_cuda``, `xla_ffi/cuda/handlers.cc`) runs a
launch program of Triton kernels (`jax_nbx.backends.cuda.kernels`) on XLA's stream.  All of
the program is decided here at trace time; the kernels are compiled for the
device's compute capability at first use (cached on disk by Triton).

Budget rule on CUDA: the workspace comes from XLA's own device pool (a second
output buffer of the call, which XLA allocates and this module drops), so
the account's default budget for ``cuda:N`` is half of that pool's limit
(``device.memory_stats()["bytes_limit"]``, i.e. the memory XLA took for the
process), set at first use unless
``JAX_NBX_BUDGET`` or `jax_nbx.memory.set_budget(..., "cuda", N)` set one.
Pointer tables (``3·E`` int64 per distinct set of expert addresses) are
allocated outside the pool and counted under the tag ``"tables"``; the
backward's gradient tables (new buffers every call) go in the first bytes of
its workspace instead.
"""
from __future__ import annotations

import jax
import numpy as np

from ... import _env, _registry, contract, formats, memory
from ...experts import WeightLayout
from ...formats import QuantizedWeight
from ...planning import plan_bands
from ..handler_calls import lora_attrs, split_arrays, weight_groups
from . import plan as P

_budget_set: set[int] = set()


def unavailable_reason() -> str:
    """Why the CUDA path cannot run in this process; "" when it can."""
    return _registry.cuda_unavailable_reason()


def _device(ordinal: int = 0):
    return jax.devices("gpu")[ordinal]


def compute_capability(dev) -> int:
    cc = getattr(dev, "compute_capability", None)
    if cc is None:
        raise RuntimeError(f"cannot read the compute capability of {dev}")
    major, minor = str(cc).split(".")[:2]
    return int(major) * 10 + int(minor)


def ensure_budget(ordinal: int = 0) -> None:
    """Sets cuda:N's default budget (half of XLA's pool) once, unless one was set."""
    if ordinal in _budget_set:
        return
    _budget_set.add(ordinal)
    budget = _env.budget()
    if budget is not None:
        memory.set_budget(budget, "cuda", ordinal)
        return
    if memory.budget("cuda", ordinal) != _registry.ffi_module().account_unlimited():
        return  # set by the user
    stats = _device(ordinal).memory_stats() or {}
    limit = int(stats.get("bytes_limit", 0))
    if limit > 0:
        memory.set_budget(limit // 2, "cuda", ordinal)


def band_workspace_bytes(tokens: int, k: int, E: int, H: int, I: int, wdtype, quant=None,
                         call_tokens: int | None = None) -> int:
    """Bytes of one band's workspace on cuda:0 in a call of ``call_tokens``
    tokens (`plan.band_workspace`, the device's tile configs)."""
    return P.band_workspace(tokens, k, E, H, I, wdtype, _device(0).device_kind, quant, call_tokens)


def plan_band_tokens(T: int, k: int, E: int, H: int, I: int, wdtype,
                     max_workspace_bytes=None, quant=None) -> int:
    """Tokens per band so that one band's workspace fits cuda:0's budget."""
    ensure_budget(0)
    name = _device(0).device_kind

    def need(t: int) -> int:
        return P.band_workspace(t, k, E, H, I, wdtype, name, quant, call_tokens=T)

    return plan_bands(need, T, H, "cuda", max_workspace_bytes,
                             f"(E={E} k={k} H={H} I={I}) on cuda:0")


def plan_backward_band_tokens(T: int, k: int, E: int, H: int, I: int, wdtype,
                              max_workspace_bytes=None) -> int:
    """Tokens per band of the CUDA backward so that one band's workspace
    (`plan.backward_band_workspace`) fits cuda:0's budget."""
    ensure_budget(0)
    name = _device(0).device_kind

    def need(t: int) -> int:
        return P.backward_band_workspace(t, k, E, H, I, wdtype, name, call_tokens=T)

    return plan_bands(need, T, H, "cuda", max_workspace_bytes,
                             f"(backward, E={E} k={k} H={H} I={I}) on cuda:0")


def _program_attrs(prog, dev, strides_ok: bool, E: int, skip_outside: bool) -> dict:
    """The attributes every CUDA handler takes with its program (abi.h): the
    compiled kernels, the encoded launches, the workspace, the expert-id
    check and whether the launches go as one CUDA graph
    (``JAX_NBX_CUDA_GRAPHS``)."""
    from . import compile as C  # imports Triton: only when a CUDA call is traced

    blob, table = C.pack(prog, compute_capability(dev))
    return dict(blob=blob, kernels=table.reshape(-1), program=prog.encode(),
                workspace_bytes=prog.workspace_bytes, err_offset=prog.err_offset,
                err_words=prog.err_words, w_aligned=strides_ok, num_experts=E,
                check_ids=check_ids_mode(skip_outside), graph=_env.cuda_graphs())


def check_ids_mode(skip_outside: bool = False) -> int:
    """The handlers' ``check_ids`` attribute (abi.h): ``JAX_NBX_CUDA_CHECK_IDS``
    = 1 (default) reads the expert-id check back after the launches (one
    stream synchronization; the call fails naming the slot and the id);
    ``deferred`` copies it asynchronously into pinned memory and the next call
    on the device fails naming the earlier call's slot (no synchronization;
    calls of at most `contract.MAX_DEFERRED_ERR_WORDS` slots, larger ones read it
    back at once); 0 skips it.  Bad ids are never used as indices in any mode:
    their slots are skipped.  ``skip_outside`` (sharded_moe's psum dispatch):
    off."""
    if skip_outside:
        return contract.ID_CHECK_OFF
    return {"sync": contract.ID_CHECK_SYNC, "deferred": contract.ID_CHECK_DEFERRED,
            "off": contract.ID_CHECK_OFF}[_env.cuda_check_ids()]


def _view_groups(arrays, layout: WeightLayout, lists: bool):
    """(weight groups, biases, E, weights' dtype, whether every per-expert
    stride is a multiple of 16 bytes) of dense experts in any layout:
    ``arrays`` = the groups (gate_up, down when fused, else gate, up, down;
    one stacked array or E arrays each), then the biases when ``layout.bias``."""
    weights, biases = split_arrays(arrays, layout)
    if any(isinstance(a, QuantizedWeight) for a in weights):
        raise ValueError("the CUDA path reads quantized experts in the plain layout only (gate, up "
                         "[E, H, I], down [E, I, H], no fused gate_up; biases or not)")
    n_groups = 2 if layout.fused else len(contract.PROJECTIONS)
    per = len(weights) // n_groups if lists else 1
    groups = [list(weights[g * per:(g + 1) * per]) for g in range(n_groups)]
    E = per if lists else int(weights[0].shape[0])
    strides_ok = lists or all(
        (int(np.prod(g[0].shape[1:])) * np.dtype(g[0].dtype).itemsize) % 16 == 0 for g in groups)
    return groups, biases, E, np.dtype(weights[0].dtype), strides_ok


def forward(x, w, ids, *arrays, activation, band_tokens: int, lists: bool = False,
            skip_outside: bool = False, layout: WeightLayout | None = None, lora=None, lora_spec=None):
    """The raw CUDA FFI call on 2-D inputs (x [T, H], w f32 [T, k], ids i32 [T, k]).

    ``arrays`` = the weights as `Experts.flat` gives them, then with
    ``layout.bias`` the three float32 biases of `Experts.handler_biases`.
    ``layout`` (`WeightLayout`; None: plain): plain weights are (gate, up,
    down) stacked, or with ``lists`` the E gate, E up and E down arrays; each
    may be a `QuantizedWeight`.  Any other layout (transposed, fused
    gate_up, biases: abi.h "weight views") is dense and read in place by the
    kernels through its views.  Dense stacked plain experts go to
    ``nbx_fused_moe_fwd_cuda``; the others to ``nbx_fused_moe_fwd_cuda_tables``
    as groups of buffers (gate, up, down, then scales, then mins; or
    gate_up, down), every buffer's address in the pointer table, then the
    biases.  ``skip_outside``: ids outside [0, E) are skipped without an error
    (the kernels never use them as indices either way).  ``lora``: a
    `jax_nbx.LoRA` with its validated `LoRASpec` ``lora_spec``: the adapters
    go after the biases (`LoRA.handler_arrays`, float32 stacked) to the
    tables handler, fused into the kernels (`plan.build`).
    """
    T, H = x.shape
    k = ids.shape[1]
    if layout is not None and layout.plain_views and any(isinstance(a, QuantizedWeight) for a in arrays):
        # quantized experts with biases: the plain views, then the biases
        weights, biases = split_arrays(arrays, layout)
        groups, E, I, quant, wdtype, strides_ok = weight_groups(weights, lists)
        views = layout if layout.bias else None
    elif layout is None or layout.native:
        groups, E, I, quant, wdtype, strides_ok = weight_groups(arrays, lists)
        biases, views = (), None
        layout = WeightLayout(sum(P.plain_views(H, I), ()), I, False, False)
    else:
        groups, biases, E, wdtype, strides_ok = _view_groups(arrays, layout, lists)
        I, quant, views = int(layout.intermediate), None, layout
    dev = _device(0)
    prog = P.build(T, band_tokens or T, k, E, H, I, np.dtype(x.dtype), wdtype, activation,
                   dev.device_kind, w_aligned=strides_ok, quant=quant, layout=views, lora=lora_spec)
    attrs = _program_attrs(prog, dev, strides_ok, E, skip_outside)
    # The workspace is a second output that XLA allocates in its pool (stream
    # ordered, planned by XLA) and that is dropped here.
    outs = (jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct((max(prog.workspace_bytes, 1),), np.uint8))
    if quant is None and not lists and views is None and lora is None:
        call = jax.ffi.ffi_call(contract.TARGET_CUDA_FORWARD, outs, vmap_method="sequential")
        y, _ = call(x, w, ids, *arrays, **contract.attributes("cuda_forward", attrs))
        return y
    bufs = [b for g in groups for b in (g if lists else g[:1])]
    bufs += [b.astype(np.float32) for b in biases]
    bufs += lora.handler_arrays() if lora is not None else []
    call = jax.ffi.ffi_call(contract.TARGET_CUDA_FORWARD_TABLES, outs, vmap_method="sequential")
    y, _ = call(x, w, ids, *bufs, **contract.attributes(
        "cuda_forward_tables", dict(attrs, format=formats.get(quant[0] if quant else "dense").code,
                                    groups=len(groups), stacked=not lists, **layout.attrs(),
                                    **lora_attrs(lora_spec if lora is not None else None))))
    return y


def backward(dy, x, w, ids, *arrays, activation, band_tokens: int, lists: bool = False,
             skip_outside: bool = False, layout: WeightLayout | None = None):
    """The raw CUDA backward call (``nbx_fused_moe_bwd_cuda``) on 2-D inputs:
    ``(dx, dw, dweights)`` with ``dweights`` the gradients of the weight
    arrays in ``arrays``' order (`Experts.flat`: dense experts, any layout,
    stacked or lists) in the weights' dtypes (the handler writes them so when
    the call is one band, else float32 cast here), then with
    ``layout.bias`` the three float32 gradients of the handler's biases
    (``arrays`` ends with `Experts.handler_biases`, as for `forward`).
    The kernels (`plan.build_backward`) recompute gate and up, order the
    slots by expert like the forward and sum every gradient in a fixed order
    (no atomics); weight gradients are accumulated band after band.
    Not yet run on a GPU: written against the handler and the interpreter-
    tested program only."""
    T, H = x.shape
    k = ids.shape[1]
    if layout is None or layout.native:
        groups, E, I, quant, wdtype, strides_ok = weight_groups(arrays, lists)
        if quant is not None:
            raise ValueError("the CUDA backward takes dense experts (quantized ones are frozen)")
        biases, views = (), None
        layout = WeightLayout(sum(P.plain_views(H, I), ()), I, False, False)
    else:
        groups, biases, E, wdtype, strides_ok = _view_groups(arrays, layout, lists)
        I, views = int(layout.intermediate), layout
    dev = _device(0)
    prog = P.build_backward(T, band_tokens or T, k, E, H, I, np.dtype(x.dtype), wdtype, activation,
                            dev.device_kind, w_aligned=strides_ok, layout=views)
    # no id check of its own: the forward checked these ids (the residuals);
    # the kernels still skip a bad slot
    attrs = _program_attrs(prog, dev, strides_ok, E, skip_outside=True)
    bufs = [b for g in groups for b in (g if lists else g[:1])]
    bufs += [b.astype(np.float32) for b in biases]
    weights = [b for g in groups for b in g] + list(biases)
    n_w = len(weights) - len(biases)  # weight gradients in prog.grad_dtype, bias gradients float32
    outs = ([jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, np.float32)]
            + [jax.ShapeDtypeStruct(a.shape, prog.grad_dtype if i < n_w else np.float32)
               for i, a in enumerate(weights)]
            + [jax.ShapeDtypeStruct((max(prog.workspace_bytes, 1),), np.uint8)])
    call = jax.ffi.ffi_call(contract.TARGET_CUDA_BACKWARD, outs, vmap_method="sequential")
    dx, dw, *dws, _ = call(x, w, ids, *bufs, dy.astype(x.dtype), **contract.attributes(
        "cuda_backward", dict(attrs, format=contract.FORMAT_CODES["dense"], groups=len(groups),
                              stacked=not lists, **layout.attrs(),
                              grad_f32=prog.grad_dtype == "float32")))
    return dx, dw, [d.astype(a.dtype) for d, a in zip(dws, weights)]
