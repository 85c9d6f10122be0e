"""The CUDA backend's programs run by Triton's interpreter, as a backend of
`fused_moe` (tests only): ``implementation="cuda-interpret"``.

The forward builds the same launch program the CUDA handler runs
(`jax_nbx.backends.cuda.plan.build`: kernels, grids, arguments, the pointer
tables of absolute addresses, bands) and executes it on host memory under
``TRITON_INTERPRET=1`` inside a ``jax.pure_callback``; the backward (dense
experts) runs `plan.build_backward`'s program the same way.  Bad ids: the
program's check word names the first bad slot, and the call fails as the
handler's sync check does.  Small shapes only: the interpreter is slow.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_nbx import backends  # noqa: E402
from jax_nbx.backends import handler_calls  # noqa: E402
from jax_nbx.backends.base import Backend, Problem  # noqa: E402
from jax_nbx.backends.cuda import plan as P  # noqa: E402
from jax_nbx.backends.handler_calls import split_arrays  # noqa: E402

from . import triton_interpret as interpret  # noqa: E402

NAME = "cuda-interpret"


def _np(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a))


def _groups(problem: Problem, arrays):
    """(weight groups as numpy arrays or lists of them, biases, strides_ok)."""
    weights, biases = split_arrays(list(arrays), problem.layout)
    if problem.layout.native or problem.quant is not None:  # quantized: plain views, biases or not
        groups = handler_calls.weight_groups(weights, problem.lists)[0]
    else:
        n = 2 if problem.layout.fused else 3
        per = len(weights) // n if problem.lists else 1
        groups = [list(weights[g * per:(g + 1) * per]) for g in range(n)]
    groups = [[_np(b) for b in g] for g in groups]
    strides_ok = problem.lists or all((g[0][0].nbytes % 16) == 0 for g in groups)
    return groups, [_np(b).astype(np.float32) for b in biases], strides_ok


def _tables(groups, lists: bool):
    firsts = [g[0] for g in groups]
    tables = interpret.pointer_tables(*(g if lists else g[0] for g in groups))
    return firsts, tables


def _record(prog) -> None:
    """``JAX_NBX_KERNEL_RECORD=DIR``: the kernels of every program run here are appended to
    ``DIR/kernels-<pid>.pkl`` (pickled `Program.kernels` lists), for ``benchmarks/gpu_precompile.py``
    to compile into the cubin cache a GPU machine then reads: the interpreter builds the programs the
    GPU builds (the same plan; the default tile configs, as long as configs/ has no file for the device)."""
    folder = os.environ.get("JAX_NBX_KERNEL_RECORD")
    if folder:
        import pickle
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"kernels-{os.getpid()}.pkl"), "ab") as f:
            pickle.dump(prog.kernels(), f)


def _bad_slot(ids: np.ndarray, err: int, E: int) -> str:
    """The CUDA handler's message for the first bad slot (its sync check)."""
    k = ids.shape[1]
    return f"topk_ids[{err // k}, {err % k}] = {int(ids.reshape(-1)[err])} is outside [0, {E})"


class InterpretedCuda(Backend):
    name = NAME
    takes_lora = True  # as the CUDA backend: fused forward, the reference's VJP
    kernels = "cuda"

    def why_not(self, problem: Problem) -> str:
        return P.kernels_refusal(problem.quant, problem.layout.plain_views, problem.bf16_dot,
                                 problem.tensor_scales, problem.lora)

    def why_not_by_default(self, problem: Problem) -> str:
        return "a test backend: named only"

    device = "cpu"  # the interpreter's workspace is host memory; planned against cpu:0's budget

    def workspace_bytes(self, problem: Problem, tokens: int, call_tokens: int | None = None) -> int:
        p = problem
        return P.band_workspace(tokens, p.k, p.E, p.H, p.I, p.w_dtype, None, p.quant, call_tokens)

    def forward(self, problem, band_tokens, x, w, ids, experts, lora=None):
        arrays = (*experts.flat(), *experts.handler_biases())
        adapters = lora.handler_arrays() if lora is not None else []
        n_ad = len(adapters)

        def host(x, w, ids, *arrays):
            x, w, ids = _np(x), _np(w), _np(ids)
            arrays, adapters = arrays[:len(arrays) - n_ad], [_np(a) for a in arrays[len(arrays) - n_ad:]]
            groups, biases, strides_ok = _groups(problem, arrays)
            T, H = x.shape
            prog = P.build(T, band_tokens or T, problem.k, problem.E, H, problem.I, x.dtype, problem.w_dtype,
                           problem.activation, None, w_aligned=strides_ok, quant=problem.quant,
                           layout=None if problem.layout.native else problem.layout,
                           lora=problem.lora if n_ad else None)
            _record(prog)
            y = np.full((T, H), np.nan, x.dtype)
            firsts, tables = _tables(groups, problem.lists)
            err = interpret.run(prog, [x, w, ids, *firsts, *biases, *adapters], y, tables=tables)
            if err != P.ERR_NONE and not problem.skip_outside and T:
                raise ValueError(_bad_slot(ids, err, problem.E))
            return y

        out = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jax.pure_callback(host, out, x, w, ids, *arrays, *adapters, vmap_method="sequential")

    def backward(self, problem, dy, x, w, ids, experts, lora=None, weight_grads: bool = True):
        if problem.quant is not None or lora is not None:
            return None
        arrays = (*experts.flat(), *experts.handler_biases())
        weights, biases = split_arrays(list(arrays), problem.layout)
        grad_shapes = [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (*weights, *biases)]

        def host(dy, x, w, ids, *arrays):
            x, w, ids, dy = _np(x), _np(w), _np(ids), _np(dy).astype(x.dtype)
            groups, bias_arrays, strides_ok = _groups(problem, arrays)
            T, H = x.shape
            prog = P.build_backward(T, T, problem.k, problem.E, H, problem.I, x.dtype, problem.w_dtype,
                                    problem.activation, None, w_aligned=strides_ok,
                                    layout=None if problem.layout.native else problem.layout,
                                    grad_dtype="float32")
            _record(prog)
            dx = np.full((T, H), np.nan, x.dtype)
            dw = np.full(w.shape, np.nan, np.float32)
            grads = [[np.full(b.shape, np.nan, np.float32) for b in g] for g in groups]
            dbias = [np.full(b.shape, np.nan, np.float32) for b in bias_arrays]
            firsts, _ = _tables(groups, problem.lists)
            tables = interpret.pointer_tables(*(g if problem.lists else g[0] for g in groups),
                                              *(g if problem.lists else g[0] for g in grads))
            err = interpret.run(prog, [x, w, ids, *firsts, *bias_arrays, dy], [dx, dw, *dbias], tables=tables)
            if err != P.ERR_NONE and not problem.skip_outside and T:
                raise ValueError(_bad_slot(ids, err, problem.E))
            flat = [b for g in grads for b in g]
            return (dx, dw, *flat, *dbias)

        outs = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, jnp.float32),
                *grad_shapes)
        dx, dw, *dws = jax.pure_callback(host, outs, dy, x, w, ids, *arrays, vmap_method="sequential")
        return dx, dw, [d.astype(a.dtype) for d, a in zip(dws, arrays)], None


def register() -> None:
    """Adds the backend to `jax_nbx.backends` (once)."""
    if NAME not in backends.names():
        backends.register(InterpretedCuda())


