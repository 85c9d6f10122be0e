"""Fills the cubin cache that ``benchmarks/gpu_check.sh`` reads, on a machine without a GPU.

    python benchmarks/gpu_precompile.py [--cache gpu_cubins] [--cc 90] [--tests SEL ...]

1. Runs the GPU check's correctness tests with the CUDA programs under Triton's interpreter
   (``--backends cuda-interpret``), recording the kernels of every program built
   (``JAX_NBX_KERNEL_RECORD``, tests/support/cuda_interpret.py): the interpreter runs the very
   programs the CUDA handler would get, planned the same way.
2. Compiles each recorded kernel once for each ``--cc`` (``sm_90``: H100 and H200) into ``--cache``
   (`jax_nbx.backends.cuda.compile.precompile`; Triton ships ptxas, no GPU needed).

The GPU machine's first call then loads cubins instead of compiling them: ``gpu_check.sh`` points
``JAX_NBX_CUBIN_CACHE`` at ``gpu_cubins`` (carry that folder to it) and reports how many kernels it
still had to compile.  The cache is keyed by Triton's version, so it serves a machine only with the
same Triton: the GPU machines have Triton 3.6.0 (a warning is printed otherwise; make the cache in a
venv with ``triton==3.6.0``).  Programs planned differently on the GPU (another band split for a
larger budget, a tuned tile config) miss and are compiled there.
"""
from __future__ import annotations

import argparse
import glob
import os
import pickle
import subprocess
import sys
import tempfile
import time

GPU_TRITON = "3.6.0"
# What gpu_check.sh runs on the GPU, as the interpreter runs it here (its cases, not its sweeps)
DEFAULT_TESTS = ["tests/suite", "-m", "not sweep", "--backends", "cuda-interpret"]


def records(folder: str) -> list:
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "kernels-*.pkl"))):
        with open(path, "rb") as f:
            while True:
                try:
                    out.extend(pickle.load(f))
                except EOFError:
                    break
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default="gpu_cubins", help="the cubin cache folder to fill")
    ap.add_argument("--cc", default="90", help="compute capabilities, comma-separated (90: sm_90)")
    ap.add_argument("--records", help="kernels already recorded in this folder: skip the tests")
    ap.add_argument("--tests", nargs=argparse.REMAINDER, help="pytest arguments instead of the default")
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)   # this process compiles; the tests' process interprets
    cache = os.path.abspath(args.cache)
    os.environ["JAX_NBX_CUBIN_CACHE"] = cache
    folder = args.records
    if folder is None:
        folder = tempfile.mkdtemp(prefix="nbx_kernels_")
        t0 = time.time()
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(args.tests or DEFAULT_TESTS)]
        env = dict(os.environ, JAX_NBX_KERNEL_RECORD=folder, TRITON_INTERPRET="1")
        rc = subprocess.run(cmd, env=env).returncode
        print(f"== the tests under the interpreter: exit {rc}, {time.time() - t0:.0f} s")
    kernels = records(folder)
    from importlib.metadata import version

    from jax_nbx.backends.cuda import compile as C
    triton = version("triton")
    print(f"== {len(kernels)} kernel uses recorded, {len(set(kernels))} distinct; Triton {triton}")
    if triton != GPU_TRITON:
        print(f"warning: the GPU machines have Triton {GPU_TRITON}; a cache made with {triton} misses there")
    for cc in (int(c) for c in args.cc.split(",")):
        t0 = time.time()
        got = C.precompile(kernels, cc)
        print(f"== sm_{cc}: {got['compiled']} compiled, {got['found']} already in {cache} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
