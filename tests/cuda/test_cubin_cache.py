"""The CUDA kernels' cubin cache (jax_nbx/backends/cuda/compile.py): compiled for sm_90 on this
machine (Triton ships ptxas; no GPU needed), stored under JAX_NBX_CUBIN_CACHE, served again without
Triton's compiler, and missed -- never a stale cubin -- when the Triton version or its TRITON_*
settings, the target, the kernels' source or the kernel's options change, or a file is torn; and
the GPU check's cache filled from the programs the interpreter ran (benchmarks/gpu_precompile.py)."""
from __future__ import annotations

import dataclasses
import os

# As every test module of tests/cuda: Triton's kernels in this process are the interpreter's (a
# module importing Triton first, outside it, would make them compiled kernels for the whole worker)
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton")

from jax_nbx.backends.cuda import compile as C  # noqa: E402
from jax_nbx.backends.cuda import plan as P  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_NBX_CUBIN_CACHE", str(tmp_path / "cubins"))
    C._compile.cache_clear()
    yield tmp_path / "cubins"
    C._compile.cache_clear()


@pytest.fixture
def compiler(monkeypatch):
    """Triton's compile stood in for in this process (its kernels, once imported here outside the
    interpreter, would break the interpreter's tests in the same worker): a cubin made of the
    compile's arguments, and the calls counted.  The real compile runs in the precompile test's
    subprocess below."""
    calls = []

    def fake(kernel, ptypes, aligned, cc):
        calls.append(kernel.name)
        return kernel.name, repr((kernel, ptypes, aligned, cc)).encode(), kernel.num_warps, 0
    monkeypatch.setattr(C, "_triton_compile", fake)
    return calls


def _prog():
    return P.build(3, 3, 2, 5, 64, 32, np.float32, np.float32, 0)   # decode: decode1, decode2, combine


def test_a_cubin_compiled_once_is_served_from_the_cache(cache, compiler):
    before = C.cache_stats()
    blob, table = C.pack(_prog(), 90)
    n = len(_prog().kernels())
    assert len(compiler) == n == 3
    files = sorted(os.listdir(cache))
    assert len(files) == 2 * n and all("-sm90-" in f for f in files)      # a .cubin and a .json each
    assert C.cache_stats()["misses"] == before["misses"] + n and C.cache_stats()["writes"] == before["writes"] + n
    C._compile.cache_clear()
    blob2, table2 = C.pack(_prog(), 90)
    assert len(compiler) == n                                            # nothing compiled again
    assert C.cache_stats()["hits"] == before["hits"] + n
    np.testing.assert_array_equal(blob2, blob)
    np.testing.assert_array_equal(table2, table)


@pytest.mark.parametrize("change", ["triton", "triton_env", "target", "source", "options", "torn"])
def test_a_changed_key_or_a_torn_file_misses(cache, compiler, monkeypatch, change):
    C.pack(_prog(), 90)
    C._compile.cache_clear()
    cc, prog = 90, _prog()
    n = len(prog.kernels())
    if change == "triton":
        monkeypatch.setattr(C, "_triton_version", lambda: "0.0.1")
    elif change == "triton_env":
        monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    elif change == "target":
        cc = 80
    elif change == "source":
        monkeypatch.setattr(C, "_source_digest", lambda: "another source")
    elif change == "options":
        prog = dataclasses.replace(prog, launches=[
            dataclasses.replace(ln, kernel=dataclasses.replace(ln.kernel, num_warps=ln.kernel.num_warps * 2))
            for ln in prog.launches])
    else:
        for f in os.listdir(cache):
            if f.endswith(".cubin"):
                with open(cache / f, "r+b") as fh:
                    fh.truncate(10)
    C.pack(prog, cc)
    assert len(compiler) == 2 * n                  # compiled again, not loaded
    if change == "torn":                           # and rewritten whole: served next time
        C._compile.cache_clear()
        C.pack(prog, cc)
        assert len(compiler) == 2 * n


