"""The CUDA programs that ``benchmarks/gpu.py`` launches, found on a machine without a GPU.

`record(models, tokens, quant_tokens, train_tokens, device_kind, cc)` traces gpu.py's own
functions -- its correctness cases, every timing variant of every (model, T) row, the quantized
decode rows, the training step's forward and backward -- with `jax.eval_shape` against a
stand-in CUDA device (`fake_gpu`): the CUDA backend plans and builds each call's program as it
would on that GPU (the same `plan.build`, the device kind's tile configs, one band: the GPU
check's budget holds every row in one), and instead of compiling and calling the handler, the
kernels each program names are collected.  No array is allocated (shapes only) and nothing runs.
``benchmarks/gpu_precompile.py`` then compiles them into the cubin cache, so that the GPU check's
timing rows load their kernels instead of compiling them there.
"""
from __future__ import annotations

import contextlib
import functools
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import jax_nbx as nbx
from jax_nbx import _registry
from jax_nbx.backends.cuda import calls
from jax_nbx.backends.cuda import compile as C
from jax_nbx.models import MODELS


class _Device:
    """What the CUDA calls read of a device: its kind (the tile configs' file) and capability."""

    def __init__(self, kind: str, cc: int):
        self.device_kind = kind
        self.compute_capability = f"{cc // 10}.{cc % 10}"


@contextlib.contextmanager
def fake_gpu(kernels: list, device_kind: str = "NVIDIA H200", cc: int = 90):
    """Within the block the CUDA backend runs as on a ``device_kind`` GPU of capability ``cc``
    for tracing only: `compile.pack` appends each program's kernels to ``kernels`` (what
    `precompile` takes) instead of compiling them; the budget is left unlimited (one band)."""

    def pack(prog, _cc):
        kernels.extend(prog.kernels())
        return np.zeros(1, np.uint8), np.zeros((len(prog.kernels()), len(C.KERNEL_FIELDS)), np.int64)

    with mock.patch.object(calls, "_device", lambda ordinal=0: _Device(device_kind, cc)), \
            mock.patch.object(C, "pack", pack), mock.patch.object(calls, "ensure_budget", lambda ordinal=0: None), \
            mock.patch.object(_registry, "platform_is_cuda", lambda: True), \
            mock.patch.object(_registry, "cuda_unavailable_reason", lambda: ""), \
            mock.patch.object(jax, "default_backend", lambda: "gpu"):
        yield kernels


def _layer(m, T: int):
    return jax.eval_shape(functools.partial(m.random_layer, T, jnp.bfloat16, T))


def _random_case(T, E, k, H, I, xd, wd):
    x = jax.ShapeDtypeStruct((T, H), xd)
    ex = nbx.Experts(*(jax.ShapeDtypeStruct(s, wd) for s in ((E, H, I), (E, H, I), (E, I, H))))
    return x, jax.ShapeDtypeStruct((T, k), jnp.float32), jax.ShapeDtypeStruct((T, k), jnp.int32), ex


def traced_calls(gpu, models, tokens, quant_tokens, train_tokens, checks: bool = True):
    """(label, thunk) for every CUDA call gpu.py makes with these arguments (``gpu``: the module);
    each thunk traces its call with `jax.eval_shape`."""
    out = []
    if checks:
        for T, E, k, H, I, xd, wd, act, band in gpu.CHECK_CASES:
            f = functools.partial(lambda a, band, x, w, ids, ex: nbx.fused_moe(
                x, w, ids, ex, activation=a, implementation="ffi", max_workspace_bytes=band), act, band)
            out.append((f"check T={T} E={E} H={H}", functools.partial(jax.eval_shape, f,
                                                                      *_random_case(T, E, k, H, I, xd, wd))))
        for T, E, k, H, I, wd in gpu.GRAD_CASES:
            x, w, ids, ex = _random_case(T, E, k, H, I, wd, wd)
            out.append((f"grad T={T} E={E} H={H}", functools.partial(jax.eval_shape, _grad(gpu.ours), x, w, ex, ids)))
    for name in models:
        m = MODELS[name]
        for T in tokens:
            args = _layer(m, T)
            for label, fn in gpu.BENCH_VARIANTS:
                if label in ("ragged", "dense") or not gpu.variant_runs(label, m, T):
                    continue
                out.append((f"{name} T={T} {label}", functools.partial(jax.eval_shape, fn, *args)))
        for T in quant_tokens:
            x, w, ids, ex = _layer(m, T)
            for fmt in gpu.QUANT_FORMATS[1:]:
                out.append((f"{name} T={T} {fmt}", functools.partial(
                    lambda f, x, w, ids, ex: jax.eval_shape(
                        lambda x, w, ids, ex: gpu.ours(x, w, ids, gpu.quantized(ex, f)), x, w, ids, ex),
                    fmt, x, w, ids, ex)))
        for T in train_tokens:
            x, w, ids, ex = _layer(m, T)
            out.append((f"{name} T={T} training step", functools.partial(
                jax.eval_shape, _grad(gpu.ours), x, w, ex, ids)))
    return out


def _grad(fn):
    """d sum(fn(...)^2) / d(x, topk_weights, experts), as gpu.py's gradient checks and training rows."""
    return jax.grad(lambda x, w, ex, ids: jnp.sum(jnp.square(fn(x, w, ids, ex).astype(jnp.float32))),
                    argnums=(0, 1, 2))


def record(models, tokens, quant_tokens, train_tokens, device_kind: str = "NVIDIA H200", cc: int = 90,
           checks: bool = True) -> list:
    """The kernels (`Program.kernels` entries) of every CUDA call gpu.py makes with these
    arguments on a ``device_kind`` GPU; raises if a call cannot be traced (naming it)."""
    import gpu  # benchmarks/gpu.py (this folder on sys.path)

    kernels: list = []
    with fake_gpu(kernels, device_kind, cc):
        for label, thunk in traced_calls(gpu, models, tokens, quant_tokens, train_tokens, checks):
            try:
                thunk()
            except Exception as e:
                raise RuntimeError(f"gpu_programs: tracing {label} failed: {type(e).__name__}: {e}") from e
    return kernels


if __name__ == "__main__":  # a quick look: how many kernels gpu.py's default rows name
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    ks = record(["mixtral-8x7b", "olmoe-1b-7b", "qwen3-30b-a3b"], [1, 16, 512, 4096], [1], [4096])
    print(len(ks), "kernel uses,", len(set(ks)), "distinct")
