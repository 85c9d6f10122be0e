"""The CUDA kernels' cubin cache (jax_nbx/backends/cuda/compile.py): compiled for sm_90 on this
machine (Triton ships ptxas; no GPU needed), stored under JAX_NBX_CUBIN_CACHE, served again without
Triton's compiler, and missed -- never a stale cubin -- when the Triton version, the target, the
kernels' source or the kernel's options change, or a file is torn."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

pytest.importorskip("triton")

from jax_nbx.backends.cuda import compile as C  # noqa: E402
from jax_nbx.backends.cuda import plan as P  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_NBX_CUBIN_CACHE", str(tmp_path / "cubins"))
    C._compile.cache_clear()
    yield tmp_path / "cubins"
    C._compile.cache_clear()


def _prog():
    return P.build(0, 0, 2, 5, 40, 24, np.float32, np.float32, 0)   # no tokens: one fill_i32 kernel


def _refuse_compiles(monkeypatch):
    def refuse(*a):
        raise AssertionError("compiled: the cache missed")
    monkeypatch.setattr(C, "_triton_compile", refuse)


def test_a_cubin_compiled_once_is_served_from_the_cache(cache, monkeypatch):
    before = C.cache_stats()
    blob, table = C.pack(_prog(), 90)
    files = sorted(os.listdir(cache))
    assert [f.split("-sm90-")[0] for f in files] == ["fill_i32", "fill_i32"]        # .cubin and .json
    assert C.cache_stats()["misses"] == before["misses"] + 1 and C.cache_stats()["writes"] == before["writes"] + 1
    C._compile.cache_clear()
    _refuse_compiles(monkeypatch)
    blob2, table2 = C.pack(_prog(), 90)
    assert C.cache_stats()["hits"] == before["hits"] + 1
    np.testing.assert_array_equal(blob2, blob)
    np.testing.assert_array_equal(table2, table)


@pytest.mark.parametrize("change", ["triton", "target", "source", "options", "torn"])
def test_a_changed_key_or_a_torn_file_misses(cache, monkeypatch, change):
    C.pack(_prog(), 90)
    C._compile.cache_clear()
    cc, prog = 90, _prog()
    if change == "triton":
        monkeypatch.setattr(C, "_triton_version", lambda: "0.0.1")
    elif change == "target":
        cc = 80
    elif change == "source":
        monkeypatch.setattr(C, "_source_digest", lambda: "another source")
    elif change == "options":
        ln = prog.launches[0]
        kernel = dataclasses.replace(ln.kernel, num_warps=ln.kernel.num_warps * 2)
        prog = dataclasses.replace(prog, launches=[dataclasses.replace(ln, kernel=kernel)])
    else:
        cubin = [f for f in os.listdir(cache) if f.endswith(".cubin")][0]
        with open(cache / cubin, "r+b") as f:
            f.truncate(10)
    calls = []
    real = C._triton_compile
    monkeypatch.setattr(C, "_triton_compile", lambda *a: calls.append(a) or real(*a))
    C.pack(prog, cc)
    assert len(calls) == 1                      # compiled again, not loaded
    if change == "torn":                        # and rewritten whole
        C._compile.cache_clear()
        _refuse_compiles(monkeypatch)
        C.pack(prog, cc)


def test_no_cache_folder_with_0(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_NBX_CUBIN_CACHE", "0")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    C._compile.cache_clear()
    try:
        C.pack(_prog(), 90)
    finally:
        C._compile.cache_clear()
    assert not os.listdir(tmp_path)


def test_the_default_folder_is_under_xdg_cache_home(tmp_path, monkeypatch):
    from jax_nbx import _env
    monkeypatch.delenv("JAX_NBX_CUBIN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _env.cubin_cache() == os.path.join(str(tmp_path), "jax_nbx", "cubins")
    monkeypatch.setenv("JAX_NBX_CUBIN_CACHE", "~/x")
    assert _env.cubin_cache() == os.path.expanduser("~/x")
