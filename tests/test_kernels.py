"""The CPU micro-kernels of every instruction set this CPU runs, one at a time.

The testers are C++ (xla_ffi/testing/kernel_tests.cc): each sweeps one entry
of an instruction set's kernel table over its parameter space (rows, ragged
columns, K, partial-sum modes, activations, weight formats) with fresh random
inputs, checks it against a float64 reference and the bit-for-bit claims of
kernels.h, and returns one line per failing case.
"""
from __future__ import annotations

import random

import pytest

import jax_nbx.cpu
from jax_nbx import _ffi

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("kernel", _ffi.kernel_names())
@pytest.mark.parametrize("isa", jax_nbx.cpu.supported_isas())
def test_kernel(isa, kernel):
    seed = random.SystemRandom().randrange(2**32)  # fresh inputs every run
    failures = _ffi.run_kernel_tests(isa, kernel, seed)
    assert not failures, (
        f"{isa} {kernel}: {len(failures)} failing cases with seed={seed} (reproduce: "
        f"jax_nbx._ffi.run_kernel_tests({isa!r}, {kernel!r}, {seed})); the first 20:\n"
        + "\n".join(failures[:20]))


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="instruction set"):
        _ffi.run_kernel_tests("sse1", "gemm1", 0)
    with pytest.raises(ValueError, match="unknown kernel"):
        _ffi.run_kernel_tests(jax_nbx.cpu.supported_isas()[-1], "gemm3", 0)
