"""Ahead-of-time compilation of the CUDA path's Triton kernels.

`triton.compile` makes a cubin for the device's compute capability (it needs
no GPU: Triton ships ptxas).  Compiled kernels are kept in this process and
in jax_nbx's **cubin cache** on disk (``JAX_NBX_CUBIN_CACHE``, default
``$XDG_CACHE_HOME/jax_nbx/cubins``; docs/backends.md): one file per kernel,
named by a key over everything the cubin depends on -- the installed Triton's
version and its ``TRITON_*`` settings, the target (compute capability), the text of the kernels' modules
(``kernels.py``, ``kernels_backward.py``), the kernel's name, argument types,
alignments, constexprs, warps and stages, and this cache's format -- so that a
change to any of them misses rather than loads a stale cubin.  A hit imports
neither Triton's compiler nor the kernels: a cache filled on a machine without
a GPU (`precompile`) serves a GPU machine's first call.  `pack` turns a
program's kernels into the two attributes the CUDA handler takes: one byte
blob (names and cubins) and an int64 table.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import json
import os
import tempfile

import numpy as np

from ... import _env, contract
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


#: this cache's file format; part of every key
CACHE_FORMAT = 1
_KERNEL_MODULES = ("jax_nbx.backends.cuda.kernels", "jax_nbx.backends.cuda.kernels_backward")
_stats = {"hits": 0, "misses": 0, "writes": 0}


def cache_stats() -> dict:
    """This process's cubin-cache lookups: hits and misses on disk, cubins written."""
    return dict(_stats)


@functools.cache
def _source_digest() -> str:
    """The kernels' modules' text, hashed (read from the files: Triton is not imported)."""
    h = hashlib.blake2b(digest_size=16)
    for mod in _KERNEL_MODULES:
        with open(importlib.util.find_spec(mod).origin, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _triton_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("triton")
    except PackageNotFoundError:
        return "none"


def cache_key(kernel: P.Kernel, ptypes: tuple[str, ...], aligned: tuple[bool, ...], cc: int) -> str:
    """The cubin cache's file name of one compiled kernel (see the module's docstring)."""
    desc = json.dumps({"format": CACHE_FORMAT, "triton": _triton_version(), "env": _env.triton_settings(),
                       "cc": int(cc), "source": _source_digest(), "kernel": kernel.name, "ptypes": list(ptypes),
                       "aligned": [bool(a) for a in aligned], "constexprs": sorted((k, repr(v)) for k, v in
                                                                                   kernel.constexprs),
                       "num_warps": kernel.num_warps, "num_stages": kernel.num_stages}, sort_keys=True)
    return f"{kernel.name}-sm{int(cc)}-{hashlib.blake2b(desc.encode(), digest_size=16).hexdigest()}"


def _load(folder: str, key: str):
    try:
        with open(os.path.join(folder, key + ".json")) as f:
            meta = json.load(f)
        with open(os.path.join(folder, key + ".cubin"), "rb") as f:
            cubin = f.read()
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("cubin_len") != len(cubin) or meta.get("key") != key:
        return None  # torn or foreign: compiled again and rewritten
    return meta["name"], cubin, int(meta["num_warps"]), int(meta["shared"])


def _store(folder: str, key: str, name: str, cubin: bytes, warps: int, shared: int) -> None:
    """Written atomically (a temporary file renamed), cubin first: a reader sees both files or a miss."""
    try:
        os.makedirs(folder, exist_ok=True)
        meta = json.dumps({"key": key, "name": name, "num_warps": warps, "shared": shared,
                           "cubin_len": len(cubin)})
        for ext, data in ((".cubin", cubin), (".json", meta.encode())):
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, os.path.join(folder, key + ext))
        _stats["writes"] += 1
    except OSError:
        pass  # a read-only or full cache folder costs a compile next time, nothing else


@functools.cache
def _compile(kernel: P.Kernel, ptypes: tuple[str, ...], aligned: tuple[bool, ...], cc: int):
    folder = _env.cubin_cache()
    key = cache_key(kernel, ptypes, aligned, cc) if folder else None
    if folder:
        hit = _load(folder, key)
        if hit is not None:
            _stats["hits"] += 1
            return hit
        _stats["misses"] += 1
    out = _triton_compile(kernel, ptypes, aligned, cc)
    if folder:
        _store(folder, key, *out)
    return out


def _triton_compile(kernel: P.Kernel, ptypes: tuple[str, ...], aligned: tuple[bool, ...], cc: int):
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


def precompile(kernels, cc: int) -> dict:
    """Compiles ``kernels`` (`Program.kernels` entries: (kernel, argument types, alignments)) for
    compute capability ``cc`` into the cubin cache, each once; returns how many were found there
    already and how many were compiled.  Needs Triton's compiler (not its interpreter: run it in a
    process without ``TRITON_INTERPRET``), no GPU; ``benchmarks/gpu_precompile.py`` uses it."""
    if _env.cubin_cache() is None:
        raise ValueError("precompile: JAX_NBX_CUBIN_CACHE is off ('0'): there is no cache to fill")
    before = cache_stats()
    for key in dict.fromkeys(kernels):
        _compile(*key, int(cc))
    after = cache_stats()
    return {"found": after["hits"] - before["hits"], "compiled": after["misses"] - before["misses"]}


def missing(kernels, cc: int) -> list:
    """The ``kernels`` (`Program.kernels` entries) that the cubin cache lacks for compute
    capability ``cc``, each once (read only: nothing is compiled, Triton is not imported)."""
    folder = _env.cubin_cache()
    if folder is None:
        raise ValueError("missing: JAX_NBX_CUBIN_CACHE is off ('0'): there is no cache to read")
    return [key for key in dict.fromkeys(kernels) if _load(folder, cache_key(*key, int(cc))) is None]


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
