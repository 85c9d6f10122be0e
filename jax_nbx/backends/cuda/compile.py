"""Ahead-of-time compilation of the CUDA path's Triton kernels.

`triton.compile` makes a cubin for the device's compute capability (it needs
no GPU: Triton ships ptxas).  Compiled kernels are cached on disk by Triton
itself (``TRITON_CACHE_DIR``, default ``~/.triton/cache``: the key covers the
kernel source, signature, constexprs, options, Triton version and target) and
in this process.  `pack` turns a program's kernels into the two attributes
the CUDA handler takes: one byte blob (names and cubins) and an int64 table.
"""
from __future__ import annotations

import functools
import hashlib
import inspect

import numpy as np

from ... import contract
from . import plan as P

# int64 fields per kernel in the handler's table (abi::kKernelFieldNames;
# decoded by DecodeKernelTable in xla_ffi/cuda/program.h)
KERNEL_FIELDS = contract.KERNEL_FIELDS


def kernel_function(name: str):
    """The Triton kernel a program names (forward: `kernels`; backward:
    `kernels_backward`); imports Triton."""
    from . import kernels, kernels_backward

    for module in (kernels, kernels_backward):
        if not name.startswith("_") and hasattr(module, name):
            return getattr(module, name)
    raise ValueError(f"the program names a kernel {name!r} that neither kernels nor kernels_backward has")


@functools.cache
def _compile(kernel: P.Kernel, ptypes: tuple[str, ...], aligned: tuple[bool, ...], cc: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel_function(kernel.name)
    params = list(inspect.signature(fn.fn).parameters)
    const = dict(kernel.constexprs)
    runtime = [p for p in params if p not in const]
    if len(runtime) != len(ptypes):
        raise ValueError(f"kernel {kernel.name}: {len(ptypes)} arguments for parameters {runtime}")
    sig, attrs, it = {}, {}, iter(zip(ptypes, aligned))
    for i, p in enumerate(params):
        if p in const:
            sig[p] = "constexpr"
            continue
        t, al = next(it)
        sig[p] = t
        if t.startswith("*") and al:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=const, attrs=attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                        options={"num_warps": kernel.num_warps, "num_stages": kernel.num_stages})
    md = ck.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise NotImplementedError(f"kernel {kernel.name} needs Triton scratch memory; not supported")
    return md.name, bytes(ck.asm["cubin"]), int(md.num_warps), int(md.shared)


def pack(prog: P.Program, cc: int) -> tuple[np.ndarray, np.ndarray]:
    """(blob uint8, table int64 [n_kernels, len(KERNEL_FIELDS)]) for the handler."""
    blob, rows = bytearray(), []
    for kernel, ptypes, aligned in prog.kernels():
        name, cubin, warps, shared = _compile(kernel, ptypes, aligned, cc)
        h = int.from_bytes(hashlib.blake2b(cubin + name.encode(), digest_size=8).digest(), "little")
        name_off = len(blob)
        blob += name.encode()
        cubin_off = len(blob)
        blob += cubin
        fields = dict(name_off=name_off, name_len=len(name), cubin_off=cubin_off, cubin_len=len(cubin),
                      num_warps=warps, shared=shared, hash=h - (1 << 64) if h >= 1 << 63 else h)
        rows.append([fields[f] for f in KERNEL_FIELDS])
    return np.frombuffer(bytes(blob), np.uint8).copy(), np.asarray(rows, np.int64).reshape(-1, len(KERNEL_FIELDS))
