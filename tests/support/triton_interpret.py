"""Runs a `plan.Program` with the Triton interpreter on NumPy arrays.

The test suite's way to check the CUDA path's kernels AND its launch program
without a GPU: the same launches, grids and arguments the CUDA handler
executes, with the same pointer tables (absolute addresses of each expert's
weights), run by ``triton``'s interpreter (``TRITON_INTERPRET=1``) on host
memory.  Slow: small shapes only.

The interpreter expects torch-like tensors; `_HostTensor` is the least of
that interface over a raw host address (no copies: the interpreter's "device"
and "host" are the same memory, so absolute addresses in a table stay valid).
"""
from __future__ import annotations

import os

import numpy as np

from jax_nbx import contract
from jax_nbx.backends.cuda import plan as P

_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "i32": "int32",
                "i64": "int64", "i8": "int8", "u8": "uint8"}


class _DType:
    def __init__(self, name: str):
        self.name = name
        self.itemsize = np.dtype(name).itemsize if name != "bfloat16" else 2

    def __str__(self):
        return f"torch.{self.name}"

    __repr__ = __str__


_DTYPES = {name: _DType(name) for name in _DTYPE_NAMES.values()}  # one object each: Triton
# caches argument types by the dtype object, so a fresh one per tensor could alias a dead one


class _Storage:
    def __init__(self, addr: int):
        self._addr = addr

    def data_ptr(self) -> int:
        return self._addr

    def cpu(self):
        return self

    def copy_(self, other):  # same memory
        return self


class _HostTensor:
    """A raw host address typed for Triton (what the interpreter reads of a torch tensor)."""

    def __init__(self, addr: int, ptype: str):
        self._addr = int(addr)
        self.dtype = _DTYPES[_DTYPE_NAMES[ptype.lstrip("*")]]

    def data_ptr(self) -> int:
        return self._addr

    def untyped_storage(self):
        return _Storage(self._addr)

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return (1,)

    def stride(self):
        return (1,)

    def new_empty(self, *args, **kwargs):
        return _HostTensor(self._addr, "*" + {v: k for k, v in _DTYPE_NAMES.items()}[self.dtype.name])

    def set_(self, storage, offset, size, stride):
        self._addr = storage.data_ptr() + offset * self.dtype.itemsize
        return self

    def copy_(self, other):  # same memory
        return self


def _patch_dot() -> None:
    """Two fixes to Triton's interpreter's `tl.dot` (triton 3.6):

    * it stores bfloat16 as uint16 and multiplies those integers: bf16
      operands are converted to float32 first (exact), as the GPU's bf16 dot
      accumulates in float32 anyway;
    * it calls ``np.matmul`` in float32, whose BLAS blocking makes a row's sum
      depend on where the row sits in the tile (edge kernels), unlike the
      GPU, where each element's K-sum depends on its row and column only.
      The product is taken in float64 (float32/16-bit products are exact
      there) and rounded once to the accumulator's dtype, so a row gives the
      same bits wherever it lands (what banded == unbanded tests rely on).
    """
    from triton.runtime import interpreter as itp

    if getattr(itp.InterpreterBuilder.create_dot, "_nbx", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def f64(t):
            data = t.data
            if t.dtype.scalar == itp.tl.bfloat16:
                data = itp._convert_float(data, itp.tl.bfloat16, itp.tl.float32, None).view(np.float32)
            elif t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating():
                data = itp._convert_float(data, t.dtype, itp.tl.float16, None).view(np.float16)
            return data.astype(np.float64)
        prod = np.matmul(f64(a), f64(b)).astype(d.data.dtype)
        return itp.TensorHandle(prod + d.data, d.dtype.scalar)

    create_dot._nbx = True
    itp.InterpreterBuilder.create_dot = create_dot


def _interpreted(name: str):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton.runtime.interpreter import InterpretedFunction

    _patch_dot()

    import triton

    from jax_nbx.backends.cuda import compile as C
    from jax_nbx.backends.cuda import kernels, kernels_backward

    fn = C.kernel_function(name)
    fn = getattr(fn, "fn", fn)  # the Python function under triton.jit
    # helpers called from kernels (module globals: _glu, _wtile ...) must be
    # interpreted too, in every module whose kernels call them
    for module in (kernels, kernels_backward):
        for helper, h in list(vars(module).items()):
            if helper.startswith("_") and isinstance(h, triton.runtime.JITFunction):
                setattr(module, helper, InterpretedFunction(h.fn))
    return InterpretedFunction(fn)


def pointer_tables(*groups) -> list[np.ndarray]:
    """One int64 address per expert and group (gate, up, down[, their scales,
    their mins]), as the handler builds them: stacked [E, …] arrays (expert e
    at base + e·bytes/E) or lists of per-expert arrays (each array's own
    address; keep the arrays alive)."""
    out = []
    for a in groups:
        if isinstance(a, (list, tuple)):
            addrs = [np.ascontiguousarray(m).ctypes.data for m in a]
        else:
            stride = a.nbytes // a.shape[0]
            addrs = [a.ctypes.data + e * stride for e in range(a.shape[0])]
        out.append(np.asarray(addrs, np.uint64).view(np.int64))
    return out


def run(prog: P.Program, inputs: list[np.ndarray], out: np.ndarray | list[np.ndarray],
        tables: list[np.ndarray] | None = None, workspace: list | None = None) -> int:
    """Executes ``prog`` on host arrays (inputs in call order: x, w, ids, then
    each weight group's first array; ``out`` written in place: one array, or
    a list indexed by the outputs' numbers (the backward's dx, dw); ``tables``
    default to the stacked arrays' own, for dense experts).  Returns the err word: the first slot
    with a bad expert id, or `contract.ERR_NONE`.  ``workspace`` (a list) receives
    the workspace bytes, for debugging."""
    inputs = [np.ascontiguousarray(a) for a in inputs]
    outs = out if isinstance(out, (list, tuple)) else [out]
    assert all(o.flags.c_contiguous for o in outs), "outputs are written in place: contiguous arrays"
    if tables is None:
        tables = pointer_tables(*inputs[contract.IN_GROUP0:])
    align = contract.WORKSPACE_ALIGN
    ws = np.empty(prog.workspace_bytes + align, np.uint8)
    ws_base = -(-ws.ctypes.data // align) * align
    ws[:] = 0xCD  # poison: nothing may depend on workspace it did not write
    fns: dict[str, object] = {}
    for ln in prog.launches:
        args = []
        for a in ln.args:
            if a.kind == contract.ARG_INPUT:
                args.append(_HostTensor(inputs[a.index].ctypes.data + a.offset, a.ptype))
            elif a.kind == contract.ARG_OUTPUT:
                args.append(_HostTensor(outs[a.index].ctypes.data + a.offset, a.ptype))
            elif a.kind == contract.ARG_WORKSPACE:
                args.append(_HostTensor(ws_base + a.offset, a.ptype))
            elif a.kind == contract.ARG_TABLE:
                args.append(_HostTensor(tables[a.index].ctypes.data, "*i64"))
            else:
                args.append(a.offset)
        if ln.kernel.name not in fns:
            fns[ln.kernel.name] = _interpreted(ln.kernel.name)
        fns[ln.kernel.name][ln.grid](*args, **dict(ln.kernel.constexprs))
    start = ws_base - ws.ctypes.data
    if workspace is not None:
        workspace.append(ws[start:start + prog.workspace_bytes])
    err = np.frombuffer(ws, np.int32, prog.err_words, start + prog.err_offset)
    return int(err.min())  # the handler's reading: the smallest word (the first bad slot)
