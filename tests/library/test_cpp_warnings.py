"""Our C++ compiles clean under -Wall -Wextra -Werror with GCC and with Clang
(every source under xla_ffi/ -- the core library's and the product module's --
and under tests/native/ -- the test module's --, each with its own
instruction-set flags, as CMakeLists.txt builds it; jaxlib's and nanobind's
headers are system headers).

Clang is installed by .ci/run; where a compiler is missing its case skips."""
from __future__ import annotations

import concurrent.futures
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import jax
import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
SRC = ROOT / "xla_ffi"
TESTS = ROOT / "tests"  # the test module's includes name their folder: "native/..."
# per-file flags (CMakeLists.txt's NBX_KERNEL_SOURCES)
ISA_FLAGS = {
    "cpu/kernels/kernels_avx2.cc": ["-mavx2", "-mfma", "-mf16c"],
    "cpu/kernels/kernels_dot_avx2.cc": ["-mavx2", "-mfma", "-mf16c"],
    "cpu/kernels/kernels_avx512.cc": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"],
    "cpu/kernels/kernels_dot_avx512.cc": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"],
    "cpu/kernels/kernels_dot_avx512bf16.cc": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16",
                                              "-mavx2", "-mfma"],
}
CUDA_INCLUDE = pathlib.Path("/usr/local/cuda/include")


def _sources() -> list[str]:
    files = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.cc"))
    if not (CUDA_INCLUDE / "cuda.h").exists():
        files = [f for f in files if not f.startswith("cuda/")]
    return files + sorted(str(p.relative_to(ROOT)) for p in (TESTS / "native").rglob("*.cc"))


def _nanobind_include() -> str:
    try:
        import nanobind
    except ImportError:
        pytest.skip("nanobind is not installed (pip install -e '.[test]' brings it)")
    return nanobind.include_dir()


def _generated_stand_ins(folder: pathlib.Path) -> None:
    """What CMake generates into build/.../generated/, stand-ins of the same form: the Metal
    library source (metal/library_source.inc) and the optional backends' header (a build without
    them: cmake/optional_backend.cmake)."""
    (folder / "metal").mkdir(exist_ok=True)
    (folder / "metal" / "library_source.inc").write_text('R"NBX_MSL(// kernels)NBX_MSL"')
    (folder / "optional_backends.h").write_text('#pragma once\n#define NBX_CUDA_NOT_BUILT "stand-in"\n'
                                                '#define NBX_METAL_NOT_BUILT "stand-in"\n')


def _compile(compiler: str, source: str, generated: pathlib.Path) -> str:
    """"" when ``source`` compiles clean, else the command and its errors."""
    cmd = [compiler, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
           "-isystem", jax.ffi.include_dir(), "-isystem", _nanobind_include(),
           "-isystem", sysconfig.get_paths()["include"], "-I", str(SRC), "-I", str(TESTS), "-I", str(generated),
           *ISA_FLAGS.get(source, []), str(SRC / source if not source.startswith("tests/") else ROOT / source)]
    if source.startswith("cuda/"):
        cmd[1:1] = ["-isystem", str(CUDA_INCLUDE)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return "" if out.returncode == 0 else f"{' '.join(cmd)}\n{out.stderr[-4000:]}"


@pytest.mark.parametrize("compiler", ["g++", "clang++"])
def test_compiles_without_warnings(compiler, tmp_path):
    """Every source, each compiled on its own (in parallel: one per core)."""
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} is not installed")
    if sys.platform != "linux":
        pytest.skip("checked on Linux")
    sources = _sources()
    _generated_stand_ins(tmp_path)
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        errors = [e for e in pool.map(lambda src: _compile(compiler, src, tmp_path), sources) if e]
    assert not errors, f"{len(errors)} of {len(sources)} sources:\n" + "\n".join(errors)
