"""The CPU micro-kernels of every instruction set this CPU runs, one at a time.

The testers are C++ (tests/native/kernel_tests.cc): each sweeps one entry
of an instruction set's kernel table over its parameter space (rows, ragged
columns, K, partial-sum modes, activations, weight formats) with fresh random
inputs, checks it against a float64 reference and the bit-for-bit claims of
kernels.h, and returns one line per failing case.
"""
from __future__ import annotations

import platform
import random

import pytest

import jax_nbx.cpu
from jax_nbx import _ffi

from support import ffi_testing

T = ffi_testing.load()  # jax_nbx._ffi_testing: the testers
pytestmark = [pytest.mark.fast, pytest.mark.sanitize, pytest.mark.arm64]


@pytest.mark.parametrize("kernel", T.kernel_names())
@pytest.mark.parametrize("isa", jax_nbx.cpu.supported_isas())
def test_kernel(isa, kernel):
    _sweep(T.run_kernel_tests, isa, kernel)


def _sweep(run, table: str, kernel: str) -> None:
    """One tester sweep (`run(table, kernel, seed)`) on fresh inputs: no failing case."""
    seed = random.SystemRandom().randrange(2**32)  # fresh inputs every run
    failures = run(table, kernel, seed)
    assert not failures, (
        f"{table} {kernel}: {len(failures)} failing cases with seed={seed} (reproduce: "
        f"jax_nbx._ffi_testing.{run.__name__}({table!r}, {kernel!r}, {seed})); the first 20:\n"
        + "\n".join(failures[:20]))


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="instruction set"):
        T.run_kernel_tests("sse1", "gemm1", 0)
    with pytest.raises(ValueError, match="unknown kernel"):
        T.run_kernel_tests(jax_nbx.cpu.supported_isas()[-1], "gemm3", 0)


# The bfloat16 dot-product kernels (xla_ffi/cpu/kernels/kernels_dot.h): the emulated
# tables everywhere, the fma ones on x86-64 with AVX2 (8x6) or AVX-512 (16x12),
# the avx512_bf16 ones where the CPU has the instruction.  "semantics" checks
# the documented bits: the emulation's and the fma tables' (the instruction's
# are its hardware's).
# stream1/stream2 (bit for bit against the table's packed kernels) where the
# table streams (dot_streaming_tables(): the fma and avx512_bf16 ones; the
# instruction's tables stream with the fma kernels of their width, so there
# the check is that the instruction's bits are the documented ones).
_DOT_CASES = [(table, kernel) for table in T.dot_kernel_tables() for kernel in T.dot_kernel_names()
              if (kernel != "semantics" or not table.startswith("avx512_bf16/"))
              and (not kernel.startswith("stream") or table in T.dot_streaming_tables())]


@pytest.mark.parametrize("table, kernel", _DOT_CASES)
def test_dot_kernel(table, kernel):
    _sweep(T.run_dot_kernel_tests, table, kernel)


def _cpu_flags() -> set[str]:
    if platform.machine() not in ("x86_64", "AMD64"):  # (under qemu-aarch64, /proc/cpuinfo is the host's)
        return set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def test_dot_kernel_tables_follow_the_cpu():
    tables = set(T.dot_kernel_tables())
    assert {"emulated/16x12", "emulated/8x6", "emulated/4x6"} <= tables
    flags = _cpu_flags()
    isas = jax_nbx.cpu.supported_isas()
    has_bf16 = "avx512_bf16" in flags and "avx512" in isas
    assert ({"avx512_bf16/16x12", "avx512_bf16/8x6"} <= tables) == has_bf16
    assert ("fma/8x6" in tables) == ("avx2" in isas)
    assert ("fma/16x12" in tables) == ("avx512" in isas)
    assert set(T.dot_streaming_tables()) == {t for t in tables if not t.startswith("emulated/")}
    blocking = jax_nbx.cpu.isa_families()["dot"]  # the dot tables follow the dot family's blocking
    assert jax_nbx.cpu.dot_kernels() == ("emulated" if blocking == "generic" else "avx512_bf16" if has_bf16 else "fma")


def test_set_dot_kernels_forces_and_restores():
    if jax_nbx.cpu.isa_families()["dot"] == "generic":
        pytest.skip("the generic blocking has only the emulation")
    supported = jax_nbx.cpu.supported_dot_kernels()
    assert supported[-1] == "emulated"
    auto = jax_nbx.cpu.dot_kernels()
    try:
        for name in supported:
            jax_nbx.cpu.set_dot_kernels(name)
            assert jax_nbx.cpu.dot_kernels() == name
    finally:
        jax_nbx.cpu.set_dot_kernels("auto")
    assert jax_nbx.cpu.dot_kernels() == auto
    with pytest.raises(ValueError, match="set_dot_kernels: expected"):
        jax_nbx.cpu.set_dot_kernels("amx")
    if "avx512_bf16" not in supported:  # a known kind this CPU lacks: said so by the module
        with pytest.raises(ValueError, match="'avx512_bf16' are not supported on this CPU"):
            _ffi.set_cpu_dot_kernels("avx512_bf16")


def test_dot_kernels_unknown_names_raise():
    with pytest.raises(ValueError, match="dot kernels 'amx/16x12'"):
        T.run_dot_kernel_tests("amx/16x12", "gemm1", 0)
    with pytest.raises(ValueError, match="unknown dot kernel"):
        T.run_dot_kernel_tests("emulated/16x12", "gemm3", 0)
    with pytest.raises(ValueError, match="has no streaming kernels"):
        T.run_dot_kernel_tests("emulated/8x6", "stream1", 0)