def test_no_cache_folder_with_0(tmp_path, monkeypatch, compiler):
    monkeypatch.setenv("JAX_NBX_CUBIN_CACHE", "0")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    C._compile.cache_clear()
    try:
        C.pack(_prog(), 90)
        with pytest.raises(ValueError, match="JAX_NBX_CUBIN_CACHE is off"):
            C.precompile(_prog().kernels(), 90)
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


def test_precompile_fills_the_cache_with_the_interpreted_programs_kernels(tmp_path, monkeypatch):
    """The rehearsal of the GPU check's cache: a test run under the interpreter records its programs'
    kernels, gpu_precompile.py compiles them for sm_90 (in a process without the interpreter), and
    every kernel the interpreter ran is then a hit: its file is in the cache, under the key this
    process computes."""
    import pickle
    import subprocess
    import sys
    cache, rec = tmp_path / "cubins", tmp_path / "records"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu_precompile.py"), "--cache", str(cache),
                        "--no-bench", "--any-triton",
                        "--tests", "tests/suite/test_forward.py", "-m", "not sweep", "--backends", "cuda-interpret",
                        "-k", "test_matches_float64 and xbf16", "-p", "no:xdist"],
                       cwd=root, capture_output=True, text=True, env=dict(os.environ, JAX_NBX_KERNEL_RECORD=""),
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "sm_90:" in r.stdout and " 0 compiled" not in r.stdout
    # the same programs' kernels, recorded again here, are all in the cache
    monkeypatch.setenv("JAX_NBX_KERNEL_RECORD", str(rec))
    monkeypatch.setenv("JAX_NBX_CUBIN_CACHE", str(cache))
    from support.cuda_interpret import _record
    prog = P.build(3, 3, 2, 5, 64, 32, np.float32, np.float32, 0)
    _record(prog)
    with open(next(rec.iterdir()), "rb") as f:
        kernels = pickle.load(f)
    script = [sys.executable, os.path.join(root, "benchmarks", "gpu_precompile.py"), "--records", str(rec),
              "--no-bench", "--any-triton"]
    r = subprocess.run(script + ["--cache", str(cache)], cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "sm_90:" in r.stdout, r.stdout + r.stderr
    for kernel, ptypes, aligned in kernels:
        assert (cache / (C.cache_key(kernel, ptypes, aligned, 90) + ".cubin")).exists()
    # --check compiles nothing: every kernel found here; an empty cache lacks them all (exit 1)
    r = subprocess.run(script + ["--cache", str(cache), "--check"], cwd=root, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and " 0 missing" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(script + ["--cache", str(tmp_path / "empty"), "--check"], cwd=root, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 1 and f"0 of {len(set(kernels))} kernels" in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").iterdir())


def test_the_benchmarks_programs_are_traced_as_on_a_gpu():
    """benchmarks/gpu_programs.py: gpu.py's rows traced against a stand-in H200 name the kernels the
    CUDA handler would launch -- decode at T=1, the ordered GEMMs at T=512, the backward for the
    training step, each quantized format's own kernels -- and run nothing; outside the block the
    CUDA backend is unavailable again."""
    import sys
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
    if bench not in sys.path:
        sys.path.append(bench)  # appended: benchmarks' module names never shadow a package
    import gpu_programs
    ks = gpu_programs.record(["olmoe-1b-7b"], [1, 512], [1], [16], checks=False)
    names = {k.name for k, _, _ in ks}
    assert {"decode1", "decode2", "gemm1", "gemm2", "bwd_gemm1", "bwd_dw", "bwd_dx"} <= names, names
    # the quantized rows' decode kernels differ from bf16's (their constexprs or argument types)
    decodes = {(k, p) for k, p, _ in ks if k.name == "decode1"}
    assert len(decodes) >= 1 + len(__import__("gpu").QUANT_FORMATS[1:]), decodes
    import jax
    assert jax.default_backend() == "cpu"
