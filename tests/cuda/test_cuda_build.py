"""The CUDA handler's build and registration, checked where there is no GPU."""
from __future__ import annotations

import shutil

import pytest

import jax_nbx as nbx
from jax_nbx import _registry, contract
from jax_nbx.backends.cuda import calls as _cuda

ffi = _registry.ffi_module()


def test_cuda_handler_built_where_nvcc_is():
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc on this machine: the CUDA handler is not built (NBX_CUDA=AUTO)")
    assert ffi.has_cuda, f"nvcc is on PATH but the CUDA handler was not built: {ffi.cuda_not_built}"
    assert contract.TARGET_CUDA_FORWARD in ffi.cuda_handlers()
    assert contract.TARGET_CUDA_FORWARD_TABLES in ffi.cuda_handlers()
    assert contract.TARGET_CUDA_BACKWARD in ffi.cuda_handlers()


def test_the_build_says_why_it_has_no_cuda_handler():
    """cmake/optional_backend.cmake writes the reason into the module: "" where
    the handler is built, else why not (NBX_CUDA=OFF, no nvcc, or the sources
    failed to compile), which the CUDA path gives as its own."""
    assert (ffi.cuda_not_built == "") == ffi.has_cuda
    if not ffi.has_cuda:
        assert ffi.cuda_not_built.startswith(("this build of jax_nbx has no CUDA handler: ",
                                              "the CUDA handler failed to compile when jax_nbx was built: "))
        assert _registry.cuda_unavailable_reason() == ffi.cuda_not_built


def test_no_gpu_means_no_gpu_platform():
    if _registry.platform_is_cuda():
        pytest.skip("this machine has a CUDA device")
    assert not _registry.has_handler("gpu")
    assert "gpu" not in _registry.platforms()


def test_missing_driver_is_reported_not_fatal():
    if not ffi.has_cuda:
        pytest.skip("built without the CUDA handler")
    status = ffi.cuda_driver_status()
    if status:  # no libcuda here: the module still imported, and says why
        assert "libcuda" in status or "cuInit" in status
    assert nbx.tables.stats("cuda")["entries"] >= 0


def test_cuda_unavailable_reason_says_why_not():
    msg = _cuda.unavailable_reason()
    assert msg == "" or "CUDA handler" in msg or "Triton" in msg


def test_tables_api():
    s = nbx.tables.stats()
    assert set(s) == {"entries", "hits", "misses", "evictions", "bytes"}
    with pytest.raises(ValueError, match="capacity must be >= 1; got 0"):
        nbx.tables.set_capacity(0)
    nbx.tables.set_capacity(256)
    nbx.tables.clear()
    assert nbx.tables.stats()["entries"] == 0
